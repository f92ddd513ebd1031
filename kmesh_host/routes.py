"""Storage routes into GPU memory: ``host_staging`` and ``direct``, each ending verified and placed.

``host_staging``: segment file --O_DIRECT reads on a thread pool--> pinned host buffer (the host
tier's) --async H2D on the current CUDA stream, chunk by chunk as reads land--> device buffer.
With the tier's retention a resident segment skips the read and is copied from RAM.

``direct``: segment file --KvikIO/cuFile--> device buffer. With GPUDirect Storage the storage DMA
writes GPU memory; in KvikIO's (or cuFile's) compatibility mode the bytes go through a host bounce
buffer. The report labels the mechanism from positive evidence only: a run is called GDS only when
KvikIO is not in compatibility mode and the cuFile driver reports GDS available; anything else is
reported as a bounce-buffer copy, never as direct.

Both routes then verify every object where it landed: the kmesh-tree-sha256/v1 root of its padded
payload is computed on the device (``kmesh_gpu.tree_digests``, one launch per object as soon as
its bytes are in place, so hashing overlaps the reads of the next object) and compared with the
root stored in the file, and only then place the KV into the paged cache (``kmesh_gpu.place``,
shifting K to new positions when a RoPE spec is given). A mismatch raises IntegrityError naming
the segments and nothing is placed.

Every kernel and copy is issued on the caller's current CUDA stream.
"""

from __future__ import annotations

import ctypes
import queue
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import kmesh_gpu
from kmesh_gpu.errors import BackendError, IntegrityError, LayoutError

from .direct_io import ALIGN, IO_ENGINE, IO_ENGINE_NOTE, round_up
from .segment import ModelFingerprint, Segment, SegmentHeader, check_fingerprint, check_payload
from .store import SegmentStore
from .tier import HostTier, HostTierConfig

ROUTES = ("host_staging", "direct")
VERIFY_MODES = ("device", "device-batched", "host", "none")
_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124


@dataclass(frozen=True)
class RestoreTarget:
    """One segment to restore and where to put it.

    Attributes:
        key: the segment key.
        slots: ``int64[T]`` cache slots on the cache's device (``-1`` skips a token); ``None`` when
            the call only brings the segment to the device without placing it.
        new_positions: ``int64[T]`` positions in the child; with a RoPE spec, K is shifted from the
            stored original positions to these.
    """

    key: str
    slots: torch.Tensor | None = None
    new_positions: torch.Tensor | None = None


@dataclass
class RouteReport:
    """What a restore did and which mechanism moved the bytes.

    ``timings`` holds nested wall intervals in seconds (never add them): ``read_s`` (first read
    submitted to last read complete) and ``verify_s`` (first digest launched to the roots checked)
    both lie inside ``restore_s`` (call start to data verified, placed and the stream synchronised).
    """

    route: str
    mechanism: str
    device: str
    objects: int = 0
    bytes_moved: int = 0
    bytes_read: int = 0
    tier_sources: dict = field(default_factory=dict)
    io_engine: str = ""
    o_direct: bool | None = None
    pinned: bool | None = None
    direct_dma: bool = False
    verification: str = ""
    placed: bool = False
    timings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class RestoreResult:
    """The restored objects on the device. ``buffer`` (uint8) holds every padded payload at
    ``offsets``; ``kv[i]`` views segment ``i``'s ``(2, L, T, H, D)`` tensor inside it. The caller
    owns ``buffer`` and drops it when done."""

    report: RouteReport
    buffer: torch.Tensor
    offsets: list[int]
    headers: list[SegmentHeader]
    kv: list[torch.Tensor]

    def segments(self) -> list[Segment]:
        return [Segment(kv=kv, token_ids=torch.from_numpy(h.token_ids.astype(np.int64)),
                        positions=torch.from_numpy(h.positions.astype(np.int64)), key=h.key,
                        fingerprint=h.fingerprint) for kv, h in zip(self.kv, self.headers)]


# ----------------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _event(device: torch.device):
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def _layout_offsets(headers: list[SegmentHeader]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for h in headers:
        offsets.append(total)
        total += round_up(h.padded_length, ALIGN)
    return offsets, max(total, ALIGN)


class _Verifier:
    """Device tree-root verification, launched per object as its bytes land, checked once."""

    def __init__(self, mode: str, buffer: torch.Tensor, backend: str):
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify: expected one of {VERIFY_MODES}, got {mode!r}")
        self.mode, self.buffer, self.backend = mode, buffer, backend
        self.started: float | None = None
        self._pending: list[tuple[int, SegmentHeader, torch.Tensor | None]] = []

    def _mark(self):
        if self.started is None:
            self.started = time.perf_counter()

    def landed(self, offset: int, header: SegmentHeader, host_payload=None) -> None:
        """Object bytes are in ``buffer[offset:]`` (on the current stream); start checking them."""
        if self.mode == "device":
            self._mark()
            # Host lists: the index is uploaded without a device sync; launches follow the copies
            # on the current stream.
            roots = kmesh_gpu.tree_digests(self.buffer, [offset], [header.padded_length],
                                           leaf_size=header.tree_leaf_size, fanout=header.tree_fanout,
                                           backend=self.backend)
            self._pending.append((offset, header, roots))
        elif self.mode == "host" and host_payload is not None:
            self._mark()
            check_payload(header, host_payload, sha=False, tree=True)
        else:
            self._pending.append((offset, header, None))

    def finish(self) -> float:
        """Raise IntegrityError naming every segment whose root does not match; returns seconds spent."""
        if self.mode == "none" or (self.mode == "host" and not self._pending):
            return 0.0 if self.started is None else time.perf_counter() - self.started
        headers = [h for _, h, _ in self._pending]
        expected = torch.from_numpy(np.frombuffer(b"".join(h.tree_root for h in headers), dtype=np.uint8)
                                    .copy()).view(len(headers), 32)
        if self.mode == "host":
            # Objects that only exist on the device (direct route): download and hash on the host.
            self._mark()
            for offset, h, _ in self._pending:
                host = self.buffer[offset: offset + h.padded_length].cpu().numpy()
                check_payload(h, host, sha=False, tree=True)
            return time.perf_counter() - self.started
        if self.mode == "device-batched":
            self._mark()
            offs = [o for o, _, _ in self._pending]
            lens = [h.padded_length for h in headers]
            params = {(h.tree_leaf_size, h.tree_fanout) for h in headers}
            if len(params) != 1:
                raise IntegrityError(f"segments {[h.key for h in headers]}: mixed tree parameters {params}; "
                                     "use verify='device'")
            leaf, fanout = params.pop()
            try:
                kmesh_gpu.verify_tree_roots(self.buffer, offs, lens, expected, names=[h.key for h in headers],
                                            leaf_size=leaf, fanout=fanout, backend=self.backend)
            except IntegrityError as exc:
                raise IntegrityError(f"segment(s) {', '.join(h.key for h in headers)}: {exc}; nothing was "
                                     "placed") from exc
            return time.perf_counter() - self.started
        roots = torch.cat([r.reshape(-1, 32) for _, _, r in self._pending])
        bad = (roots.to(torch.uint8) != expected.to(roots.device)).any(dim=1).cpu().tolist()
        elapsed = time.perf_counter() - self.started
        if any(bad):
            names = [h.key for h, b in zip(headers, bad) if b]
            raise IntegrityError(f"segment(s) {', '.join(names)}: kmesh-tree-sha256 root mismatch where the "
                                 "data landed (corrupt read or storage); nothing was placed")
        return elapsed


def _place(result: RestoreResult, targets: list[RestoreTarget], *, cache, layout, rope, k_scale,
           backend: str) -> None:
    """All segments in one ``kmesh_gpu.place_many`` launch (K shifted when ``rope`` is given)."""
    device = result.buffer.device
    for target, header in zip(targets, result.headers):
        if target.slots is None:
            raise LayoutError(f"targets[{target.key}].slots: expected int64[T={header.num_tokens}] to place "
                              "into the cache, got None")
        if rope is not None and target.new_positions is None:
            raise LayoutError(f"targets[{target.key}].new_positions: expected int64[T={header.num_tokens}] "
                              "with a RoPE spec, got None")
    slots = [t.slots for t in targets]
    if rope is None:
        kmesh_gpu.place_many(result.kv, cache, layout, slots, k_scale=k_scale, backend=backend)
        return
    old = [torch.from_numpy(h.positions.astype(np.int64)).to(device, non_blocking=True) for h in result.headers]
    kmesh_gpu.place_many(result.kv, cache, layout, slots, rope=rope, old_positions=old,
                         new_positions=[t.new_positions for t in targets], k_scale=k_scale, backend=backend)


def _check_targets(targets) -> list[RestoreTarget]:
    targets = list(targets)
    for i, t in enumerate(targets):
        if not isinstance(t, RestoreTarget):
            raise LayoutError(f"targets[{i}]: expected a RestoreTarget, got {type(t).__name__}")
    if not targets:
        raise LayoutError("targets: expected at least one RestoreTarget")
    return targets


# ----------------------------------------------------------------------------------- host staging
def restore_host_staging(store: SegmentStore, targets, *, model_fingerprint: ModelFingerprint, device="cuda",
                         tier: HostTier | None = None, cache=None, layout=None, rope=None, k_scale=None,
                         verify: str = "device", backend: str = "auto",
                         hash_backend: str = "auto") -> RestoreResult:
    """Restore ``targets`` through pinned host RAM (see the module docstring).

    Args:
        store: where the segments live (a local filesystem for O_DIRECT reads).
        targets: :class:`RestoreTarget` per segment.
        model_fingerprint: the child's model; a segment of another model raises FingerprintMismatch.
        device: destination device (``"cpu"`` runs the host side alone: the "H2D" is a memcpy).
        tier: the host tier whose pinned buffers stage the reads (retention and singleflight are
            its configuration); ``None`` makes a private tier for this call (slow: it pins afresh).
        cache, layout: the paged KV cache and its :class:`kmesh_gpu.KVLayout`; ``None`` skips placement.
        rope: a :class:`kmesh_gpu.RopeSpec` to shift K to ``new_positions``; ``k_scale``: fp8 K scale.
        verify: ``"device"`` (default), ``"device-batched"``, ``"host"`` (tree root on the host
            before upload) or ``"none"``.
        backend: placement backend (``kmesh_gpu.place``); hash_backend: ``kmesh_gpu.tree_digests``'s.
    """
    device = torch.device(device)
    targets = _check_targets(targets)
    own_tier = tier is None
    if own_tier:
        tier = HostTier(store, HostTierConfig(retain=False, singleflight=False, verify="none",
                                              pin=device.type == "cuda"))
    t0 = time.perf_counter()
    leases: list = [None] * len(targets)
    report = RouteReport(route="host_staging", mechanism="", device=str(device), io_engine=IO_ENGINE,
                         notes=[IO_ENGINE_NOTE])
    events: queue.SimpleQueue = queue.SimpleQueue()
    pending = 0  # loads submitted whose "done" event has not been taken yet
    try:
        headers = [store.read_header(t.key) for t in targets]
        for h in headers:
            check_fingerprint(h, model_fingerprint)
        offsets, total = _layout_offsets(headers)
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        verifier = _Verifier(verify, buffer, hash_backend)
        # Every object loads at once on the tier's loader threads; this thread turns each chunk that
        # lands into an async H2D copy and each finished object into a digest launch.
        read_start = time.perf_counter()
        for i, target in enumerate(targets):
            def on_chunk(chunk, lo, hi, i=i):
                events.put(("chunk", i, chunk, lo, hi))

            fut = tier.acquire_async(target.key, model_fingerprint=model_fingerprint, on_chunk=on_chunk)
            fut.add_done_callback(lambda f, i=i: events.put(("done", i, f, time.perf_counter(), None)))
            pending += 1
        read_end, sources, failure = None, {}, None
        o_direct_flags, io_notes = set(), set()
        while pending:
            kind, i, item, a, b = events.get()
            header, off = headers[i], offsets[i]
            if kind == "chunk":
                # item: the host chunk holding payload bytes [a, b)
                if failure is None:
                    try:
                        buffer[off + a: off + b].copy_(item, non_blocking=True)
                    except BaseException as exc:
                        failure = exc
                continue
            pending -= 1
            stamp = a
            try:
                lease = leases[i] = item.result()
            except BaseException as exc:
                failure = failure or exc
                continue
            if failure is not None:
                continue
            try:
                if lease.header.sha256 != header.sha256:
                    raise IntegrityError(f"segment {targets[i].key}: changed on storage during the restore")
                sources[lease.source] = sources.get(lease.source, 0) + 1
                if lease.source == "read":
                    read_end = stamp
                    report.bytes_read += header.padded_length
                    o_direct_flags.add(lease.o_direct)
                    if lease.io_note:
                        io_notes.add(lease.io_note)
                else:
                    buffer[off: off + header.padded_length].copy_(lease.payload, non_blocking=True)
                lease.fence(_event(device))
                report.bytes_moved += header.padded_length
                verifier.landed(off, header, host_payload=lease.payload.numpy() if verify == "host" else None)
            except BaseException as exc:
                failure = exc
        if failure is not None:
            raise failure
        verify_s = verifier.finish()
        kvs = [h.kv_view(buffer[o: o + h.padded_length]) for h, o in zip(headers, offsets)]
        result = RestoreResult(report, buffer, offsets, headers, kvs)
        if cache is not None:
            _place(result, targets, cache=cache, layout=layout, rope=rope, k_scale=k_scale, backend=backend)
            report.placed = True
        _sync(device)
    finally:
        # Loads still in flight after an early error: take their leases so every one is released.
        while pending:
            kind, i, item, _, _ = events.get()
            if kind == "done":
                pending -= 1
                if item.exception() is None:
                    leases[i] = item.result()
        for lease in leases:
            if lease is not None:
                lease.release()
        if own_tier:
            tier.close()
    report.objects = len(targets)
    report.tier_sources = sources
    report.pinned = tier.pin
    report.o_direct = (o_direct_flags == {True}) if o_direct_flags else None
    report.notes += sorted(io_notes)
    report.verification = {"device": "device tree-root (per object, overlapped)", "device-batched":
                           "device tree-root (one batched launch)", "host": "host tree-root before upload",
                           "none": "none"}[verify]
    dst = "cudaMemcpyAsync H2D" if device.type == "cuda" else "host memcpy (no GPU)"
    staging = "pinned host RAM" if tier.pin else "pageable host RAM"
    if sources.get("read"):
        how = "O_DIRECT reads" if report.o_direct else "page-cache reads (O_DIRECT unavailable)"
        report.mechanism = f"{how} on {IO_ENGINE} -> {staging} -> {dst}, chunked"
    else:
        report.mechanism = f"host tier ({staging}, retained) -> {dst}"
    report.timings = {"read_s": (read_end - read_start) if read_end is not None else 0.0, "verify_s": verify_s,
                      "restore_s": time.perf_counter() - t0}
    return result


# ----------------------------------------------------------------------------------- direct
def _kvikio():
    try:
        import kvikio
    except ImportError as exc:
        raise BackendError("route 'direct' needs the kvikio package (KvikIO/cuFile); it is not installed") from exc
    return kvikio


def _device_attribute(attribute: int, ordinal: int) -> int | None:
    """A CUDA driver device attribute through libcuda (None where the driver cannot be asked)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return None
        if lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev) != 0:
            return None
        return value.value
    except OSError:
        return None


def direct_facts(device: torch.device) -> dict:
    """What the platform offers the direct route, from the KvikIO/cuFile driver and the kernel.

    Targets KvikIO >= 25.04 (``kvikio.defaults.is_compat_mode_preferred``,
    ``kvikio.cufile_driver.get``); an older KvikIO gives ``"unknown"`` answers, which the route
    treats as "not GDS".
    """
    kvikio = _kvikio()
    facts: dict = {"kvikio_version": getattr(kvikio, "__version__", "unknown")}
    try:
        facts["kvikio_compat_mode"] = str(kvikio.defaults.get("compat_mode"))
        facts["kvikio_compat_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        facts["kvikio_compat_preferred"] = f"unknown ({type(exc).__name__})"
    try:
        import kvikio.cufile_driver as drv

        facts["gds_available"] = bool(drv.get("is_gds_available"))
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        facts["gds_available"] = f"unknown ({type(exc).__name__})"
    try:
        with open("/proc/modules") as f:
            facts["nvidia_fs_loaded"] = any(line.startswith("nvidia_fs ") for line in f)
    except OSError:
        facts["nvidia_fs_loaded"] = "unknown"
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    dmabuf = _device_attribute(_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, ordinal)
    facts["device_dmabuf_supported"] = None if dmabuf is None else bool(dmabuf)
    return facts


def _direct_mechanism(facts: dict) -> tuple[str, bool]:
    # Direct only on positive evidence: KvikIO resolved to cuFile and the driver reports GDS.
    if facts.get("kvikio_compat_preferred") is False and facts.get("gds_available") is True:
        path = "nvidia-fs" if facts.get("nvidia_fs_loaded") is True else \
            "kernel PCI P2PDMA (DMA-BUF capable device)" if facts.get("device_dmabuf_supported") else "cuFile"
        return f"cuFile GPUDirect Storage: storage DMA into GPU memory via {path}", True
    return ("KvikIO/cuFile compatibility mode: POSIX reads into a host bounce buffer, then a host-to-device "
            "copy (NOT direct)"), False


def restore_direct(store: SegmentStore, targets, *, model_fingerprint: ModelFingerprint, device="cuda",
                   cache=None, layout=None, rope=None, k_scale=None, verify: str = "device",
                   backend: str = "auto", hash_backend: str = "auto",
                   register_buffer: bool = True) -> RestoreResult:
    """Restore ``targets`` with KvikIO/cuFile reads straight into device memory (see module docstring).

    Arguments as :func:`restore_host_staging`; ``register_buffer`` registers the destination with
    cuFile (``cuFileBufRegister``) when GDS is active. Needs CUDA and the kvikio package.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise BackendError(f"route 'direct' reads into GPU memory; device {device} is not a CUDA device")
    targets = _check_targets(targets)
    kvikio = _kvikio()
    facts = direct_facts(device)
    mechanism, is_direct = _direct_mechanism(facts)
    t0 = time.perf_counter()
    report = RouteReport(route="direct", mechanism=mechanism, device=str(device), direct_dma=is_direct,
                         io_engine="kvikio thread pool", facts=facts)
    if is_direct:
        report.notes.append("cuFile can still fall back to POSIX per file when its own allow_compat_mode is "
                            "set and the filesystem is unsupported; cufile.log records such fallbacks")
    files, registered = [], None
    try:
        headers = [store.read_header(t.key) for t in targets]
        for h in headers:
            check_fingerprint(h, model_fingerprint)
        offsets, total = _layout_offsets(headers)
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        if register_buffer and is_direct:
            try:
                from kvikio.buffer import memory_register
            except ImportError:
                report.notes.append("kvikio.buffer.memory_register unavailable: destination not registered")
            else:
                memory_register(buffer)
                registered = buffer
        report.facts["buffer_registered"] = registered is not None
        # kvikio reads on its own threads into memory the current stream may still be using.
        _sync(device)
        verifier = _Verifier(verify, buffer, hash_backend)
        read_start = time.perf_counter()
        futures = []
        for target, header, off in zip(targets, headers, offsets):
            f = kvikio.CuFile(store.local_path(target.key), "r")
            files.append(f)
            futures.append(f.pread(buffer[off: off + header.padded_length], header.padded_length,
                                   header.payload_offset))
        for target, header, off, fut in zip(targets, headers, offsets, futures):
            got = fut.get()
            if got != header.padded_length:
                raise IntegrityError(f"segment {target.key}: read {got} of {header.padded_length} payload bytes "
                                     "(truncated file)")
            report.bytes_read += got
            verifier.landed(off, header)
        read_end = time.perf_counter()
        report.bytes_moved = report.bytes_read
        verify_s = verifier.finish()
        kvs = [h.kv_view(buffer[o: o + h.padded_length]) for h, o in zip(headers, offsets)]
        result = RestoreResult(report, buffer, offsets, headers, kvs)
        if cache is not None:
            _place(result, targets, cache=cache, layout=layout, rope=rope, k_scale=k_scale, backend=backend)
            report.placed = True
        _sync(device)
    finally:
        for f in files:
            f.close()
        if registered is not None:
            from kvikio.buffer import memory_deregister

            memory_deregister(registered)
    report.objects = len(targets)
    report.verification = {"device": "device tree-root (per object, overlapped)", "device-batched":
                           "device tree-root (one batched launch)", "host": "download + host tree-root",
                           "none": "none"}[verify]
    report.timings = {"read_s": read_end - read_start, "verify_s": verify_s, "restore_s": time.perf_counter() - t0}
    return result


def restore(route: str, store: SegmentStore, targets, **kwargs) -> RestoreResult:
    """Dispatch to :func:`restore_host_staging` (``route="host_staging"``) or :func:`restore_direct`."""
    if route == "host_staging":
        return restore_host_staging(store, targets, **kwargs)
    if route == "direct":
        kwargs.pop("tier", None)
        return restore_direct(store, targets, **kwargs)
    raise ValueError(f"route: expected one of {ROUTES}, got {route!r}")


__all__ = ["ROUTES", "RestoreTarget", "RouteReport", "RestoreResult", "restore", "restore_host_staging",
           "restore_direct", "direct_facts"]
