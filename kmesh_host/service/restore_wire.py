"""The restore request and its success reply as fixed-layout binary frames (``flags``
:data:`.protocol.FLAG_BINARY`): the hot path's wire format, since protocol version 3.

A restore is one request and one reply per child, on every request of a worker: parsing a JSON
header and converting index lists cost more than the restore's own host work, so the request's
fixed part, its item table and keys are packed structs and its index arrays the body, used in place
by the service (:func:`decode_restore` returns views of the received frame). A failed restore is
answered with a JSON error reply like any other request (:func:`.protocol.error_reply`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kmesh_gpu.errors import ProtocolError

from .protocol import (DEFAULT_MAX_BODY_BYTES, FLAG_BINARY, MAGIC, MAX_HEADER_BYTES, MAX_TIMEOUT_S, VERSION,
                       decode_header, encode_json)

#: Fixed part of a binary restore request's header (little endian): kind u16 (:data:`KIND_RESTORE`),
#: bits u16 (``BIT_*``), n_items u32, id i64, reg i64, secret 32 bytes, timeout f64 (with
#: :data:`BIT_TIMEOUT`, else 0), keys_len u32, extras_len u32. Then, in this order: the client's
#: CUDA IPC event handle (64 bytes, with :data:`BIT_EVENT`); int32[n_items, 3] (each item's key
#: length in bytes, slot count, new-position count or -1 for an item restored without a shift);
#: the keys (UTF-8, end to end, ``keys_len`` bytes); the extras (a JSON object with
#: ``inject``, ``extras_len`` bytes, 0: none); zero padding to a
#: multiple of 8 bytes, so that the body's arrays are aligned. The body: every item's int64 slots
#: end to end, then the int64 new positions of the shifted items end to end.
RESTORE_REQUEST = struct.Struct("<HHIqq32sdII")
#: A binary restore reply's header: kind u16 (:data:`KIND_RESTORE`), bits u16 (:data:`BIT_TIMINGS`
#: or 0), state u32 (index in :data:`OP_STATES`), id i64, op i64; then, with :data:`BIT_TIMINGS`,
#: int64[8]: the service's :data:`RESTORE_STAGES` timestamps (-1: the stage was not reached). No body.
RESTORE_REPLY = struct.Struct("<HHIqq")
_STAMPS = struct.Struct("<8q")
KIND_RESTORE = 1
BIT_WAIT, BIT_TIMINGS, BIT_TIMEOUT, BIT_EVENT = 1, 2, 4, 8
_REQUEST_BITS = BIT_WAIT | BIT_TIMINGS | BIT_TIMEOUT | BIT_EVENT
SECRET_BYTES = 32
EVENT_HANDLE_BYTES = 64
MAX_RESTORE_ITEMS = 1 << 16
MAX_KEY_BYTES = 4096
_EXTRAS = ("inject",)
RESTORE_STAGES = ("received", "parsed", "validated", "resolved", "prepared", "launched", "completed", "reply_sent")
OP_STATES = ("submitting", "pending", "drained")
_ZERO_PAD = bytes(8)
_I8 = np.dtype("<i8")  # parsed once: a dtype given as a string is parsed again by every call
#: the most buffers :func:`restore_frame` hands to one ``sendmsg`` (arrays beyond: joined first)
_MAX_PARTS = 64


@dataclass(eq=False, slots=True)
class RestoreRequest:
    """One restore request, as the client builds it and as :func:`decode_restore` returns it.

    ``keys``, ``slot_counts``, ``position_counts``: one entry per item (``position_counts[i]``
    ``None``: item ``i`` is restored without a RoPE shift). ``slots``: int64[sum(slot_counts)], the
    items' destination slots end to end; ``new_positions``: int64[sum of the position counts].
    Decoded arrays are views of the received frame. ``secret``: the registration's 32 raw bytes;
    ``wait_event``: the client's 64-byte CUDA IPC event handle or ``None``; ``timeout``: seconds or
    ``None``; ``inject``: a JSON object (fault injection, tests) or ``None``. ``values``: decoded
    requests only (else ``None``), the whole body as one int64 array, ``slots`` then
    ``new_positions`` (both are views of it), so the service splits it per item in one call.
    """

    request_id: int
    reg_id: int
    secret: bytes
    keys: tuple
    slot_counts: tuple
    position_counts: tuple
    slots: np.ndarray
    new_positions: np.ndarray
    wait: bool = True
    timeout: float | None = None
    timings: bool = False
    wait_event: bytes | None = None
    inject: dict | None = None
    values: np.ndarray | None = None


class RestoreReply(NamedTuple):
    """A successful restore's reply: the operation id and state, and the service's stage timestamps
    (monotonic ns by :data:`RESTORE_STAGES` name) when the request asked for them."""

    request_id: int
    op_id: int
    state: str
    timings: dict | None = None


#: prefix and fixed part of a restore request, packed at once
_RESTORE_HEAD = struct.Struct("<4sHHII" + RESTORE_REQUEST.format.lstrip("<"))
_REPLY_HEAD = struct.Struct("<4sHHII" + RESTORE_REPLY.format.lstrip("<"))
_REPLY_HEAD_STAMPS = struct.Struct(_REPLY_HEAD.format + _STAMPS.format.lstrip("<"))
_STATE_INDEX = {s: i for i, s in enumerate(OP_STATES)}


@dataclass(frozen=True)
class RestoreItems:
    """The item part of a restore request's header, encoded once (see :func:`restore_items`): the
    count table and the keys (``raw``), with what the rest of the frame needs to know of them."""

    n: int
    raw: bytes
    keys_len: int
    n_slots: int
    n_new: int


def restore_items(keys, slot_counts, position_counts) -> RestoreItems:
    """Encode and check a restore's items (``position_counts[i]`` ``None``: no shift). Raises
    :class:`ProtocolError` for items the service would refuse to parse. The result depends on
    these values only, so a client may keep it for requests with the same items."""
    n = len(keys)
    if not 1 <= n <= MAX_RESTORE_ITEMS:
        raise ProtocolError(f"items: expected 1..{MAX_RESTORE_ITEMS} restore items, got {n}")
    if len(slot_counts) != n or len(position_counts) != n:
        raise ProtocolError(f"items: {n} keys, {len(slot_counts)} slot counts, {len(position_counts)} "
                            "position counts")
    try:
        raw_keys = [k.encode("utf-8") for k in keys]
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"items: a key is not valid Unicode ({exc})") from exc
    counts = [-1 if c is None else c for c in position_counts]
    try:
        if max(map(len, raw_keys)) > MAX_KEY_BYTES or min(slot_counts) < 0 or min(counts) < -1:
            raise ProtocolError(f"items: key over {MAX_KEY_BYTES} bytes or a negative count")
        table = struct.pack(f"<{3 * n}i", *[v for row in zip(map(len, raw_keys), slot_counts, counts) for v in row])
    except (TypeError, struct.error) as exc:
        raise ProtocolError(f"items: counts must be int32 ({exc})") from exc
    blob = b"".join(raw_keys)
    return RestoreItems(n, table + blob, len(blob), sum(slot_counts), sum(c for c in counts if c > 0))


def restore_frame(items: RestoreItems, request_id: int, reg_id: int, secret: bytes, arrays, *, wait: bool = True,
                  timeout: float | None = None, timings: bool = False, wait_event: bytes | None = None,
                  inject: dict | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list:
    """A restore request's frame as buffers for :func:`send_parts`: the prefix and header (one
    ``bytes``), then ``arrays``, which the caller guarantees are C-contiguous little-endian int64
    arrays (or byte views of such memory, with ``nbytes``) holding, end to end, every item's slots,
    then the shifted items' new positions (``items.n_slots + items.n_new`` values in all,
    checked). Empty arrays are left out."""
    if len(secret) != SECRET_BYTES:
        raise ProtocolError(f"secret: expected {SECRET_BYTES} bytes, got {len(secret)}")
    bits = BIT_WAIT if wait else 0
    if timings:
        bits |= BIT_TIMINGS
    if timeout is None:
        timeout_s = 0.0
    else:
        timeout_s = float(timeout)
        if not 0 <= timeout_s <= MAX_TIMEOUT_S:  # NaN fails too
            raise ProtocolError(f"timeout: expected 0..{MAX_TIMEOUT_S:g} seconds, got {timeout!r}")
        bits |= BIT_TIMEOUT
    event = b""
    if wait_event is not None:
        if len(wait_event) != EVENT_HANDLE_BYTES:
            raise ProtocolError(f"wait_event: a CUDA IPC event handle has {EVENT_HANDLE_BYTES} bytes, "
                                f"got {len(wait_event)}")
        bits |= BIT_EVENT
        event = bytes(wait_event)
    raw_extras = encode_json({"inject": inject}, "inject") if inject is not None else b""
    end = RESTORE_REQUEST.size + len(event) + len(items.raw) + len(raw_extras)
    pad = -end % 8
    header_len = end + pad
    body_len = 8 * (items.n_slots + items.n_new)
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"header: {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    if body_len > max_body_bytes:
        raise ProtocolError(f"body: {body_len} bytes exceeds the limit of {max_body_bytes}")
    out = [None]
    nbytes = 0
    for a in arrays:
        if a.nbytes:
            nbytes += a.nbytes
            out.append(a)
    if nbytes != body_len:
        raise ProtocolError(f"slots/new_positions: the items count {items.n_slots} and {items.n_new}, the arrays "
                            f"hold {nbytes // 8} values in all")
    if len(out) > _MAX_PARTS:  # sendmsg takes a bounded number of buffers
        out[1:] = [b"".join(out[1:])]  # arrays and byte views alike, in order
    try:
        head = _RESTORE_HEAD.pack(MAGIC, VERSION, FLAG_BINARY, header_len, body_len, KIND_RESTORE, bits, items.n,
                                  request_id, reg_id, secret, timeout_s, items.keys_len, len(raw_extras))
    except struct.error as exc:
        raise ProtocolError(f"restore: a field is out of range ({exc})") from exc
    out[0] = b"".join((head, event, items.raw, raw_extras, _ZERO_PAD[:pad])) if event or raw_extras or pad \
        else head + items.raw
    return out


def encode_restore(req: RestoreRequest, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list:
    """The frame of ``req`` as byte buffers for :func:`send_parts` (the index arrays are not copied
    when they already are contiguous little-endian int64). Raises :class:`ProtocolError` for a
    request the service would refuse to parse."""
    if len(req.secret) != SECRET_BYTES:
        raise ProtocolError(f"secret: expected {SECRET_BYTES} bytes, got {len(req.secret)}")
    items = restore_items(req.keys, req.slot_counts, req.position_counts)
    slots = np.ascontiguousarray(req.slots, dtype="<i8")
    new = np.ascontiguousarray(req.new_positions, dtype="<i8")
    if slots.ndim != 1 or new.ndim != 1 or slots.shape[0] != items.n_slots or new.shape[0] != items.n_new:
        raise ProtocolError(f"slots/new_positions: the items count {items.n_slots} and {items.n_new}, the arrays hold "
                            f"{list(slots.shape)} and {list(new.shape)}")
    return restore_frame(items, req.request_id, req.reg_id, req.secret, (slots, new), wait=req.wait,
                         timeout=req.timeout, timings=req.timings, wait_event=req.wait_event, inject=req.inject,
                         max_body_bytes=max_body_bytes)


def binary_request_id(raw) -> int | None:
    """The request id of a binary frame's header when it is long enough to hold one (for the error
    reply to a request that did not parse), else ``None``."""
    if len(raw) < 16:
        return None
    rid = struct.unpack_from("<q", raw, 8)[0]
    return rid if rid >= 0 else None


#: (item count, the header's item table and keys) -> what :func:`_decode_items` made of them: a
#: worker restores the same items over and over, and their parse depends on these bytes alone
_ITEMS_SEEN: dict = {}
_ITEMS_SEEN_MAX = 1024
_ITEMS_SEEN_BLOB_MAX = 4096


def _decode_items(raw, off: int, n: int, keys_len: int, body_len: int) -> tuple:
    """``(keys, slot_counts, position_counts, n_slots, n_new)`` of the item table and keys at
    ``raw[off:]``, checked (the body's length too, in the order :func:`decode_restore` documents)."""
    blob = bytes(raw[off:off + 12 * n + keys_len])
    seen = _ITEMS_SEEN.get((n, blob))
    if seen is not None:
        n_slots, n_new = seen[3], seen[4]
        if body_len != 8 * (n_slots + n_new):
            raise ProtocolError(f"body: {body_len} bytes, the items' {n_slots} slots and {n_new} new positions "
                                f"need {8 * (n_slots + n_new)}")
        return seen
    table = struct.unpack_from(f"<{3 * n}i", blob)
    key_lens, slot_counts, position_counts = table[0::3], table[1::3], table[2::3]
    if min(key_lens) < 0 or max(key_lens) > MAX_KEY_BYTES:
        i = next(i for i, k in enumerate(key_lens) if not 0 <= k <= MAX_KEY_BYTES)
        raise ProtocolError(f"items[{i}]: key length {key_lens[i]} outside 0..{MAX_KEY_BYTES}")
    if sum(key_lens) != keys_len:
        raise ProtocolError(f"keys: the items' key lengths add up to {sum(key_lens)} bytes, the header says {keys_len}")
    if min(slot_counts) < 0:
        raise ProtocolError(f"items[{next(i for i, c in enumerate(slot_counts) if c < 0)}].slots: negative count")
    if min(position_counts) < -1:
        raise ProtocolError(f"items[{next(i for i, c in enumerate(position_counts) if c < -1)}].new_positions: "
                            "count below -1")
    n_slots = sum(slot_counts)
    n_new = sum(c for c in position_counts if c > 0)
    if body_len != 8 * (n_slots + n_new):
        raise ProtocolError(f"body: {body_len} bytes, the items' {n_slots} slots and {n_new} new positions "
                            f"need {8 * (n_slots + n_new)}")
    keys, start = [], 12 * n
    try:
        for length in key_lens:
            keys.append(blob[start:start + length].decode("utf-8"))
            start += length
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"items[{len(keys)}].key: not valid UTF-8 ({exc})") from exc
    seen = (tuple(keys), slot_counts,
            position_counts if min(position_counts) >= 0 else tuple(None if c < 0 else c for c in position_counts),
            n_slots, n_new)
    if len(blob) <= _ITEMS_SEEN_BLOB_MAX:
        if len(_ITEMS_SEEN) >= _ITEMS_SEEN_MAX:
            _ITEMS_SEEN.clear()
        _ITEMS_SEEN[(n, blob)] = seen
    return seen


def decode_restore(raw, body) -> RestoreRequest:
    """Parse and check a binary restore request (``raw``: its header, ``body``: its body, as split
    by :func:`read_frame`). Every length, count and bit is checked; raises :class:`ProtocolError`
    naming the first field that is wrong (fixed part, header length and padding, item table, body
    length, keys, extras). What the values mean (registration, keys, slot ranges) is the service's
    to check."""
    if len(raw) < RESTORE_REQUEST.size:
        raise ProtocolError(f"binary frame: a {len(raw)}-byte header, a restore request's fixed part alone "
                            f"has {RESTORE_REQUEST.size}")
    kind, bits, n, rid, reg, secret, timeout, keys_len, extras_len = RESTORE_REQUEST.unpack_from(raw)
    if kind != KIND_RESTORE:
        raise ProtocolError(f"binary frame: unknown kind {kind}")
    if bits & ~_REQUEST_BITS:
        raise ProtocolError(f"restore: unknown bits {bits & ~_REQUEST_BITS:#x}")
    if not 1 <= n <= MAX_RESTORE_ITEMS:
        raise ProtocolError(f"items: expected 1..{MAX_RESTORE_ITEMS} restore items, got {n}")
    if rid < 0:
        raise ProtocolError(f"id: {rid} is negative")
    if reg < 0:
        raise ProtocolError(f"reg: {reg} is negative")
    if bits & BIT_TIMEOUT:
        if not 0 <= timeout <= MAX_TIMEOUT_S:  # NaN fails too
            raise ProtocolError(f"timeout: expected 0..{MAX_TIMEOUT_S:g} seconds, got {timeout!r}")
    elif timeout != 0.0:
        raise ProtocolError("timeout: set, but the request says it has none")
    off = RESTORE_REQUEST.size
    event = None
    if bits & BIT_EVENT:
        event = bytes(raw[off:off + EVENT_HANDLE_BYTES])
        off += EVENT_HANDLE_BYTES
    end = off + 12 * n + keys_len + extras_len
    header_len = end + (-end % 8)
    if len(raw) != header_len:
        raise ProtocolError(f"restore: a {len(raw)}-byte header, its {n} items, {keys_len} bytes of keys and "
                            f"{extras_len} of extras need {header_len}")
    if end != header_len and any(raw[end:header_len]):
        raise ProtocolError("restore: non-zero padding")
    keys, slot_counts, position_counts, n_slots, n_new = _decode_items(raw, off, n, keys_len, len(body))
    inject = None
    if extras_len:
        at = off + 12 * n + keys_len
        extras = decode_header(raw[at:end])
        for k, v in extras.items():
            if k not in _EXTRAS:
                raise ProtocolError(f"restore extras: unknown field {k!r}")
            if v is not None and not isinstance(v, dict):
                raise ProtocolError(f"{k}: expected an object, got {type(v).__name__}")
        inject = extras.get("inject")
    values = np.frombuffer(body, dtype=_I8)
    return RestoreRequest(
        rid, reg, secret, keys, slot_counts, position_counts, values[:n_slots], values[n_slots:],
        bits & BIT_WAIT != 0, timeout if bits & BIT_TIMEOUT else None, bits & BIT_TIMINGS != 0, event, inject, values)


def encode_restore_reply(request_id: int, op_id: int, state: str, stamps: dict | None = None) -> bytes:
    """The binary frame answering a successful restore (``stamps``: :data:`RESTORE_STAGES` by name)."""
    if stamps is None:
        return _REPLY_HEAD.pack(MAGIC, VERSION, FLAG_BINARY, RESTORE_REPLY.size, 0, KIND_RESTORE, 0,
                                _STATE_INDEX[state], request_id, op_id)
    return _REPLY_HEAD_STAMPS.pack(MAGIC, VERSION, FLAG_BINARY, RESTORE_REPLY.size + _STAMPS.size, 0, KIND_RESTORE,
                                   BIT_TIMINGS, _STATE_INDEX[state], request_id, op_id,
                                   *[stamps.get(k, -1) for k in RESTORE_STAGES])


def decode_restore_reply(raw, body) -> RestoreReply:
    """Parse and check a binary restore reply (see :func:`encode_restore_reply`)."""
    if len(raw) < RESTORE_REPLY.size:
        raise ProtocolError(f"reply: a {len(raw)}-byte binary header, a restore reply has at least "
                            f"{RESTORE_REPLY.size}")
    kind, bits, state, rid, op_id = RESTORE_REPLY.unpack_from(raw)
    if kind != KIND_RESTORE or bits & ~BIT_TIMINGS:
        raise ProtocolError(f"reply: unknown binary kind {kind} or bits {bits:#x}")
    want = RESTORE_REPLY.size + (_STAMPS.size if bits & BIT_TIMINGS else 0)
    if len(raw) != want or len(body):
        raise ProtocolError(f"reply: a {len(raw)}-byte header and {len(body)}-byte body, expected {want} and 0")
    if not 0 <= state < len(OP_STATES) or op_id < 0 or rid < 0:
        raise ProtocolError(f"reply: state {state}, op {op_id} or id {rid} out of range")
    timings = None
    if bits & BIT_TIMINGS:
        timings = {k: v for k, v in zip(RESTORE_STAGES, _STAMPS.unpack_from(raw, RESTORE_REPLY.size)) if v >= 0}
    return RestoreReply(rid, op_id, OP_STATES[state], timings)
