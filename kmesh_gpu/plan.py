"""Placement into one paged cache, prepared once and launched many times: :class:`PlacementPlan`.

A plan binds a destination cache (one tensor, or a list of per-layer tensors as vLLM allocates
them), its :class:`KVLayout` and an optional :class:`RopeSpec`; the cache is checked once, and what
every placement into it shares (layer addresses, alignment, bounds, the kernels' constant tables and
packed launch arguments) is worked out once. Then, per placement:

* :meth:`PlacementPlan.prepare` validates the segments and index arrays and returns a
  :class:`Launch` whose tables are uploaded; :meth:`Launch.run` submits the one launch (and
  :meth:`Launch.gate` can queue a device-side verdict ahead of it);
* :meth:`PlacementPlan.place` prepares and launches in one step (on CUDA, one compiled call);
* :meth:`PlacementPlan.gather` reads slots back into a ``(2, L, T, H, D)`` tensor.

One preparation serves every backend. Where the run kernel applies (``"cupy"``, 16-byte aligned
rows), the compiled builder (:mod:`._host_tables`) checks the slots and positions and writes the
run table in one pass; on CUDA the table is uploaded (and with :meth:`PlacementPlan.place` the
kernel launched) by compiled driver calls from a page-locked ring (:mod:`._table_ring`). Anything
else (the per-token kernels, the ``"warp"`` and ``"torch"`` backends, slots the builder refuses) is
checked with NumPy, which names the offending argument, and tabulated per token. All paths give
identical bits.

Ownership: a plan keeps a reference to the cache it was made for and to nothing else of the
caller's; a :class:`Launch` keeps the segments it reads and its tables alive until it is dropped
(the device tables are torch allocations on the current stream, whose allocator orders their reuse
after the launch). Nothing here synchronises a stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import cuda
from ._checks import _cache_layers, _check_args, _check_values, _fmt, _Item, _k_scale
from ._facts import _facts
from ._host_tables import RUN_COLS, RUN_LEN_COL
from ._inputs import _fill, _indices, _Index, _sources, _Sources
from ._place_torch import torch_run
from ._tables import _consts, _i64, _tok_tables, _token_index
from .errors import BackendError, LayoutError
from .layout import KVLayout
from .rope import RopeSpec

__all__ = ["KernelShape", "PlacementPlan", "Launch", "StagedSegments", "CompiledLaunch"]


@dataclass(frozen=True)
class KernelShape:
    """Compile-time shape of the placement kernels (``csrc/place.cu``); the defaults are the
    measured best on the H200 (docs/perf-history.md). Tools that sweep a shape pass another.

    Attributes:
        run_kernel: use ``kmesh_place_runs`` where it applies (``False``: the per-token kernels).
        run_groups: pair groups per lane in the run kernel.
        run_heads: heads per load batch in the run kernel.
        run_vectors: 16-byte vectors in flight per lane on plain rows.
        run_kv_fused: a warp moves K and V of its run layer by layer (else K and V in separate warps).
        run_units: warps that fill the GPU before a warp takes several layers.
        vec_per: chunks of 8 elements per lane in ``kmesh_place_vec``.
        vec_layers: layers per lane in ``kmesh_place_vec``.
    """

    run_kernel: bool = True
    run_groups: int = 1
    run_heads: int = 2
    run_vectors: int = 4
    run_kv_fused: bool = True
    run_units: int = 4096
    vec_per: int = 2
    vec_layers: int = 4

    def __post_init__(self):
        # checked here, not as a ZeroDivisionError at a first launch or a kernel that does not compile
        for name in ("run_kernel", "run_kv_fused"):
            if type(getattr(self, name)) is not bool:
                raise LayoutError(f"shape.{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("run_groups", "run_heads", "run_vectors", "run_units", "vec_per", "vec_layers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise LayoutError(f"shape.{name}: expected an int >= 1, got {value!r}")


@dataclass(frozen=True)
class StagedSegments:
    """Segments laid out in one byte buffer (a restore's staging buffer): segment ``i`` is a dense
    ``(2, L, token_counts[i], H, D)`` array of ``dtype`` starting ``offsets[i]`` bytes into
    ``buffer`` (``uint8[M]``, contiguous, on the cache's device; every segment's address a multiple
    of the dtype's size). Placing from it builds no tensor view per segment; every segment is checked
    to lie inside the buffer."""

    buffer: torch.Tensor
    offsets: tuple
    token_counts: tuple
    dtype: torch.dtype

    def views(self, layout: KVLayout) -> list[torch.Tensor]:
        """Each segment as a ``(2, L, T, H, D)`` tensor view of the buffer."""
        L, _, H, _, D = layout.sizes
        size = self.dtype.itemsize
        typed = self.buffer.view(self.dtype) if self.buffer.numel() % size == 0 else None
        out = []
        for o, t in zip(self.offsets, self.token_counts):
            n = 2 * L * t * H * D
            if typed is not None:
                out.append(typed[o // size:o // size + n].view(2, L, t, H, D))
            else:
                out.append(self.buffer[o:o + n * size].view(self.dtype).view(2, L, t, H, D))
        return out


@dataclass(frozen=True)
class CompiledLaunch:
    """What a compiled loop of its own needs to build, upload and launch the run kernel into a
    plan's cache without Python (the cache service's shared-memory channel): the device, the
    cache's storage dtype, ``kernel`` = int64 ``(CUfunction, warps per run, warps to fill the GPU,
    argument count)``, ``template`` = the packed launch arguments (per-launch ones 0, then as many
    scratch slots), ``params`` = the run builder's constants (``PARAMS`` order), the layers'
    addresses and the cache's ``(L, H, D)``. Read-only arrays."""

    device_index: int
    storage_dtype: torch.dtype
    kernel: np.ndarray
    template: np.ndarray
    params: np.ndarray
    layer_base: np.ndarray
    kv_shape: tuple


# --------------------------------------------------------------------------- the plan
class PlacementPlan:
    """Placement of saved K/V segments into one paged cache (see the module docstring).

    Args:
        cache: the paged cache described by ``layout``: a tensor whose memory holds
            ``layout.extent`` elements from its first element, or a list of ``L`` per-layer tensors
            (the layer stride then does not apply). vLLM's own tensors of the layout are accepted.
        layout: the cache's :class:`KVLayout`.
        rope: the model's :class:`RopeSpec`; with it, K is shifted from each segment's old
            positions to its new ones (fp32, one rounding). ``None`` copies K and V unchanged.
        backend: ``"auto"``, ``"torch"`` (reference), ``"warp"`` (CPU and CUDA) or ``"cupy"`` (CUDA).
        shape: the kernels' :class:`KernelShape`.

    Raises :class:`LayoutError` (naming the argument) for a cache that does not fit ``layout`` or a
    RoPE spec of another head size or dtype, :class:`BackendError` for an unavailable backend.
    """

    __slots__ = ("cache", "layout", "rope", "_f")

    def __init__(self, cache, layout: KVLayout, *, rope: RopeSpec | None = None, backend: str = "auto",
                 shape: KernelShape = KernelShape()):
        _check_args(layout, rope, None, None, positions_follow=False)
        if not isinstance(shape, KernelShape):
            raise LayoutError(f"shape: expected a KernelShape, got {type(shape).__name__}")
        self.cache, self.layout, self.rope = cache, layout, rope
        self._f = _facts(cache, layout, rope, backend, shape)

    @property
    def device(self) -> torch.device:
        return self._f.device

    @property
    def backend(self) -> str:
        """The backend this plan launches with (``"auto"`` resolved)."""
        return self._f.backend

    # ------------------------------------------------------------------ public operations
    def prepare(self, segments, slots, *, old_positions=None, new_positions=None, k_scale=None) -> "Launch":
        """Validate a placement and build its launch (tables uploaded on the current stream).

        Args:
            segments: a list of ``(2, L, T_i, H, D)`` tensors in the cache dtype (fp8 e4m3 as uint8
                or float8_e4m3fn), contiguous, on the cache's device, keys post-RoPE at their old
                positions; or a :class:`StagedSegments`. They must not share memory with the cache.
            slots: per segment an ``int64[T_i]`` tensor of destination slots in
                ``[-1, num_blocks * block_size)`` (-1 skips a token), or one ``int64[sum T_i]`` array
                (tensor or ndarray) of all segments' slots in order. No slot twice.
            old_positions, new_positions: the same forms, required with a RoPE spec, each value in
                ``[0, rope.num_positions)`` (a skipped token's are not read).
            k_scale: fp8 caches with RoPE only: the K scale (a float or float32[L]); K is dequantised
                with it, rotated and requantised with it. V is always copied bit for bit.

        Nothing is written by a refused call (:class:`LayoutError` naming the argument).
        """
        return self._prepare(segments, slots, old_positions, new_positions, k_scale)

    def _prepare(self, segments, slots, old_positions, new_positions, k_scale, labels=None) -> "Launch":
        """:meth:`prepare`; ``labels``: each segment's index in the caller's call, which errors name
        (``place_many`` splits a call over several caches into one plan each)."""
        f = self._f
        rope = self.rope
        if rope is None and (old_positions is not None or new_positions is not None):
            raise LayoutError("old_positions/new_positions: given without rope; make the plan with rope= to shift keys")
        if rope is not None and (old_positions is None or new_positions is None):
            raise LayoutError("old_positions/new_positions: both are required when the plan has a RoPE spec")
        src = _sources(f, segments, gather=False, labels=labels)
        sl = _indices("slots", slots, src.counts, labels)
        old = _indices("old_positions", old_positions, src.counts, labels) if rope is not None else None
        new = _indices("new_positions", new_positions, src.counts, labels) if rope is not None else None
        scale = self._scale(k_scale)
        return self._launch(src, sl, old, new, scale, gather=False)

    def place(self, segments, slots, *, old_positions=None, new_positions=None, k_scale=None) -> None:
        """:meth:`prepare` and :meth:`Launch.run` in one step: on CUDA with the run kernel one compiled
        call gathers the indices into a fenced page-locked region, checks them, builds and uploads
        the run table and launches the kernel on the current stream."""
        if k_scale is None and self._place_in_one_call(segments, slots, old_positions, new_positions):
            return
        self.prepare(segments, slots, old_positions=old_positions, new_positions=new_positions,
                     k_scale=k_scale).run()

    def gather(self, slots: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``slots`` (int64[T]; -1 gives zeros) back into a ``(2, L, T, H, D)`` tensor (keys as
        stored: no shift, whatever the plan's RoPE spec). ``out`` may supply the destination
        (contiguous, cache dtype, cache device); it must not share memory with the cache."""
        f = self._f
        layout = self.layout
        T = slots.shape[0] if isinstance(slots, torch.Tensor) and slots.dim() == 1 else -1
        if T < 0:
            raise LayoutError(f"slots: expected int64[T], got {slots!r}")
        L, _, H, _, D = layout.sizes
        given = out is not None
        if out is None:
            out = torch.zeros((2, L, T, H, D), dtype=layout.dtype, device=f.device)
        elif isinstance(out, torch.Tensor) and out.dim() == 5 and out.shape[2] != T:
            raise LayoutError(f"out: expected (2, L, T={T}, H, D) for {T} slots, got {_fmt(out)}")
        src = _sources(f, [out], gather=True)
        sl = _indices("slots", [slots], src.counts)
        launch = self._launch(src, sl, None, None, None, gather=True)  # validates: a refused call writes nothing
        if given:  # skipped tokens come back as zeros, as with a new tensor
            skipped = np.flatnonzero(sl.host() < 0)
            if skipped.size:
                src.kvs[0].index_fill_(2, torch.from_numpy(skipped).to(out.device), 0)
        launch.run()
        return out

    def compiled_launch(self) -> CompiledLaunch | None:
        """The constants of this plan's run-kernel launch for a compiled loop of the caller's own
        (:class:`CompiledLaunch`), or ``None`` where it does not apply (no CUDA driver or Numba, not
        the ``"cupy"`` backend, a layout or RoPE spec the run kernel does not serve, fp8)."""
        single = self._single()
        if not single:
            return None
        _, dev_id, want, kernel, template, params, _, _ = single
        f = self._f
        return CompiledLaunch(dev_id, want, kernel, template, params, f.layer_base, f.kv_shape)

    # ------------------------------------------------------------------ internals
    def _scale(self, k_scale):
        layout = self.layout
        if layout.storage_dtype == torch.uint8:
            return _k_scale(k_scale, layout.num_layers) if self.rope is not None else None
        if k_scale is not None:
            raise LayoutError("k_scale: only meaningful for fp8 (uint8) caches")
        return None

    def _launch(self, src: _Sources, sl: _Index, old, new, scale, *, gather: bool) -> "Launch":
        f = self._f
        if sum(src.counts) == 0:
            return Launch(self, None, src, None, None, gather=gather)
        cap = f.gather_cap if gather else f.cap
        if cap and src.bits % 16 == 0:
            launch = self._run_launch(src, sl, old, new, scale, cap, gather=gather)
            if launch is not None:
                return launch
        return self._token_launch(src, sl, old, new, scale, gather=gather)

    def _run_launch(self, src: _Sources, sl: _Index, old, new, scale, cap: int, *, gather: bool):
        """The run kernel's launch, its table built by the compiled builder; ``None`` where the
        builder declines (the per-token path then checks, names any error, or serves)."""
        f = self._f
        L, T = f.kv_shape[0], sum(src.counts)
        consts = f.consts if scale is None else _consts(self.layout, self.rope, scale, f.device)
        starts = _token_index(src.counts, f.row)[0]
        params = f.run_params(cap)
        ptrs = _i64(src.ptrs)
        rope = old is not None
        runs_at = L + 3 * T
        n64 = runs_at + T * RUN_COLS
        # [layer bases L | old, new positions 2 x T | slots T | runs R x RUN_COLS], sized for the most runs (T)
        jit = cuda.compiled_driver() if f.cuda else None
        ring = f.table_ring() if jit is not None and _current_device() == f.device.index else False
        got = ring.reserve(8 * n64) if ring else None
        if got is not None:  # compiled build and upload from a fenced region of the device's ring
            offset, event = got
            o = offset // 8
            h, t64 = ring.a64[o:o + n64], ring.t64[o:o + n64]
            _fill(h, t64, f.layer_base, sl, old, new, L, T)
            dev = torch.empty(n64, dtype=torch.int64, device=f.device)
            p = dev.data_ptr()
            stream = cuda.current_stream(f.device.index)
            module, fns = jit
            R = module.build_upload(fns, h[L + 2 * T:runs_at], starts, ptrs, params, h[L:L + 2 * T] if rope else h[:0],
                                    h[runs_at:].reshape(T, RUN_COLS), runs_at, ring.base + offset, p, stream,
                                    event.cuda_event)
            if R == module.RECORD_REFUSED:  # the upload is queued but unfenced: wait, the region is then free
                if not cuda.stream_synchronize(stream):
                    torch.cuda.current_stream(f.device).synchronize()
                return None
            if R < 0 or R == 0:
                ring.cancel(offset)  # nothing was queued from the region
            if R == 0:
                return Launch(self, None, src, None, None, gather=gather)
            if R < 0 and R != module.COPY_REFUSED:
                return None
            if R > 0:
                return self._built(src, dev, p, runs_at, R, T, consts, gather=gather)
        from .compiled import build_runs  # the build on the host, uploaded by torch

        host = torch.empty(n64, dtype=torch.int64, pin_memory=f.cuda)
        h = host.numpy()
        _fill(h, host, f.layer_base, sl, old, new, L, T)
        R = build_runs(h[L + 2 * T:runs_at], starts, ptrs, params, not gather, h[L:L + 2 * T] if rope else h[:0],
                       h[runs_at:].reshape(T, RUN_COLS))
        if R == 0:
            return Launch(self, None, src, None, None, gather=gather)
        if R < 0:
            return None
        dev = host[:runs_at + R * RUN_COLS].to(f.device, non_blocking=True)
        return self._built(src, dev, dev.data_ptr(), runs_at, R, T, consts, gather=gather)

    def _built(self, src, dev, p: int, runs_at: int, R: int, T: int, consts, *, gather: bool) -> "Launch":
        f = self._f
        L = f.kv_shape[0]
        tables = {"total": T, "vec16": True, "runs": R, "run_args": (p + 8 * runs_at, p + 8 * L, p, R),
                  "buffer": dev, "cos_sin": consts[0], "fp8_table": consts[1], "k_scale": consts[2]}
        if not gather and consts is f.consts and f.cuda and cuda.compiled_driver() is not None:
            tables["driver_launch"] = self._driver_launch(p, runs_at, R, T)
        return Launch(self, tables, src, None, None, gather=gather)

    def _driver_launch(self, p: int, runs_at: int, R: int, T: int):
        """The run kernel's launch through one compiled driver call: the plan's packed arguments
        with this launch's table addresses, sizes and grid; ``None`` where CuPy must launch."""
        f = self._f
        if f.template is None:
            from . import _place_cupy

            f.template = _place_cupy.driver_template(self.layout, f.device.index, self.rope, f.consts,
                                                     f.shape) or False
        if f.template is False:
            return None
        fn, per_run, _, template, n = f.template
        L = f.kv_shape[0]
        # enough warps to fill the GPU before a warp takes several layers (as _place_cupy._runs_call)
        groups = min(L, max(1, -(-f.shape.run_units // (per_run * R))))
        lg = -(-L // groups)
        units = per_run * R * (-(-L // lg))
        args = template.copy()
        args[0], args[1], args[2], args[3], args[4], args[6] = p + 8 * runs_at, p + 8 * L, p, R, T, lg
        return fn, np.array([-(-units // 8), 1, 1], dtype=np.int64), _BLOCK, args, n, f.device.index

    def _token_launch(self, src: _Sources, sl: _Index, old, new, scale, *, gather: bool) -> "Launch":
        """Every index checked with NumPy (each error names its argument) and the per-token tables
        built (or the torch reference's items)."""
        f = self._f
        layout, rope = self.layout, self.rope if not gather else None
        all_slots = sl.host()
        all_old = old.host() if old is not None else None
        all_new = new.host() if new is not None else None
        kvs = src.tensors(layout) if f.backend == "torch" else None
        items, pos = [], 0
        for i, c in enumerate(src.counts):
            item = _Item(kvs[i] if kvs is not None else None, 0, all_slots[pos:pos + c], None, None)
            if all_old is not None:
                item.old, item.new = all_old[pos:pos + c], all_new[pos:pos + c]
            items.append(item)
            pos += c
        _check_values(items, layout, rope, all_slots, all_old, all_new, check_duplicates=not gather, labels=src.labels)
        if f.backend == "torch":
            return Launch(self, None, src, items, scale, gather=gather)
        if not f.tokens_ok:
            raise LayoutError("layout: K and V layer strides differ; the cupy and warp kernels address one layer "
                              "base per layer (use backend='torch')")
        tables = _tok_tables(_i64(src.ptrs), src.counts, f.layer_base, all_slots, all_old, all_new, layout, rope,
                             scale, f.device)
        return Launch(self, tables, src, None, scale, gather=gather)

    def _single(self):
        """The one-call placement's constants (made once), or ``False``."""
        f = self._f
        if f.single is None:
            f.single = False
            jit = cuda.compiled_driver() if f.cuda and f.cap and f.layout.storage_dtype != torch.uint8 else None
            ring = f.table_ring() if jit is not None else False
            mirror = ring.device_mirror(f.device) if ring else 0
            if mirror:
                from . import _place_cupy

                found = _place_cupy.driver_template(self.layout, f.device.index, self.rope, f.consts, f.shape)
                if found is not None:
                    fn, per_run, _, template, count = found
                    kernel = np.array([fn, per_run, f.shape.run_units, count], dtype=np.int64)
                    kernel.setflags(write=False)
                    f.single = (jit, f.device.index, self.layout.storage_dtype, kernel, template,
                                f.run_params(f.cap), ring, mirror)
        return f.single

    def _place_in_one_call(self, segments, slots, old_positions, new_positions) -> bool:
        """:meth:`place` by one compiled call (``_driver_jit.place_now``); ``False`` where it does not
        apply or declines, with nothing queued (the caller prepares and runs, which names any error)."""
        f = self._f
        if not f.cap or not f.cuda:
            return False
        single = f.single if f.single is not None else self._single()
        if not single or _current_device() != f.device.index:
            return False
        (module, fns), dev_id, want, kernel, template, params, ring, mirror = single
        try:
            src = _sources(f, segments, gather=False)
        except LayoutError:
            return False
        T = sum(src.counts)
        if not T or src.bits % 16:
            return False
        starts = _token_index(src.counts, f.row)[0]
        try:
            kinds = [_indices("slots", slots, src.counts)]
            if self.rope is not None:
                if old_positions is None or new_positions is None:
                    return False
                kinds = [_indices("old_positions", old_positions, src.counts),
                         _indices("new_positions", new_positions, src.counts)] + kinds
            elif old_positions is not None or new_positions is not None:
                return False
        except LayoutError:
            return False
        srcs = []
        for kind in kinds:
            at = kind.addresses(starts)
            if at is None:
                return False
            srcs += at
        L = f.kv_shape[0]
        got = ring.reserve(8 * (L + 10 * T))
        if got is None:
            return False
        offset, event = got
        stream = cuda.current_stream(dev_id)
        R = module.place_now(fns, _i64(srcs), f.layer_base, starts, _i64(src.ptrs), params, ring.a64, offset // 8,
                             ring.base + offset, mirror + offset, stream, event.cuda_event, kernel, template)
        if R > 0:
            return True
        if R == module.UNFENCED or R == module.LAUNCH_REFUSED:  # queued work reads the region: wait, it is then free
            if not cuda.stream_synchronize(stream):
                torch.cuda.current_stream(f.device).synchronize()
        ring.cancel(offset)
        return R == module.UNFENCED or R == 0


_BLOCK = np.array([256, 1, 1], dtype=np.int64)


def _current_device() -> int:
    return torch.cuda.current_device()


_GATES: dict = {}  # device index -> kmesh_gate_runs (csrc/gate.cu) as a CuPy Function


class Launch:
    """A validated placement with its tables uploaded; :meth:`run` submits its one launch on the
    current stream of the cache's device. Benchmarks time :meth:`run` alone to separate the kernel
    from validation and table building. ``uses_run_kernel`` says which kernel it launches."""

    __slots__ = ("plan", "tables", "sources", "items", "scale", "gather")

    def __init__(self, plan: PlacementPlan, tables, sources, items, scale, *, gather: bool):
        self.plan, self.tables, self.sources, self.items, self.scale = plan, tables, sources, items, scale
        self.gather = gather

    @property
    def empty(self) -> bool:
        """Nothing to write (no tokens, or every token skipped)."""
        return self.tables is None and self.items is None

    @property
    def uses_run_kernel(self) -> bool:
        return self.tables is not None and self.tables.get("runs") is not None

    def gate(self, got: int, want: int, nbytes: int, stream: int) -> bool:
        """Queue on the raw stream ``stream``, ahead of :meth:`run` there, a comparison of the
        ``nbytes`` bytes at device addresses ``got`` and ``want`` that empties this launch's run
        table (each run's length set to 0, so the run kernel writes nothing) unless they are equal
        (``csrc/gate.cu``): a restore verifies digests on the device and queues its placement behind
        the verdict. ``True`` once queued; ``False``, with nothing queued, where this launch has no
        run table on the device or the driver refused: the caller then compares on the host first."""
        if not self.uses_run_kernel or nbytes <= 0:
            return False
        runs, _, _, count = self.tables["run_args"]
        device = self.plan.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = _GATES.get(index)
        if fn is None:
            try:
                import cupy

                from ._jit import get_kernel

                kernel = get_kernel("gate.cu", "kmesh_gate_runs", device_id=index)
                with cupy.cuda.Device(index):
                    fn = _GATES[index] = getattr(kernel, "kernel", kernel)  # the Function (its ptr)
            except (BackendError, ImportError):
                return False
        return cuda.launch(fn, (1,), (256,), stream, (got, want, nbytes, runs, count, RUN_COLS, RUN_LEN_COL))

    def run(self) -> None:
        if self.empty:
            return
        plan = self.plan
        layout, rope = plan.layout, plan.rope
        f = plan._f
        if self.items is not None:  # the torch reference
            flats, per_layer = _cache_layers(plan.cache, layout, "cache")
            kvs = self.sources.tensors(layout)
            for item, kv in zip(self.items, kvs):
                item.kv = kv
            torch_run(self.items, {0: (flats, per_layer)}, layout, rope if not self.gather else None, self.scale,
                      gather=self.gather)
            return
        tables = self.tables
        if f.backend == "cupy":
            plan_ = tables.get("driver_launch")
            if plan_ is not None and _driver_launch(plan_):
                return
            from . import _place_cupy

            _place_cupy.run(tables, layout, f.device, gather=self.gather, rope=rope if not self.gather else None,
                            shape=f.shape)
            return
        from . import _place_warp

        L, _, H, N, D = layout.sizes
        rope = rope if not self.gather else None
        _place_warp.launch(tables, layout.storage_dtype, f.device, L=L, H=H, D=D, N=N, total_tokens=tables["total"],
                           gather=self.gather, rope=rope is not None, neox=bool(rope and rope.is_neox_style),
                           rd=rope.rotary_dim if rope else 0)


def _driver_launch(plan) -> bool:
    """Launch a ``driver_launch`` plan on the current stream of its device; ``False`` when it cannot
    be launched this way (another device current, or the driver refused: nothing queued)."""
    fn, grid, block, args, count, dev_id = plan
    jit = cuda.compiled_driver()
    if jit is None or _current_device() != dev_id:
        return False
    module, fns = jit
    return module.launch(fns, fn, grid, block, cuda.current_stream(dev_id), args, count) == 0
