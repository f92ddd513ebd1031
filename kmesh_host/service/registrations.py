"""Registrations in the service: a client's cache mapped into this process as a typed
:class:`Destination` (what a restore writes into and how), and the client's interprocess events.

A registration is a destination like a :class:`~kmesh_host.restore.Restorer`'s: the cache (one
allocation, or one per layer as vLLM allocates them), its :class:`~kmesh_gpu.KVLayout`, the model's
:class:`~kmesh_host.ModelFingerprint` (decoded once here and compared, typed, with every original a
request names) and its :class:`~kmesh_gpu.RopeSpec`. Its two :class:`~kmesh_gpu.PlacementPlan`\\ s
(one with the RoPE spec, one without) are made here, once.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from kmesh_gpu import KVLayout, PlacementPlan, RopeSpec
from kmesh_gpu.errors import KmeshError, LayoutError, ProtocolError

from ..segment import ModelFingerprint
from . import _compiled, protocol
from .memory import DeviceMappings, LayerMappings, Mapping, MemoryHandle, CudaIpcMapping, ShmMapping
from .registry import PeerIdentity, Registration, Registry
from .restore_wire import EVENT_HANDLE_BYTES
from .sockets import FdStream
from .vmm import MAX_CHUNKS, VmmMapping

#: how long a registration waits for the start-up warm-up before compiling what it needs itself
WARM_WAIT_S = 300.0


@dataclass(eq=False)
class Destination:
    """What the service writes into for one registration (immutable after registration, except the
    memos below).

    Attributes:
        cache: the mapped cache tensor, or a list of per-layer tensors (``per_layer``).
        layout, model_fingerprint, rope: as registered (``rope`` ``None``: no restore may shift).
        device: the cache's device (looked up once: a tensor's device is a new object at every ask).
        plain, shifted: the placement plans without and with the RoPE spec (``shifted`` ``None``
            without one).
        num_positions: the RoPE spec's position bound (``None`` without one).
        stream, stream_ids, device_index: CUDA only: the registration's stream (its copies run
            there), torch's ids of it, and the device's ordinal.
        free_events: completion events of drained synchronous copies, recorded again by the next.
        item_plans: what a restore's items need beyond their arrays, by item list (see
            :func:`.restores.item_plan`).
    """

    cache: object
    layout: KVLayout
    model_fingerprint: ModelFingerprint
    rope: RopeSpec | None
    device: torch.device
    per_layer: bool
    plain: PlacementPlan
    shifted: PlacementPlan | None
    num_positions: int | None
    stream: object = None
    stream_ids: tuple | None = None
    device_index: int | None = None
    free_events: list = field(default_factory=list)
    item_plans: dict = field(default_factory=dict)

    @property
    def on_cuda(self) -> bool:
        return self.stream is not None


def open_handle(h: MemoryHandle, device_mappings: DeviceMappings, fds: FdStream | None = None) -> Mapping:
    """Map a client's allocation into this process. ``fds``: the request's descriptors (cuda_vmm:
    the chunks', read here)."""
    if h.kind == "cuda_vmm":
        return VmmMapping(h, fds if fds is not None else FdStream(None, 0, None))
    if h.kind == "shm":
        return ShmMapping(h)
    if h.kind == "cuda_ipc":
        if not torch.cuda.is_available():
            raise ProtocolError("memory: a cuda_ipc handle was sent to a service without CUDA")
        return CudaIpcMapping(h, device_mappings)
    raise ProtocolError(f"memory.kind: {h.kind!r} is not supported")


def _check_layers_apart(tensors, identities) -> None:
    """A per-layer registration's allocations must be distinct memory: the same allocation twice
    (equal identities, however it was mapped here) or overlapping address ranges would have two
    layers written into one place."""
    seen = {}
    for i, ident in enumerate(identities):
        if ident in seen:
            raise LayoutError(f"layers[{i}]: the same memory as layers[{seen[ident]}]")
        seen[ident] = i
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(tensors))
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise LayoutError(f"layers[{j}]: overlaps layers[{i}]")


def _check_fingerprint_fits(fp: ModelFingerprint, layout: KVLayout) -> None:
    L, _, H, _, D = layout.sizes
    if (fp.num_layers, fp.num_kv_heads, fp.head_size) != (L, H, D):
        raise LayoutError(f"model_fingerprint: {fp.num_layers} layers, {fp.num_kv_heads} KV heads of "
                          f"{fp.head_size}, the layout holds {L}, {H} of {D}")


class Registrations:
    """Registering client memory (``register``) and the clients' interprocess events, per connection.

    ``wait_warm()``: blocks until the start-up warm-up has compiled what a registration needs.
    """

    def __init__(self, registry: Registry, *, backend: str, frame_timeout_s: float, wait_warm):
        self.registry = registry
        self.backend = backend
        self.frame_timeout_s = frame_timeout_s
        self._wait_warm = wait_warm
        self.device_mappings = DeviceMappings()
        # conn id -> {reg id: (IPC handle bytes, the client's event opened here)}; each connection's
        # thread alone reads and fills its own entry
        self._events: dict[int, dict] = {}

    # ------------------------------------------------------------------ connections
    def connection_opened(self, conn_id: int) -> None:
        self._events[conn_id] = {}

    def connection_closed(self, conn_id: int) -> None:
        self._events.pop(conn_id, None)  # ops that waited on one keep it in their keepalive

    def closed(self, reg: Registration, conn_id: int) -> None:
        events = self._events.get(conn_id)
        if events is not None:
            events.pop(reg.reg_id, None)

    @staticmethod
    def release_memory(reg: Registration) -> None:
        reg.memory.close()

    # ------------------------------------------------------------------ register
    def register(self, h: dict, peer: PeerIdentity, conn_id: int, sock) -> Registration:
        """The ``register`` request ``h``: its memory mapped, checked against its layout, registered
        and attached to the connection. Descriptors it announces (cuda_vmm chunks) follow its frame
        on ``sock``: read by the mapping, or drained here when the request fails before, so the
        stream stays in step."""
        nfds = protocol.field(h, "fds", int, optional=True, default=0)
        if not 0 <= nfds <= MAX_CHUNKS:
            raise ProtocolError(f"fds: {nfds} outside 0..{MAX_CHUNKS}")
        fds = FdStream(sock, nfds, self.frame_timeout_s)
        try:
            reg = self._register(h, peer, fds)
        finally:
            fds.drain()
        self.registry.attach(reg, conn_id)
        return reg

    def _register(self, h: dict, peer: PeerIdentity, fds: FdStream) -> Registration:
        # one allocation holding every layer ("memory"), or one per layer ("layers", in layer order:
        # what vLLM allocates), each mapped on its own
        whole, layers = h.get("memory"), h.get("layers")
        if (whole is None) == (layers is None):
            raise ProtocolError("register: expected exactly one of 'memory' (one allocation) and 'layers' "
                                "(one allocation per layer)")
        if layers is not None and (not isinstance(layers, list) or not layers):
            raise ProtocolError("layers: expected a non-empty list of memory descriptions")
        handles = [MemoryHandle.from_dict(protocol.field(h, "memory", dict))] if layers is None else \
            [MemoryHandle.from_dict(d) for d in layers]
        kind, device = handles[0].kind, handles[0].device
        if any(x.device != device for x in handles):
            raise ProtocolError("layers: every layer's memory must be on one device")
        if fds.count and not any(x.kind == "cuda_vmm" for x in handles):
            raise ProtocolError(f"fds: {fds.count} file descriptors announced for {kind!r} memory")
        layout_d = protocol.field(h, "layout", dict)
        rope_d = protocol.field(h, "rope", dict, optional=True)
        fingerprint = ModelFingerprint.from_dict(protocol.field(h, "model_fingerprint", dict))
        try:
            layout = KVLayout.from_dict(layout_d)
            rope = RopeSpec.from_dict(rope_d) if rope_d is not None else None
        except KmeshError:
            raise
        except (ValueError, TypeError, OverflowError) as exc:
            raise LayoutError(f"layout/rope: malformed description ({type(exc).__name__}: {exc})") from exc
        _check_fingerprint_fits(fingerprint, layout)
        instance = protocol.field(h, "instance", int, optional=True, default=0)
        if layers is not None and len(handles) != layout.num_layers:
            raise LayoutError(f"layers: {len(handles)} allocations for a layout of {layout.num_layers} layers")
        view = layout if layers is None else layout.per_layer()  # what each allocation holds
        need = math.prod(view.physical_shape) * torch.empty((), dtype=layout.dtype).element_size()
        for i, x in enumerate(handles):
            if x.nbytes != need:
                where = "memory" if layers is None else f"layers[{i}]"
                raise LayoutError(f"{where}.nbytes: {x.nbytes} bytes registered, the layout's physical shape "
                                  f"{list(view.physical_shape)} of {layout.dtype} needs {need}")
        if rope is not None and rope.head_size != layout.head_size:
            raise LayoutError(f"rope: head_size {rope.head_size} differs from the layout's D={layout.head_size}")
        # compiled (or loaded) by the warm-up as the service started: waited for here rather than
        # compiled again in parallel, and not left to the registration's first restore
        self._wait_warm()
        _compiled.compiled()
        mappings = []
        try:
            for x in handles:
                mappings.append(open_handle(x, self.device_mappings, fds))
            if not fds.done:
                raise ProtocolError(f"fds: {fds.left} file descriptors announced beyond the chunks of the memory")
            mapping = mappings[0] if layers is None else LayerMappings(mappings)
            cache = mapping.cache(layout) if layers is None else [m.cache(view) for m in mappings]
            if layers is not None:
                _check_layers_apart(cache, [m.identity(x) for m, x in zip(mappings, handles)])
            destination = self._destination(cache, layout, fingerprint, rope, layers is not None)
            identity = mapping.identity(handles[0]) if layers is None else \
                b"%s|layers|" % kind.encode() + b"|".join(m.identity(x) for m, x in zip(mappings, handles))
            return self.registry.register(peer, instance=instance, handle_key=identity, layout=layout, memory=mapping,
                                          destination=destination)
        except BaseException:
            for m in mappings:
                m.close()
            raise

    def _destination(self, cache, layout: KVLayout, fingerprint: ModelFingerprint, rope: RopeSpec | None,
                     per_layer: bool) -> Destination:
        first = cache[0] if per_layer else cache
        device = first.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            plain = PlacementPlan(cache, layout, backend=self.backend)
            shifted = PlacementPlan(cache, layout, rope=rope, backend=self.backend) if rope is not None else None
            dest = Destination(cache, layout, fingerprint, rope, device, per_layer, plain, shifted,
                               None if rope is None else int(rope.num_positions))
            if device.type == "cuda":
                from kmesh_gpu import cuda

                cuda.warm_up()  # the compiled driver calls of placement, loaded before the first restore
                dest.stream = torch.cuda.Stream(device=device)
                dest.stream_ids = (dest.stream.stream_id, dest.stream.device_index, dest.stream.device_type)
                dest.device_index = device.index
        return dest

    # ------------------------------------------------------------------ the clients' events
    def client_event(self, raw: bytes | None, reg: Registration, conn_id: int):
        """The client's interprocess event whose IPC handle is ``raw`` (``None`` when absent or for
        host memory), opened once per connection and registration: the client re-records the same
        event before each request, and a connection carries one request at a time, so the service's
        stream wait (made before the reply) always sees the record of this request."""
        dest = reg.destination
        if not raw or not dest.on_cuda:
            return None
        if len(raw) != EVENT_HANDLE_BYTES:
            raise ProtocolError(f"wait_event: a CUDA IPC event handle has {EVENT_HANDLE_BYTES} bytes, got {len(raw)}")
        events = self._events.get(conn_id)
        entry = None if events is None else events.get(reg.reg_id)
        if entry is not None and entry[0] == raw:
            return entry[1]
        event = open_event(dest.device, raw, "wait_event")
        if events is not None:
            events[reg.reg_id] = (raw, event)
        return event


def open_event(device: torch.device, raw: bytes, name: str):
    """The CUDA IPC event handle ``raw`` (a request's field ``name``) opened on ``device``."""
    try:
        return torch.cuda.Event.from_ipc_handle(device, raw)
    except RuntimeError as exc:
        raise ProtocolError(f"{name}: cannot open the CUDA IPC event handle: {exc}") from exc
