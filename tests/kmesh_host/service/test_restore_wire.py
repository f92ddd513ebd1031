"""The binary restore request and reply (:mod:`kmesh_host.service.restore_wire`): round trips, and every malformed
variant answered with a typed error while the connection and the service keep working."""

from __future__ import annotations

import math
import socket
import struct
import threading

import numpy as np
import pytest
import torch

from kmesh_gpu.errors import LayoutError, OwnershipError, ProtocolError
from kmesh_host.service import CacheClient, SharedCache, protocol, restore_wire
from tests.kmesh_host.service.helpers import fingerprint, item, put_original, running_service, small_layout, small_rope

SECRET = bytes(range(32))
EVENT = bytes(range(100, 164))
FIXED = restore_wire.RESTORE_REQUEST.size


def _request(**kw) -> restore_wire.RestoreRequest:
    args = dict(request_id=7, reg_id=3, secret=SECRET, keys=("a", "bé", "c"), slot_counts=(2, 3, 1),
                position_counts=(2, None, 1), slots=np.array([0, 1, 4, 5, -1, 9], dtype=np.int64),
                new_positions=np.array([10, 11, 40], dtype=np.int64))
    args.update(kw)
    return restore_wire.RestoreRequest(**args)


def _split(parts: list) -> tuple[int, bytes, bytes]:
    """``(flags, header, body)`` of an encoded frame."""
    frame = b"".join(bytes(p) for p in parts)
    magic, version, flags, header_len, body_len = protocol.PREFIX.unpack_from(frame)
    assert magic == protocol.MAGIC and version == protocol.VERSION
    p = protocol.PREFIX.size
    assert len(frame) == p + header_len + body_len
    return flags, frame[p:p + header_len], frame[p + header_len:]


def _decode(header: bytes, body: bytes) -> restore_wire.RestoreRequest:
    # the receiver's buffers are writable bytearrays; decoding must not need more than a view
    buf = bytearray(header + body)
    view = memoryview(buf)
    return restore_wire.decode_restore(view[:len(header)], view[len(header):])


def _frame(header: bytes, body: bytes = b"", *, version: int = protocol.VERSION,
           flags: int = protocol.FLAG_BINARY) -> bytes:
    return protocol.PREFIX.pack(protocol.MAGIC, version, flags, len(header), len(body)) + header + body


def _patched(header: bytes, fmt: str, offset: int, value) -> bytes:
    out = bytearray(header)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


# ---------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("extra", [
    {},
    {"wait": False, "timeout": 2.5, "timings": True},
    {"wait_event": EVENT, "timeout": 0.0},
    {"inject": {"spin_cycles": 5}},
    {"keys": ("only",), "slot_counts": (0,), "position_counts": (None,), "slots": np.zeros(0, dtype=np.int64),
     "new_positions": np.zeros(0, dtype=np.int64)},
], ids=["plain", "nowait-timeout-timings", "event", "extras", "empty-item"])
def test_request_roundtrip(extra):
    req = _request(**extra)
    flags, header, body = _split(restore_wire.encode_restore(req))
    assert flags == protocol.FLAG_BINARY and len(header) % 8 == 0
    got = _decode(header, body)
    for name in ("request_id", "reg_id", "secret", "keys", "slot_counts", "position_counts", "wait", "timeout",
                 "timings", "wait_event", "inject"):
        assert getattr(got, name) == getattr(req, name), name
    assert got.slots.dtype == np.int64 and np.array_equal(got.slots, req.slots)
    assert np.array_equal(got.new_positions, req.new_positions)
    assert got.slots.flags.writeable  # a view of the frame, usable by torch.from_numpy without a copy


def test_request_over_a_socket_is_one_binary_frame():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(5)
        req = _request(timings=True)
        protocol.send_parts(a, restore_wire.encode_restore(req))
        protocol.send_message(a, {"op": "status"})
        flags, buf, body = protocol.read_frame(b, spin_s=1e-3)
        got = restore_wire.decode_restore(memoryview(buf)[:len(buf) - len(body)], body)
        assert flags == protocol.FLAG_BINARY and got.keys == req.keys and got.timings
        assert protocol.read_message(b).header == {"op": "status"}  # the boundary is kept


@pytest.mark.parametrize("spin_while", [None, lambda: False], ids=["spin", "spin-stopped"])
def test_polling_read_falls_back_to_a_blocking_one(spin_while):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(5)
        late = threading.Timer(0.05, lambda: a.sendall(restore_wire.encode_restore_reply(3, 4, "pending")))
        late.start()
        try:
            flags, buf, body = protocol.read_frame(b, spin_s=2e-3, spin_while=spin_while)
        finally:
            late.join()
        assert restore_wire.decode_restore_reply(memoryview(buf)[:len(buf) - len(body)], body).op_id == 4
        assert b.gettimeout() == 5  # the socket's own timeout is back
        a.close()
        with pytest.raises(protocol.ConnectionClosed):
            protocol.read_frame(b, spin_s=2e-3)


@pytest.mark.parametrize("cpus", [1, 2, protocol.MIN_CPUS_TO_SPIN - 1, protocol.MIN_CPUS_TO_SPIN, 64])
def test_spin_default(monkeypatch, cpus):
    """Polling by default only with a core to spare for each side: decided on the CPUs this process
    may use (a 2-core CI runner and a many-core host each get their own answer here)."""
    monkeypatch.setattr(protocol.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert protocol.spin_default(0, 1.0) == 0.0 and protocol.spin_default(3e-3, 1.0) == 3e-3
    assert protocol.spin_default(None, 1.0) == (1.0 if cpus >= protocol.MIN_CPUS_TO_SPIN else 0.0)


@pytest.mark.parametrize("stamps", [None, {"received": 5, "parsed": 6, "completed": 9}], ids=["plain", "timings"])
def test_reply_roundtrip(stamps):
    frame = restore_wire.encode_restore_reply(12, 34, "drained", stamps)
    flags, header, body = _split([frame])
    reply = restore_wire.decode_restore_reply(header, body)
    assert flags == protocol.FLAG_BINARY and (reply.request_id, reply.op_id, reply.state) == (12, 34, "drained")
    assert reply.timings == stamps  # stages not reached are left out


def test_json_reader_refuses_a_binary_frame_but_keeps_the_boundary():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(5)
        a.sendall(restore_wire.encode_restore_reply(1, 2, "pending"))
        protocol.send_message(a, {"op": "ok"})
        with pytest.raises(ProtocolError, match="binary") as info:
            protocol.read_message(b)
        assert not isinstance(info.value, protocol.FatalFrameError)
        assert protocol.read_message(b).header == {"op": "ok"}


def test_old_version_binary_frame_is_fatal():
    _, header, body = _split(restore_wire.encode_restore(_request()))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(5)
        a.sendall(_frame(header, body, version=2))
        with pytest.raises(protocol.FatalFrameError, match="version"):
            protocol.read_frame(b)


# ---------------------------------------------------------------------------------- malformed requests
def _variants():
    """``(id, header, body, message)``: one wrong field each, starting from a valid request."""
    _, h, body = _split(restore_wire.encode_restore(_request()))
    _, he, body_e = _split(restore_wire.encode_restore(_request(inject={"spin_cycles": 1})))
    table = FIXED  # items start right after the fixed part (no event)
    yield "truncated-fixed", h[:FIXED - 1], body, "fixed part"
    yield "empty", b"", b"", "fixed part"
    yield "kind", _patched(h, "<H", 0, 9), body, "unknown kind"
    yield "bits", _patched(h, "<H", 2, 0x40), body, "unknown bits"
    yield "no-items", _patched(h, "<I", 4, 0), body, "restore items"
    yield "too-many-items", _patched(h, "<I", 4, restore_wire.MAX_RESTORE_ITEMS + 1), body, "restore items"
    yield "items-count-vs-length", _patched(h, "<I", 4, 2), body, "need"
    yield "negative-id", _patched(h, "<q", 8, -1), body, "id"
    yield "negative-reg", _patched(h, "<q", 16, -5), body, "reg"
    yield "timeout-without-bit", _patched(h, "<d", 56, 1.0), body, "timeout"
    with_timeout = _patched(h, "<H", 2, restore_wire.BIT_WAIT | restore_wire.BIT_TIMEOUT)
    yield "timeout-nan", _patched(with_timeout, "<d", 56, math.nan), body, "timeout"
    yield "timeout-negative", _patched(with_timeout, "<d", 56, -1.0), body, "timeout"
    yield "timeout-inf", _patched(with_timeout, "<d", 56, math.inf), body, "timeout"
    yield "timeout-huge", _patched(with_timeout, "<d", 56, protocol.MAX_TIMEOUT_S * 2), body, "timeout"
    yield "event-bit-without-event", _patched(h, "<H", 2, restore_wire.BIT_WAIT | restore_wire.BIT_EVENT), body, "need"
    yield "header-one-byte-long", h + b"\0", body, "need"
    yield "header-one-word-long", h + bytes(8), body, "need"
    yield "header-short", h[:-8], body, "need"
    yield "nonzero-padding", h[:-1] + b"\x01", body, "padding"
    yield "keys-len", _patched(h, "<I", 64, 99), body, "need"
    yield "negative-key-length", _patched(h, "<i", table, -1), body, "key length"
    yield "key-lengths-vs-keys", _patched(h, "<i", table, 2), body, "key lengths"
    yield "negative-slot-count", _patched(h, "<i", table + 4, -2), body, "negative count"
    yield "position-count-below-minus-one", _patched(h, "<i", table + 8, -2), body, "below -1"
    yield "body-short", h, body[:-8], "body"
    yield "body-long", h, body + bytes(8), "body"
    yield "body-ragged", h, body[:-3], "body"
    yield "slot-count-vs-body", _patched(h, "<i", table + 4, 3), body, "body"
    keys_at = table + 3 * 12
    yield "key-not-utf8", h[:keys_at] + b"\xff" + h[keys_at + 1:], body, "UTF-8"
    ex_at = FIXED + 3 * 12 + len("abéc".encode())
    ex_len = struct.unpack_from("<I", he, 68)[0]
    yield "extras-not-json", he[:ex_at] + b"!" * ex_len + he[ex_at + ex_len:], body_e, "JSON"
    bad = b'{"injekt":{}}'.ljust(ex_len)
    yield "extras-unknown-field", he[:ex_at] + bad[:ex_len] + he[ex_at + ex_len:], body_e, "unknown field"
    bad = b'{"inject":[1]}'.ljust(ex_len)
    yield "extras-not-an-object", he[:ex_at] + bad[:ex_len] + he[ex_at + ex_len:], body_e, "expected an object"


VARIANTS = list(_variants())


@pytest.mark.parametrize("header, body, match", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_malformed_request_is_a_protocol_error(header, body, match):
    with pytest.raises(ProtocolError, match=match) as info:
        _decode(header, body)
    assert not isinstance(info.value, protocol.FatalFrameError)


@pytest.mark.parametrize("change, match", [
    ({"secret": b"short"}, "secret"),
    ({"keys": ()}, "restore items"),
    ({"slot_counts": (2, 3)}, "counts"),
    ({"slot_counts": (2, 3, 2)}, "arrays hold"),
    ({"position_counts": (2, None, -3)}, "negative count"),
    ({"slot_counts": (2, 3, 1 << 40)}, "int32"),
    ({"timeout": float("nan")}, "timeout"),
    ({"wait_event": b"\0" * 8}, "64 bytes"),
    ({"request_id": 1 << 70}, "out of range"),
    ({"keys": ("k" * (restore_wire.MAX_KEY_BYTES + 1), "b", "c")}, "key over"),
], ids=["secret", "no-items", "count-mismatch", "array-mismatch", "negative", "int32", "timeout-nan", "event",
        "id-range", "long-key"])
def test_encoder_refuses_what_the_service_would(change, match):
    with pytest.raises(ProtocolError, match=match):
        restore_wire.encode_restore(_request(**change))


@pytest.mark.parametrize("raw, match", [
    (b"\x01\x00", "at least"),
    (restore_wire.RESTORE_REPLY.pack(2, 0, 0, 1, 1), "kind"),
    (restore_wire.RESTORE_REPLY.pack(1, 4, 0, 1, 1), "bits"),
    (restore_wire.RESTORE_REPLY.pack(1, 0, 7, 1, 1), "state"),
    (restore_wire.RESTORE_REPLY.pack(1, 0, 0, 1, -4), "op"),
    (restore_wire.RESTORE_REPLY.pack(1, 0, 0, 1, 1) + b"\0", "expected"),
    (restore_wire.RESTORE_REPLY.pack(1, restore_wire.BIT_TIMINGS, 0, 1, 1) + bytes(8), "expected"),
], ids=["short", "kind", "bits", "state", "negative-op", "trailing", "short-stamps"])
def test_malformed_reply_is_a_protocol_error(raw, match):
    with pytest.raises(ProtocolError, match=match):
        restore_wire.decode_restore_reply(raw, b"")


# ---------------------------------------------------------------------------------- live service
@pytest.fixture(scope="module")
def service():
    # polling for requests on, whatever the machine: the tests cover that path too
    with running_service(reap_interval_s=0.02, receive_spin_s=2e-3) as svc:
        yield svc


def _ask(s: socket.socket, frame: bytes) -> dict:
    """Send ``frame``; the service must answer it with a JSON error reply."""
    s.sendall(frame)
    msg = protocol.read_message(s)
    assert msg.header["ok"] is False and msg.header["error"]["code"] in protocol.ERROR_CODES
    return msg.header


def test_service_answers_malformed_binary_requests_and_keeps_serving(service):
    layout = small_layout()
    with SharedCache(layout, fill=0x5A) as cache, CacheClient(service.socket_path, timeout=60) as client:
        kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
        key = put_original(client, kv)
        reg = client.register(cache, layout, model_fingerprint=fingerprint(), rope=small_rope())
        before = cache.tensor.view(torch.uint8).clone()
        good = _request(request_id=41, reg_id=reg.reg_id, secret=reg.secret_bytes, keys=(key,),
                        slot_counts=(4,), position_counts=(None,), slots=np.arange(4, dtype=np.int64),
                        new_positions=np.zeros(0, dtype=np.int64))
        _, header, body = _split(restore_wire.encode_restore(good))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(service.socket_path)
        with s:
            for name, bad_header, bad_body, _ in VARIANTS:
                if not bad_header:  # an empty header loses the frame boundary: fatal, tested with the prefixes
                    continue
                reply = _ask(s, _frame(bad_header, bad_body))
                assert reply["error"]["code"] == "protocol", name
            # a well-formed frame whose values are wrong: typed errors of their own kind, with the request id
            wrong_secret = _patched(header, "<32s", 24, b"\0" * 32)
            reply = _ask(s, _frame(wrong_secret, body))
            assert reply["error"]["code"] == "ownership" and reply["id"] == 41
            unknown = _patched(header, "<q", 16, 10 ** 6)
            assert _ask(s, _frame(unknown, body))["error"]["code"] == "ownership"
            out_of_range = bytes(body[:-8]) + struct.pack("<q", layout.num_slots)
            assert _ask(s, _frame(header, out_of_range))["error"]["code"] == "layout"
            # a JSON restore is a protocol error since version 3
            protocol.send_message(s, {"op": "restore", "id": 5, "reg": reg.reg_id, "secret": reg.secret})
            assert protocol.read_message(s).header["error"]["code"] == "protocol"
            protocol.send_message(s, {"op": "status", "id": 9})
            status = protocol.read_message(s).header
            assert status["healthy"] is True and status["protocol_version"] == protocol.VERSION
        assert torch.equal(cache.tensor.view(torch.uint8), before)  # nothing written by any of them
        mine = [r for r in client.status()["registrations"] if r["reg"] == reg.reg_id][0]
        assert mine["held_blocks"] == [] and mine["pending_ops"] == []
        client.restore(reg, [item(key, [0, 1, 2, 3])])  # and the registration still works
        assert client.close_registration(reg) is True


def test_polling_client_and_service_restore_bit_exact(service):
    from kmesh_gpu import place_many

    layout, rope = small_layout(), small_rope()
    g = torch.Generator().manual_seed(3)
    kvs = [torch.randn(2, 2, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    plan = [([0, 1, 2, 3], [9, 10, 11, 12]), ([4, -1, 6, 7], None), ([20, 21, 22, 23], [1, 2, 3, 4])]
    with SharedCache(layout, fill=0x5A) as cache, CacheClient(service.socket_path, timeout=60,
                                                               reply_spin_s=5e-3) as client:
        keys = [put_original(client, kv) for kv in kvs]
        reg = client.register(cache, layout, model_fingerprint=fingerprint(), rope=rope)
        items = [item(keys[i], s, p) for i, (s, p) in enumerate(plan)]
        for _ in range(3):  # replies and requests come back to back: both sides poll
            client.drain(reg)
            client.restore(reg, items, timings=True)
        ref = layout.allocate(fill=0x5A)
        shifted = [0, 2]
        place_many([kvs[i] for i in shifted], ref, layout, [torch.tensor(plan[i][0]) for i in shifted], rope=rope,
                   old_positions=[torch.arange(4)] * 2, new_positions=[torch.tensor(plan[i][1]) for i in shifted])
        place_many([kvs[1]], ref, layout, [torch.tensor(plan[1][0])])
        assert torch.equal(cache.tensor.view(torch.uint8), ref.view(torch.uint8))
        s = client.last_timings["service"]
        assert list(s) == [k for k in restore_wire.RESTORE_STAGES if k in s] and "reply_sent" in s
        assert client.close_registration(reg) is True


def test_client_refuses_a_secret_that_is_not_32_bytes(service):
    layout = small_layout()
    with SharedCache(layout, fill=0) as cache, CacheClient(service.socket_path, timeout=60) as client:
        reg = client.register(cache, layout, model_fingerprint=fingerprint())
        forged = type(reg)(reg.reg_id, reg.generation, "zz", reg.layout, reg.handle, reg.cache)
        with pytest.raises(OwnershipError, match="wrong secret"):
            client.restore(forged, [("k", [0])])
        with pytest.raises(LayoutError, match="slots"):
            client.restore(reg, [("k", [[0, 1]])])
        assert client.close_registration(reg) is True
