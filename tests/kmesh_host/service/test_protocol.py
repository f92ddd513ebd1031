"""Wire format: framing limits, typed errors, and fuzzing a live service that must keep serving."""

from __future__ import annotations

import os
import random
import socket
import stat
import struct
import threading
import time

import pytest
import torch

from kmesh_gpu.errors import LayoutError, OwnershipError, ProtocolError, SegmentNotFound, ServiceError
from kmesh_host.service import CacheClient, CacheService, ServiceConfig
from kmesh_host.service import protocol
from kmesh_host.service.registry import PeerIdentity
from kmesh_host.service.sockets import check_peer, prepare_socket_dir
from tests.kmesh_host.service.helpers import fingerprint, socket_dir

MAX_BODY = 1 << 20


# ---------------------------------------------------------------------------------- offline
WAIT_S = 30.0  # the sockets' timeouts: they only bound a test whose other side never comes


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(WAIT_S)
    b.settimeout(WAIT_S)
    return a, b


def test_roundtrip_with_body():
    a, b = _pair()
    with a, b:
        protocol.send_message(a, {"op": "x", "id": 1}, b"\x00\x01payload")
        msg = protocol.read_message(b)
        assert msg.header == {"op": "x", "id": 1} and msg.body == b"\x00\x01payload"


@pytest.mark.parametrize("prefix, match", [
    (struct.pack("<4sHHII", b"XXXX", protocol.VERSION, 0, 2, 0), "magic"),
    (struct.pack("<4sHHII", b"KMSH", protocol.VERSION + 1, 0, 2, 0), "version"),
    (struct.pack("<4sHHII", b"KMSH", 1, 0, 2, 0), "version"),
    (struct.pack("<4sHHII", b"KMSH", protocol.VERSION, 2, 2, 0), "flags"),
    (struct.pack("<4sHHII", b"KMSH", protocol.VERSION, 0, 0xFFFFFFFF, 0), "header length"),
    (struct.pack("<4sHHII", b"KMSH", protocol.VERSION, 0, 0, 0), "header length"),
    (struct.pack("<4sHHII", b"KMSH", protocol.VERSION, 0, 2, 0xFFFFFFFF), "body length"),
], ids=["magic", "version", "old-version", "flags", "absurd-header", "empty-header", "absurd-body"])
def test_bad_prefix_is_fatal(prefix, match):
    a, b = _pair()
    with a, b:
        a.sendall(prefix + b"{}")
        with pytest.raises(protocol.FatalFrameError, match=match):
            protocol.read_message(b, max_body_bytes=MAX_BODY)


@pytest.mark.parametrize("raw", [b"not json", b"[1,2]", b"\xff\xfe", b'"str"'], ids=["text", "list", "utf8", "string"])
def test_bad_header_keeps_the_frame_boundary(raw):
    a, b = _pair()
    with a, b:
        a.sendall(struct.pack("<4sHHII", b"KMSH", protocol.VERSION, 0, len(raw), 0) + raw)
        protocol.send_message(a, {"op": "ok"})
        with pytest.raises(ProtocolError) as info:
            protocol.read_message(b)
        assert not isinstance(info.value, protocol.FatalFrameError)
        assert protocol.read_message(b).header == {"op": "ok"}


def test_truncated_frame():
    a, b = _pair()
    with b:
        frame = protocol.encode({"op": "status"}, b"12345")
        a.sendall(frame[:-2])
        a.close()
        with pytest.raises(protocol.ConnectionClosed, match="middle of a frame"):
            protocol.read_message(b)


# ---------------------------------------------------------------------------------- polled descriptors
def _scratch(n: int = 1 << 16) -> memoryview:
    return memoryview(bytearray(n))


def _later(delay: float, fn, *args) -> threading.Thread:
    def run():
        time.sleep(delay)
        fn(*args)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _read_polled(sock, **kw):
    kw.setdefault("spin_s", 0.05)
    return protocol.read_frame(sock, max_body_bytes=8 << 20, frame_timeout=WAIT_S, scratch=_scratch(), **kw)


@pytest.mark.parametrize("body_len", [0, 5, (1 << 16) - 40, 1 << 16, 300_000, (1 << 20) + 7],
                         ids=["empty", "small", "fills-scratch", "over-scratch", "large", "over-prealloc"])
def test_polled_read_gives_the_frame_read_frame_gives(body_len):
    body = bytes(random.Random(body_len).getrandbits(8) for _ in range(min(body_len, 4096))) * \
        (body_len // 4096 + 1)
    body = body[:body_len]
    frame = protocol.encode({"id": 3, "ok": True}, body, max_body_bytes=8 << 20)
    for polled in (True, False):
        a, b = _pair()
        with a, b:
            sender = _later(0.0, a.sendall, frame)
            got = _read_polled(b) if polled else protocol.read_frame(b, max_body_bytes=8 << 20, frame_timeout=WAIT_S)
            sender.join()
            flags, buf, got_body = got
            assert flags == 0 and bytes(got_body) == body
            assert protocol.decode_header(memoryview(buf)[:len(buf) - len(got_body)]) == {"id": 3, "ok": True}
            assert b.gettimeout() == WAIT_S  # put back


@pytest.mark.parametrize("split", [1, 7, 16, 17, 40])
def test_polled_read_of_a_frame_that_arrives_in_pieces(split):
    frame = protocol.encode({"id": 4, "ok": True}, b"x" * 100)
    a, b = _pair()
    with a, b:
        a.sendall(frame[:split])
        sender = _later(0.1, a.sendall, frame[split:])  # the rest after the polled read has returned
        flags, buf, body = _read_polled(b)
        sender.join()
        assert bytes(body) == b"x" * 100 and b.gettimeout() == WAIT_S


def test_polled_read_waits_as_usual_when_nothing_came_while_polling():
    frame = protocol.encode({"id": 5, "ok": True})
    a, b = _pair()
    with a, b:
        sender = _later(0.2, a.sendall, frame)
        flags, buf, body = _read_polled(b, spin_s=0.01)
        sender.join()
        assert protocol.decode_header(buf) == {"id": 5, "ok": True}


def test_polled_read_refuses_bytes_beyond_one_frame_and_bad_prefixes():
    a, b = _pair()
    with a, b:
        a.sendall(protocol.encode({"id": 6, "ok": True}) * 2)  # two replies where one was asked for
        # (a Unix socket's send has queued both at the reader by the time it returns)
        with pytest.raises(protocol.FatalFrameError, match="beyond the end"):
            _read_polled(b)
    a, b = _pair()
    with a, b:
        a.sendall(struct.pack("<4sHHII", b"XXXX", protocol.VERSION, 0, 2, 0) + b"{}")
        with pytest.raises(protocol.FatalFrameError, match="magic"):
            _read_polled(b)


def test_polled_read_at_end_of_stream_and_mid_frame():
    a, b = _pair()
    with b:
        a.close()
        with pytest.raises(protocol.ConnectionClosed, match="connection closed"):
            _read_polled(b)
    a, b = _pair()
    with b:
        a.sendall(protocol.encode({"id": 7}, b"12345")[:-2])
        a.close()
        with pytest.raises(protocol.ConnectionClosed, match="middle of a frame"):
            _read_polled(b)


def test_polled_frame_is_not_a_view_of_the_scratch_buffer():
    a, b = _pair()
    scratch = _scratch()
    with a, b:
        a.sendall(protocol.encode({"id": 8, "ok": True}, b"first"))
        _, buf, body = protocol.read_frame(b, frame_timeout=WAIT_S, spin_s=0.05, scratch=scratch)
        a.sendall(protocol.encode({"id": 9, "ok": True}, b"other"))
        protocol.read_frame(b, frame_timeout=WAIT_S, spin_s=0.05, scratch=scratch)
        assert bytes(body) == b"first"


def test_send_parts_on_a_socket_with_a_timeout_sends_everything_in_order():
    import ctypes

    a, b = _pair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the frame does not fit: the rest follows
        values = torch.arange(200_000, dtype=torch.int64)
        view = memoryview((ctypes.c_char * values.nbytes).from_address(values.data_ptr()))
        head = struct.pack("<4sHHII", b"KMSH", protocol.VERSION, protocol.FLAG_BINARY, 8, 2 * values.nbytes)
        parts = [head + bytes(8), view, values.numpy()]
        got = bytearray()

        def drain():
            while len(got) < 24 + 2 * values.nbytes:
                got.extend(b.recv(1 << 16))
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        protocol.send_parts(a, parts)
        reader.join(WAIT_S)
        assert bytes(got) == b"".join([head + bytes(8), values.numpy().tobytes() * 2])


def test_encode_limits():
    with pytest.raises(ProtocolError, match="body"):
        protocol.encode({"op": "x"}, b"x" * 11, max_body_bytes=10)
    with pytest.raises(ProtocolError, match="header"):
        protocol.encode({"op": "x" * (protocol.MAX_HEADER_BYTES + 1)})


def test_typed_error_roundtrip():
    for exc in (OwnershipError("o"), LayoutError("l"), SegmentNotFound("k"), ProtocolError("p"), ValueError("v")):
        reply = protocol.error_reply(3, exc)
        expected = type(exc) if not isinstance(exc, ValueError) or isinstance(exc, LayoutError) else ServiceError
        with pytest.raises(expected):
            protocol.raise_for_reply(reply)
    with pytest.raises(ServiceError):
        protocol.raise_for_reply({"ok": False, "error": {"code": "no-such-code", "message": "?"}})
    with pytest.raises(ProtocolError):
        protocol.raise_for_reply({"ok": "yes"})


def test_tensor_packing_checks():
    kv = torch.randn(2, 1, 3, 1, 4).to(torch.bfloat16)
    descr, body = protocol.pack_tensors({"kv": kv, "pos": torch.arange(3)})
    assert torch.equal(protocol.unpack_tensor(descr, body, "kv").view(torch.int16), kv.view(torch.int16))
    for bad in ({"dtype": "complex64"}, {"shape": [10 ** 6]}, {"offset": len(body)}, {"shape": "x"}, {"nbytes": -1}):
        d = {"kv": {**descr["kv"], **bad}}
        with pytest.raises(ProtocolError):
            protocol.unpack_tensor(d, body, "kv")


def test_field_types():
    h = {"op": "restore", "reg": True, "n": 3, "l": [1, "2"]}
    with pytest.raises(ProtocolError, match="bool"):
        protocol.field(h, "reg", int)
    with pytest.raises(ProtocolError, match="missing"):
        protocol.field(h, "secret", str)
    with pytest.raises(ProtocolError, match="integers"):
        protocol.int_list(h, "l")
    assert protocol.field(h, "n", int) == 3


def test_peer_and_directory_checks(tmp_path):
    check_peer(PeerIdentity(1, os.getuid(), 0), os.getuid())
    with pytest.raises(OwnershipError, match="uid"):
        check_peer(PeerIdentity(1, os.getuid() + 1, 0), os.getuid())
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(ServiceError, match="mode"):
        prepare_socket_dir(str(open_dir / "s.sock"))
    prepare_socket_dir(str(tmp_path / "new" / "s.sock"))
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700


# ---------------------------------------------------------------------------------- live service
@pytest.fixture(scope="module")
def service():
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), max_body_bytes=MAX_BODY,
                            frame_timeout_s=1.0)
        with CacheService(cfg) as svc:
            yield svc


def _raw(service) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(WAIT_S)  # far beyond the service's frame timeout (1 s)
    s.connect(service.socket_path)
    return s


def _reply_or_closed(s: socket.socket):
    """The service's answer to garbage: a typed error reply, or a closed connection (``None``);
    neither (this socket's own timeout) is a hang."""
    try:
        msg = protocol.read_message(s, max_body_bytes=MAX_BODY)
    except protocol.ConnectionClosed as exc:  # (this socket's timeout is raised as one too)
        assert not any(m in str(exc) for m in ("idle timeout", "timed out")), "neither answered nor closed"
        return None
    except OSError:
        return None
    assert msg.header.get("ok") is False and msg.header["error"]["code"] in protocol.ERROR_CODES
    return msg


def _healthy(service) -> None:
    with CacheClient(service.socket_path, timeout=30) as c:
        assert c.status()["healthy"] is True


def test_socket_is_private(service):
    st = os.stat(service.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(service.socket_path)).st_mode) == 0o700


def test_random_bytes(service):
    rng = random.Random(1234)
    for i in range(24):
        s = _raw(service)
        with s:
            blob = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 256)))
            if i % 3 == 0:  # garbage after a valid magic and version reaches the length checks
                blob = b"KMSH" + struct.pack("<H", protocol.VERSION) + blob
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)
            _reply_or_closed(s)
    _healthy(service)


@pytest.mark.parametrize("header_len, body_len", [(0xFFFFFFFF, 0), (16, 0xFFFFFFFF), (16, MAX_BODY + 1),
                                                  (protocol.MAX_HEADER_BYTES + 1, 0)],
                         ids=["header-4G", "body-4G", "body-over-limit", "header-over-limit"])
def test_absurd_lengths_get_an_error_and_close(service, header_len, body_len):
    with _raw(service) as s:
        s.sendall(struct.pack("<4sHHII", b"KMSH", protocol.VERSION, 0, header_len, body_len))
        msg = _reply_or_closed(s)
        assert msg is not None and msg.header["error"]["code"] == "protocol"
        assert _reply_or_closed(s) is None  # then the service closes the connection
    _healthy(service)


def test_oversized_message_from_client_is_refused(service):
    with CacheClient(service.socket_path, max_body_bytes=4 * MAX_BODY) as c:
        big = torch.zeros(2, 1, MAX_BODY // 8 + 1, 1, 4, dtype=torch.bfloat16)
        with pytest.raises(ServiceError):  # error reply, then closed: the client sees the connection end
            try:
                c.put(big, torch.arange(big.shape[2]), torch.arange(big.shape[2]),
                      model_fingerprint=fingerprint(1, 1, 4))
            except ProtocolError as exc:  # the reply may win the race with the rest of the upload
                raise ServiceError(str(exc)) from exc
    _healthy(service)


def test_truncated_then_silent_then_closed(service):
    frame = protocol.encode({"op": "status", "id": 1})
    with _raw(service) as s:
        s.sendall(frame[:7])  # stalls inside the prefix: the frame timeout (1 s) ends it
        assert _reply_or_closed(s) is None
    with _raw(service) as s:
        s.sendall(frame[:-3])
        s.shutdown(socket.SHUT_WR)
        assert _reply_or_closed(s) is None
    _healthy(service)


def test_malformed_requests_keep_the_connection(service):
    with _raw(service) as s:
        bad = [
            {"op": "no-such-op", "id": 1},
            {"id": 2},
            {"op": "restore", "id": 3, "reg": "one", "secret": "00"},
            {"op": "acquire", "id": 4, "reg": 1, "secret": "zz", "blocks": [0]},
            {"op": "put", "id": 5, "model_fingerprint": fingerprint().to_dict(),
             "tensors": {"kv": {"dtype": "bfloat16", "shape": [2], "offset": 0, "nbytes": 400}}},
            {"op": "register", "id": 6, "memory": {"kind": "cumem_fd", "handle": "00", "offset": 0, "nbytes": 1,
                                                   "device": 0}, "layout": {}},
            {"op": "register", "id": 7, "memory": {"kind": "shm", "handle": "2e2e2f6574632f706173737764",
                                                   "offset": 0, "nbytes": 64, "device": -1},
             "layout": {"sizes": [1, 1, 1, 1, 2], "k_strides": [4, 4, 2, 2, 1], "v_strides": [4, 4, 2, 2, 1],
                        "k_offset": 0, "v_offset": 2, "dtype": "float32", "physical_shape": [16]}},
            {"op": "get", "id": 8, "key": "absent", "model_fingerprint": fingerprint().to_dict()},
        ]
        codes = []
        for h in bad:
            protocol.send_message(s, h)
            msg = protocol.read_message(s)
            assert msg.header["ok"] is False
            codes.append(msg.header["error"]["code"])
        assert codes[:4] == ["protocol", "protocol", "protocol", "ownership"]
        assert codes[5:8] == ["protocol", "protocol", "not_found"]
        protocol.send_message(s, {"op": "status", "id": 9})
        assert protocol.read_message(s).header["healthy"] is True
