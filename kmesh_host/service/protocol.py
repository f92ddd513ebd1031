"""Wire format of the cache service: versioned, length-prefixed frames with a maximum size.

A frame is a fixed 16-byte prefix, a UTF-8 JSON header (an object) and an optional binary body::

    magic  b"KMSH" | version u16 | flags u16 (0) | header_len u32 | body_len u32     (little endian)

Requests carry ``{"op": str, "id": int, ...}``; replies carry ``{"id": int, "ok": true, ...}`` or
``{"id": int, "ok": false, "error": {"code": str, "message": str}}``. Error codes map to the KMesh
exception classes in :data:`ERROR_CODES`, so a client re-raises the same typed error the service
raised. Tensors travel in the body, described by ``{"dtype", "shape", "offset", "nbytes"}`` entries
in the header (see :func:`pack_tensors`); so do the int64 index arrays of restore and save requests
(slots, positions), which would cost a JSON number per token each way otherwise.

Version 2: restore and save requests carry their index arrays in the body (version 1 sent JSON lists).

A frame whose prefix is wrong (bad magic, unknown version, a length over the limit) cannot be
skipped safely, so the receiver answers with an error and closes the connection; a frame that is
well delimited but whose header is not valid JSON is answered with an error and the connection
stays usable.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass

import numpy as np
import torch

from kmesh_gpu.errors import (
    DrainError,
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    LayoutError,
    OwnershipError,
    ProtocolError,
    SegmentNotFound,
    ServiceError,
)

MAGIC = b"KMSH"
VERSION = 2
PREFIX = struct.Struct("<4sHHII")
MAX_HEADER_BYTES = 1 << 20
#: Default body limit: one message carries at most one upload of an original (a few MiB at seed size).
DEFAULT_MAX_BODY_BYTES = 256 << 20

#: Error code on the wire -> exception class. Unknown codes are raised as ServiceError.
ERROR_CODES: dict[str, type[KmeshError]] = {
    "protocol": ProtocolError,
    "ownership": OwnershipError,
    "drain": DrainError,
    "layout": LayoutError,
    "not_found": SegmentNotFound,
    "fingerprint": FingerprintMismatch,
    "integrity": IntegrityError,
    "service": ServiceError,
    "kmesh": KmeshError,
}

# Most specific first: the first class an exception is an instance of names its code.
_CODE_ORDER = ("protocol", "ownership", "drain", "layout", "not_found", "fingerprint", "integrity", "service", "kmesh")

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
    """One frame. Raises :class:`ProtocolError` when the header or body exceeds the limits."""
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header: {len(raw)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    if len(body) > max_body_bytes:
        raise ProtocolError(f"body: {len(body)} bytes exceeds the limit of {max_body_bytes}")
    return PREFIX.pack(MAGIC, VERSION, 0, len(raw), len(body)) + raw + bytes(body)


def _recv_exact(sock: socket.socket, view: memoryview, got: int) -> None:
    """Fill ``view`` from byte ``got`` on (a frame has begun: any end of stream is mid-frame)."""
    n = len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout as exc:
            raise ConnectionClosed("timed out in the middle of a frame") from exc
        if k == 0:
            raise ConnectionClosed(f"connection closed in the middle of a frame ({got} of {n} bytes)")
        got += k


def read_frame(sock: socket.socket, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               frame_timeout: float | None = None) -> tuple[bytearray, memoryview]:
    """Read one frame's raw header and body (see :func:`read_message`; :func:`decode_header` parses).

    Two reads in the common case: the prefix (waiting without limit, or the socket's own timeout,
    for its first byte), then header and body together. The socket's timeout is switched to
    ``frame_timeout`` only when a frame arrives in pieces, and put back afterwards.
    """
    idle_timeout = sock.gettimeout()
    prefix = bytearray(PREFIX.size)
    pview = memoryview(prefix)
    try:
        k = sock.recv_into(pview, PREFIX.size)
    except socket.timeout as exc:
        raise ConnectionClosed("idle timeout") from exc
    if k == 0:
        raise ConnectionClosed("connection closed")
    switched = False
    try:
        if k < PREFIX.size:
            if frame_timeout != idle_timeout:
                sock.settimeout(frame_timeout)
                switched = True
            _recv_exact(sock, pview, k)
        magic, version, flags, header_len, body_len = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise FatalFrameError(f"frame: bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise FatalFrameError(f"frame: protocol version {version}, this service speaks {VERSION}")
        if flags != 0:
            raise FatalFrameError(f"frame: unknown flags {flags:#x}")
        if header_len > MAX_HEADER_BYTES or header_len == 0:
            raise FatalFrameError(f"frame: header length {header_len} outside 1..{MAX_HEADER_BYTES}")
        if body_len > max_body_bytes:
            raise FatalFrameError(f"frame: body length {body_len} exceeds the limit of {max_body_bytes}")
        buf = bytearray(header_len + body_len)
        view = memoryview(buf)
        try:
            # whatever has arrived already, without waiting (blocking sockets only: a socket with a
            # timeout polls before it reads, which is what the next read does anyway)
            got = sock.recv_into(view, len(buf), socket.MSG_DONTWAIT) if idle_timeout is None else 0
        except (BlockingIOError, InterruptedError):
            got = 0
        if got < len(buf):
            if not switched and frame_timeout != idle_timeout:
                sock.settimeout(frame_timeout)
                switched = True
            _recv_exact(sock, view, got)
    finally:
        if switched:
            sock.settimeout(idle_timeout)
    return buf, view[header_len:]


def decode_header(raw) -> dict:
    """The JSON object at the start of a frame read by :func:`read_frame` (``raw`` may be longer:
    the header's own length is taken from its prefix by the caller)."""
    try:
        header = json.loads(str(raw, "utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header: not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header: expected a JSON object, got {type(header).__name__}")
    return header


def read_message(sock: socket.socket, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 frame_timeout: float | None = None) -> Message:
    """Read one frame. Waits without limit for its first byte, then at most ``frame_timeout`` per read.

    Raises :class:`ConnectionClosed` at end of stream, :class:`FatalFrameError` when the prefix is
    invalid (the caller must close), and :class:`ProtocolError` for a well-delimited frame whose
    header is not a JSON object (the connection stays usable).
    """
    buf, body = read_frame(sock, max_body_bytes=max_body_bytes, frame_timeout=frame_timeout)
    return Message(decode_header(memoryview(buf)[:len(buf) - len(body)]), body)


def send_message(sock: socket.socket, header: dict, body: bytes | bytearray | memoryview = b"", *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    sock.sendall(encode(header, body, max_body_bytes=max_body_bytes))


# ---------------------------------------------------------------------------------- errors
def error_code(exc: BaseException) -> str:
    for code in _CODE_ORDER:
        if isinstance(exc, ERROR_CODES[code]):
            return code
    return "service"


def error_reply(request_id, exc: BaseException) -> dict:
    return {"id": request_id, "ok": False, "error": {"code": error_code(exc), "message": str(exc)}}


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
            a = np.frombuffer(body, dtype="<i8", count=shape[0], offset=offset)
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
