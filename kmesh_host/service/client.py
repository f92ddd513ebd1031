"""The model worker's side of the cache service: :class:`CacheClient` (a context manager).

One client is one connection; its methods are thread-safe (one request in flight at a time).
For a GPU registration the client holds one interprocess CUDA event per registration, re-recorded on
the calling thread's current stream right before each restore or save is sent, so the service's copy
waits for the client's earlier work on those blocks. A restore goes through one of two transports
(:mod:`.transports`): the registration's shared-memory channel where it serves the request, else
the socket.

Errors come back typed: the service's ``OwnershipError``, ``DrainError``, ``LayoutError``,
``ProtocolError``, ``SegmentNotFound`` ... are raised here as the same classes. An error that
concerns a submitted operation carries its id in ``exc.op_id`` (drain it before reusing its blocks).

Ownership of a registered cache stays with the client, which must keep the cache allocated and
unused by others until :meth:`CacheClient.close_registration` returned ``True`` (every copy into or
out of it has physically finished and the service has unmapped it).
"""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from kmesh_gpu import cuda
from kmesh_gpu.errors import KmeshError, LayoutError, OwnershipError, ProtocolError, ServiceError

from ..segment import ModelFingerprint, Segment
from . import protocol, restore_wire, vmm
from .memory import MemoryHandle, SharedCache, export_cuda
from .transports import ChannelTransport, RestoreTransport, SocketTransport, int64_array, ints
from .vmm import VmmCache


@dataclass
class Registration:
    """What the client keeps of one registration: the id, its secret and the destination it covers
    (the cache, its layout, the model's fingerprint and RoPE spec, as registered)."""

    reg_id: int
    generation: int
    secret: str
    layout: object
    handle: MemoryHandle  # a list of them for a per-layer registration
    cache: torch.Tensor = field(repr=False)  # a list of per-layer tensors for a per-layer registration
    model_fingerprint: ModelFingerprint | None = None
    rope: object = None  # kmesh_gpu.RopeSpec
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
    ``channel``: serve the restores a channel can (``wait=True``, GPU registrations, see
    :mod:`.channel`) through a page of shared memory to a compiled loop in the service instead of
    the socket; each registration's channel opens on its first such restore (a thread of the
    service, polling 2 ms after each request; this process polls 2 ms for each reply).
    ``route_counts`` says how many restores went which way, ``last_route`` which way the last one did.
    """

    def __init__(self, socket_path: str, *, timeout: float = 120.0,
                 max_body_bytes: int = protocol.DEFAULT_MAX_BODY_BYTES, reply_spin_s: float | None = None,
                 channel: bool = True):
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
        #: where a polled reply is read whole (see protocol.read_frame); used under ``_lock``
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        #: the stage timestamps of the last request made with ``timings=True`` (see :meth:`restore`)
        self.last_timings: dict | None = None
        #: the transports a restore is offered to, in order (the socket serves every request)
        self._transports: list[RestoreTransport] = ([ChannelTransport(self)] if channel else []) + \
            [SocketTransport(self)]
        self.channel = bool(channel)
        #: restores per transport name; ``last_route``: the last restore's
        self.route_counts = {t.name: 0 for t in self._transports}
        self.last_route: str | None = None
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
        for transport in self._transports:
            transport.close()

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
        ``tests/kmesh_host/service/test_events.py``), and non-blocking streams are covered by
        neither."""
        stream = cuda.current_stream(reg.device_index)
        if cuda.stream_query(stream):
            return None
        entry = self._events.get(reg.reg_id)
        if entry is None:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(reg.device_index))  # creates it on the cache's device
            entry = self._events[reg.reg_id] = (event, bytes(event.ipc_handle()))
        elif not cuda.record_event(entry[0].cuda_event, stream):
            entry[0].record(torch.cuda.current_stream(reg.device_index))  # where the driver call is declined
        return entry[1]

    # ------------------------------------------------------------------ service state and originals
    def status(self) -> dict:
        h = dict(self.call({"op": "status"}).header)
        for k in ("id", "ok"):
            h.pop(k, None)
        return h

    def put(self, kv: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, *,
            model_fingerprint: ModelFingerprint) -> str:
        """Publish a segment as a shared original (``kv`` ``(2, L, T, H, D)`` keys post-RoPE at
        ``positions``, ``token_ids`` and ``positions`` int64[T]): the service writes it to its
        segment store and keeps it resident in its host tier. Returns its key (the store's:
        ``SegmentStore.put`` of the same segment returns the same key)."""
        if not isinstance(model_fingerprint, ModelFingerprint):
            raise LayoutError(f"model_fingerprint: expected a ModelFingerprint, got {type(model_fingerprint).__name__}")
        descr, body = protocol.pack_tensors({"kv": kv, "positions": positions, "token_ids": token_ids})
        reply = self.call({"op": "put", "tensors": descr, "model_fingerprint": model_fingerprint.to_dict()}, body)
        return protocol.field(reply.header, "key", str)

    def get(self, key: str, *, model_fingerprint: ModelFingerprint) -> Segment:
        """Download an original (read through the service's host tier) as a :class:`~kmesh_host.Segment`
        on the CPU; ``FingerprintMismatch`` when another model saved it."""
        if not isinstance(model_fingerprint, ModelFingerprint):
            raise LayoutError(f"model_fingerprint: expected a ModelFingerprint, got {type(model_fingerprint).__name__}")
        reply = self.call({"op": "get", "key": key, "model_fingerprint": model_fingerprint.to_dict()})
        d = reply.header.get("tensors", {})
        kv = protocol.unpack_tensor(d, reply.body, "kv")
        pos = protocol.unpack_tensor(d, reply.body, "positions")
        tok = protocol.unpack_tensor(d, reply.body, "token_ids")
        return Segment(kv=kv, token_ids=tok, positions=pos, key=key, fingerprint=model_fingerprint)

    def evict(self, key: str) -> bool:
        """Drop ``key`` from the service's host tier and its device copies (refused while a pending
        operation reads it). The segment's file stays in the store: a later restore reads it again.
        ``True`` when anything was dropped."""
        return bool(self.call({"op": "evict", "key": key}).header.get("evicted"))

    # ------------------------------------------------------------------ registrations
    def register(self, cache, layout, *, model_fingerprint: ModelFingerprint, rope=None,
                 instance: int = 0) -> Registration:
        """Register a cache the service may write: a CUDA tensor (CUDA IPC, or its chunks' file
        descriptors where it lies in virtual memory), a :class:`VmmCache` or a :class:`SharedCache`
        — or a list of ``layout.num_layers`` of them, one allocation per layer (what vLLM allocates),
        each of ``layout.per_layer().physical_shape``. A registration is a destination like a
        :class:`~kmesh_host.restore.Restorer`'s.

        ``cache``: the whole allocation described by ``layout`` (``physical_shape``, ``layout.dtype``).
        ``model_fingerprint``: the model whose KV the cache holds; every original a restore names
        must have been saved by it, and a save publishes under it.
        ``rope``: the model's ``kmesh_gpu.RopeSpec``, needed to restore with ``new_positions``.
        ``instance``: a label (the worker's rank, say); it grants nothing.
        """
        if not isinstance(model_fingerprint, ModelFingerprint):
            raise LayoutError(f"model_fingerprint: expected a ModelFingerprint, got {type(model_fingerprint).__name__}")
        per_layer = isinstance(cache, (list, tuple))
        if per_layer and len(cache) != layout.num_layers:
            raise LayoutError(f"cache: {len(cache)} per-layer allocations for a layout of {layout.num_layers} layers")
        view = layout.per_layer() if per_layer else layout
        parts = []  # (handle, tensor, chunks or None, driver or None) per allocation
        try:
            for i, c in enumerate(cache if per_layer else [cache]):
                parts.append(_export_one(c, view, f"cache[{i}]" if per_layer else "cache"))
            header = {"op": "register", "layout": layout.to_dict(), "instance": int(instance),
                      "model_fingerprint": model_fingerprint.to_dict()}
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
                            protocol.field(h, "secret", str), layout, handle, tensor, model_fingerprint, rope)

    def attach(self, reg: Registration) -> None:
        """Use ``reg`` (registered by this process) over this connection too."""
        self.call({"op": "attach", **self._auth(reg)})

    def restore(self, reg: Registration, items, *, wait: bool = True, timeout: float | None = None,
                inject: dict | None = None, timings: bool = False) -> int:
        """Restore originals into the registration's slots; returns the operation id.

        ``items``: :class:`~kmesh_host.restore.RestoreItem` objects or ``(key, slots[, new_positions])``
        tuples (slots and positions: int64 tensors or arrays, or sequences of ints; a slot -1 skips
        a token; ``new_positions`` shifts the keys, with the registration's RoPE spec).
        ``wait=True``: returns after the copy has physically finished (the blocks are usable).
        On a GPU registration such a restore goes through this connection's channel where the
        channel serves it (see :mod:`.channel` and ``channel``); it then returns 0 (nothing is left
        to drain). ``wait=False``: returns once submitted; call :meth:`drain` (or :meth:`acquire`)
        before reading or reusing the blocks.
        ``timings=True``: record where the time went; :attr:`last_timings` then holds
        ``{"client": {...}, "service": {...}}``, monotonic nanoseconds (one clock for both processes
        on Linux). Client: ``start`` (call entered), ``built`` (request encoded), ``sent``,
        ``received`` (reply read). Service: ``received`` (frame read), ``parsed`` (header decoded),
        ``validated`` (authorised, originals found and checked, slots bounds-checked against the
        registration, blocks reserved), ``resolved`` (device copies of the originals found),
        ``prepared`` (placement validated and its launch tables built), ``launched``,
        ``completed`` (completion event observed, holds released), ``reply_sent`` (reply built,
        handed to the socket right after).
        """
        stamps = {"start": time.monotonic_ns()} if timings else None
        secret = reg.secret_bytes
        if secret is None or len(secret) != restore_wire.SECRET_BYTES:
            raise OwnershipError(f"registration {reg.reg_id}: wrong secret (not {restore_wire.SECRET_BYTES} bytes "
                                 "of hex)")
        if not isinstance(items, (list, tuple)):
            try:
                items = list(items)
            except TypeError as exc:
                raise LayoutError(f"items: expected an iterable of restore items, got {type(items).__name__}") \
                    from exc
        for transport in self._transports:
            op = transport.restore(reg, items, wait=wait, timeout=timeout, inject=inject, stamps=stamps)
            if op is not None:
                self.route_counts[transport.name] += 1
                self.last_route = transport.name
                return op
        raise ServiceError("restore: no transport served the request")  # the socket serves every request

    def save(self, reg: Registration, slots, token_ids, positions, *, timeout: float | None = None,
             inject: dict | None = None) -> str:
        """Copy the registration's ``slots`` into a new original (``token_ids``, and the ``positions``
        its keys were rotated at; the registration's model fingerprint) and return its key, once the
        copy has drained and the service has published it. A save whose wait fails raises with
        ``op_id`` and is published when a later drain succeeds (a save of the same content then
        returns its key)."""
        arrays = {"slots": int64_array("slots", slots), "positions": int64_array("positions", positions),
                  "token_ids": int64_array("token_ids", token_ids)}
        tensors, body = protocol.pack_int64(arrays)
        header = {"op": "save", **self._auth(reg), "tensors": tensors, "timeout": timeout}
        if inject:
            header["inject"] = inject
        return protocol.field(self._call(header, body, event_for=reg).header, "key", str)

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
        header = {"op": "acquire", **self._auth(reg), "blocks": ints("blocks", blocks), "timeout": timeout}
        return protocol.int_list(self.call(header).header, "drained")

    def close_registration(self, reg: Registration, *, timeout: float | None = None) -> bool:
        """Stop new work on ``reg`` and wait up to ``timeout`` for its copies. ``True``: the service
        has unmapped the cache and the client may free or reuse it; ``False``: copies are still
        pending (the service keeps waiting for them; ask again, or watch ``status``)."""
        h = self.call({"op": "close", **self._auth(reg), "timeout": timeout}).header
        with self._lock:
            self._events.pop(reg.reg_id, None)
        for transport in self._transports:
            transport.forget(reg.reg_id)
        return protocol.field(h, "freed", bool)
