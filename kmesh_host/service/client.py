"""The model worker's side of the cache service: :class:`CacheClient` (a context manager).

One client is one connection; its methods are thread-safe (one request in flight at a time).
For a GPU registration the client holds one interprocess CUDA event per registration, re-recorded on
the calling thread's current stream right before each restore or save is sent, so the service's copy
waits for the client's earlier work on those blocks.
Errors come back typed: the service's ``OwnershipError``, ``DrainError``, ``LayoutError``,
``ProtocolError``, ``SegmentNotFound`` ... are raised here as the same classes. An error that
concerns a submitted operation carries its id in ``exc.op_id`` (drain it before reusing its blocks).

Ownership of a registered cache stays with the client, which must keep the cache allocated and
unused by others until :meth:`CacheClient.close_registration` returned ``True`` (every copy into or
out of it has physically finished and the service has unmapped it).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import operator
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kmesh_gpu import _launch  # driver-level event records
from kmesh_gpu.errors import KmeshError, LayoutError, OwnershipError, ProtocolError, ServiceError

from . import lane as _lane
from . import protocol
from . import vmm
from .memory import MemoryHandle, SharedCache, export_cuda
from .vmm import VmmCache


@dataclass(frozen=True)
class RestoreItem:
    """One original to restore: its ``key``, the destination ``slots`` (one per token; -1 skips)
    and, to shift keys, the ``new_positions`` (one per token; needs a RoPE spec at registration)."""

    key: str
    slots: list
    new_positions: list | None = None

    def to_dict(self) -> dict:
        """A JSON-friendly description (for logs; requests carry the indices as binary int64)."""
        d = {"key": self.key, "slots": _ints("slots", self.slots)}
        if self.new_positions is not None:
            d["new_positions"] = _ints("new_positions", self.new_positions)
        return d



@dataclass
class Registration:
    """What the client keeps of one registration: the id, its secret and the cache it covers."""

    reg_id: int
    generation: int
    secret: str
    layout: object
    handle: MemoryHandle  # a list of them for a per-layer registration
    cache: torch.Tensor = field(repr=False)  # a list of per-layer tensors for a per-layer registration
    #: the cache's device; CUDA memory: requests carry the client's interprocess event
    device: torch.device = field(init=False, repr=False)
    is_cuda: bool = field(init=False, repr=False)
    #: ``device.index``: an int is the cheapest way to name the device to torch.cuda calls
    device_index: int | None = field(init=False, repr=False)
    #: ``secret`` as raw bytes for binary requests (``None``: not hex, so no service accepts it)
    secret_bytes: bytes | None = field(init=False, repr=False)

    def __post_init__(self):
        # looked up once: every restore needs both, and a tensor's device is not free to ask for
        self.device = (self.cache[0] if isinstance(self.cache, list) else self.cache).device
        self.is_cuda = self.device.type == "cuda"
        self.device_index = self.device.index
        try:
            self.secret_bytes = bytes.fromhex(self.secret)
        except (TypeError, ValueError):
            self.secret_bytes = None


def _ints(name: str, values) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.int64 or values.dim() != 1:
            raise LayoutError(f"{name}: expected int64[T], got {str(values.dtype).removeprefix('torch.')}"
                              f"{list(values.shape)}")
        return values.tolist()
    try:
        return [operator.index(v) for v in values]  # int() would truncate 0.5 and parse "1"
    except TypeError as exc:
        raise LayoutError(f"{name}: expected integers ({exc})") from exc


_I8 = np.dtype("<i8")
_TENSOR, _TORCH_I8, _STRIDED = torch.Tensor, torch.int64, torch.strided
_BYTE = ctypes.c_char


def _wire_array(name: str, values, keep: list):
    """``(buffer, value count)``: ``values`` as int64 values for the wire. What a model runner
    holds, a contiguous 1-D int64 CPU tensor, is sent from its own memory through a byte view made
    without NumPy (``Tensor.numpy()`` costs several times more, and a restore has two index arrays
    per item); such a view does not keep the tensor alive, so the tensor goes into ``keep``, which
    the caller holds until the frame has been sent. Anything else is converted by :func:`_int64`."""
    if type(values) is _TENSOR and values.dtype is _TORCH_I8 and values.layout is _STRIDED and values.dim() == 1 \
            and values.is_cpu and values.is_contiguous():
        n = values.nbytes
        if not n:
            return _EMPTY, 0
        keep.append(values)
        return memoryview((_BYTE * n).from_address(values.data_ptr())), n >> 3
    a = _int64(name, values)
    return a, a.shape[0]


_EMPTY = memoryview(b"")


def _vmm_export(tensor: torch.Tensor, device: int):
    """``vmm.export`` of a CUDA tensor in virtual (cuMemCreate) memory; ``None`` for other memory
    (CUDA IPC then), and also where this process cannot tell (no cuda.bindings) or the driver's
    virtual-memory queries fail unexpectedly: ``cudaMalloc`` memory keeps registering through CUDA
    IPC whatever happens here. A chunk that cannot be exported is a :class:`LayoutError`."""
    if not tensor.is_contiguous():
        return None
    try:
        drv = vmm.driver()
    except KmeshError:
        return None
    try:
        return vmm.export(tensor, device, drv)
    except KmeshError:
        raise
    except Exception:  # noqa: BLE001 - detection only; CUDA IPC export reports its own errors
        return None


def _item_fields(it):
    """``(key, slots, new_positions or None)`` of a :class:`RestoreItem` or a 2- or 3-tuple; ``None``
    for anything else (the caller converts or refuses it)."""
    if type(it) is RestoreItem:
        return it.key, it.slots, it.new_positions
    if type(it) is tuple and len(it) == 3:
        return it
    if type(it) is tuple and len(it) == 2:
        return it[0], it[1], None
    return None


def _lane_vector(x, keep: list):
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


def _export_one(cache, layout, name: str):
    """``(handle, tensor, VMM chunk handles or None, their driver or None)`` of one allocation of
    ``layout``'s physical shape: a SharedCache, a VmmCache or a CUDA tensor."""
    if isinstance(cache, SharedCache):
        tensor = cache.tensor
    elif isinstance(cache, VmmCache):
        tensor = cache.tensor
    elif isinstance(cache, torch.Tensor) and cache.device.type == "cuda":
        tensor = cache
    else:
        raise LayoutError(f"{name}: expected a CUDA tensor, a VmmCache or a SharedCache (CPU caches must live in "
                          f"shared memory), got {type(cache).__name__}")
    if tuple(tensor.shape) != tuple(layout.physical_shape) or tensor.dtype != layout.dtype:
        raise LayoutError(f"{name}: expected {list(layout.physical_shape)} {layout.dtype}, got "
                          f"{list(tensor.shape)} {tensor.dtype}")
    if isinstance(cache, SharedCache):
        return cache.handle, tensor, None, None
    if isinstance(cache, VmmCache):
        handle, chunks = vmm.export(tensor, cache.device, cache.driver)
        return handle, tensor, chunks, cache.driver
    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    found = _vmm_export(tensor, device)
    if found is not None:
        return found[0], tensor, found[1], vmm.driver()
    return export_cuda(tensor), tensor, None, None


def _int64(name: str, values) -> np.ndarray:
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


#: distinct item lists a client keeps encoded (see :func:`.protocol.restore_items`)
_ITEMS_KEPT = 256
#: a polled reply up to this size is read with one system call (larger ones in further reads)
_SCRATCH_BYTES = 1 << 16


class CacheClient:
    """A connection to the cache service at ``socket_path``.

    ``timeout``: seconds any single reply may take (synchronous copies included).
    ``reply_spin_s``: how long to poll for a reply without sleeping before a blocking wait (0: never
    poll; ``None``: 2 ms where the machine has cores to spare, see :func:`.protocol.spin_default`).
    A restore is answered within about a millisecond, sooner than a thread asleep in ``recv`` is
    woken; polling costs this thread's core for that long (the GIL is released between polls). A
    request polls only when the previous reply came within that time, so a busy service (replies
    that queue) is waited for asleep.
    ``fast_lane``: serve the restores a lane can (``wait=True``, GPU registrations, see :mod:`.lane`)
    through a page of shared memory to a compiled loop in the service instead of the socket; each
    registration's lane opens on its first such restore (a thread of the service, polling 2 ms after
    each request; this process polls 2 ms for each reply). ``lane_counts`` says how many went which way.
    """

    def __init__(self, socket_path: str, *, timeout: float = 120.0,
                 max_body_bytes: int = protocol.DEFAULT_MAX_BODY_BYTES, reply_spin_s: float | None = None,
                 fast_lane: bool = True):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ServiceError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.socket_path = socket_path
        self.max_body_bytes = max_body_bytes
        self.timeout = timeout
        self.reply_spin_s = protocol.spin_default(reply_spin_s, 2e-3)
        self._last_reply_ns = 0  # how long the previous reply took after its request was sent
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._events: dict[int, tuple[torch.cuda.Event, bytes]] = {}  # reg id -> (event, IPC handle)
        self._items: dict[tuple, protocol.RestoreItems] = {}  # (keys, slot counts, position counts) -> encoded
        #: where a polled reply is read whole (see protocol.read_frame); used under ``_lock``
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        #: the stage timestamps of the last request made with ``timings=True`` (see :meth:`restore`)
        self.last_timings: dict | None = None
        #: restores the fast lane can serve go through it (see :mod:`.lane`); the rest through the socket
        self.fast_lane = bool(fast_lane)
        self._lanes: dict[int, _lane.ClientLane] = {}  # reg id -> this connection's lane
        self._no_lane: set[int] = set()  # registrations the service opens no lane for
        self._lane_lock = threading.Lock()  # one lane opened per registration, whichever thread asks first
        #: restores served through a lane / sent through the socket while ``fast_lane`` was on
        self.lane_counts = {"lane": 0, "socket": 0}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
        except (OSError, TypeError, ValueError) as exc:
            self._sock.close()
            raise ServiceError(f"cannot connect to the cache service at {socket_path}: {exc}") from exc

    # ------------------------------------------------------------------ plumbing
    def call(self, header: dict, body: bytes = b"") -> protocol.Message:
        """Send one request and return its reply; a typed error reply is raised as its class."""
        return self._call(dict(header), body)

    def _call(self, header: dict, body: bytes = b"", *, event_for=None, after=None) -> protocol.Message:
        """One JSON request and its reply. ``event_for``: a GPU registration whose event is recorded
        (and named in ``wait_event``) under the connection lock, so no other request of this
        connection can re-record it before the service has queued its wait on it. ``after(sock)``:
        sends what follows the frame on the socket (a register's descriptors), before the reply is read."""
        def build(rid, event):
            header["id"] = rid
            if event is not None:
                header["wait_event"] = event.hex()
            return [protocol.encode(header, body, max_body_bytes=self.max_body_bytes)]

        rid, flags, buf, reply_body = self._exchange(header.get("op"), build, event_for, after=after)
        if flags & protocol.FLAG_BINARY:
            raise ProtocolError(f"reply to {header.get('op')!r}: a binary frame where JSON was expected")
        reply = protocol.Message(protocol.decode_header(memoryview(buf)[:len(buf) - len(reply_body)]), reply_body)
        self._check_reply(reply.header, rid)
        return reply

    def _exchange(self, op: str, build, event_for=None, stamps: dict | None = None, after=None):
        """Send the frame ``build(request id, event handle or None)`` returns (a list of buffers)
        and read the reply frame: ``(request id, flags, buffer, body)``. ``stamps``: client-side
        timestamps ``built``, ``sent``, ``received`` (monotonic ns)."""
        with self._lock:
            if self._sock is None:
                raise ServiceError("CacheClient: closed")
            rid = next(self._ids)
            event = self._record_event(event_for) if event_for is not None and event_for.is_cuda else None
            parts = build(rid, event)
            if stamps is not None:
                stamps["built"] = time.monotonic_ns()
            try:
                protocol.send_parts(self._sock, parts)
                if after is not None:
                    after(self._sock)
                sent = time.monotonic_ns()
                spin = self.reply_spin_s if self._last_reply_ns <= self.reply_spin_s * 1e9 else 0.0
                flags, buf, body = protocol.read_frame(self._sock, max_body_bytes=self.max_body_bytes,
                                                       frame_timeout=self.timeout, spin_s=spin,
                                                       deadline=sent / 1e9 + self.timeout, scratch=self._scratch)
                received = time.monotonic_ns()
                self._last_reply_ns = received - sent
                if stamps is not None:
                    stamps["sent"], stamps["received"] = sent, received
            except BaseException as exc:
                # a request may be out without its reply read, a frame half sent or half read, or a
                # frame's boundary lost: a later request could read what is left of this one as its
                # reply, so the connection is not used again
                refusal = self._refusal() if isinstance(exc, OSError) else None
                self._abandon()
                if refusal is not None:  # the service refused the connection before this request reached it
                    protocol.raise_for_reply(refusal)
                if isinstance(exc, (OSError, protocol.ConnectionClosed)):
                    raise ServiceError(f"cache service connection lost during {op!r}: {exc}") from exc
                raise
        return rid, flags, buf, body

    def _abandon(self) -> None:
        """Close the connection after it lost track of its replies (``_lock`` held)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._events.clear()

    def _refusal(self) -> dict | None:
        """The id-less error reply the service sent before closing a connection it refused (too
        many connections, another user), if it is already here (``_lock`` held)."""
        try:
            self._sock.settimeout(0.0)
            flags, buf, body = protocol.read_frame(self._sock, max_body_bytes=self.max_body_bytes, frame_timeout=0.0)
            header = protocol.decode_header(memoryview(buf)[:len(buf) - len(body)])
        except (OSError, KmeshError):
            return None
        if header.get("id") is None and header.get("ok") is False and isinstance(header.get("error"), dict):
            return header
        return None

    def _desynchronized(self, message: str) -> ProtocolError:
        with self._lock:
            self._abandon()
        return ProtocolError(f"{message}; connection closed")

    def _check_reply(self, header: dict, rid: int) -> None:
        """Raise a JSON reply's typed error (with the operation id, if any, as ``exc.op_id``)."""
        got = header.get("id")
        if got is None and header.get("ok") is False and isinstance(header.get("error"), dict):
            # the service's answer to what it could not take (a refused connection, a frame it could
            # not parse) has no id: raise it as the service typed it; the service closes the connection
            with self._lock:
                self._abandon()
            protocol.raise_for_reply(header)
        if type(got) is not int or got != rid:  # (True == 1 and 1.0 == 1 in Python)
            raise self._desynchronized(f"reply id {got!r} does not match request {rid}")
        try:
            protocol.raise_for_reply(header)
        except KmeshError as exc:
            err = header.get("error")
            exc.op_id = err.get("op") if isinstance(err, dict) else None
            raise

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._events.clear()
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _auth(reg: Registration) -> dict:
        return {"reg": reg.reg_id, "secret": reg.secret}

    def _record_event(self, reg: Registration) -> bytes | None:
        """Record this connection's interprocess event of ``reg`` after the calling thread's queued
        work; returns its IPC handle (64 bytes), or ``None`` when that stream has nothing queued (the
        request then has nothing to wait for, and the device has no command of this process to run
        before the service's copy: on a GPU without MPS a record would make it switch to this
        process's context and back before the copy, each switch longer than the copy). Created
        once: opening an IPC event costs the service far more than a record costs here. Called
        with ``_lock`` held.

        The legacy default stream (0) is queried like any other: a query follows default-stream
        semantics, so it also reports the other blocking streams' earlier work still running (what
        a record there would wait for; checked on the GPU by
        ``tests/kmesh_host/test_service_events.py``), and non-blocking streams are covered by
        neither."""
        stream = _launch.current_stream(reg.device_index)
        if _launch.stream_query(stream):
            return None
        entry = self._events.get(reg.reg_id)
        if entry is None:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(reg.device_index))  # creates it on the cache's device
            entry = self._events[reg.reg_id] = (event, bytes(event.ipc_handle()))
        elif not _launch.record_event(entry[0].cuda_event, stream):
            entry[0].record(torch.cuda.current_stream(reg.device_index))  # where the driver call is declined
        return entry[1]

    # ------------------------------------------------------------------ service state and originals
    def status(self) -> dict:
        h = dict(self.call({"op": "status"}).header)
        for k in ("id", "ok"):
            h.pop(k, None)
        return h

    def put(self, key: str, kv: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
        """Upload a shared original (``kv`` ``(2, L, T, H, D)``, ``positions`` int64[T]) to the host tier."""
        tensors = {"kv": kv, "positions": positions}
        if token_ids is not None:
            tensors["token_ids"] = token_ids
        descr, body = protocol.pack_tensors(tensors)
        self.call({"op": "put", "key": key, "tensors": descr}, body)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Download an original: ``(kv, positions, token_ids or None)`` on the CPU."""
        reply = self.call({"op": "get", "key": key})
        d = reply.header.get("tensors", {})
        kv = protocol.unpack_tensor(d, reply.body, "kv")
        pos = protocol.unpack_tensor(d, reply.body, "positions")
        tok = protocol.unpack_tensor(d, reply.body, "token_ids") if "token_ids" in d else None
        return kv, pos, tok

    def evict(self, key: str) -> bool:
        return bool(self.call({"op": "evict", "key": key}).header.get("evicted"))

    # ------------------------------------------------------------------ registrations
    def register(self, cache, layout, *, instance: int = 0, rope=None) -> Registration:
        """Register a cache the service may write: a CUDA tensor (CUDA IPC, or its chunks' file
        descriptors where it lies in virtual memory), a :class:`VmmCache` or a :class:`SharedCache`
        — or a list of ``layout.num_layers`` of them, one allocation per layer (what vLLM allocates),
        each of ``layout.per_layer().physical_shape``.

        ``cache``: the whole allocation described by ``layout`` (``physical_shape``, ``layout.dtype``).
        ``rope``: the model's ``kmesh_gpu.RopeSpec``, needed to restore with ``new_positions``.
        """
        per_layer = isinstance(cache, (list, tuple))
        if per_layer and len(cache) != layout.num_layers:
            raise LayoutError(f"cache: {len(cache)} per-layer allocations for a layout of {layout.num_layers} layers")
        view = layout.per_layer() if per_layer else layout
        parts = []  # (handle, tensor, chunks or None, driver or None) per allocation
        try:
            for i, c in enumerate(cache if per_layer else [cache]):
                parts.append(_export_one(c, view, f"cache[{i}]" if per_layer else "cache"))
            header = {"op": "register", "layout": layout.to_dict(), "instance": int(instance)}
            if per_layer:
                header["layers"] = [p[0].to_dict() for p in parts]
            else:
                header["memory"] = parts[0][0].to_dict()
            if rope is not None:
                header["rope"] = rope.to_dict()
            sent = [(drv, chunks) for _, _, chunks, drv in parts if chunks is not None]
            if not sent:
                h = self.call(header).header
            else:
                header["fds"] = sum(len(chunks) for _, chunks in sent)

                def send_descriptors(sock):  # each allocation's in messages of their own, in order
                    for drv, chunks in sent:
                        vmm.send_fd_batches(sock, drv, chunks)

                h = self._call(header, after=send_descriptors).header
        finally:
            for _, _, chunks, drv in parts:
                if chunks is not None:
                    vmm.release_all(drv, chunks)
        handle = [p[0] for p in parts] if per_layer else parts[0][0]
        tensor = [p[1] for p in parts] if per_layer else parts[0][1]
        return Registration(protocol.field(h, "reg", int), protocol.field(h, "generation", int),
                            protocol.field(h, "secret", str), layout, handle, tensor)

    def attach(self, reg: Registration) -> None:
        """Use ``reg`` (registered by this process) over this connection too."""
        self.call({"op": "attach", **self._auth(reg)})

    def restore(self, reg: Registration, items, *, wait: bool = True, timeout: float | None = None,
                model_fingerprint: dict | None = None, inject: dict | None = None, timings: bool = False) -> int:
        """Restore originals into the registration's slots; returns the operation id.

        ``wait=True``: returns after the copy has physically finished (the blocks are usable).
        On a GPU registration such a restore goes through this connection's fast lane where the lane
        serves it (see :mod:`.lane` and ``fast_lane``); it then returns 0 (nothing is left to drain).
        ``wait=False``: returns once submitted; call :meth:`drain` (or :meth:`acquire`) before
        reading or reusing the blocks.
        ``timings=True``: record where the time went; :attr:`last_timings` then holds
        ``{"client": {...}, "service": {...}}``, monotonic nanoseconds (one clock for both processes
        on Linux). Client: ``start`` (call entered), ``built`` (request encoded), ``sent``,
        ``received`` (reply read). Service: ``received`` (frame read), ``parsed`` (header decoded),
        ``validated`` (authorised, items and originals checked, slots bounds-checked against the
        registration, blocks reserved), ``resolved`` (device copies of the originals found),
        ``prepared`` (placement validated and its launch tables built), ``launched``,
        ``completed`` (completion event observed, holds released), ``reply_sent`` (reply built,
        handed to the socket right after).
        """
        stamps = {"start": time.monotonic_ns()} if timings else None
        secret = reg.secret_bytes
        if secret is None or len(secret) != protocol.SECRET_BYTES:
            raise OwnershipError(f"registration {reg.reg_id}: wrong secret (not {protocol.SECRET_BYTES} bytes of hex)")
        if self.fast_lane and wait and not inject and not timings and reg.is_cuda:
            if not isinstance(items, (list, tuple)):
                try:
                    items = list(items)
                except TypeError as exc:
                    raise LayoutError(f"items: expected an iterable of restore items, got {type(items).__name__}") \
                        from exc
            if self._lane_restore(reg, items, timeout, model_fingerprint):
                self.lane_counts["lane"] += 1
                return 0
            self.lane_counts["socket"] += 1
        keys, slot_counts, position_counts, arrays, shifts = [], [], [], [], []
        keep: list = []  # tensors sent from their own memory, alive until the frame is sent
        try:
            numbered = enumerate(items)
        except TypeError as exc:
            raise LayoutError(f"items: expected an iterable of restore items, got {type(items).__name__}") from exc
        for i, it in numbered:
            fields = _item_fields(it)
            if fields is not None:
                key, slots, new_positions = fields
            else:
                try:
                    it = it if isinstance(it, RestoreItem) else RestoreItem(*it)
                except TypeError as exc:
                    raise LayoutError(f"items[{i}]: expected a RestoreItem or (key, slots[, new_positions]), "
                                      f"got {type(it).__name__}") from exc
                key, slots, new_positions = it.key, it.slots, it.new_positions
            if type(key) is not str:
                raise ProtocolError(f"items[{i}].key: expected str, got {type(key).__name__}")
            s, count = _wire_array("slots", slots, keep)
            keys.append(key)
            arrays.append(s)
            slot_counts.append(count)
            if new_positions is None:
                position_counts.append(None)
            else:
                p, count = _wire_array("new_positions", new_positions, keep)
                shifts.append(p)
                position_counts.append(count)
        arrays += shifts  # the body: every item's slots, then the shifted items' new positions
        signature = (tuple(keys), tuple(slot_counts), tuple(position_counts))
        encoded = self._items.get(signature)
        if encoded is None:
            encoded = protocol.restore_items(*signature)
            if len(self._items) >= _ITEMS_KEPT:
                self._items.clear()
            self._items[signature] = encoded
        inject = inject or None

        def build(rid, event):
            return protocol.restore_frame(encoded, rid, reg.reg_id, secret, arrays, wait=wait, timeout=timeout,
                                          timings=timings, wait_event=event, model_fingerprint=model_fingerprint,
                                          inject=inject, max_body_bytes=self.max_body_bytes)

        rid, flags, buf, body = self._exchange("restore", build, reg, stamps)
        raw = memoryview(buf)[:len(buf) - len(body)]
        if not flags & protocol.FLAG_BINARY:  # a typed error reply
            header = protocol.decode_header(raw)
            self._check_reply(header, rid)
            raise ProtocolError(f"reply to 'restore': JSON success {header!r} where a binary reply was expected")
        reply = protocol.decode_restore_reply(raw, body)
        if reply.request_id != rid:
            raise self._desynchronized(f"reply id {reply.request_id} does not match request {rid}")
        if stamps is not None:
            self.last_timings = {"client": stamps, "service": reply.timings or {}}
        return reply.op_id

    # ------------------------------------------------------------------ the fast lane
    def _lane_restore(self, reg: Registration, items, timeout, model_fingerprint) -> bool:
        """Serve ``items`` through this connection's lane of ``reg`` (opened on first use): ``True``
        once restored; ``False`` when the lane does not serve this request (the caller sends it
        through the socket, where any error is named)."""
        J = _lane.jit()
        if J is None:
            return False
        J = J[0]
        n = len(items)
        if not 0 < n <= J.MAX_ITEMS:
            return False
        lane = self._lanes.get(reg.reg_id)
        if lane is None or lane.closed is not False:
            with self._lane_lock:
                lane = self._lanes.get(reg.reg_id)
                if lane is not None and lane.closed is not False:
                    self._drop_lane(reg.reg_id)
                    lane = None
                if lane is None:
                    if reg.reg_id in self._no_lane:
                        return False
                    lane = self._open_lane(reg)
                    if lane is None:
                        return False
        fp = None if model_fingerprint is None else json.dumps(model_fingerprint, sort_keys=True)
        parsed, keep = [], []  # keep: arrays made from lists here, alive until the request is written
        shifted = None
        for it in items:
            fields = _item_fields(it)
            if fields is None:
                return False
            key, slots, new_positions = fields
            s = _lane_vector(slots, keep)
            p = None if new_positions is None else _lane_vector(new_positions, keep)
            if type(key) is not str or s is None or (new_positions is not None and (p is None or p[1] != s[1])):
                return False
            if shifted is None:
                shifted = p is not None
                if shifted and not lane.shifted:
                    return False  # the registration's RoPE spec is not one the lane's kernel applies
            elif shifted != (p is not None):
                return False  # some shifted, some not: the socket path places them apart
            parsed.append((key, s, p))
        handles = lane.handles
        missing = [k for k, _, _ in parsed if (k, fp) not in handles]
        if missing:
            header = {"op": "lane_keys", **self._auth(reg), "lane": lane.op_id, "keys": list(dict.fromkeys(missing))}
            if model_fingerprint is not None:
                header["model_fingerprint"] = model_fingerprint
            try:
                got = self.call(header).header.get("handles")
            except KmeshError:  # a missing key, another fingerprint: the socket path says so
                return False
            if not isinstance(got, list) or len(got) != len(header["keys"]):
                raise ProtocolError("reply to 'lane_keys': expected one handle per key")
            for k, hnd in zip(header["keys"], got):
                if hnd is not None:
                    handles[(k, fp)] = tuple(hnd)
            if any((k, fp) not in handles for k in missing):
                return False
        rows, srcs = lane.items, lane.srcs
        T = 0
        for i, (key, s, p) in enumerate(parsed):
            row, gen, count = handles[(key, fp)]
            if count != s[1]:
                return False
            rows[3 * i], rows[3 * i + 1], rows[3 * i + 2] = row, gen, count
            srcs[i] = s[0]
            if p is not None:
                srcs[n + i] = p[0]
            T += count
        flags = J.SHIFTED if shifted else 0
        deadline = time.monotonic() + (self.timeout if timeout is None else min(float(timeout), self.timeout))
        with self._lock:
            if lane.closed is not False:
                return False
            # the client's earlier work on these blocks comes first: with work queued on this
            # thread's stream, the lane's event is recorded after it and the copy waits for it (under
            # the lock: no other request re-records it before the service has queued that wait)
            stream = _launch.current_stream(reg.device_index)
            if _launch.stream_query(stream) is not True:
                if not _launch.record_event(lane.event.cuda_event, stream):
                    lane.event.record(torch.cuda.current_stream(reg.device_index))
                flags |= J.AFTER_EVENT
            code = lane.call(n, T, flags, deadline)
        if code == J.OK:
            return True
        if code == J.STALE:
            handles.clear()
        elif code in (J.CLOSED, J.GONE):
            self._drop_lane(reg.reg_id)
        elif code == J.STUCK:
            self._drop_lane(reg.reg_id)
            exc = ServiceError(f"restore through lane {lane.op_id}: its copy's completion could not be observed; "
                               f"its blocks stay held until the lane's operation {lane.op_id} drains")
            exc.op_id = lane.op_id
            raise exc
        return False  # declined, busy, refused by the driver: nothing of it is in flight

    def _open_lane(self, reg: Registration):
        """This connection's lane for ``reg``, or ``None`` (remembered when the service has none for it)."""
        if _lane.functions(False) is None:
            self._no_lane.add(reg.reg_id)
            return None
        max_tokens = min(reg.layout.num_slots, _lane.MAX_TOKENS)
        page, fd = _lane.Page.create(max_tokens)
        efds = [_lane.new_eventfd(), _lane.new_eventfd()]
        try:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(reg.device_index))  # creates it on the cache's device

            def send_descriptors(sock):
                socket.send_fds(sock, [vmm.FD_MARK], [fd, *efds])

            h = self._call({"op": "lane", **self._auth(reg), "fds": 3, "max_tokens": max_tokens,
                            "event": bytes(event.ipc_handle()).hex()}, after=send_descriptors).header
            lane = _lane.ClientLane(reg.reg_id, protocol.field(h, "lane", int), page, efds[0], efds[1])
            lane.shifted = protocol.field(h, "shifted", bool)
            lane.event = event
        except BaseException as exc:
            page.close()
            for x in efds:
                os.close(x)
            if isinstance(exc, OwnershipError):  # closed, not this client's: the socket path says so
                return None
            if isinstance(exc, KmeshError):  # no lane for this registration here: not asked again
                self._no_lane.add(reg.reg_id)
                return None
            raise
        finally:
            os.close(fd)
        self._lanes[reg.reg_id] = lane
        return lane

    def _drop_lane(self, reg_id: int) -> None:
        lane = self._lanes.pop(reg_id, None)
        if lane is not None:
            lane.close()

    def save(self, reg: Registration, key: str, slots, positions, token_ids=None, *, wait: bool = True,
             timeout: float | None = None, inject: dict | None = None) -> int:
        """Copy the registration's ``slots`` into a new host original ``key`` (published once drained)."""
        arrays = {"slots": _int64("slots", slots), "positions": _int64("positions", positions)}
        if token_ids is not None:
            arrays["token_ids"] = _int64("token_ids", token_ids)
        tensors, body = protocol.pack_int64(arrays)
        header = {"op": "save", **self._auth(reg), "key": key, "tensors": tensors, "wait": wait, "timeout": timeout}
        if inject:
            header["inject"] = inject
        return protocol.field(self._call(header, body, event_for=reg).header, "op", int)

    def cancel(self, reg: Registration, op_id: int) -> dict:
        """Discard an operation's result. Its blocks stay held until it has drained."""
        h = dict(self.call({"op": "cancel", **self._auth(reg), "op_id": int(op_id)}).header)
        missing = [k for k in ("op", "state", "outcome") if k not in h]
        if missing:
            raise ProtocolError(f"reply to 'cancel': {missing} missing")
        return {k: h[k] for k in ("op", "state", "outcome")}

    def drain(self, reg: Registration, ops=None, *, timeout: float | None = None) -> list[int]:
        """Wait for the physical completion of ``ops`` (default: all pending) and release their holds."""
        header = {"op": "drain", **self._auth(reg), "timeout": timeout}
        if ops is not None:
            header["ops"] = [int(o) for o in ops]
        return protocol.int_list(self.call(header).header, "drained")

    def acquire(self, reg: Registration, blocks, *, timeout: float | None = None) -> list[int]:
        """Wait until no submitted copy can still write ``blocks`` (drains the operations holding
        them); afterwards the client may recompute into them. Returns the drained operation ids."""
        header = {"op": "acquire", **self._auth(reg), "blocks": _ints("blocks", blocks), "timeout": timeout}
        return protocol.int_list(self.call(header).header, "drained")

    def close_registration(self, reg: Registration, *, timeout: float | None = None) -> bool:
        """Stop new work on ``reg`` and wait up to ``timeout`` for its copies. ``True``: the service
        has unmapped the cache and the client may free or reuse it; ``False``: copies are still
        pending (the service keeps waiting for them; ask again, or watch ``status``)."""
        h = self.call({"op": "close", **self._auth(reg), "timeout": timeout}).header
        with self._lock:
            self._events.pop(reg.reg_id, None)
            self._drop_lane(reg.reg_id)
        return protocol.field(h, "freed", bool)
