"""Regressions of the cache service's client and command line found by an audit (each failed before
its fix): a failed call leaving the connection in use so that a later call read a stale or forged
reply, the timeout bounding each read rather than the reply, error fields and reply fields read
unchecked, reply ids of other types accepted, a refusal losing its type, non-integer indices
silently converted (2**64-1 became -1, "skip"), bad inputs raising non-Kmesh errors, ``kmesh
status`` exiting 0 for any truthy ``healthy``, ``kmesh serve`` replacing a regular file at its
socket path, the foreground service not stopped when something failed after it started.
"""

from __future__ import annotations

import decimal
import json
import os
import socket
import threading

import numpy as np
import pytest
import torch

from kmesh_gpu.errors import KmeshError, LayoutError, ProtocolError, ServiceError
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache, restore_wire
from kmesh_host.service.sockets import bind_socket
from kmesh_vllm.cli import main as kmesh_main
from tests.kmesh_host.service.helpers import fingerprint, small_layout, socket_dir
from tests.kmesh_host.service.fake_peer import (
    HOLD_S, FakePeer, client, do_restore, fake_reg, first_then_good, frame, good, good_reply, timed_out,
)


def _own_reply_or_closed(call, want_echo):
    """A later call must read its own reply, or find the connection closed: never another's."""
    try:
        got = call()
    except ServiceError as exc:
        assert "closed" in str(exc)
        return None
    assert got == want_echo, f"read a reply that is not its own: {got!r}"
    return got


# ---------------------------------------------------------------------------------- bug 1: stale replies
def test_a_reply_that_comes_after_the_timeout_is_never_read_by_a_later_call():
    gave_up, answered = threading.Event(), threading.Event()

    def late(peer, conn):
        while (req := peer.read(conn)) is not None:
            if req.rid == 1:
                peer.hold(until=gave_up)  # answers after the client gave up
                try:
                    conn.sendall(good_reply(req))
                finally:
                    answered.set()
                continue
            conn.sendall(good_reply(req))

    with FakePeer(late) as peer, client(peer) as c:
        with pytest.raises(ServiceError, match="timeout"):
            c.status()
        gave_up.set()
        assert answered.wait(HOLD_S)  # the late reply to request 1 is now waiting in the socket (or was refused)
        for rid in (2, 3):
            _own_reply_or_closed(lambda: c.status()["echo"], rid)


def test_bytes_left_by_a_fatal_frame_are_never_taken_for_a_reply():
    """A frame with a wrong magic loses the frame boundary (the protocol says: close). Here the peer
    follows it with a frame forged for the next request id: the next call must not accept it."""
    def forge(peer, conn, req):
        conn.sendall(b"XXXX" + bytes(12) + frame({"id": req.rid + 1, "ok": True, "healthy": True, "forged": 1}))

    with FakePeer(first_then_good(forge)) as peer, client(peer) as c:
        with pytest.raises(ProtocolError, match="magic"):
            c.status()
        try:
            state = c.status()
        except ServiceError:
            return  # closed: what the fix does
        assert "forged" not in state


@pytest.mark.parametrize("version_or_flags", [{"version": 2}, {"flags": 4}, {"body_len": 0xFFFFFFFF}])
def test_a_fatal_prefix_closes_the_connection(version_or_flags):
    def bad(peer, conn, req):
        conn.sendall(frame({"id": req.rid, "ok": True, "pad": "x" * 40}, **version_or_flags))

    with FakePeer(first_then_good(bad)) as peer, client(peer) as c:
        with pytest.raises(ProtocolError):
            c.status()
        _own_reply_or_closed(lambda: c.status()["echo"], 2)


def test_the_rest_of_a_frame_that_timed_out_is_never_read():
    gave_up, answered = threading.Event(), threading.Event()

    def stall(peer, conn, req):
        raw = frame({"id": req.rid, "ok": True, "healthy": True, "pad": "y" * 30})
        conn.sendall(raw[:20])
        peer.hold(until=gave_up)
        try:
            conn.sendall(raw[20:])
        finally:
            answered.set()

    with FakePeer(first_then_good(stall)) as peer, client(peer) as c:
        with pytest.raises(ServiceError, match="middle of a frame"):
            c.status()
        gave_up.set()
        assert answered.wait(HOLD_S)
        _own_reply_or_closed(lambda: c.status()["echo"], 2)


@pytest.mark.parametrize("op", ["status", "restore"])
def test_after_a_reply_with_another_id_no_later_call_reads_a_stale_reply(op):
    """The peer answers request 1 with id 99, then with a frame for id 2: after the mismatch the
    client cannot tell whose replies are still on the way, and must not take the second frame as
    the answer to its next request."""
    def two(peer, conn, req):
        if req.header is None:
            conn.sendall(restore_wire.encode_restore_reply(99, 1, "drained")
                         + restore_wire.encode_restore_reply(req.rid + 1, 666, "drained"))
        else:
            conn.sendall(frame({"id": 99, "ok": True}) + frame({"id": req.rid + 1, "ok": True, "echo": 666}))

    call = (lambda c: c.status()["echo"]) if op == "status" else do_restore
    with FakePeer(first_then_good(two)) as peer, client(peer) as c:
        with pytest.raises(ProtocolError, match="does not match"):
            call(c)
        _own_reply_or_closed(lambda: call(c), 2 if op == "status" else 1002)


# ---------------------------------------------------------------------------------- bug 2: trickling peer
def _trickle(peer, conn):
    """One byte per 0.1 s, each well within the timeout, the whole frame taking longer than HOLD_S:
    a timeout per read never fires, and a call ended by a timeout was ended by the reply's."""
    req = peer.read(conn)
    raw = frame({"id": req.rid, "ok": True, "healthy": True, "pad": "z" * int(HOLD_S / 0.1)})
    for i in range(len(raw)):
        conn.sendall(raw[i:i + 1])
        if peer.stopped(0.1):
            return


def test_a_trickling_reply_is_bounded_by_the_timeout():
    with FakePeer(_trickle) as peer, client(peer, timeout=0.3) as c:
        with pytest.raises(KmeshError) as info:
            c.status()
        assert timed_out(info.value), info.value


def test_status_cli_does_not_hang_on_a_trickling_peer(capsys):
    with FakePeer(_trickle) as peer:
        rc = kmesh_main(["status", "--socket", peer.path, "--timeout", "0.3"])
        out = json.loads(capsys.readouterr().out)
        assert rc == 1 and out.get("healthy") is not True
        assert timed_out(out.get("error", "")), out


# ---------------------------------------------------------------------------------- bug 3: error not an object
@pytest.mark.parametrize("error", [[1], "oops", 5, True])
@pytest.mark.parametrize("op", ["status", "restore"])
def test_an_error_field_that_is_not_an_object_is_a_protocol_error(error, op):
    act = lambda peer, conn, req: conn.sendall(frame({"id": req.rid, "ok": False, "error": error}))  # noqa: E731
    with FakePeer(first_then_good(act)) as peer, client(peer) as c:
        with pytest.raises(ProtocolError, match="neither a success nor a typed error"):
            c.status() if op == "status" else do_restore(c)


def test_status_cli_prints_json_for_an_error_field_that_is_not_an_object(capsys):
    act = lambda peer, conn, req: conn.sendall(frame({"id": req.rid, "ok": False, "error": "x"}))  # noqa: E731
    with FakePeer(first_then_good(act)) as peer:
        rc = kmesh_main(["status", "--socket", peer.path, "--timeout", "1"])
        assert rc == 1 and json.loads(capsys.readouterr().out)["healthy"] is False


# ---------------------------------------------------------------------------------- bug 4: id type
@pytest.mark.parametrize("wrong", [True, 1.0], ids=["true", "1.0"])
def test_the_reply_id_must_be_the_integer_request_id(wrong):
    act = lambda peer, conn, req: conn.sendall(frame({"id": wrong, "ok": True, "healthy": True}))  # noqa: E731
    with FakePeer(first_then_good(act)) as peer, client(peer) as c:
        with pytest.raises(ProtocolError, match="does not match"):
            c.status()  # request id 1


# ---------------------------------------------------------------------------------- bug 5: refusals lose their type
@pytest.mark.parametrize("after_close", [False, True], ids=["at-once", "after-the-peer-closed"])
def test_an_id_less_refusal_is_raised_as_the_services_typed_error(after_close):
    """What the service does to a connection it refuses: one error reply without id, then close.
    The request may reach it first (the reply is read) or not (the send fails: EPIPE)."""
    def refuse(peer, conn):
        conn.sendall(frame({"id": None, "ok": False, "error": {"code": "service",
                                                                "message": "too many connections (limit 1)"}}))

    with FakePeer(refuse) as peer, client(peer) as c:
        if after_close:
            assert peer.hung_up.wait(HOLD_S)
        with pytest.raises(ServiceError, match="too many connections"):
            c.status()


def test_a_real_service_refusing_a_connection_says_why():
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "k.sock"), max_connections=1)
        with CacheService(cfg) as svc, CacheClient(svc.socket_path, timeout=60) as first:
            assert first.status()["healthy"] is True
            with CacheClient(svc.socket_path, timeout=60) as second:
                with pytest.raises(ServiceError, match="too many connections"):
                    second.status()


# ---------------------------------------------------------------------------------- bug 6: reply fields unchecked
def _bare(peer, conn):
    while (req := peer.read(conn)) is not None:
        if req.header is None:
            conn.sendall(good_reply(req))
        elif req.header.get("op") == "drain":
            conn.sendall(frame({"id": req.rid, "ok": True, "drained": 5}))
        elif req.header.get("op") == "close":
            conn.sendall(frame({"id": req.rid, "ok": True, "freed": "yes"}))
        else:
            conn.sendall(frame({"id": req.rid, "ok": True}))


@pytest.mark.parametrize("name", ["register", "save", "cancel", "drain", "acquire", "close_registration"])
def test_a_success_reply_without_its_fields_is_a_protocol_error(name):
    layout = small_layout()
    reg = fake_reg()
    with FakePeer(_bare) as peer, client(peer) as c, SharedCache(layout, fill=0) as cache:
        calls = {"register": lambda: c.register(cache, layout, model_fingerprint=fingerprint()),
                 "save": lambda: c.save(reg, [0], [0], [0]),
                 "cancel": lambda: c.cancel(reg, 1), "drain": lambda: c.drain(reg),
                 "acquire": lambda: c.acquire(reg, [0]), "close_registration": lambda: c.close_registration(reg)}
        with pytest.raises(ProtocolError):
            calls[name]()


# ---------------------------------------------------------------------------------- bug 7: silent truncation
NOT_INTEGERS = {
    "float-list": [0.7, 1.9], "float-array": np.array([0.9, 2.5]), "digit-strings": ["1", "2"],
    "uint64-max": np.array([2 ** 64 - 1], dtype=np.uint64), "decimal": [decimal.Decimal("1.5")],
}


# block ids of acquire are Python ints: a uint64 holding 2**64-1 is an integer there (the service range-checks it)
WHERE = [(n, w) for n in NOT_INTEGERS for w in ("slots", "new_positions", "save", "acquire")
         if not (w == "acquire" and n == "uint64-max")]


@pytest.mark.parametrize("name, where", WHERE, ids=[f"{n}-{w}" for n, w in WHERE])
def test_index_values_that_are_not_integers_are_refused_before_sending(name, where):
    values = NOT_INTEGERS[name]
    reg = fake_reg()
    with FakePeer(good) as peer, client(peer) as c:
        calls = {"slots": lambda: c.restore(reg, [("k", values)]),
                 "new_positions": lambda: c.restore(reg, [("k", [0] * len(values), values)]),
                 "save": lambda: c.save(reg, values, [0] * len(values), [0] * len(values)),
                 "acquire": lambda: c.acquire(reg, values)}
        with pytest.raises(LayoutError):
            calls[where]()
        assert peer.requests == []


# ---------------------------------------------------------------------------------- bug 8: untyped input errors
MALFORMED = {
    "items-None": (lambda c, r: c.restore(r, None)),
    "items-int": (lambda c, r: c.restore(r, 5)),
    "item-one-char-string": (lambda c, r: c.restore(r, ["a"])),
    "item-int": (lambda c, r: c.restore(r, [5])),
    "item-None": (lambda c, r: c.restore(r, [None])),
    "item-four-fields": (lambda c, r: c.restore(r, [("k", [0], None, 1)])),
    "key-lone-surrogate": (lambda c, r: c.restore(r, [("\ud800", [0])])),
    "fingerprint-not-a-fingerprint": (lambda c, r: c.put(torch.zeros(2, 1, 1, 1, 4), torch.arange(1), torch.arange(1),
                                                         model_fingerprint={"a": {1, 2}})),
    "get-fingerprint-a-dict": (lambda c, r: c.get("k", model_fingerprint=fingerprint().to_dict())),
    "inject-nan": (lambda c, r: c.restore(r, [("k", [0])], inject={"spin_cycles": float("nan")})),
    "call-not-json": (lambda c, r: c.call({"op": "status", "x": {1}})),
    "save-inject-nan": (lambda c, r: c.save(r, [0], [0], [0], inject={"x": float("nan")})),
    "save-token-ids-words": (lambda c, r: c.save(r, [0], ["x"], [0])),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_inputs_are_typed_errors_before_sending(name):
    with FakePeer(good) as peer, client(peer) as c:
        with pytest.raises(KmeshError):
            MALFORMED[name](c, fake_reg())
        assert peer.requests == []
        assert c.status()["healthy"] is True


@pytest.mark.parametrize("timeout", [-1, float("nan")])
def test_a_bad_client_timeout_is_a_typed_error(timeout):
    with FakePeer(good) as peer:
        with pytest.raises(KmeshError):
            CacheClient(peer.path, timeout=timeout)


@pytest.mark.parametrize("timeout", ["-1", "nan"])
def test_status_cli_with_a_bad_timeout_prints_json_and_fails(capsys, timeout):
    with FakePeer(good) as peer:
        rc = kmesh_main(["status", "--socket", peer.path, "--timeout", timeout])
        assert rc == 1 and json.loads(capsys.readouterr().out)["healthy"] is False


# ---------------------------------------------------------------------------------- bug 9: status exit code
@pytest.mark.parametrize("healthy", ["no", "false", 1, [0]])
def test_status_succeeds_only_when_healthy_is_true(capsys, healthy):
    act = lambda peer, conn, req: conn.sendall(frame({"id": req.rid, "ok": True, "healthy": healthy}))  # noqa: E731
    with FakePeer(first_then_good(act)) as peer:
        assert kmesh_main(["status", "--socket", peer.path, "--timeout", "1"]) == 1
        capsys.readouterr()


# ---------------------------------------------------------------------------------- bug 10: serve deletes files
def test_serve_never_removes_a_file_that_is_not_a_socket():
    with socket_dir() as d:
        precious = os.path.join(d, "notes.txt")
        with open(precious, "w") as f:
            f.write("keep me")
        with pytest.raises(ServiceError, match="not a socket"):
            bind_socket(precious).close()
        with open(precious) as f:
            assert f.read() == "keep me"
        folder = os.path.join(d, "folder")
        os.mkdir(folder, 0o700)
        with pytest.raises(ServiceError):
            bind_socket(folder).close()
        assert os.path.isdir(folder)


# ---------------------------------------------------------------------------------- bug 11: foreground not stopped
def test_run_foreground_stops_the_service_when_on_ready_fails():
    from kmesh_host.service.process import run_foreground

    def broken(service):
        raise BrokenPipeError("stderr is gone")

    with socket_dir() as d:
        path = os.path.join(d, "svc", "k.sock")
        with pytest.raises(BrokenPipeError):
            run_foreground(ServiceConfig(socket_path=path), on_ready=broken)
        assert not os.path.exists(path), "the socket was left behind and the service still accepts"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with pytest.raises(OSError):
            probe.connect(path)
        probe.close()
