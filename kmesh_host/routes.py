"""Storage routes into GPU memory: ``host_staging`` and ``direct``, each ending verified and placed.

``host_staging``: segment file --O_DIRECT reads (io_uring, or a thread pool)--> pinned host buffer (the host
tier's, pooled: released buffers are reused, never pinned again) --async H2D on a copy stream, one
copy per object as its last chunk lands--> device buffer. Every chunk of every missing object is
queued on the reader at once, in object order (``HostTier.start_loads``: no thread per object), so
the reader keeps its queue depth from the first chunk to the last. The thread that lands an
object's last chunk queues its copy at once; objects that land together (the reader reports the
completions one wake-up reaped as a group, ``on_batch``; the lent virtio disk completes a child's
reads all at once) are then fenced by one event and hashed by one tree-digest launch on a side
stream that waits for that event (a device-side wait, not a host one), while the reads of later
objects continue. All of that runs on the reader's completion thread between landings, so it is
kept short (a late landing is a late restore): a copy is one driver call, and a digest launch the
route has made before on that stream (every child after the first of a shape) one launch plus one
driver download of its roots. With the tier's retention a resident
segment skips the read and is copied from RAM in one H2D per object, issued before anything else
so the DMA overlaps the placement preparation; it was verified when it
entered the tier (the tier's host check, or an earlier restore's device check of a copy of that
very buffer), so by default it is not hashed again (``trust_verified=False`` re-verifies it on
the device).

``direct``: segment file --KvikIO/cuFile--> device buffer. With GPUDirect Storage the storage DMA
writes GPU memory; in KvikIO's (or cuFile's) compatibility mode the bytes go through a host bounce
buffer. The report labels the mechanism from positive evidence only: a run is called GDS only when
KvikIO is not in compatibility mode and the cuFile driver reports GDS available; anything else is
reported as a bounce-buffer copy, never as direct. Where the device supports DMA-BUF, the
destination is also exported as a DMA-BUF (the handle a P2PDMA-capable storage driver writes GPU
memory through) and the report says whether that worked (``facts["dma_buf"]``); the export alone
moves no bytes and changes no label. (Its code: :mod:`kmesh_host.direct_route`.)

Both routes verify every object that is not already verified where it landed: the
kmesh-tree-sha256/v1 root of its padded payload is computed on the device
(``kmesh_gpu.tree_digests``, one launch per group of objects as soon as their bytes are in place),
the roots downloaded into a page-locked table right behind their digest, and all roots are compared
with the stored ones on the host once every download's event has completed. The KV is placed into
the paged cache with one launch (K shifted to new positions when a RoPE spec is given) only behind
a verdict: on ``host_staging`` with device verification the placement is queued on the work stream
behind a device comparison of the roots with the stored ones that empties its run table on any
mismatch (``_Verifier.gate``, ``csrc/gate.cu``), so it follows the last digest on the device with no
host round trip in between; elsewhere (other verification modes, a placement without a run table)
it is launched after the host's comparison. A mismatch raises IntegrityError naming every bad
segment, nothing is placed, and the bad segment leaves the host tier.

Placement is prepared (``prepare_place_many``: slot and position validation, launch tables) while
the bytes are still moving: it needs the objects' device addresses, not their bytes.

Streams: copies run on a copy stream; digests on a few side streams; the gate and placement on
a work stream. Both start after the caller's current stream's earlier work, and before the call returns
(also on failure) the caller's current stream waits for both, so later work on it sees the placed
cache and buffers it frees are no longer in use. A child whose objects are all resident and
trusted has nothing to overlap: its copies and placement run in order on the caller's stream,
its first copy queued before anything else is arranged, into a staging buffer the previous such
child of the same size made while its own copies ran (``SPARE_STAGING``).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import kmesh_gpu
from kmesh_gpu import _launch as _driver  # driver-level async H2D copies of pinned host memory
from kmesh_gpu import _place_driver  # the all-resident path's placement in one compiled call
from kmesh_gpu import sha256 as _sha256  # _tree_launch: a repeated digest as one launch
from kmesh_gpu.errors import BackendError, IntegrityError, LayoutError
from kmesh_gpu.place import _prepare_at, prepare_place_many  # _prepare_at: items by address (our buffer)

from ._streams import _CallerStream, _raw_stream, _Streams
from .direct_io import ALIGN, round_up
from .segment import ModelFingerprint, Segment, SegmentHeader, check_fingerprint, check_payload
from .store import SegmentStore
from .tier import HostTier, HostTierConfig

ROUTES = ("host_staging", "direct")
VERIFY_MODES = ("device", "device-batched", "host", "none")


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
    submitted to last read complete), ``verify_s`` (first digest launched to the roots checked) and
    ``prepare_s`` (placement preparation, overlapped with the reads and copies) all lie inside
    ``restore_s`` (call start to data verified, placed and the caller's stream synchronised).
    ``verified`` counts objects per check: checked by this call, or trusted because the host tier
    verified them when they entered it.
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
    verified: dict = field(default_factory=dict)
    placed: bool = False
    timings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


class RestoreResult:
    """The restored objects on the device. ``buffer`` (uint8) holds every padded payload at
    ``offsets``; ``kv[i]`` views segment ``i``'s ``(2, L, T, H, D)`` tensor inside it (the views are
    made on first use: a caller that only wanted the cache placed never pays for them). The caller
    owns ``buffer`` and drops it when done."""

    __slots__ = ("report", "buffer", "offsets", "headers", "_kv")

    def __init__(self, report: RouteReport, buffer: torch.Tensor, offsets: list[int], headers: list[SegmentHeader],
                 kv: list[torch.Tensor] | None = None):
        self.report, self.buffer, self.offsets, self.headers, self._kv = report, buffer, offsets, headers, kv

    @property
    def kv(self) -> list[torch.Tensor]:
        if self._kv is None:
            self._kv = _kv_views(self.buffer, self.headers, self.offsets)
        return self._kv

    def segments(self) -> list[Segment]:
        return [Segment(kv=kv, token_ids=torch.from_numpy(h.token_ids.astype(np.int64)),
                        positions=torch.from_numpy(h.positions.astype(np.int64)), key=h.key,
                        fingerprint=h.fingerprint) for kv, h in zip(self.kv, self.headers)]


# ----------------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _layout_offsets(headers: list[SegmentHeader]) -> tuple[list[int], int]:
    return _offsets_of([h.padded_length for h in headers])


def _offsets_of(lengths) -> tuple[list[int], int]:
    """Each object's offset in the staging buffer (aligned) and the buffer's size, for ``lengths`` bytes."""
    offsets, total = [], 0
    for nbytes in lengths:
        offsets.append(total)
        total += round_up(nbytes, ALIGN)
    return offsets, max(total, ALIGN)


def _kv_views(buffer: torch.Tensor, headers: list[SegmentHeader], offsets: list[int]) -> list[torch.Tensor]:
    """Each object's ``(2, L, T, H, D)`` tensor as a view of ``buffer`` (``SegmentHeader.kv_view``'s
    result, made with one strided view per object of one typed view of the buffer)."""
    kvs, typed = [], {}
    for h, o in zip(headers, offsets):
        dt = h.torch_dtype
        size = dt.itemsize
        shape = h.shape
        if o % size or h.payload_length != math.prod(shape) * size or buffer.numel() % size:
            kvs.append(h.kv_view(buffer[o: o + h.padded_length]))
            continue
        view = typed.get(dt)
        if view is None:
            view = typed[dt] = buffer.view(dt)
        strides, acc = [0] * len(shape), 1
        for i in range(len(shape) - 1, -1, -1):
            strides[i] = acc
            acc *= shape[i]
        kvs.append(view.as_strided(shape, strides, o // size))
    return kvs


def _check_placement(targets: list, headers: list[SegmentHeader], rope) -> None:
    for target, header in zip(targets, headers):
        if target.slots is None:
            raise LayoutError(f"targets[{target.key}].slots: expected int64[T={header.num_tokens}] to place "
                              "into the cache, got None")
        if rope is not None and target.new_positions is None:
            raise LayoutError(f"targets[{target.key}].new_positions: expected int64[T={header.num_tokens}] "
                              "with a RoPE spec, got None")


class _Placement:
    """One ``place_many`` launch for all objects, prepared while their bytes are still moving.

    Preparation (validation of slots and positions, launch tables) needs the objects' device
    addresses, not their bytes; it works on host copies of the indices (slot mappings from a
    scheduler are host tensors; CUDA ones are read back once) and queues one table upload on the
    work stream, before any digest is queued there. On CUDA it takes the objects' addresses in the
    staging buffer (no tensor view is built before the launch; the caller builds the views after
    it), where anything unusual falls back to views. :meth:`run` then only launches.
    """

    def __init__(self, buffer: torch.Tensor, offsets: list[int], targets, headers, *, cache, layout, rope, k_scale,
                 backend, streams: _Streams):
        self.streams = streams
        slots = [t.slots for t in targets]
        old = new = None
        if rope is not None:
            new = [t.new_positions for t in targets]
            # the stored positions stay on the host (placement checks and tabulates indices there)
            old = [h.positions_int64 for h in headers]
        self.kvs = None  # the objects' views, where preparation needed them
        with streams.on_work():
            launch = None
            at = _addresses(buffer, headers, offsets) if buffer.is_cuda else None
            if at is not None:
                launch = _prepare_at(at[0], [h.shape for h in headers], at[1], buffer.device, cache, layout, slots,
                                     rope=rope, old_positions=old, new_positions=new, k_scale=k_scale,
                                     backend=backend)
            if launch is None:
                self.kvs = _kv_views(buffer, headers, offsets)
                launch = prepare_place_many(self.kvs, cache, layout, slots, rope=rope, old_positions=old,
                                            new_positions=new, k_scale=k_scale, backend=backend)
            self.launch = launch

    def run(self) -> None:
        with self.streams.on_work():
            self.launch.run()


#: the all-resident path's placement prepared and launched in one compiled call
#: (``_place_driver.place_now``); ``False``: in steps, as on the other paths (tests and benchmarks
#: compare them)
LANE = True


def _place_now(buffer: torch.Tensor, offsets: list[int], targets, headers: list[SegmentHeader], *, cache, layout,
               rope, k_scale, backend, streams) -> bool:
    """The placement launched on the caller's stream by ``_place_driver.place_now``; ``False`` where
    that path does not apply (nothing queued: the caller prepares it the usual way)."""
    if not LANE or k_scale is not None:
        return False
    at = _addresses(buffer, headers, offsets)
    if at is None:
        return False
    olds = news = None
    if rope is not None:
        news = [t.new_positions for t in targets]
        olds = [h.positions_int64 for h in headers]
    return _place_driver.place_now(at[0], [h.shape for h in headers], at[1], cache, layout, [t.slots for t in targets],
                                   rope=rope, old_positions=olds, new_positions=news, backend=backend)


def _addresses(buffer: torch.Tensor, headers: list[SegmentHeader], offsets: list[int]):
    """``(addresses, dtype)`` of every object's KV in ``buffer`` where all share one dtype and each
    is exactly its shape's bytes at an aligned offset (what :func:`_kv_views` views directly);
    else ``None``."""
    dt = headers[0].torch_dtype
    size = dt.itemsize
    base = buffer.data_ptr()
    out = []
    for h, o in zip(headers, offsets):
        if not h.dense_kv or o % size or h.torch_dtype is not dt:
            return None
        out.append(base + o)
    return out, dt


class _Verifier:
    """Tree-root checks of objects where they landed: launched as objects land, compared once.

    ``landed(...)`` / ``landed_many(...)`` are called as objects' bytes arrive (in any order; the
    objects of one call together); objects whose tier entry is already verified are trusted when
    ``trust_verified``. :meth:`finish` compares every root with one synchronisation and returns the
    keys that failed; :meth:`gate` lets the placement go ahead of that comparison on the device.
    """

    _HOW = {"device": "device kmesh-tree-sha256 root", "device-batched": "device kmesh-tree-sha256 root",
            "host": "host kmesh-tree-sha256 root"}

    def __init__(self, mode: str, buffer: torch.Tensor, backend: str, streams: _Streams, *, trust_verified: bool,
                 objects: int = 0):
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify: expected one of {VERIFY_MODES}, got {mode!r}")
        self.mode, self.buffer, self.backend, self.streams = mode, buffer, backend, streams
        self.trust = trust_verified
        self.started: float | None = None
        self.counts: dict[str, int] = {}
        self._checked: list[tuple[int, SegmentHeader, object]] = []  # (offset, header, lease or None)
        self._roots: list[torch.Tensor] = []
        self._host_bad: list[str] = []
        # ``device`` mode on CUDA: the objects landed together get one digest launch, whose roots
        # go into rows of a device table and are downloaded right after it, on its stream, into a
        # pinned table, so that once the last digest is done the comparison is one wait and a host
        # compare of 32-byte rows. Both tables have 2 x ``objects`` rows (made before the reads):
        # rows [0, objects) the computed roots, in the order of ``_checked``; rows [objects, 2 x
        # objects) the stored ones, which the gate uploads and compares on the device.
        self._objects = objects
        self._rows = 0  # table rows filled (checked objects, in the order of ``_checked``)
        self._host_roots = self._dev_roots = None
        self._root_events: list = []  # per digest launch (tables only): an event after its roots' download
        self.fast_digests = 0  # digest launches that took the short path (tests, tools)
        self.gated = False  # the placement was queued behind a device comparison of the roots (gate())
        self._gate_done = None  # an event after the gate
        if mode == "device" and objects > 0 and buffer.is_cuda:
            self._host_roots = torch.empty((2 * objects, 32), dtype=torch.uint8, pin_memory=True)
            self._dev_roots = torch.empty((2 * objects, 32), dtype=torch.uint8, device=buffer.device)

    def _mark(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def landed(self, offset: int, header: SegmentHeader, *, lease=None, event=None) -> None:
        """Object bytes are in ``buffer[offset:]`` once ``event`` (its copy; ``None``: already) completes."""
        self.landed_many([(offset, header, lease)], event)

    def landed_many(self, items, event=None) -> None:
        """Objects ``(offset, header, lease or None)`` whose bytes are all in ``buffer`` once ``event``
        completes (``None``: already). In ``device`` mode with the tables, those to check are hashed
        by one launch (one per set of tree parameters among them)."""
        group = []
        for offset, header, lease in items:
            if lease is not None and self.trust and lease.verified:
                self._count(f"trusted: {lease.verified}")
                continue
            if self.mode == "none":
                self._count("not verified")
                continue
            self._count(f"{self._HOW[self.mode]} (this call)")
            if self.mode == "device":
                self._mark()
                if self._host_roots is not None:
                    if self._rows + len(group) >= self._objects:
                        raise RuntimeError(f"_Verifier: more objects landed than the {self._objects} it was made for")
                    group.append((offset, header, lease))
                    continue
                self._checked.append((offset, header, lease))
                with self.streams.on_digest(event):
                    root = kmesh_gpu.tree_digests(self.buffer, [offset], [header.padded_length],
                                                  leaf_size=header.tree_leaf_size, fanout=header.tree_fanout,
                                                  backend=self.backend)
                    self._roots.append(root)
                continue
            self._checked.append((offset, header, lease))
            if self.mode == "host" and lease is not None:
                self._mark()
                if not _host_root_ok(header, lease.payload.numpy()):
                    self._host_bad.append(header.key)
        if group:
            by_params: dict = {}
            for item in group:
                by_params.setdefault((item[1].tree_leaf_size, item[1].tree_fanout), []).append(item)
            for (leaf, fanout), items_ in by_params.items():
                self._digest_to_table(items_, leaf, fanout, event)

    def _digest_to_table(self, items: list, leaf: int, fanout: int, event) -> None:
        """One digest launch for ``items`` (same tree parameters) on the next side stream after
        ``event``, their roots into the next rows of the device table, downloaded into the same
        rows of the pinned table there, and an event recorded after that (the comparison waits for
        those events alone, not for a join of every stream). Often runs on the reader's completion
        thread, between chunk landings, so it is kept short: a digest this restore's shape has had
        on that stream before is one launch and one driver copy (``sha256._tree_launch``); anything
        else goes through :func:`kmesh_gpu.tree_digests` and torch, which also makes the next one
        short."""
        k, m = self._rows, len(items)
        stored = self._host_roots.numpy()
        for j, (_, header, _) in enumerate(items):  # the stored roots, for the gate's upload
            stored[self._objects + k + j] = np.frombuffer(header.tree_root, dtype=np.uint8)
        side = self.streams.digest_side(event)
        offsets = tuple(o for o, _, _ in items)
        lengths = tuple(h.padded_length for _, h, _ in items)
        out = self._dev_roots[k:k + m]
        done = False
        if FAST_DIGESTS and self.backend in ("auto", "cupy") and _sha256._tree_launch(
                self.buffer, offsets, lengths, leaf, fanout, side.cuda_stream, out):
            self.fast_digests += 1
            done = _driver.copy_dtoh(self._host_roots.data_ptr() + 32 * k, out.data_ptr(), 32 * m, side.cuda_stream)
            if not done:
                with self.streams.on_side(side):
                    self._host_roots[k:k + m].copy_(out, non_blocking=True)
                done = True
        if not done:
            with self.streams.on_side(side):
                roots = kmesh_gpu.tree_digests(self.buffer, list(offsets), list(lengths), leaf_size=leaf,
                                               fanout=fanout, backend=self.backend)
                out.copy_(roots, non_blocking=True)  # the gate compares the device rows
                self._host_roots[k:k + m].copy_(roots, non_blocking=True)
        event = _driver.DriverEvent.recorded(side.cuda_stream)
        if event is None:
            event = torch.cuda.Event()
            event.record(side)
        self._root_events.append(event)
        self._checked.extend(items)
        self._rows += m

    def _in_tables(self) -> bool:
        """Every checked object's root is (on its way) in the tables."""
        return self._host_roots is not None and self._rows == len(self._checked) and not self._roots

    def gate(self, launch) -> bool:
        """Queue on the work stream, behind every checked object's root (each digest launch's
        event), the device comparison of those roots with the stored ones, made so that ``launch``
        (the placement's ``_Launch``, run next on the work stream) writes nothing unless all of
        them match (``_Launch.gate``): the placement can then be launched before :meth:`finish`
        compares on the host, with no host round trip between the last digest and the placement.
        ``True`` when queued; ``False`` (nothing of the gate queued) in other verification modes,
        for a placement without a run table on the device, or on a refusal: compare first, then
        place."""
        n = self._rows
        if not GATED_PLACEMENT or self.mode != "device" or not n or not self._in_tables() \
                or self.streams.work is None:
            return False
        work = self.streams.work.cuda_stream
        want = self._dev_roots.data_ptr() + 32 * self._objects
        if not _driver.copy_htod(want, self._host_roots.data_ptr() + 32 * self._objects, 32 * n, work):
            return False
        # (a failed gate below leaves that upload queued: harmless, and settle() waits for it)
        self._gate_done = _driver.DriverEvent.recorded(work)
        for event in self._root_events:
            self.streams.work_after(event)
        self.gated = launch.gate(self._dev_roots.data_ptr(), want, 32 * n, work)
        if self.gated:
            self._gate_done = _driver.DriverEvent.recorded(work) or self._gate_done
        return self.gated

    def settle(self) -> None:
        """Wait for every digest, root download and gate still pending where this class queued them
        below torch: driver copies into and out of the pinned table (which torch's pinned allocator
        does not track), reading device rows made on another thread's stream. Called before the
        tables can go, also when a restore fails before :meth:`finish` (after it, the events have
        completed and this only queries them)."""
        for event in (*self._root_events, self._gate_done):
            if event is None:
                continue
            try:
                event.synchronize()
            except RuntimeError:  # a device error: the restore's own error (or finish's) reports it
                pass

    def finish(self) -> tuple[float, list[str]]:
        """``(seconds since the first check started, keys whose root does not match)``."""
        if not self._checked:
            return 0.0, []
        self._mark()
        headers = [h for _, h, _ in self._checked]
        if self.mode == "host":
            bad = list(self._host_bad)
            for offset, h, lease in self._checked:
                if lease is None:  # objects that only exist on the device (direct route): download
                    with self.streams.on_work():
                        host = self.buffer[offset: offset + h.padded_length].cpu().numpy()
                    if not _host_root_ok(h, host):
                        bad.append(h.key)
            return time.perf_counter() - self.started, bad
        n = len(headers)
        if self.mode == "device" and self._in_tables():
            # every root is on its way to the pinned table: wait for each download's event (no
            # stream waits for the digests here: the placement reads the buffer, not the roots, and
            # the caller's stream joins the digest streams before the buffer can go, in join())
            if JOIN_BEFORE_COMPARE:  # the earlier arrangement, kept for comparisons
                self.streams.digests_done()
                with self.streams.on_work():
                    done = torch.cuda.Event()
                    done.record()
                done.synchronize()
            else:
                for event in self._root_events:
                    event.synchronize()
            _stamp("roots downloaded")
            got = self._host_roots.numpy()[:n]
        else:
            self.streams.digests_done()
            with self.streams.on_work():
                if self.mode == "device-batched":
                    params = {(h.tree_leaf_size, h.tree_fanout) for h in headers}
                    if len(params) != 1:
                        raise IntegrityError(f"segments {[h.key for h in headers]}: mixed tree parameters "
                                             f"{params}; use verify='device'")
                    leaf, fanout = params.pop()
                    roots = kmesh_gpu.tree_digests(self.buffer, [o for o, _, _ in self._checked],
                                                   [h.padded_length for h in headers], leaf_size=leaf,
                                                   fanout=fanout, backend=self.backend)
                else:
                    roots = torch.cat([r.reshape(-1, 32) for r in self._roots])
                # The one synchronisation: the roots come back (32 bytes per object).
                got = roots.cpu().numpy()
        bad = [h.key for h, row in zip(headers, got) if row.tobytes() != h.tree_root]
        return time.perf_counter() - self.started, bad

    def mark_verified(self, route: str) -> None:
        """After a successful :meth:`finish`: tier entries checked here are trusted from now on."""
        if self.mode == "none":
            return
        how = f"{self._HOW[self.mode]} of a copy of this buffer (route {route})" if self.mode != "host" else \
            f"{self._HOW[self.mode]} (route {route})"
        for _, _, lease in self._checked:
            if lease is not None:
                lease.mark_verified(how)

    @property
    def description(self) -> str:
        return {"device": "device tree-root (objects as they land, compared once)",
                "device-batched": "device tree-root (one batched launch)", "host": "host tree-root",
                "none": "none"}[self.mode]


def _host_root_ok(header: SegmentHeader, payload) -> bool:
    try:
        check_payload(header, payload, sha=False, tree=True)
    except IntegrityError:
        return False
    return True


def _integrity_failure(bad: list[str]) -> IntegrityError:
    return IntegrityError(f"segment(s) {', '.join(bad)}: kmesh-tree-sha256 root mismatch where the data landed "
                          "(corrupt read or storage); nothing was placed")


_USABLE_DEVICES: set = set()  # devices a route has found usable (a restore checks a set, not the driver)


def _check_device(device, route: str) -> torch.device:
    """``device`` as a torch.device a route can restore into; a typed refusal (BackendError) naming
    why when it is not: an unknown spelling, a device type that holds no data (``meta``) or a CUDA
    device this process cannot use."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BackendError(f"route {route!r}: device {device!r} is not a device ({exc})") from exc
    if device in _USABLE_DEVICES:
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendError(f"route {route!r}: device {device} needs CUDA, and this process has no usable CUDA "
                               f"device (torch {torch.__version__}, CUDA available: False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BackendError(f"route {route!r}: device {device}: only {torch.cuda.device_count()} CUDA "
                               "device(s) visible")
    elif device.type != "cpu":
        raise BackendError(f"route {route!r}: device {device}: expected a CUDA device or 'cpu'")
    _USABLE_DEVICES.add(device)
    return device


def _check_targets(targets) -> list[RestoreTarget]:
    targets = list(targets)
    for i, t in enumerate(targets):
        if not isinstance(t, RestoreTarget):
            raise LayoutError(f"targets[{i}]: expected a RestoreTarget, got {type(t).__name__}")
    if not targets:
        raise LayoutError("targets: expected at least one RestoreTarget")
    return targets


# ----------------------------------------------------------------------------------- host staging
TRACE: list | None = None  # tools set a list: restore_host_staging appends (step, perf_counter()) to it
#: ``True``: a child whose objects are all resident in page-locked memory and trusted is leased, its
#: staging buffer made and its first copy queued in one short step (``HostTier.acquire_ready``);
#: ``False``: through the general start, as any other child (comparisons, ``tools/ab_lane.py``)
READY = True
#: ``True``: an object's digest repeated from an earlier restore of the same shape is one launch and
#: one driver copy of its root from the reader's completion thread (``_Verifier._digest_to_table``);
#: ``False``: through ``kmesh_gpu.tree_digests`` and torch every time (comparisons)
FAST_DIGESTS = True
#: ``True``: a chunk read from storage is copied to the GPU by one driver call from the reader's
#: completion thread; ``False``: through torch (comparisons, ``tools/probe_read_factors.py``)
CHUNK_DRIVER_COPIES = True
#: ``True``: a read object is copied to the GPU in one driver call from the reader's completion thread
#: once its last chunk has landed; ``False``: chunk by chunk as they land (``CHUNK_DRIVER_COPIES``).
#: The lent machine's disk completes a child's reads together (``tools/probe_read_timeline.py``: one
#: wake-up of the completion thread reaps all twelve), so per-chunk copies overlapped nothing and
#: only lengthened the serial work after the landing
OBJECT_COPIES = True
#: ``True``: with device verification the placement is queued behind a device comparison of the
#: roots (``_Verifier.gate``: a run table emptied on a mismatch) before the host compares them;
#: ``False``: launched after the host's comparison (comparisons, ``tools/ab_lane.py``)
GATED_PLACEMENT = True
#: ``True``: objects that land together (the engine reports a group of completions at once) are
#: copied, fenced and hashed together: one event, one digest launch; ``False``: each as it lands
BATCH_LANDINGS = True
#: ``True``: a child's reads are queued as soon as its headers are read, before its staging buffer,
#: streams, verifier and report are made (landings before those exist wait, parked); ``False``: after
#: them (comparisons, ``tools/probe_read_timeline.py --switches READS_FIRST``)
READS_FIRST = True
#: ``True``: a child whose objects are all ready (``READY``) makes the staging buffer for the next
#: such child of the same size while its own copies run (the host only waits for the device then),
#: so the next one's first copy is queued without an allocation before it; at most
#: ``_MAX_SPARES`` such buffers are kept, one per (device, stream); ``drop_staging_spares()``
#: frees them. ``False``: each child allocates its own (comparisons, ``tools/ab_lane.py``)
SPARE_STAGING = True
_MAX_SPARES = 4
_spares: dict = {}  # (device index, raw stream) -> an unused staging buffer, taken by the next ready child


def _take_spare(index: int, stream: int, total: int) -> torch.Tensor | None:
    """The spare staging buffer kept for this device and stream when it has ``total`` bytes, else
    ``None``; either way it is no longer kept (one child takes it, a size that differs frees it)."""
    spare = _spares.pop((index, stream), None)  # one pop: two threads cannot both take it
    return spare if spare is not None and spare.numel() == total else None


def _stock_spare(device: torch.device, index: int, stream: int, total: int) -> None:
    """Keep a fresh staging buffer of ``total`` bytes for the next ready child on this device and
    stream (allocated on that stream, which the caching allocator ties it to)."""
    if (index, stream) not in _spares and len(_spares) < _MAX_SPARES:
        _spares[(index, stream)] = torch.empty(total, dtype=torch.uint8, device=device)


def drop_staging_spares() -> int:
    """Free the spare staging buffers (``SPARE_STAGING``); returns how many were kept."""
    n = len(_spares)
    _spares.clear()
    return n


#: ``True``: the root comparison waits for every digest stream joined into the work stream (the
#: arrangement before each root's own download event; ``tools/probe_forced_read_tail.py --ab``)
JOIN_BEFORE_COMPARE = False


def _stamp(step: str) -> None:
    if TRACE is not None:
        TRACE.append((step, time.perf_counter()))


def restore_host_staging(store: SegmentStore, targets, *, model_fingerprint: ModelFingerprint, device="cuda",
                         tier: HostTier | None = None, cache=None, layout=None, rope=None, k_scale=None,
                         verify: str = "device", trust_verified: bool = True, backend: str = "auto",
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
        verify: check of objects not yet verified: ``"device"`` (default), ``"device-batched"``,
            ``"host"`` (tree root on the host, before placement) or ``"none"``.
        trust_verified: objects whose host-tier entry was verified when it entered the tier are
            not checked again; ``False`` checks them too, with ``verify``.
        backend: placement backend (``kmesh_gpu.place``); hash_backend: ``kmesh_gpu.tree_digests``'s.
    """
    device = _check_device(device, "host_staging")
    targets = _check_targets(targets)
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify: expected one of {VERIFY_MODES}, got {verify!r}")
    own_tier = tier is None
    if own_tier:
        tier = HostTier(store, HostTierConfig(retain=False, singleflight=False, verify="none",
                                              pin=device.type == "cuda"))
    t0 = time.perf_counter()
    _stamp("start")
    # Every object resident in page-locked memory and trusted (or not to be checked): nothing to
    # read and nothing to hash, so nothing to overlap, and one stream serves; the DMA starts with
    # the first object's copy, before anything else is arranged (this call's own set-up below
    # included), into a staging buffer made while the previous such child's copies ran where one
    # is kept (``SPARE_STAGING``).
    ready = tier.acquire_ready([t.key for t in targets], model_fingerprint=model_fingerprint,
                               verified=verify != "none") \
        if READY and not own_tier and device.type == "cuda" and (verify == "none" or trust_verified) else None
    if ready is not None:
        leases, rows = ready
        try:
            _stamp("leased")
            offsets, total = _offsets_of([nbytes for _, nbytes in rows])
            index = device.index if device.index is not None else torch.cuda.current_device()
            stream = _raw_stream(index)
            buffer = _take_spare(index, stream, total) if SPARE_STAGING else None
            if buffer is None:
                buffer = torch.empty(total, dtype=torch.uint8, device=device)
            base = buffer.data_ptr()
            _stamp("staging allocated")
            early = int(_driver.copy_htod(base, rows[0][0], rows[0][1], stream))
            _stamp("first copy queued")
        except BaseException:
            for lease in leases:
                lease.release()
            raise
    n = len(targets)
    if ready is None:
        leases = [None] * n
    engine = tier.io_engine
    # Each load's outcome (i, lease, error), in the order they settle; `all_settled` is set by the
    # last one (one wake-up of this thread, not one per object: each would take the GIL from the
    # completion thread while it lands the next object)
    settled: list = []
    all_settled = None  # (a threading.Event, made only when something is read)
    pending = 0  # loads started whose outcomes have not been taken yet
    stopped = []  # set when this call gives up: reading threads copy no further chunks
    streams = verifier = None
    land_lock = threading.Lock()  # verifier, streams and report bookkeeping: one landing at a time
    read_start = read_end = None
    prepare_s, sources, o_direct_flags, io_notes = 0.0, {}, set(), set()
    landed = [None] * n  # seconds from the call's start to each read object's load completing
    try:
        keys = [t.key for t in targets]
        # The reading side. Its callbacks name the staging buffer, streams, verifier and report
        # made further down: with ``READS_FIRST`` the reads start before those exist (right after
        # the headers are read), and a landing that comes before they do is parked until this
        # thread arms the landings; otherwise the reads start once they exist, armed.
        failures: list = []
        missing: list = []  # indices of the objects read (not resident)
        per_chunk = not OBJECT_COPIES
        arrived: list = []  # (i, lease) of objects landed whose copies and digests are not queued yet
        armed: list = []  # set once landings can be copied, hashed and reported (lock held)
        parked: list = []  # (i, lease, when) of landings before that
        reads_started = False

        def land(i: int, lease, when: float) -> None:
            """Object ``i``'s load finished (lock held, armed): its checks and bookkeeping;
            :func:`flush` queues its copy (unless made chunk by chunk) and digest."""
            nonlocal read_end
            header = headers[i]
            if lease.header.sha256 != header.sha256:
                raise IntegrityError(f"segment {targets[i].key}: changed on storage during the restore")
            sources[lease.source] = sources.get(lease.source, 0) + 1
            landed[i] = when - t0
            if lease.source == "read":
                read_end = when if read_end is None else max(read_end, when)
                report.bytes_read += header.padded_length
                o_direct_flags.add(lease.o_direct)
                if lease.io_note:
                    io_notes.add(lease.io_note)
            if not (lease.source == "read" and per_chunk):  # the DMA starts at once
                _copy_into(buffer, offsets[i], lease, streams, copy_handle)
            arrived.append((i, lease))
            if not BATCH_LANDINGS:
                flush()

        def flush() -> None:
            """(lock held) The objects landed (and copied) since the last flush: one event after
            their copies fencing their buffers and awaited by the work stream, and their digests,
            one launch for all of them (``landed_many``). Runs on the reading thread after each
            group of landings the engine reports together (``on_batch``), and on this thread once
            every load has settled."""
            if not arrived:
                return
            group = arrived[:]
            arrived.clear()
            event = streams.copied()  # after every copy issued so far (chunk copies too)
            for _, lease in group:  # fenced also when the restore gives up
                lease.fence(event)
            if stopped or failures:
                return
            for i, _ in group:
                report.bytes_moved += headers[i].padded_length
            streams.work_after(event)
            verifier.landed_many([(offsets[i], headers[i], lease) for i, lease in group], event)
            _stamp("objects landed, digests queued")

        def on_batch() -> None:
            with land_lock:
                if not armed:
                    return
                try:
                    flush()
                except BaseException as exc:
                    failures.append(exc)

        def on_chunk(j, chunk, lo, hi):
            # With ``per_chunk`` (never with ``READS_FIRST``) each chunk's copy is queued from the
            # engine's completion thread as the chunk lands: one driver call where the tier's
            # buffers are page-locked (a copy through torch, under a stream context, made that
            # thread slow enough to hold back the reads themselves: tools/probe_read_factors.py),
            # torch's copy otherwise.
            if stopped:
                return
            off = offsets[missing[j]]
            chunk_handle = copy_handle if CHUNK_DRIVER_COPIES else None
            if chunk_handle is not None and _driver.copy_htod(base + off + lo, chunk.data_ptr(), chunk.numel(),
                                                              chunk_handle):
                return
            with streams.on_copy():  # a raise here fails that object's load (on_done gets it)
                buffer[off + lo: off + hi].copy_(chunk, non_blocking=True)

        def on_done(j, lease, error):
            when = time.perf_counter()
            i = missing[j]
            with land_lock:
                if error is not None:
                    failures.append(error)
                    stopped.append(True)
                elif not stopped and not failures:
                    if not armed:
                        parked.append((i, lease, when))
                    else:
                        try:
                            land(i, lease, when)
                        except BaseException as exc:
                            failures.append(exc)
                settled.append((i, lease, error))
                last = len(settled) == len(missing)
            if last:
                all_settled.set()

        def start_reads() -> None:
            """Every chunk of every missing object queued on the tier's reader, in order."""
            nonlocal read_start, all_settled, pending, reads_started
            read_start = time.perf_counter()
            all_settled = threading.Event()
            pending = len(missing)
            reads_started = True
            tier.start_loads([targets[i].key for i in missing], model_fingerprint=model_fingerprint,
                             headers=[headers[i] for i in missing], on_chunk=on_chunk if per_chunk else None,
                             on_done=on_done, on_batch=on_batch if BATCH_LANDINGS else None)
            _stamp("reads queued")

        if ready is not None:
            headers = [lease.header for lease in leases]
            lean, streams = True, _CallerStream(device)
        else:
            # Resident objects are leased here, on this thread: no read and no thread hop.
            leases[:] = tier.acquire_resident_many(keys, model_fingerprint=model_fingerprint)
            headers = [lease.header if lease is not None else store.read_header(t.key)
                       for lease, t in zip(leases, targets)]
            for lease, h in zip(leases, headers):
                if lease is None:  # resident ones were checked when leased
                    check_fingerprint(h, model_fingerprint)
            _stamp("leased")
            offsets, total = _layout_offsets(headers)
            missing[:] = [i for i in range(n) if leases[i] is None]
            if READS_FIRST and missing and not per_chunk:
                # the reads go out now, before the staging buffer, streams and checks below are made
                # (landings until then are parked); a placement that cannot work costs no read
                if cache is not None:
                    _check_placement(targets, headers, rope)
                start_reads()
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            base = buffer.data_ptr()
            _stamp("staging allocated")
            # nothing to read and nothing to hash (all trusted): nothing to overlap, one stream serves;
            # digests of several objects run side by side on separate streams, so they keep _Streams
            lean = device.type == "cuda" and all(
                lease is not None and (verify == "none" or (trust_verified and lease.verified)) for lease in leases)
            streams = _CallerStream(device) if lean else _Streams(device)
            early = 0  # objects whose copy is already queued
            if lean and n:  # the DMA starts with the first object's copy, before the others' are arranged
                addr, pinned = leases[0].payload_memory()
                early = int(pinned and _driver.copy_htod(base + offsets[0], addr, headers[0].padded_length,
                                                         streams.copy_handle()))
            _stamp("first copy queued")
        # 1. Resident objects: their copies go first, so the DMA runs while everything below is done.
        resident = [i for i in range(n) if leases[i] is not None]
        resident_event = None
        if resident:
            handle = streams.copy_handle()
            with streams.on_copy():
                # pinned payloads: the driver's copies, all in one compiled call where it serves
                # (torch's copy_ costs several times more); the others (and any the driver
                # refused) through torch, in order after them
                rows = []
                if handle is not None:
                    for i in resident[early:]:
                        addr, pinned = leases[i].payload_memory()
                        if not pinned:
                            break
                        rows.append((base + offsets[i], addr, headers[i].padded_length))
                queued = early + (_driver.copies_htod(np.array(rows, dtype=np.int64), len(rows), handle)
                                  if rows else 0)
                for i in resident[queued:]:
                    off, nbytes = offsets[i], headers[i].padded_length
                    buffer[off: off + nbytes].copy_(leases[i].payload, non_blocking=True)
            resident_event = streams.copied()  # one event fences every resident buffer
            _stamp("resident copies issued")
            for i in resident:
                leases[i].fence(resident_event)
        # (checks that need no data come after the copies: the DMA is running meanwhile)
        if cache is not None and not reads_started:
            _check_placement(targets, headers, rope)
        placing = dict(cache=cache, layout=layout, rope=rope, k_scale=k_scale, backend=backend, streams=streams)
        if lean:  # nothing to read or check: prepare, launch, then the bookkeeping while the GPU works
            placement = None
            tp = time.perf_counter()
            placed = cache is not None and _place_now(buffer, offsets, targets, headers, **placing)
            if placed:
                prepare_s = time.perf_counter() - tp
                _stamp("placement launched")
            else:
                placement, prepare_s = _timed_placement(buffer, offsets, targets, headers, **placing)
                if placement is not None:
                    placement.run()
                    _stamp("placement launched")
            report = _new_report(device, engine)
            report.placed = placed or placement is not None
            # every object trusted (or not to be checked): no digest, so no root tables (objects=0)
            verifier = _Verifier(verify, buffer, hash_backend, streams, trust_verified=trust_verified, objects=0)
            for i in range(n):
                sources["hit"] = sources.get("hit", 0) + 1
                report.bytes_moved += headers[i].padded_length
                verifier.landed(offsets[i], headers[i], lease=leases[i], event=resident_event)
                # every copy from the tier's buffers is queued and fenced (resident_event): the
                # leases can go before the wait (a buffer is reused only after its fence)
                leases[i].release()
                leases[i] = None
            verify_s = 0.0
            result = RestoreResult(report, buffer, offsets, headers, placement and placement.kvs)
            _stamp("bookkept")
            if ready is not None and SPARE_STAGING:  # the host waits for the device below anyway
                _stock_spare(device, index, stream, total)
            streams.sync()
            _stamp("synced")
            return _finish_report(result, tier, sources, o_direct_flags, io_notes, verifier, engine, device, landed,
                                  read_start, read_end, verify_s, prepare_s, t0)
        report = _new_report(device, engine)
        _stamp("report made")
        # 2. Missing objects: every chunk of every one is queued on the tier's reader (here, or
        # already after the headers with READS_FIRST), in order; the thread that finishes an object
        # (the tier reports it done after all its chunk callbacks returned) queues its copy at once
        # (`land`), and after each group of landings the reader reports together it fences them and
        # queues their digest (`flush`), while the other reads go on: no hop to this thread sits
        # between an object's last byte and its digest.
        verifier = _Verifier(verify, buffer, hash_backend, streams, trust_verified=trust_verified, objects=n)
        _stamp("placement checked")
        # A read object's bytes go to the GPU in one driver copy from the completion thread once its
        # last chunk has landed (``OBJECT_COPIES``), or chunk by chunk as they land (``on_chunk``).
        copy_handle = streams.copy_handle() if tier.pool.pin and (OBJECT_COPIES or CHUNK_DRIVER_COPIES) else None
        if reads_started:  # landings that came before this point were parked: take them now
            with land_lock:
                armed.append(True)
                try:
                    if not (stopped or failures):
                        for i, lease, when in parked:
                            land(i, lease, when)
                        flush()
                    parked.clear()  # (their leases are in `settled`: released with the others)
                except BaseException as exc:
                    failures.append(exc)
            _stamp("landings armed")
        elif missing:
            armed.append(True)
            start_reads()
        # 3. While the bytes move: the placement (validation and launch tables).
        placement, prepare_s = _timed_placement(buffer, offsets, targets, headers, **placing)
        if resident:
            with land_lock:
                # Digests and placement read the resident objects only after their copies.
                streams.work_after(resident_event)
                for i in resident:
                    sources["hit"] = sources.get("hit", 0) + 1
                    report.bytes_moved += headers[i].padded_length
                verifier.landed_many([(offsets[i], headers[i], leases[i]) for i in resident], resident_event)
        if pending:  # every load's lease, so that each is released whatever happened
            all_settled.wait()
            pending = _take_leases(settled, leases)
            with land_lock:  # landings no reading thread has queued yet (none when it kept up)
                try:
                    flush()
                except BaseException as exc:
                    failures.append(exc)
        failure = failures[0] if failures else None
        if failure is not None:
            raise failure
        _stamp("loads settled")
        # The placement behind a device comparison of the roots where it can be (it writes nothing
        # unless all match), so that it follows the last digest on the device, not the host's
        # comparison; otherwise it is launched once the host has compared.
        gated = placement is not None and verifier.gate(placement.launch)
        if gated:
            placement.run()
            _stamp("placement launched behind the gate")
        verify_s, bad = verifier.finish()
        _stamp("roots compared")
        if bad:
            for key in bad:
                tier.evict(key)  # retention must not keep bytes that failed their check
            raise _integrity_failure(bad)
        verifier.mark_verified("host_staging")
        _stamp("verified")
        if placement is not None:
            if not gated:
                placement.run()
                _stamp("placement launched")
            report.placed = True
        result = RestoreResult(report, buffer, offsets, headers, placement and placement.kvs)
        streams.join()
        streams.sync()
        _stamp("synced")
    finally:
        with land_lock:  # no landing runs past this point: later ones see `stopped`
            stopped.append(True)
        if streams is not None:
            streams.join()
        if verifier is not None:
            verifier.settle()
        # Loads still in flight after an early error: take their leases so every one is released.
        drained = bool(pending)
        if pending:
            all_settled.wait()
            pending = _take_leases(settled, leases)
        if drained and streams is not None and streams.copy is not None:
            # chunk copies issued by reading threads before they saw `stopped`: the caller's stream
            # (which frees `buffer`) waits for them too
            streams.caller.wait_stream(streams.copy)
        for lease in leases:
            if lease is not None:
                lease.release()
        if own_tier:
            tier.close()
    return _finish_report(result, tier, sources, o_direct_flags, io_notes, verifier, engine, device, landed,
                          read_start, read_end, verify_s, prepare_s, t0)


def _take_leases(settled: list, leases: list) -> int:
    """Every settled load's lease into ``leases`` (its release is the caller's); returns 0 (none pending)."""
    for i, lease, error in settled:
        if error is None:
            leases[i] = lease
    return 0


def _timed_placement(buffer, offsets, targets, headers, *, cache, **kwargs) -> tuple:
    """``(the prepared _Placement, seconds it took)``; ``(None, 0.0)`` without a cache to place into."""
    if cache is None:
        return None, 0.0
    tp = time.perf_counter()
    placement = _Placement(buffer, offsets, targets, headers, cache=cache, **kwargs)
    seconds = time.perf_counter() - tp
    _stamp("placement prepared")
    return placement, seconds


def _new_report(device: torch.device, engine) -> RouteReport:
    return RouteReport(route="host_staging", mechanism="", device=str(device), io_engine=engine.engine,
                       notes=[f"reads: {engine.description}"])


def _finish_report(result: RestoreResult, tier: HostTier, sources: dict, o_direct_flags: set, io_notes: set,
                   verifier: "_Verifier", engine, device: torch.device, landed: list, read_start, read_end,
                   verify_s: float, prepare_s: float, t0: float) -> RestoreResult:
    """The host-staging report's facts, filled in after the restore's wait (``restore_s`` ends here)."""
    end = time.perf_counter()
    _stamp("end")
    report = result.report
    n = len(result.headers)
    report.objects = n
    report.tier_sources = sources
    report.pinned = tier.pin
    report.o_direct = (o_direct_flags == {True}) if o_direct_flags else None
    report.notes += sorted(io_notes)
    report.verification = verifier.description
    report.verified = dict(verifier.counts)
    cfg = tier.config
    # With reads queued in object order, objects land one after another and each digest overlaps
    # the later reads; ~equal times mean the disk served all objects' chunks together.
    report.facts["loads_done_s"] = landed
    report.facts["io"] = {"engine": engine.engine, "engine_note": engine.engine_note, "chunk_bytes": cfg.chunk_bytes,
                          "queue_depth": cfg.read_threads, "submission": "every chunk of every object at once, "
                          "in object order (no thread per object)"}
    dst = "cudaMemcpyAsync H2D on a copy stream" if device.type == "cuda" else "host memcpy (no GPU)"
    staging = "pinned host RAM" if tier.pin else "pageable host RAM"
    if sources.get("read") and not tier.store.local:
        report.facts["io"] = {"engine": "pyarrow.fs", "filesystem": tier.store.filesystem.type_name,
                              "submission": "one read per object on the tier's loader threads"}
        report.mechanism = (f"reads through pyarrow.fs ({tier.store.filesystem.type_name}), one per object "
                            f"-> {staging} -> {dst}, one copy per object")
    elif sources.get("read"):
        how = "O_DIRECT reads" if report.o_direct else "page-cache reads (O_DIRECT unavailable)"
        copies = "one copy per object as its last chunk lands" if OBJECT_COPIES else "chunk by chunk as reads land"
        report.mechanism = (f"{how} through {engine.description}, {cfg.chunk_bytes >> 10} KiB chunks "
                            f"-> {staging} -> {dst}, {copies}")
    else:
        report.mechanism = f"host tier ({staging}, retained) -> {dst}, one copy per object"
    report.timings = {"read_s": (read_end - read_start) if read_end is not None else 0.0, "verify_s": verify_s,
                      "prepare_s": prepare_s, "tail_s": (end - read_end) if read_end is not None else 0.0,
                      "restore_s": end - t0}
    return result


def _copy_into(buffer: torch.Tensor, offset: int, lease, streams: _Streams, handle: int | None = None) -> None:
    """One async copy of a leased payload into ``buffer[offset:]`` on the copy stream (the caller
    records the event that fences it). ``handle``: the copy stream's raw handle, for one driver call
    where the payload is page-locked (torch's copy otherwise, or where the driver refuses)."""
    addr, pinned = lease.payload_memory() if handle is not None else (0, False)
    if not (pinned and _driver.copy_htod(buffer.data_ptr() + offset, addr, lease.header.padded_length, handle)):
        payload = lease.payload
        with streams.on_copy():
            buffer[offset: offset + payload.numel()].copy_(payload, non_blocking=True)


def restore(route: str, store: SegmentStore, targets, **kwargs) -> RestoreResult:
    """Dispatch to :func:`restore_host_staging` (``route="host_staging"``) or :func:`restore_direct`."""
    if route == "host_staging":
        return restore_host_staging(store, targets, **kwargs)
    if route == "direct":
        kwargs.pop("tier", None)
        kwargs.pop("trust_verified", None)  # nothing is resident on the direct route
        return restore_direct(store, targets, **kwargs)
    raise ValueError(f"route: expected one of {ROUTES}, got {route!r}")


from .direct_route import direct_facts, restore_direct  # noqa: E402  (it builds on the helpers above)

__all__ = ["ROUTES", "RestoreTarget", "RouteReport", "RestoreResult", "restore", "restore_host_staging",
           "restore_direct", "direct_facts"]
