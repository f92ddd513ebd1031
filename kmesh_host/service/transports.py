"""How :meth:`CacheClient.restore <.client.CacheClient.restore>` reaches the service: two transports
behind one small interface (:class:`RestoreTransport`), tried in order.

* :class:`ChannelTransport` — the connection's shared-memory channel of the registration (opened on
  first use, see :mod:`.channel`): the usual synchronous restore into GPU memory, no Python per
  request in the service. It declines what it does not serve (returns ``None``), with nothing of
  the request in flight.
* :class:`SocketTransport` — the binary restore frame over the connection's socket
  (:mod:`.restore_wire`): every request; it decides and names every error.

Also here: the conversion of a restore's items and index arrays for the wire (one request carries
two int64 arrays per item, sent from their own memory where they are contiguous int64 already).
"""

from __future__ import annotations

import ctypes
import operator
import os
import socket
import threading
import time
from abc import ABC, abstractmethod

import numpy as np
import torch

from kmesh_gpu import cuda
from kmesh_gpu.errors import KmeshError, LayoutError, OwnershipError, ProtocolError, ServiceError

from ..restore.contract import RestoreItem
from . import channel, protocol, restore_wire
from .sockets import FD_MARK

_I8 = np.dtype("<i8")
_TENSOR, _TORCH_I8, _STRIDED = torch.Tensor, torch.int64, torch.strided
_BYTE = ctypes.c_char
_EMPTY = memoryview(b"")
#: distinct item lists a client keeps encoded (see :func:`.restore_wire.restore_items`)
_ITEMS_KEPT = 256


# ---------------------------------------------------------------------------------- inputs
def ints(name: str, values) -> list[int]:
    """``values`` (an int64[T] tensor or a sequence of integers) as a list of ints (block ids)."""
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.int64 or values.dim() != 1:
            raise LayoutError(f"{name}: expected int64[T], got {str(values.dtype).removeprefix('torch.')}"
                              f"{list(values.shape)}")
        return values.tolist()
    try:
        return [operator.index(v) for v in values]  # int() would truncate 0.5 and parse "1"
    except TypeError as exc:
        raise LayoutError(f"{name}: expected integers ({exc})") from exc


def int64_array(name: str, values) -> np.ndarray:
    """``values`` (an int64[T] tensor, a 1-D integer array or a sequence of integers) as a
    C-contiguous 1-D little-endian int64 array for the wire: contiguous int64 arrays and CPU
    tensors are used as they are (no copy), a list is converted with one call."""
    if isinstance(values, torch.Tensor):
        if values.layout is not torch.strided:
            raise LayoutError(f"{name}: expected a strided (dense) int64[T] tensor, got layout {values.layout}")
        if values.dtype is not torch.int64 or values.dim() != 1:
            raise LayoutError(f"{name}: expected int64[T], got {str(values.dtype).removeprefix('torch.')}"
                              f"{list(values.shape)}")
        a = (values if values.is_cpu else values.cpu()).numpy()
    elif type(values) is np.ndarray and values.dtype is _I8 and values.ndim == 1:
        a = values
    else:
        try:
            a = np.asarray(values)
        except (TypeError, ValueError, OverflowError) as exc:
            raise LayoutError(f"{name}: expected integers ({exc})") from exc
        if a.ndim != 1:
            raise LayoutError(f"{name}: expected a flat sequence of integers, got shape {list(a.shape)}")
        if a.size == 0:
            a = a.astype(_I8)
        elif a.dtype.kind not in "iu" or a.dtype.kind == "u" and a.max() > np.iinfo(np.int64).max:
            # np.asarray(..., dtype=int64) truncates floats, parses strings and wraps uint64 (2**64-1 -> -1: "skip")
            raise LayoutError(f"{name}: expected int64 integers, got {a.dtype} values")
    if not a.flags.c_contiguous or a.dtype is not _I8 and a.dtype != _I8:
        a = np.ascontiguousarray(a, dtype=_I8)
    return a


def wire_array(name: str, values, keep: list):
    """``(buffer, value count)``: ``values`` as int64 values for the wire. What a model runner
    holds, a contiguous 1-D int64 CPU tensor, is sent from its own memory through a byte view made
    without NumPy (``Tensor.numpy()`` costs several times more, and a restore has two index arrays
    per item); such a view does not keep the tensor alive, so the tensor goes into ``keep``, which
    the caller holds until the frame has been sent. Anything else is converted by :func:`int64_array`."""
    if type(values) is _TENSOR and values.dtype is _TORCH_I8 and values.layout is _STRIDED and values.dim() == 1 \
            and values.is_cpu and values.is_contiguous():
        n = values.nbytes
        if not n:
            return _EMPTY, 0
        keep.append(values)
        return memoryview((_BYTE * n).from_address(values.data_ptr())), n >> 3
    a = int64_array(name, values)
    return a, a.shape[0]


def item_fields(it):
    """``(key, slots, new_positions or None)`` of a :class:`~kmesh_host.restore.RestoreItem` or a
    ``(key, slots)`` / ``(key, slots, new_positions)`` tuple; ``None`` for anything else."""
    if type(it) is RestoreItem:
        return it.key, it.slots, it.new_positions
    if type(it) is tuple and len(it) == 3:
        return it
    if type(it) is tuple and len(it) == 2:
        return it[0], it[1], None
    return None


def _checked_fields(i: int, it):
    fields = item_fields(it)
    if fields is None:
        raise LayoutError(f"items[{i}]: expected a RestoreItem or (key, slots[, new_positions]), "
                          f"got {type(it).__name__}")
    return fields


def _channel_vector(x, keep: list):
    """``(address, length)`` of a non-empty contiguous int64 CPU tensor or NumPy array (a list of
    ints is converted, the array kept in ``keep``), else ``None``."""
    if type(x) is list:
        try:
            x = np.asarray(x)
        except (TypeError, ValueError, OverflowError):
            return None
        if x.dtype.kind not in "iu" or x.ndim != 1:  # floats, bools, nested: the socket path names the error
            return None
        x = x.astype(np.int64, copy=False)  # (uint64 beyond int64 wraps negative: refused as a slot)
        keep.append(x)
    if type(x) is torch.Tensor:
        if x.dtype is torch.int64 and x.dim() == 1 and not x.is_cuda and x.is_contiguous() and x.shape[0] \
                and x.device.type == "cpu":
            return x.data_ptr(), x.shape[0]
        return None
    if type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1 and x.flags.c_contiguous and x.shape[0]:
        return x.ctypes.data, x.shape[0]
    return None


# ---------------------------------------------------------------------------------- the interface
class RestoreTransport(ABC):
    """One way of sending a restore (see the module docstring). ``name`` is what the client's
    ``route_counts`` and ``last_route`` call it.

    :meth:`restore` is called by :meth:`CacheClient.restore` with the items as given (a list or
    tuple) and returns the operation id (0: drained already), or ``None`` when this transport does
    not serve the request (nothing of it sent or in flight: the next transport is tried). It raises
    the service's typed errors for a request it served and the service refused.
    """

    name: str

    @abstractmethod
    def restore(self, reg, items, *, wait: bool, timeout: float | None, inject: dict | None,
                stamps: dict | None) -> int | None: ...

    def forget(self, reg_id: int) -> None:
        """The registration ``reg_id`` was closed (or the connection lost): drop what is kept for it."""

    def close(self) -> None:
        """The client is closing."""


class SocketTransport(RestoreTransport):
    """The binary restore frame over the client's connection."""

    name = "socket"

    def __init__(self, client):
        self.client = client
        self._items: dict[tuple, restore_wire.RestoreItems] = {}  # (keys, slot counts, position counts) -> encoded

    def restore(self, reg, items, *, wait, timeout, inject, stamps):
        client = self.client
        secret = reg.secret_bytes
        keys, slot_counts, position_counts, arrays, shifts = [], [], [], [], []
        keep: list = []  # tensors sent from their own memory, alive until the frame is sent
        try:
            numbered = enumerate(items)
        except TypeError as exc:
            raise LayoutError(f"items: expected an iterable of restore items, got {type(items).__name__}") from exc
        for i, it in numbered:
            key, slots, new_positions = _checked_fields(i, it)
            if type(key) is not str:
                raise ProtocolError(f"items[{i}].key: expected str, got {type(key).__name__}")
            s, count = wire_array("slots", slots, keep)
            keys.append(key)
            arrays.append(s)
            slot_counts.append(count)
            if new_positions is None:
                position_counts.append(None)
            else:
                p, count = wire_array("new_positions", new_positions, keep)
                shifts.append(p)
                position_counts.append(count)
        arrays += shifts  # the body: every item's slots, then the shifted items' new positions
        signature = (tuple(keys), tuple(slot_counts), tuple(position_counts))
        encoded = self._items.get(signature)
        if encoded is None:
            encoded = restore_wire.restore_items(*signature)
            if len(self._items) >= _ITEMS_KEPT:
                self._items.clear()
            self._items[signature] = encoded
        inject = inject or None
        timings = stamps is not None

        def build(rid, event):
            return restore_wire.restore_frame(encoded, rid, reg.reg_id, secret, arrays, wait=wait, timeout=timeout,
                                              timings=timings, wait_event=event, inject=inject,
                                              max_body_bytes=client.max_body_bytes)

        rid, flags, buf, body = client._exchange("restore", build, reg, stamps)
        raw = memoryview(buf)[:len(buf) - len(body)]
        if not flags & protocol.FLAG_BINARY:  # a typed error reply
            header = protocol.decode_header(raw)
            client._check_reply(header, rid)
            raise ProtocolError(f"reply to 'restore': JSON success {header!r} where a binary reply was expected")
        reply = restore_wire.decode_restore_reply(raw, body)
        if reply.request_id != rid:
            raise client._desynchronized(f"reply id {reply.request_id} does not match request {rid}")
        if stamps is not None:
            client.last_timings = {"client": stamps, "service": reply.timings or {}}
        return reply.op_id


class ChannelTransport(RestoreTransport):
    """The connection's shared-memory channel of each GPU registration (see :mod:`.channel`)."""

    name = "channel"

    def __init__(self, client):
        self.client = client
        self._open: dict[int, channel.ClientChannel] = {}  # reg id -> this connection's channel
        self._refused: set[int] = set()  # registrations the service opens no channel for
        self._lock = threading.Lock()  # one channel opened per registration, whichever thread asks first

    def restore(self, reg, items, *, wait, timeout, inject, stamps):
        if not wait or inject or stamps is not None or not reg.is_cuda:
            return None
        found = channel.jit()
        if found is None:
            return None
        J = found[0]
        n = len(items)
        if not 0 < n <= J.MAX_ITEMS:
            return None
        ch = self._open.get(reg.reg_id)
        if ch is None or ch.closed is not False:
            with self._lock:
                ch = self._open.get(reg.reg_id)
                if ch is not None and ch.closed is not False:
                    self.forget(reg.reg_id)
                    ch = None
                if ch is None:
                    if reg.reg_id in self._refused:
                        return None
                    ch = self._open_channel(reg)
                    if ch is None:
                        return None
        parsed, keep = [], []  # keep: arrays made from lists here, alive until the request is written
        shifted = None
        for it in items:
            fields = item_fields(it)
            if fields is None:
                return None
            key, slots, new_positions = fields
            s = _channel_vector(slots, keep)
            p = None if new_positions is None else _channel_vector(new_positions, keep)
            if type(key) is not str or s is None or (new_positions is not None and (p is None or p[1] != s[1])):
                return None
            if shifted is None:
                shifted = p is not None
                if shifted and not ch.shifted:
                    return None  # the registration's RoPE spec is not one the channel's kernel applies
            elif shifted != (p is not None):
                return None  # some shifted, some not: the socket path places them apart
            parsed.append((key, s, p))
        rows = ch.handles
        missing = [k for k, _, _ in parsed if k not in rows]
        if missing and not self._look_up(reg, ch, list(dict.fromkeys(missing))):
            return None
        items_out, srcs = ch.items, ch.srcs
        T = 0
        for i, (key, s, p) in enumerate(parsed):
            row, gen, count = rows[key]
            if count != s[1]:
                return None
            items_out[3 * i], items_out[3 * i + 1], items_out[3 * i + 2] = row, gen, count
            srcs[i] = s[0]
            if p is not None:
                srcs[n + i] = p[0]
            T += count
        flags = J.SHIFTED if shifted else 0
        client = self.client
        deadline = time.monotonic() + (client.timeout if timeout is None else min(float(timeout), client.timeout))
        with client._lock:
            if ch.closed is not False:
                return None
            # the client's earlier work on these blocks comes first: with work queued on this
            # thread's stream, the channel's event is recorded after it and the copy waits for it
            # (under the lock: no other request re-records it before the service has queued that wait)
            stream = cuda.current_stream(reg.device_index)
            if cuda.stream_query(stream) is not True:
                if not cuda.record_event(ch.event.cuda_event, stream):
                    ch.event.record(torch.cuda.current_stream(reg.device_index))
                flags |= J.AFTER_EVENT
            code = ch.call(n, T, flags, deadline)
        if code == J.OK:
            return 0
        if code == J.STALE:
            rows.clear()
        elif code in (J.CLOSED, J.GONE):
            self.forget(reg.reg_id)
        elif code == J.STUCK:
            self.forget(reg.reg_id)
            exc = ServiceError(f"restore through channel {ch.op_id}: its copy's completion could not be observed; "
                               f"its blocks stay held until the channel's operation {ch.op_id} drains")
            exc.op_id = ch.op_id
            raise exc
        return None  # declined, busy, refused by the driver: nothing of it is in flight

    def _look_up(self, reg, ch, keys: list) -> bool:
        """Ask the service for the rows of ``keys``; ``False`` when any is missing (the socket path
        names the error: a missing key, another model's original)."""
        header = {"op": "channel_keys", **self.client._auth(reg), "channel": ch.op_id, "keys": keys}
        try:
            got = self.client.call(header).header.get("handles")
        except KmeshError:
            return False
        if not isinstance(got, list) or len(got) != len(keys):
            raise ProtocolError("reply to 'channel_keys': expected one handle per key")
        for k, hnd in zip(keys, got):
            if hnd is not None:
                ch.handles[k] = tuple(hnd)
        return all(k in ch.handles for k in keys)

    def _open_channel(self, reg):
        """This connection's channel for ``reg``, or ``None`` (remembered when the service has none for it)."""
        if channel.functions(False) is None:
            self._refused.add(reg.reg_id)
            return None
        max_tokens = min(reg.layout.num_slots, channel.MAX_TOKENS)
        page, fd = channel.Page.create(max_tokens)
        efds = [channel.new_eventfd(), channel.new_eventfd()]
        try:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(reg.device_index))  # creates it on the cache's device

            def send_descriptors(sock):
                socket.send_fds(sock, [FD_MARK], [fd, *efds])

            h = self.client._call({"op": "channel", **self.client._auth(reg), "fds": 3, "max_tokens": max_tokens,
                                   "event": bytes(event.ipc_handle()).hex()}, after=send_descriptors).header
            ch = channel.ClientChannel(reg.reg_id, protocol.field(h, "channel", int), page, efds[0], efds[1])
            ch.shifted = protocol.field(h, "shifted", bool)
            ch.event = event
        except BaseException as exc:
            page.close()
            for x in efds:
                os.close(x)
            if isinstance(exc, OwnershipError):  # closed, not this client's: the socket path says so
                return None
            if isinstance(exc, KmeshError):  # no channel for this registration here: not asked again
                self._refused.add(reg.reg_id)
                return None
            raise
        finally:
            os.close(fd)
        self._open[reg.reg_id] = ch
        return ch

    def forget(self, reg_id: int) -> None:
        ch = self._open.pop(reg_id, None)
        if ch is not None:
            ch.close()

    def close(self) -> None:
        with self._lock:
            open_, self._open = list(self._open.values()), {}
        for ch in open_:
            ch.close()
