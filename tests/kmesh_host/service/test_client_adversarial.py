"""The client side of the cache service and its command line, against peers that misbehave.

A fake peer (a raw Unix socket served by a thread, :class:`FakePeer`) answers the client's requests
with wrong ids, wrong magic, version or flags, truncated frames, absurd length prefixes, JSON that is
not an object, a binary frame where JSON was expected and the reverse, closes mid-reply, or never
replies. Each must end the call with a typed ``KmeshError``, by the client's own timeout exactly where
the peer stalls (it holds the rest for far longer, :data:`HOLD_S`); a frame that was received whole
must leave the connection usable (the next call reads its own reply). No test measures a duration. Also:
the client's lifecycle, inputs it must refuse before sending anything, item lists up to the
protocol's limit (seeded), concurrent calls on one connection, a registration used from another
connection, ``kmesh status`` against every kind of peer and ``kmesh serve`` in the foreground.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

from kmesh_gpu.errors import KmeshError, LayoutError, OwnershipError, ProtocolError, ServiceError
from kmesh_host.service import CacheClient, SharedCache, protocol, restore_wire
from kmesh_vllm.cli import main as kmesh_main
from tests.kmesh_host.service.fake_peer import (
    OPS, SECRET_HEX, TIMEOUT, FakePeer, client, do_restore, fake_reg, first_then_good, frame, good, good_reply,
    timed_out,
)
from tests.kmesh_host.service.helpers import (fingerprint, put_original, running_service, small_layout, socket_dir,
                                              wait_for)

FP = fingerprint()


# ---------------------------------------------------------------------------------- misbehaving replies
def _send(data):
    return lambda peer, conn, req: conn.sendall(data(req) if callable(data) else data)


def _send_then_close(data):
    def act(peer, conn, req):
        conn.sendall(data(req) if callable(data) else data)
        conn.shutdown(socket.SHUT_WR)
        return "close"
    return act


def _stall(data, cut: int):
    def act(peer, conn, req):
        raw = data(req)
        conn.sendall(raw[:cut])
        peer.hold()
        return "close"
    return act


def _never(peer, conn, req):
    peer.hold()
    return "close"


def _json_ok(req):
    return frame({"id": req.rid, "ok": True, "healthy": True})


#: name -> (the first request's answer, expected class for status, expected class for restore);
#: the frame is read whole in the cases marked ``consumed`` (the connection must stay usable)
MISBEHAVIOURS = {
    "wrong-id": (_send(lambda r: frame({"id": r.rid + 7, "ok": True})), ProtocolError, ProtocolError),
    "id-as-string": (_send(lambda r: frame({"id": str(r.rid), "ok": True})), ProtocolError, ProtocolError),
    "binary-wrong-id": (_send(lambda r: restore_wire.encode_restore_reply(r.rid + 1, 1, "drained")), ProtocolError,
                        ProtocolError),
    "bad-magic": (_send(lambda r: frame({"id": r.rid, "ok": True}, magic=b"HTTP")), ProtocolError, ProtocolError),
    "bad-version": (_send(lambda r: frame({"id": r.rid, "ok": True}, version=2)), ProtocolError, ProtocolError),
    "bad-flags": (_send(lambda r: frame({"id": r.rid, "ok": True}, flags=6)), ProtocolError, ProtocolError),
    "header-len-0": (_send(frame(b"", header_len=0)), ProtocolError, ProtocolError),
    "header-len-4G": (_send(frame(b"{}", header_len=0xFFFFFFFF)), ProtocolError, ProtocolError),
    "body-len-4G": (_send(lambda r: frame({"id": r.rid, "ok": True}, body_len=0xFFFFFFFF)), ProtocolError,
                    ProtocolError),
    "json-not-object": (_send(frame([1, 2, 3])), ProtocolError, ProtocolError),
    "json-string": (_send(frame(b'"ok"')), ProtocolError, ProtocolError),
    "json-invalid": (_send(frame(b"{\"id\": 1, ")), ProtocolError, ProtocolError),
    "json-not-utf8": (_send(frame(b"{\"id\": \"\xff\"}")), ProtocolError, ProtocolError),
    "json-deep": (_send(frame(b"[" * 100000 + b"]" * 100000)), ProtocolError, ProtocolError),
    "ok-not-true": (_send(lambda r: frame({"id": r.rid, "ok": 1})), ProtocolError, ProtocolError),
    "ok-missing": (_send(lambda r: frame({"id": r.rid})), ProtocolError, ProtocolError),
    "binary-for-json": (_send(lambda r: restore_wire.encode_restore_reply(r.rid, 1, "drained")), ProtocolError, None),
    "json-success-for-binary": (_send(_json_ok), None, ProtocolError),
    "binary-bad-state": (_send(lambda r: frame(restore_wire.RESTORE_REPLY.pack(1, 0, 9, r.rid, 1), flags=1)),
                         ProtocolError, ProtocolError),
    "binary-trailing": (_send(lambda r: frame(restore_wire.RESTORE_REPLY.pack(1, 0, 0, r.rid, 1) + bytes(8), flags=1)),
                        ProtocolError, ProtocolError),
    "binary-short": (_send(lambda r: frame(b"\x01\x00", flags=1)), ProtocolError, ProtocolError),
    "truncated-prefix-then-close": (_send_then_close(lambda r: _json_ok(r)[:9]), ServiceError, ServiceError),
    "truncated-header-then-close": (_send_then_close(lambda r: _json_ok(r)[:-4]), ServiceError, ServiceError),
    "truncated-body-then-close": (_send_then_close(lambda r: frame({"id": r.rid, "ok": True}, b"xy", body_len=64)),
                                  ServiceError, ServiceError),
    "close-without-reply": (_send_then_close(b""), ServiceError, ServiceError),
    "stall-in-prefix": (_stall(_json_ok, 5), ServiceError, ServiceError),
    "stall-in-header": (_stall(_json_ok, 20), ServiceError, ServiceError),
    "never-replies": (_never, ServiceError, ServiceError),
}
CONSUMED = ("wrong-id", "id-as-string", "binary-wrong-id", "json-not-object", "json-string", "json-invalid",
            "json-not-utf8", "json-deep", "ok-not-true", "ok-missing", "binary-for-json", "json-success-for-binary",
            "binary-bad-state", "binary-trailing", "binary-short")
CASES = [(name, op) for name in MISBEHAVIOURS for op in OPS if MISBEHAVIOURS[name][1 if op == "status" else 2]]


@pytest.mark.parametrize("name, op", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_misbehaving_peer_gives_a_typed_error_within_the_timeout(name, op):
    """The stalling peers hold the rest of the reply until the test ends: the call ends by the
    client's own timeout (not the peer's close, not before). Every other peer answered at once and
    the call ends on what came, never by waiting (a 4 GiB length is refused from the prefix alone)."""
    act, for_status, for_restore = MISBEHAVIOURS[name]
    expected = for_status if op == "status" else for_restore
    with FakePeer(first_then_good(act)) as peer, client(peer) as c:
        with pytest.raises(expected) as info:
            OPS[op](c)
        assert isinstance(info.value, KmeshError)
        assert timed_out(info.value) == name.startswith(("never", "stall")), f"{name}: {info.value}"


#: bad replies read whole whose request id is right or unknown (a reply with another request's id
#: is not among them: what the client must do then is in /tmp/audit2/client/failing_tests.py)
WHOLE = [(n, op) for n, op in CASES if n in CONSUMED and n not in ("wrong-id", "id-as-string", "binary-wrong-id")]


@pytest.mark.parametrize("name, op", WHOLE, ids=[f"{n}-{o}" for n, o in WHOLE])
def test_a_bad_reply_read_whole_leaves_the_connection_usable(name, op):
    """The bad reply was one whole frame: the next call (of either kind) reads its own reply."""
    act = MISBEHAVIOURS[name][0]
    with FakePeer(first_then_good(act)) as peer, client(peer) as c:
        with pytest.raises(ProtocolError):
            OPS[op](c)
        assert c.status()["echo"] == 2
        assert do_restore(c) == 3 + 1000
        assert c.status()["echo"] == 4


@pytest.mark.parametrize("name", ["truncated-prefix-then-close", "truncated-body-then-close",
                                  "close-without-reply"])
def test_a_lost_connection_is_reported_typed_on_every_later_call(name):
    with FakePeer(first_then_good(MISBEHAVIOURS[name][0])) as peer, client(peer) as c:
        with pytest.raises(ServiceError):
            c.status()
        for call in (c.status, lambda: do_restore(c), lambda: c.get("k", model_fingerprint=FP), lambda: c.evict("k")):
            with pytest.raises(ServiceError, match="closed"):  # at once: nothing is sent
                call()
        assert len(peer.requests) == 1


@pytest.mark.parametrize("code, cls", sorted(protocol.ERROR_CODES.items()))
@pytest.mark.parametrize("op", list(OPS))
def test_typed_error_replies_keep_class_message_and_op(code, cls, op):
    def act(peer, conn, req):
        conn.sendall(frame({"id": req.rid, "ok": False, "error": {"code": code, "message": f"said {code}", "op": 7}}))
    with FakePeer(first_then_good(act)) as peer, client(peer) as c:
        with pytest.raises(cls, match=f"said {code}") as info:
            OPS[op](c)
        assert type(info.value) is cls and info.value.op_id == 7
        assert c.status()["echo"] == 2  # a typed error is an answer: the connection goes on


def test_unknown_error_code_is_a_service_error():
    act = _send(lambda r: frame({"id": r.rid, "ok": False, "error": {"code": "zzz", "message": 12}}))
    with FakePeer(first_then_good(act)) as peer, client(peer) as c:
        with pytest.raises(ServiceError, match="12") as info:
            c.status()
        assert type(info.value) is ServiceError and info.value.op_id is None


def test_an_announced_body_is_not_allocated_before_it_arrives():
    """A peer announces 200 MiB (under the client's limit), sends 1 KiB and closes: the client's
    memory follows what arrived, not what was announced."""
    act = _send_then_close(lambda r: frame({"id": r.rid, "ok": True}, b"x" * 1024, body_len=200 << 20))
    with FakePeer(first_then_good(act)) as peer, client(peer) as c:
        tracemalloc.start()
        try:
            with pytest.raises(ServiceError, match="middle of a frame"):
                c.status()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20


def test_a_body_over_the_clients_limit_is_refused_from_the_prefix():
    act = _send(lambda r: frame({"id": r.rid, "ok": True}, b"", body_len=4097))
    with FakePeer(first_then_good(act)) as peer, client(peer, max_body_bytes=4096) as c:
        with pytest.raises(ProtocolError, match="exceeds the limit of 4096"):
            c.status()


# ---------------------------------------------------------------------------------- lifecycle
def test_close_twice_and_every_use_after_close_is_a_typed_error():
    with FakePeer(good) as peer:
        c = client(peer)
        assert c.status()["echo"] == 1
        c.close()
        c.close()
        assert peer.eof.wait(30)
        reg = fake_reg()
        kv = torch.zeros(2, 1, 2, 1, 4)
        uses = [c.status, lambda: c.call({"op": "status"}),
                lambda: c.put(kv, torch.arange(2), torch.arange(2), model_fingerprint=fingerprint(1, 1, 4)),
                lambda: c.get("k", model_fingerprint=FP), lambda: c.evict("k"), lambda: c.attach(reg),
                lambda: do_restore(c), lambda: c.restore(reg, [("k", [0], [5])], wait=False),
                lambda: c.save(reg, [0], [0], [0]), lambda: c.cancel(reg, 1), lambda: c.drain(reg),
                lambda: c.acquire(reg, [0]), lambda: c.close_registration(reg)]
        for use in uses:
            with pytest.raises(ServiceError, match="closed"):
                use()
        with c:  # entering a closed client and leaving it is harmless
            pass
        assert len(peer.requests) == 1


def test_context_manager_closes_on_error():
    with FakePeer(good) as peer:
        with pytest.raises(RuntimeError, match="inside"):
            with client(peer) as c:
                c.status()
                raise RuntimeError("inside")
        assert peer.eof.wait(30)
        with pytest.raises(ServiceError, match="closed"):
            c.status()


def test_connecting_to_what_is_not_a_service_is_a_typed_error(tmp_path):
    with socket_dir() as d:
        regular = os.path.join(d, "file")
        with open(regular, "w") as f:
            f.write("not a socket")
        bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound.bind(os.path.join(d, "bound"))  # bound, never listening
        try:
            for path in (os.path.join(d, "absent"), regular, d, os.path.join(d, "bound"), "/tmp/" + "x" * 200):
                with pytest.raises(ServiceError, match="cannot connect") as info:
                    CacheClient(path, timeout=TIMEOUT)
                assert not isinstance(info.value.__cause__, TimeoutError), path  # refused, not waited for
        finally:
            bound.close()


# ---------------------------------------------------------------------------------- inputs refused before sending
BAD_INPUTS = {
    "key-bytes": ([(b"key", [0])], {}, ProtocolError),
    "key-int": ([(5, [0])], {}, ProtocolError),
    "key-None": ([(None, [0])], {}, ProtocolError),
    "key-over-4096-bytes": ([("é" * 2049, [0])], {}, ProtocolError),
    "no-items": ([], {}, ProtocolError),
    "65537-items": ([("k", [0])] * 65537, {}, ProtocolError),
    "header-over-1MiB": ([("k" * 20, [0])] * 60000, {}, ProtocolError),
    "slots-2d": ([("k", [[0, 1]])], {}, LayoutError),
    "slots-scalar": ([("k", 3)], {}, LayoutError),
    "slots-float-tensor": ([("k", torch.tensor([0.0]))], {}, LayoutError),
    "slots-int32-tensor": ([("k", torch.tensor([0], dtype=torch.int32))], {}, LayoutError),
    "slots-2d-tensor": ([("k", torch.zeros(1, 2, dtype=torch.int64))], {}, LayoutError),
    "slots-over-int64": ([("k", [2 ** 63])], {}, LayoutError),
    "slots-words": ([("k", ["x"])], {}, LayoutError),
    "slots-ragged": ([("k", [[0], [1, 2]])], {}, LayoutError),
    "slots-complex": ([("k", [1 + 1j])], {}, LayoutError),
    "slots-None": ([("k", None)], {}, LayoutError),
    "new-positions-2d": ([("k", [0], [[1]])], {}, LayoutError),
    "new-positions-words": ([("k", [0], ["x"])], {}, LayoutError),
    "item-a-list": ([["k", [0]]], {}, LayoutError),
    "timeout-negative": ([("k", [0])], {"timeout": -1}, ProtocolError),
    "timeout-nan": ([("k", [0])], {"timeout": float("nan")}, ProtocolError),
    "timeout-inf": ([("k", [0])], {"timeout": float("inf")}, ProtocolError),
    "timeout-too-long": ([("k", [0])], {"timeout": 1e7}, ProtocolError),
    "secret-not-hex": ([("k", [0])], {"reg": fake_reg(secret="zz" * 32)}, OwnershipError),
    "secret-31-bytes": ([("k", [0])], {"reg": fake_reg(secret="ab" * 31)}, OwnershipError),
    "reg-id-over-int64": ([("k", [0])], {"reg": fake_reg(reg_id=2 ** 63)}, ProtocolError),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_restore_inputs_are_refused_typed_before_anything_is_sent(name):
    items, kw, cls = BAD_INPUTS[name]
    kw = dict(kw)
    reg = kw.pop("reg", fake_reg())
    with FakePeer(good) as peer, client(peer) as c:
        with pytest.raises(cls):
            c.restore(reg, items, **kw)
        assert c.status()["echo"] >= 1  # nothing went out before it: the next request is the first seen
        assert [r.header and r.header.get("op") for r in peer.requests] == ["status"]


# ---------------------------------------------------------------------------------- item lists (seeded)
def _index_input(rng: random.Random, values: list[int]):
    kind = rng.randrange(6)
    if kind == 0:
        return list(values)
    if kind == 1:
        return tuple(values)
    if kind == 2:
        return np.array(values, dtype=np.int64)
    if kind == 3:
        return np.array(values, dtype=np.int32)
    if kind == 4:
        return torch.tensor(values, dtype=torch.int64)
    doubled = torch.tensor([v for v in values for _ in (0, 1)], dtype=torch.int64)
    return doubled[::2]  # a strided view


def test_seeded_restores_reach_the_peer_exactly():
    rng = random.Random(20240611)
    alphabet = "abcXYZ-_/é漢😀"

    def collect(peer, conn):
        while (req := peer.read(conn)) is not None:
            conn.sendall(good_reply(req))

    with FakePeer(collect) as peer, client(peer, timeout=60) as c:
        expected = []
        for n_req in range(30):
            items, want = [], []
            for _ in range(rng.randint(1, 80)):
                key = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
                slots = [rng.choice((-1, rng.randrange(1 << 30))) for _ in range(rng.randint(0, 9))]
                shift = None if rng.random() < 0.5 else [rng.randrange(-5, 1 << 30) for _ in range(len(slots))]
                item = (key, _index_input(rng, slots)) if shift is None else \
                    (key, _index_input(rng, slots), _index_input(rng, shift))
                items.append(item)
                want.append((key, slots, shift))
            kw = rng.choice(({}, {"wait": False}, {"timeout": 2.5}, {"wait": False, "timeout": 0.0}))
            op = c.restore(fake_reg(reg_id=n_req + 1), items, **kw)
            assert op == len(peer.requests) + 1000
            expected.append((n_req + 1, want, kw))
        assert len(peer.requests) == len(expected)
        for req, (reg_id, want, kw) in zip(peer.requests, expected):
            got = req.restore()
            assert got.reg_id == reg_id and got.secret == bytes.fromhex(SECRET_HEX)
            assert got.wait == kw.get("wait", True) and got.timeout == kw.get("timeout")
            assert list(got.keys) == [k for k, _, _ in want]
            assert got.slots.tolist() == [s for _, slots, _ in want for s in slots]
            assert got.new_positions.tolist() == [p for _, _, shift in want if shift is not None for p in shift]
            assert list(got.position_counts) == [None if sh is None else len(sh) for _, _, sh in want]


def test_the_largest_item_list_is_one_frame_the_peer_decodes():
    n = restore_wire.MAX_RESTORE_ITEMS
    with FakePeer(good) as peer, client(peer, timeout=60) as c:
        items = [(f"k{i % 97}", [i, -1] if i % 3 else []) for i in range(n)]
        assert c.restore(fake_reg(), items) == 1001
        got = peer.requests[0].restore()
        assert len(got.keys) == n and got.keys[96] == "k96"
        assert got.slots.tolist() == [v for i in range(n) if i % 3 for v in (i, -1)]


# ---------------------------------------------------------------------------------- concurrency
def test_concurrent_calls_on_one_client_each_get_their_own_reply():
    rng = random.Random(7)
    delays = [rng.random() * 0.004 for _ in range(200)]

    def slow(peer, conn):
        i = 0
        while (req := peer.read(conn)) is not None:
            time.sleep(delays[i % len(delays)])
            i += 1
            conn.sendall(good_reply(req))

    with FakePeer(slow) as peer, client(peer, timeout=60) as c:
        mismatches, errors = [], []

        def worker(t):
            try:
                for i in range(20):
                    if (t + i) % 3 == 0:
                        c.restore(fake_reg(), [(f"t{t}", [i])])
                    else:
                        tag = f"{t}-{i}"
                        got = c.call({"op": "echo", "tag": tag}).header["tag"]
                        if got != tag:
                            mismatches.append((tag, got))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and not mismatches
        assert len(peer.requests) == 80
        assert sorted(r.rid for r in peer.requests) == list(range(1, 81))


# ---------------------------------------------------------------------------------- a real service
@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.02) as svc:
        yield svc


def _put_original(c) -> str:
    kv = torch.arange(2 * 2 * 4 * 2 * 8, dtype=torch.float32).reshape(2, 2, 4, 2, 8).to(torch.bfloat16) + 1
    return put_original(c, kv)


def test_a_registration_used_from_another_connection_of_the_same_process(service):
    layout = small_layout()
    with SharedCache(layout, fill=0) as cache, CacheClient(service.socket_path, timeout=30) as other:
        bits = lambda: cache.tensor.view(torch.uint8).clone()  # noqa: E731
        owner = CacheClient(service.socket_path, timeout=30)
        cross_src = _put_original(owner)
        reg = owner.register(cache, layout, model_fingerprint=FP)
        # same process, another connection: accepted (the owner's connection is still open)
        other.restore(reg, [(cross_src, [0, 1, 2, 3])])
        written = bits()
        assert written.any()
        # once the owner's connection ends, nobody attached: the registration is gone
        owner.close()
        wait_for(lambda: not any(r["reg"] == reg.reg_id for r in other.status()["registrations"]), timeout=30)
        with pytest.raises(OwnershipError):
            other.restore(reg, [(cross_src, [4, 5, 6, 7])])
        assert torch.equal(bits(), written)
        # attached before the owner goes: it lives on in the other connection
        owner = CacheClient(service.socket_path, timeout=30)
        reg2 = owner.register(cache, layout, model_fingerprint=FP)
        other.attach(reg2)
        connections = other.status()["connections"]
        owner.close()
        # the service has seen the owner's connection end (and decided the registration's fate then)
        wait_for(lambda: other.status()["connections"] == connections - 1, timeout=30)
        assert [r["state"] for r in other.status()["registrations"] if r["reg"] == reg2.reg_id] == ["open"]
        other.restore(reg2, [(cross_src, [4, 5, 6, 7])])
        assert not torch.equal(bits(), written)
        assert other.close_registration(reg2) is True
        with pytest.raises(OwnershipError):
            other.restore(reg2, [(cross_src, [0])])


def test_a_real_service_reply_stream_stays_in_step_after_typed_errors(service):
    layout = small_layout()
    with SharedCache(layout, fill=0) as cache, CacheClient(service.socket_path, timeout=30) as c:
        step_src = _put_original(c)
        reg = c.register(cache, layout, model_fingerprint=FP)
        rng = random.Random(99)
        for i in range(40):
            choice = rng.randrange(4)
            if choice == 0:
                with pytest.raises(KmeshError):
                    c.restore(reg, [("step-missing", [0])])
            elif choice == 1:
                with pytest.raises(KmeshError):
                    c.restore(reg, [(step_src, [0, 1, 2, 3 + 10 ** 6])])
            elif choice == 2:
                with pytest.raises(ProtocolError):
                    c.call({"op": "no-such-op"})
            else:
                assert c.restore(reg, [(step_src, [0, 1, 2, 3])]) > 0
            assert c.status()["healthy"] is True
        assert c.close_registration(reg) is True


# ---------------------------------------------------------------------------------- kmesh status
def _status(capsys, path, timeout=TIMEOUT):
    rc = kmesh_main(["status", "--socket", path, "--timeout", str(timeout)])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_status_without_a_service_prints_json_and_fails(capsys):
    with socket_dir() as d:
        regular = os.path.join(d, "file")
        with open(regular, "w") as f:
            f.write("x")
        bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound.bind(os.path.join(d, "bound"))
        try:
            for path in (os.path.join(d, "absent"), regular, d, os.path.join(d, "bound")):
                rc, state = _status(capsys, path)
                assert rc == 1 and state["healthy"] is False and state["socket"] == path and state["error"]
                assert "cannot connect" in state["error"] and not timed_out(state["error"])  # refused at once
        finally:
            bound.close()


STATUS_PEERS = {
    "http-peer": _send(b"HTTP/1.1 400 Bad Request\r\n\r\n"),
    "silent": _never,
    "closes": _send_then_close(b""),
    "truncated": _stall(_json_ok, 20),
    "json-list": _send(frame([1])),
    "binary": _send(lambda r: restore_wire.encode_restore_reply(r.rid, 1, "drained")),
    "typed-error": _send(lambda r: frame({"id": r.rid, "ok": False, "error": {"code": "service", "message": "x"}})),
    "wrong-id": _send(lambda r: frame({"id": r.rid + 1, "ok": True, "healthy": True})),
    "unhealthy": _send(lambda r: frame({"id": r.rid, "ok": True, "healthy": False})),
    "no-healthy-field": _send(lambda r: frame({"id": r.rid, "ok": True})),
    "huge-length": _send(frame(b"{}", body_len=0xFFFFFFFF)),
}


@pytest.mark.parametrize("name", list(STATUS_PEERS))
def test_status_against_a_peer_that_is_not_a_healthy_service_fails(capsys, name):
    with FakePeer(first_then_good(STATUS_PEERS[name])) as peer:
        rc, state = _status(capsys, peer.path)
        assert rc == 1 and state.get("healthy") in (False, None)  # the client's report, or the peer's own
        # the stalling peers hold their reply far longer than --timeout: the command gave up by it
        assert timed_out(state.get("error", "")) == (name in ("silent", "truncated")), state


def test_status_of_a_healthy_peer_prints_its_state_and_succeeds(capsys):
    state = {"healthy": True, "pid": 12, "nested": {"b": [1, 2]}, "protocol_version": protocol.VERSION}
    with FakePeer(first_then_good(_send(lambda r: frame({"id": r.rid, "ok": True, **state})))) as peer:
        rc, printed = _status(capsys, peer.path)
        assert rc == 0 and printed == state


# ---------------------------------------------------------------------------------- kmesh serve
def _serve(socket_path, **kw):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.Popen([sys.executable, "-m", "kmesh_vllm.cli", "serve", "--socket", socket_path], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _connect_when_up(proc, path):
    def up():
        if proc.poll() is not None:
            raise AssertionError(f"kmesh serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            return CacheClient(path, timeout=30)
        except ServiceError:
            return None
    return wait_for(up, timeout=60, interval=0.05)


def test_serve_refuses_a_directory_others_can_enter():
    with socket_dir() as d:
        os.chmod(d, 0o755)
        path = os.path.join(d, "kmesh.sock")
        proc = _serve(path)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert "mode 755" in err and "Traceback" not in err
        assert not os.path.exists(path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_drains_and_removes_its_socket_on_signal(sig):
    with socket_dir() as d:
        path = os.path.join(d, "fresh", "kmesh.sock")  # a directory that does not exist yet
        proc = _serve(path)
        try:
            c = _connect_when_up(proc, path)
            assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            layout = small_layout()
            with SharedCache(layout, fill=0) as cache:
                state = c.status()
                assert state["healthy"] is True and state["pid"] == proc.pid
                serve_src = _put_original(c)
                reg = c.register(cache, layout, model_fingerprint=FP)
                c.restore(reg, [(serve_src, [0, 1, 2, 3])], wait=False)  # left pending: the stop drains it
                if sig == signal.SIGTERM:  # a second service on the same socket is refused, the first unharmed
                    second = _serve(path)
                    _, err2 = second.communicate(timeout=120)
                    assert second.returncode == 1 and "already listening" in err2
                    assert c.status()["healthy"] is True
                proc.send_signal(sig)
                out, err = proc.communicate(timeout=60)
                assert proc.returncode == 0, err
                assert "Traceback" not in err and "never drained" not in err
                assert not os.path.exists(path)
                with pytest.raises(ServiceError):
                    c.status()
                c.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
