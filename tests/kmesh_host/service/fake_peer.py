"""A fake cache-service peer for client tests: a raw Unix socket served by a thread that answers each
request as a test tells it (wrong ids, broken frames, stalls, silence), and the helpers that drive a
client against it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import tempfile
import threading
import time

import torch

from kmesh_host.service import CacheClient, protocol, restore_wire
from kmesh_host.service.client import Registration
from tests.kmesh_host.service.helpers import small_layout

TIMEOUT = 1.0  # the client's timeout against fake peers (a peer thread answers in far less, even on a loaded machine)
#: how long a stalling script holds the rest of its reply at most: far beyond any client timeout here, so a
#: call that ended in a timeout gave up by its own timeout (no test measures how long it took)
HOLD_S = 60.0
#: what the client's errors say when its own timeout ended the call (protocol.read_frame's messages)
TIMED_OUT = ("timed out", "idle timeout")


def timed_out(error) -> bool:
    """Whether ``error`` (an exception or a message) says the client's own timeout ended the call."""
    return any(m in str(error) for m in TIMED_OUT)


SECRET_HEX = "ab" * 32


# ---------------------------------------------------------------------------------- the fake peer
class Request:
    def __init__(self, flags: int, raw: bytes, body: bytes):
        self.flags, self.raw, self.body = flags, raw, body
        if flags & protocol.FLAG_BINARY:
            self.header = None
            self.rid = struct.unpack_from("<q", raw, 8)[0]
        else:
            self.header = json.loads(raw)
            self.rid = self.header.get("id")

    def restore(self) -> restore_wire.RestoreRequest:
        return restore_wire.decode_restore(memoryview(bytearray(self.raw)), memoryview(bytearray(self.body)))


class FakePeer:
    """Serves each connection with ``script(peer, conn)`` on a thread of its own; records requests."""

    def __init__(self, script):
        self._dir = tempfile.mkdtemp(prefix="kmf-")
        self.path = os.path.join(self._dir, "peer.sock")
        self.script = script
        self.requests: list[Request] = []
        self.errors: list[BaseException] = []
        self.eof = threading.Event()  # a connection's client side was closed
        self.hung_up = threading.Event()  # a script ended and the peer closed its connection
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def read(self, conn) -> Request | None:
        try:
            flags, buf, body = protocol.read_frame(conn, frame_timeout=10)
        except (protocol.ProtocolError, OSError):
            self.eof.set()
            return None
        req = Request(flags, bytes(memoryview(buf)[:len(buf) - len(body)]), bytes(body))
        self.requests.append(req)
        return req

    def stopped(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when the peer is being shut down."""
        return self._stop.wait(seconds)

    def hold(self, until: threading.Event | None = None) -> None:
        """Send nothing more until ``until`` is set or the peer shuts down, :data:`HOLD_S` at most."""
        deadline = time.monotonic() + HOLD_S
        while not self._stop.is_set() and not (until is not None and until.is_set()) and time.monotonic() < deadline:
            self._stop.wait(0.02)

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        conn.settimeout(10)
        try:
            self.script(self, conn)
        except OSError:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by close()
            self.errors.append(exc)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            self.hung_up.set()

    def close(self):
        self._stop.set()
        self._listener.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.rmdir(self._dir)
        assert not self.errors, self.errors

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def frame(header, body: bytes = b"", *, magic=protocol.MAGIC, version=protocol.VERSION, flags=0,
          header_len=None, body_len=None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return protocol.PREFIX.pack(magic, version, flags, len(raw) if header_len is None else header_len,
                                len(body) if body_len is None else body_len) + raw + body


def good_reply(req: Request) -> bytes:
    """What a well-behaved peer answers: JSON echoing the request id (and its ``tag``), or a binary
    restore reply whose operation id is the request id + 1000."""
    if req.header is None:
        return restore_wire.encode_restore_reply(req.rid, req.rid + 1000, "drained")
    return frame({"id": req.rid, "ok": True, "healthy": True, "echo": req.rid, "tag": req.header.get("tag")})


def first_then_good(first):
    """A script: ``first(peer, conn, request)`` answers the first request (returning ``"close"``
    ends the connection), every later request gets :func:`good_reply`."""
    def script(peer, conn):
        req = peer.read(conn)
        if req is None or first(peer, conn, req) == "close":
            return
        while (req := peer.read(conn)) is not None:
            conn.sendall(good_reply(req))
    return script


def good(peer, conn):
    while (req := peer.read(conn)) is not None:
        conn.sendall(good_reply(req))


def client(peer, **kw) -> CacheClient:
    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("reply_spin_s", 0)
    return CacheClient(peer.path, **kw)


def fake_reg(reg_id: int = 3, secret: str = SECRET_HEX) -> Registration:
    return Registration(reg_id, 1, secret, small_layout(), None, torch.empty(0))


def do_status(c):
    return c.status()


def do_restore(c):
    return c.restore(fake_reg(), [("key", [0, 1, 2])])


OPS = {"status": do_status, "restore": do_restore}
