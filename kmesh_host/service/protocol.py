"""Wire format of the cache service: versioned, length-prefixed frames with a maximum size.

A frame is a fixed 16-byte prefix, a header and an optional binary body::

    magic  b"KMSH" | version u16 | flags u16 | header_len u32 | body_len u32     (little endian)

``flags`` 0: the header is a UTF-8 JSON object. Requests carry ``{"op": str, "id": int, ...}``;
replies carry ``{"id": int, "ok": true, ...}`` or ``{"id": int, "ok": false, "error": {"code": str,
"message": str}}``. Error codes map to the KMesh exception classes in :data:`ERROR_CODES`, so a
client re-raises the same typed error the service raised. Tensors travel in the body, described by
``{"dtype", "shape", "offset", "nbytes"}`` entries in the header (see :func:`pack_tensors`); so do
the int64 index arrays of save requests.

``flags`` :data:`FLAG_BINARY`: the header is a fixed little-endian binary layout. Only the hot
path uses it: the restore request and its success reply (:mod:`.restore_wire`); a failed restore
is answered with a JSON error reply like any other request.

Version 2: restore and save requests carry their index arrays in the body (version 1 sent JSON lists).
Version 3: restore requests and their success replies are binary frames (version 2 sent JSON headers).
Version 4: originals are segments of the service's store under its keys: ``put`` and ``save``
answer with the key, ``register`` carries the model fingerprint (a restore's extras no longer do),
``put`` and ``get`` carry one too; the shared-memory fast path's requests are ``channel`` and
``channel_keys`` (version 3: ``lane``, ``lane_keys``).

A frame whose prefix is wrong (bad magic, unknown version or flags, a length over the limit) cannot
be skipped safely, so the receiver answers with an error and closes the connection; a frame that is
well delimited but whose header does not parse is answered with an error and the connection stays
usable.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from dataclasses import dataclass

import numpy as np
import torch

from kmesh_gpu.errors import (
    BudgetExceeded,
    DrainError,
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    LayoutError,
    OwnershipError,
    ProtocolError,
    SegmentNotFound,
    ServiceError,
    StorageError,
)

MAGIC = b"KMSH"
VERSION = 4
#: ``flags`` bit of a frame whose header is a fixed binary layout (restore requests and replies)
FLAG_BINARY = 1
PREFIX = struct.Struct("<4sHHII")
MAX_HEADER_BYTES = 1 << 20
#: Default body limit: one message carries at most one upload of an original (a few MiB at seed size).
DEFAULT_MAX_BODY_BYTES = 256 << 20
#: the longest timeout a request may ask for (beyond it, thread waits overflow)
MAX_TIMEOUT_S = 1e6

#: Error code on the wire -> exception class. Unknown codes are raised as ServiceError.
ERROR_CODES: dict[str, type[KmeshError]] = {
    "protocol": ProtocolError,
    "ownership": OwnershipError,
    "drain": DrainError,
    "layout": LayoutError,
    "not_found": SegmentNotFound,
    "fingerprint": FingerprintMismatch,
    "integrity": IntegrityError,
    "budget": BudgetExceeded,
    "storage": StorageError,
    "service": ServiceError,
    "kmesh": KmeshError,
}

# Most specific first: the first class an exception is an instance of names its code.
_CODE_ORDER = ("protocol", "ownership", "drain", "layout", "not_found", "fingerprint", "integrity", "budget", "storage",
               "service", "kmesh")

_I8 = np.dtype("<i8")  # parsed once: a dtype given as a string is parsed again by every call

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn, "int64": torch.int64, "int32": torch.int32,
}


class FatalFrameError(ProtocolError):
    """The frame boundary is lost (bad prefix or over-limit length): answer, then close."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection (cleanly between frames, or in the middle of one)."""


@dataclass(frozen=True)
class Message:
    header: dict
    body: bytes = b""


def encode(header: dict, body: bytes | bytearray | memoryview = b"", *,
           max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """One JSON frame. Raises :class:`ProtocolError` when the header is not JSON or the header or
    body exceeds the limits."""
    raw = encode_json(header, "header")
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header: {len(raw)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    if len(body) > max_body_bytes:
        raise ProtocolError(f"body: {len(body)} bytes exceeds the limit of {max_body_bytes}")
    return PREFIX.pack(MAGIC, VERSION, 0, len(raw), len(body)) + raw + bytes(body)


def _before(deadline: float | None, sock: socket.socket) -> None:
    """With a ``deadline`` (monotonic seconds): the next read may take only the time left."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionClosed("timed out in the middle of a frame")
        sock.settimeout(left)


def encode_json(value, what: str) -> bytes:
    """``value`` as compact UTF-8 JSON; :class:`ProtocolError` for what JSON cannot carry."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
        raise ProtocolError(f"{what}: not JSON-serialisable ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _recv_exact(sock: socket.socket, view: memoryview, got: int, deadline: float | None = None) -> None:
    """Fill ``view`` from byte ``got`` on (a frame has begun: any end of stream is mid-frame)."""
    n = len(view)
    while got < n:
        _before(deadline, sock)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout as exc:
            raise ConnectionClosed("timed out in the middle of a frame") from exc
        if k == 0:
            raise ConnectionClosed(f"connection closed in the middle of a frame ({got} of {n} bytes)")
        got += k


#: frames up to this size are received into a buffer allocated at once; larger ones grow as they arrive
PREALLOC_BYTES = 1 << 20


def _recv_growing(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """The next ``n`` bytes (a frame has begun), received in chunks into a buffer that grows with them."""
    buf = bytearray()
    chunk = bytearray(PREALLOC_BYTES)
    view = memoryview(chunk)
    while len(buf) < n:
        _before(deadline, sock)
        try:
            k = sock.recv_into(view, min(len(chunk), n - len(buf)))
        except socket.timeout as exc:
            raise ConnectionClosed("timed out in the middle of a frame") from exc
        if k == 0:
            raise ConnectionClosed(f"connection closed in the middle of a frame ({len(buf)} of {n} bytes)")
        buf += view[:k]
    return buf


#: Polling for a frame wants a core for each side; with fewer usable CPUs than this it delays the
#: peer that is to answer more than the wake-up latency it saves, so ``None`` (auto) means no polling.
MIN_CPUS_TO_SPIN = 4


def spin_default(spin_s: float | None, auto_s: float) -> float:
    """``spin_s`` as given, or for ``None`` ``auto_s`` where at least :data:`MIN_CPUS_TO_SPIN` CPUs
    are usable by this process (else 0)."""
    if spin_s is not None:
        return max(0.0, float(spin_s))
    return auto_s if len(os.sched_getaffinity(0)) >= MIN_CPUS_TO_SPIN else 0.0


def _recv_spinning(sock: socket.socket, view: memoryview, spin_s: float, spin_while=None, flags: int = 0) -> int:
    """Poll for the first bytes of ``view`` without sleeping for up to ``spin_s`` seconds.

    Returns the byte count read (0: end of stream) or -1 when nothing came in time. A thread asleep
    in ``recv`` wakes well after the data arrives (scheduler and idle-state exit latency), which a
    sub-millisecond request cannot afford. The caller has made ``sock`` non-blocking, or passes
    ``MSG_DONTWAIT`` in ``flags``. Each empty poll yields the CPU, so that on a busy core the peer
    that is to answer runs first; polling also stops as soon as ``spin_while()`` (when given) is false.
    """
    deadline = time.monotonic() + spin_s
    n = len(view)
    while True:
        try:
            return sock.recv_into(view, n, flags)
        except (BlockingIOError, InterruptedError):
            if time.monotonic() >= deadline or (spin_while is not None and not spin_while()):
                return -1
            os.sched_yield()


def _check_prefix(prefix, max_body_bytes: int) -> tuple[int, int, int]:
    """``(flags, header length, body length)`` of a frame's 16-byte prefix; :class:`FatalFrameError`
    when it is not one this side accepts."""
    magic, version, flags, header_len, body_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise FatalFrameError(f"frame: bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FatalFrameError(f"frame: protocol version {version}, this service speaks {VERSION}")
    if flags & ~FLAG_BINARY:
        raise FatalFrameError(f"frame: unknown flags {flags:#x}")
    if header_len > MAX_HEADER_BYTES or header_len == 0:
        raise FatalFrameError(f"frame: header length {header_len} outside 1..{MAX_HEADER_BYTES}")
    if body_len > max_body_bytes:
        raise FatalFrameError(f"frame: body length {body_len} exceeds the limit of {max_body_bytes}")
    return flags, header_len, body_len


def _readv_spinning(fd: int, view: memoryview, spin_s: float, spin_while=None) -> int:
    """:func:`_recv_spinning` on a non-blocking descriptor read directly (``os.readv``): up to
    ``len(view)`` bytes, 0 at end of stream, -1 when nothing came in time."""
    deadline = time.monotonic() + spin_s
    bufs = [view]
    while True:
        try:
            return os.readv(fd, bufs)
        except (BlockingIOError, InterruptedError):
            if time.monotonic() >= deadline or (spin_while is not None and not spin_while()):
                return -1
            os.sched_yield()


def _rest_of_frame(sock: socket.socket, first: memoryview, max_body_bytes: int, frame_timeout: float | None,
                   deadline: float | None) -> tuple[int, bytearray, memoryview]:
    """The frame whose first bytes are ``first`` (read already, at most one frame's worth is
    accepted): the rest read from ``sock`` as :func:`read_frame` reads a frame that arrives in
    pieces (``frame_timeout`` per read, ``deadline`` for all of it)."""
    idle_timeout = sock.gettimeout()
    try:
        k = len(first)
        if k < PREFIX.size:
            prefix = bytearray(PREFIX.size)
            prefix[:k] = first
            sock.settimeout(frame_timeout)
            _recv_exact(sock, memoryview(prefix), k, deadline)
            first, k = memoryview(prefix), PREFIX.size
        flags, header_len, body_len = _check_prefix(first, max_body_bytes)
        n = header_len + body_len
        have = k - PREFIX.size
        if have > n:
            raise FatalFrameError(f"frame: {have - n} bytes beyond the end of a frame arrived with it (one reply "
                                  "was expected)")
        if have == n:
            buf = bytearray(first[PREFIX.size:])
        elif n > PREALLOC_BYTES:  # as read_frame: the buffer grows with what arrives
            sock.settimeout(frame_timeout)
            buf = bytearray(first[PREFIX.size:])
            buf += _recv_growing(sock, n - have, deadline)
        else:
            buf = bytearray(n)
            buf[:have] = first[PREFIX.size:]
            sock.settimeout(frame_timeout)
            _recv_exact(sock, memoryview(buf), have, deadline)
    finally:
        if sock.gettimeout() != idle_timeout:
            sock.settimeout(idle_timeout)
    return flags, buf, memoryview(buf)[header_len:]


def read_frame(sock: socket.socket, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               frame_timeout: float | None = None, spin_s: float = 0.0,
               spin_while=None, deadline: float | None = None,
               scratch: memoryview | None = None) -> tuple[int, bytearray, memoryview]:
    """Read one frame: ``(flags, buffer, body)``, ``buffer`` being the raw header and the body
    together (``body`` a view of its tail); :func:`decode_header` or :func:`.restore_wire.decode_restore`
    parse it.

    Two reads in the common case: the prefix (waiting without limit, or the socket's own timeout,
    for its first byte; polling without sleeping for up to ``spin_s`` first, while ``spin_while()``
    holds when given), then whatever of the header and body has arrived, without waiting (all of
    it, usually). The socket's timeout is switched to ``frame_timeout`` only when a frame arrives
    in pieces, and put back afterwards. Raises :class:`ConnectionClosed` at end of stream and
    :class:`FatalFrameError` when the prefix is invalid (the caller must close). ``deadline``
    (monotonic seconds; the client's): once the frame has begun no read goes past it, however
    slowly the frame trickles in (``frame_timeout`` alone bounds each read, not the frame).

    ``scratch`` (a client's, with ``spin_s``): a socket with a timeout has a non-blocking
    descriptor, which is then polled directly (``os.readv`` into ``scratch``), so that the first
    read takes a small frame whole, without the two switches of the socket's timeout and the second
    read that polling through the socket object costs. That read must not take more than this one
    frame: the caller expects one frame only (a reply), and bytes beyond it are a
    :class:`FatalFrameError`.
    """
    if scratch is not None and spin_s > 0 and sock.gettimeout() is not None:
        k = _readv_spinning(sock.fileno(), scratch, spin_s, spin_while)
        if k == 0:
            raise ConnectionClosed("connection closed")
        if k > 0:
            return _rest_of_frame(sock, scratch[:k], max_body_bytes, frame_timeout, deadline)
        spin_s = 0.0  # nothing came while polling: wait for it as below
    prefix = bytearray(PREFIX.size)
    pview = memoryview(prefix)
    idle_timeout = sock.gettimeout()
    current = idle_timeout  # the socket's timeout now: put back to idle_timeout before returning
    k = -1
    try:
        if spin_s > 0:
            if idle_timeout is None:
                # a blocking socket (the service's) reads without polling first: MSG_DONTWAIT alone
                # makes each read return at once, with no switch of the socket's mode and back
                k = _recv_spinning(sock, pview, spin_s, spin_while, socket.MSG_DONTWAIT)
            else:
                sock.settimeout(0.0)  # non-blocking: recv_into returns at once instead of polling first
                current = 0.0
                k = _recv_spinning(sock, pview, spin_s, spin_while)
        if k < 0:
            if current != idle_timeout:
                sock.settimeout(idle_timeout)
                current = idle_timeout
            try:
                k = sock.recv_into(pview, PREFIX.size)
            except socket.timeout as exc:
                raise ConnectionClosed("idle timeout") from exc
        if k == 0:
            raise ConnectionClosed("connection closed")
        if k < PREFIX.size:
            if current != frame_timeout:
                sock.settimeout(frame_timeout)
                current = frame_timeout
            _recv_exact(sock, pview, k, deadline)
        flags, header_len, body_len = _check_prefix(prefix, max_body_bytes)
        n = header_len + body_len
        if n > PREALLOC_BYTES:
            # a large frame: its buffer grows with the bytes that arrive, so that a prefix alone
            # (16 bytes) cannot make the receiver hold max_body_bytes for as long as it trickles
            if current != frame_timeout:
                sock.settimeout(frame_timeout)
                current = frame_timeout
            buf = _recv_growing(sock, n, deadline)
            return flags, buf, memoryview(buf)[header_len:]
        buf = bytearray(n)
        view = memoryview(buf)
        try:
            # whatever has arrived already, without waiting (a socket with a timeout would poll
            # before it reads, which the read below does anyway)
            got = sock.recv_into(view, n, socket.MSG_DONTWAIT) if current is None or current == 0.0 else 0
        except (BlockingIOError, InterruptedError):
            got = 0
        if got < n:
            if current != frame_timeout:
                sock.settimeout(frame_timeout)
                current = frame_timeout
            _recv_exact(sock, view, got, deadline)
    finally:
        if current != idle_timeout or deadline is not None:
            sock.settimeout(idle_timeout)
    return flags, buf, view[header_len:]


def decode_header(raw) -> dict:
    """The JSON object at the start of a frame read by :func:`read_frame` (``raw`` may be longer:
    the header's own length is taken from its prefix by the caller)."""
    try:
        header = json.loads(str(raw, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, and integers longer than sys.get_int_max_str_digits();
        # RecursionError: nesting deeper than the interpreter's recursion limit
        raise ProtocolError(f"header: not valid UTF-8 JSON ({type(exc).__name__}: {str(exc)[:200]})") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header: expected a JSON object, got {type(header).__name__}")
    return header


def read_message(sock: socket.socket, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 frame_timeout: float | None = None) -> Message:
    """Read one JSON frame. Waits without limit for its first byte, then at most ``frame_timeout`` per read.

    Raises :class:`ConnectionClosed` at end of stream, :class:`FatalFrameError` when the prefix is
    invalid (the caller must close), and :class:`ProtocolError` for a well-delimited frame whose
    header is not a JSON object, or is binary (the connection stays usable).
    """
    flags, buf, body = read_frame(sock, max_body_bytes=max_body_bytes, frame_timeout=frame_timeout)
    if flags & FLAG_BINARY:
        raise ProtocolError("frame: expected a JSON header, got a binary frame")
    return Message(decode_header(memoryview(buf)[:len(buf) - len(body)]), body)


def send_message(sock: socket.socket, header: dict, body: bytes | bytearray | memoryview = b"", *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    sock.sendall(encode(header, body, max_body_bytes=max_body_bytes))


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send a frame given as buffers (``bytes``, memoryviews or C-contiguous arrays: the prefix and
    header first, then arrays) with one system call in the common case, without joining them first.
    A socket with a timeout (a client's) has a non-blocking descriptor, written directly
    (``os.writev``): the socket object would first poll it for room, a system call per frame."""
    if sock.gettimeout() is not None:
        try:
            sent = os.writev(sock.fileno(), parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
    else:
        sent = sock.sendmsg(parts)
    _, _, _, header_len, body_len = PREFIX.unpack_from(parts[0])  # the frame's own length, not a sum
    if sent < PREFIX.size + header_len + body_len:  # the socket buffer was full: send the rest in order
        sock.sendall(b"".join(parts)[sent:])


# ---------------------------------------------------------------------------------- errors
def error_code(exc: BaseException) -> str:
    for code in _CODE_ORDER:
        if isinstance(exc, ERROR_CODES[code]):
            return code
    return "service"


#: the longest error message a reply carries (messages quote the request, whose header may be 1 MiB)
MAX_ERROR_MESSAGE = 2048


def error_reply(request_id, exc: BaseException) -> dict:
    message = str(exc)
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[:MAX_ERROR_MESSAGE] + f"... ({len(message)} characters)"
    return {"id": request_id, "ok": False, "error": {"code": error_code(exc), "message": message}}


def raise_for_reply(header: dict) -> None:
    """Re-raise a typed error reply on the client side; return silently for a success."""
    if header.get("ok") is True:
        return
    err = header.get("error")
    if not isinstance(err, dict):
        raise ProtocolError(f"reply: neither a success nor a typed error: {header!r}")
    cls = ERROR_CODES.get(str(err.get("code")), ServiceError)
    raise cls(str(err.get("message", "")))


# ---------------------------------------------------------------------------------- fields
def field(header: dict, name: str, kind, *, optional: bool = False, default=None):
    """``header[name]`` checked against ``kind`` (a type or tuple); bools are never ints here."""
    if name not in header or header[name] is None:
        if optional:
            return default
        raise ProtocolError(f"{name}: missing from the {header.get('op', 'message')!r} request")
    value = header[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(f"{name}: expected {'/'.join(k.__name__ for k in kinds)}, got a bool")
    if not isinstance(value, kinds):
        raise ProtocolError(f"{name}: expected {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def timeout_field(header: dict, name: str = "timeout") -> float | None:
    """An optional timeout in seconds: ``None``, or a finite number in ``0..MAX_TIMEOUT_S`` (what a
    binary restore accepts; JSON also parses NaN, Infinity and integers beyond float range)."""
    value = field(header, name, (int, float), optional=True)
    if value is None:
        return None
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not 0 <= seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise ProtocolError(f"{name}: expected 0..{MAX_TIMEOUT_S:g} seconds, got {value!r:.40}")
    return seconds


def int_list(header: dict, name: str, *, optional: bool = False) -> list[int] | None:
    value = field(header, name, list, optional=optional)
    if value is None:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ProtocolError(f"{name}: expected a list of integers")
    return value


# ---------------------------------------------------------------------------------- tensors
def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict, bytes]:
    """CPU copies of ``tensors`` laid end to end, and their descriptions for the header."""
    descr, parts, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).removeprefix("torch.")
        descr[name] = {"dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": len(raw)}
        parts.append(raw)
        offset += len(raw)
    return descr, b"".join(parts)


def pack_int64(arrays: dict[str, np.ndarray]) -> tuple[dict, bytes]:
    """1-D int64 arrays (slots, positions) laid end to end, described like :func:`pack_tensors`."""
    descr, parts, offset = {}, [], 0
    for name, a in arrays.items():
        raw = np.ascontiguousarray(a, dtype="<i8").tobytes()
        descr[name] = {"dtype": "int64", "shape": [len(a)], "offset": offset, "nbytes": len(raw)}
        parts.append(raw)
        offset += len(raw)
    return descr, b"".join(parts)


def unpack_int64(descr: dict, body, name: str, *, optional: bool = False) -> torch.Tensor | None:
    """The 1-D int64 array ``name`` of a request (see :func:`pack_int64`), a CPU tensor.

    A view of ``body`` when it is writable (a received frame's own buffer), a copy otherwise."""
    if optional and (not isinstance(descr, dict) or name not in descr):
        return None
    d = descr.get(name) if isinstance(descr, dict) else None
    if isinstance(d, dict) and d.get("dtype") == "int64":
        shape, offset, nbytes = d.get("shape"), d.get("offset"), d.get("nbytes")
        if (type(shape) is list and len(shape) == 1 and type(shape[0]) is int and type(offset) is int
                and type(nbytes) is int and 0 <= shape[0] and nbytes == 8 * shape[0] and 0 <= offset
                and offset + nbytes <= len(body)):
            if nbytes == 0:
                return torch.empty(0, dtype=torch.int64)
            a = np.frombuffer(body, dtype=_I8, count=shape[0], offset=offset)
            return torch.from_numpy(a if a.flags.writeable else a.copy())
    t = unpack_tensor(descr, body, name)  # the general path names what is wrong
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ProtocolError(f"tensors.{name}: expected int64[N], got {str(t.dtype).removeprefix('torch.')}"
                            f"{list(t.shape)}")
    return t


def unpack_tensor(descr: dict, body: bytes, name: str) -> torch.Tensor:
    """The tensor ``name`` described in ``descr`` (from :func:`pack_tensors`), checked against the body."""
    d = descr.get(name) if isinstance(descr, dict) else None
    if not isinstance(d, dict):
        raise ProtocolError(f"tensors.{name}: missing")
    dtype = _DTYPES.get(d.get("dtype"))
    shape, offset, nbytes = d.get("shape"), d.get("offset"), d.get("nbytes")
    if dtype is None:
        raise ProtocolError(f"tensors.{name}: dtype {d.get('dtype')!r} not one of {sorted(_DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < (1 << 40) for s in shape)):
        raise ProtocolError(f"tensors.{name}: malformed shape {shape!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, nbytes)):
        raise ProtocolError(f"tensors.{name}: malformed offset/nbytes")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    if numel * itemsize != nbytes or offset + nbytes > len(body):
        raise ProtocolError(f"tensors.{name}: {shape} {dtype} needs {numel * itemsize} bytes, frame holds "
                            f"{nbytes} at offset {offset} of a {len(body)}-byte body")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(body[offset:offset + nbytes])
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
