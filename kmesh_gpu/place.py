"""Placement of saved KV segments into paged caches (with the RoPE shift of K), and the reverse.

Public entry points validate everything before any byte is written; backends then run one launch:

* ``place``      — one segment into one cache.
* ``place_many`` — many segments into one or several caches (e.g. 4 segments x 4 children) in one launch.
* ``gather``     — read cache slots back into a ``(2, L, T, H, D)`` segment tensor (used when saving).

Backends: ``"torch"`` (reference, any device; ``_place_torch``), ``"warp"`` (CPU and CUDA;
``_place_warp``), ``"cupy"`` (CUDA, ``csrc/place.cu``; ``_place_cupy``). All give identical bits:
the fp32 shift uses one fixed operation order without fused multiply-adds (see
:mod:`kmesh_gpu.rope`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import _backend, _host_tables, _launch, _place_driver
from .errors import BackendError, LayoutError
from ._place_tables import (_RUN_COLS, RUN_LEN_COL, _align_bits, _consts, _i64, _run_table, _runs, _runs_pay,
                            _tables, _tok_tables, _token_index, _vec16)
from ._place_torch import torch_run
from .layout import KVLayout, storage_dtype
from .rope import RopeSpec


# ---------------------------------------------------------------------------------- validation
def _fmt(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def _inside(t: torch.Tensor, layout: KVLayout, per_layer: bool) -> bool:
    """Every element ``layout`` addresses from ``t``'s first element is an element of ``t``.

    A dense tensor (contiguous, or a permutation of a contiguous one) holds every element of its
    span. Otherwise (a strided view, e.g. vLLM's per-layer views of an interleaved buffer) each
    layout axis must step along one dimension of ``t`` by a whole number of its elements and stay
    inside it (a sufficient condition: no address carries into another dimension)."""
    dims = sorted(((st, n) for n, st in zip(t.shape, t.stride()) if n > 1 and st != 0), reverse=True)
    expect = 1
    for st, n in reversed(dims):
        if st != expect:
            break
        expect *= n
    else:
        return True
    first = 1 if per_layer else 0
    for strides, offset in ((layout.k_strides, layout.k_offset), (layout.v_strides, layout.v_offset)):
        use, rest = [], offset
        for st, n in dims:
            d = min(rest // st, n - 1)
            use.append(d)
            rest -= d * st
        if rest:
            return False
        for s, n in zip(strides[first:], layout.sizes[first:]):
            if n == 1:
                continue
            for i, (st, _) in enumerate(dims):
                if st <= s:
                    if s % st:
                        return False
                    use[i] += (n - 1) * (s // st)
                    break
            else:
                return False
        if any(u >= n for u, (_, n) in zip(use, dims)):
            return False
    return True


def _cache_layers(cache, layout: KVLayout, name: str) -> tuple[list[torch.Tensor], bool]:
    """Flat element views of ``cache`` (one tensor, or a list of L per-layer tensors)."""
    if isinstance(cache, torch.Tensor):
        tensors, per_layer = [cache], False
    elif isinstance(cache, Sequence) and cache and all(isinstance(c, torch.Tensor) for c in cache):
        tensors, per_layer = list(cache), True
        if len(tensors) != layout.num_layers:
            raise LayoutError(f"{name}: expected {layout.num_layers} per-layer tensors, got {len(tensors)}")
        if len({t.data_ptr() for t in tensors}) != len(tensors):
            raise LayoutError(f"{name}: two layers are given the same memory")
    else:
        raise LayoutError(f"{name}: expected a tensor or a list of per-layer tensors, got {type(cache).__name__}")
    want = layout.storage_dtype
    extent = layout.extent
    if per_layer:  # each tensor holds one layer: the layer stride does not apply
        last = [s - 1 for s in layout.sizes]
        extent = 1 + max(off + sum(a * b for a, b in zip(last[1:], st[1:]))
                         for st, off in ((layout.k_strides, layout.k_offset), (layout.v_strides, layout.v_offset)))
    flats = []
    for i, t in enumerate(tensors):
        label = name if not per_layer else f"{name}[{i}]"
        if storage_dtype(t.dtype) != want:
            raise LayoutError(f"{label}: expected dtype {layout.dtype}, got {_fmt(t)}")
        if t.device != tensors[0].device:
            raise LayoutError(f"{label}: all per-layer tensors must share one device, got {t.device}")
        # The tensor itself (not just its storage) must span the layout: a slice of a larger cache
        # is refused rather than silently addressed beyond its edges.
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        avail = min(span, t.untyped_storage().nbytes() // t.element_size() - t.storage_offset())
        if avail < extent:
            raise LayoutError(f"{label}: the layout addresses {extent} elements from its start, the tensor "
                              f"spans {avail} ({_fmt(t)}, layout {layout.name} sizes={layout.sizes})")
        # ... and hold every element it addresses: a strided view (every other layer, a slice of
        # a larger cache's blocks) spans enough memory but writes would land between its elements.
        if not _inside(t, layout, per_layer):
            raise LayoutError(f"{label}: the layout addresses elements that are not elements of the tensor "
                              f"({_fmt(t)}, strides {tuple(t.stride())}; layout {layout.name} sizes={layout.sizes})")
        flats.append(t.view(want).as_strided((extent,), (1,)))
    return flats, per_layer


def _ranges(flats: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[first byte, one past the last byte) that each flat cache view may address."""
    return [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in flats]


def _meets(a: tuple[int, int], ranges) -> bool:
    return any(a[0] < hi and lo < a[1] for lo, hi in ranges)


def _check_aliasing(items, cache_views, names: list[str], *, gather: bool) -> None:
    """Sources (``gather``: destinations) must not share memory with any destination cache, and
    distinct destination caches must not share memory: the backends read and write in different
    orders (torch copies the sources first, the kernels do not), so either would make the bits
    depend on the backend, and concurrent writes to one element race on a GPU."""
    keys = list(cache_views)
    ranges = {key: _ranges(cache_views[key][0]) for key in keys}
    for a in range(len(keys)):
        for b in range(a + 1, len(keys)):
            if any(_meets(r, ranges[keys[b]]) for r in ranges[keys[a]]):
                raise LayoutError("caches: two destination caches share memory (pass one tensor for both, "
                                  "or caches that do not overlap)")
    every = [r for key in keys for r in ranges[key]]
    for it, name in zip(items, names):
        kv = it.kv
        if kv.numel() and _meets((kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()), every):
            raise LayoutError(f"{name}: shares memory with the cache" + (" it is gathered from" if gather else
                                                                        " it is placed into; copy it first"))


def _index(name: str, x, n: int) -> torch.Tensor:
    """Validate an int64[n] index tensor's type and shape (values are checked later, for all items
    at once, where the indices live)."""
    if not isinstance(x, torch.Tensor) or x.is_meta:
        raise LayoutError(f"{name}: expected a torch int64[{n}] tensor with values, got "
                          f"{'a meta tensor' if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype != torch.int64 or x.dim() != 1 or x.shape[0] != n:
        raise LayoutError(f"{name}: expected int64[{n}], got {str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
    return x


@dataclass
class _Item:
    kv: torch.Tensor          # (2, L, T, H, D), storage dtype, contiguous
    cache_key: tuple          # identity of the destination cache
    slots: np.ndarray         # int64[T], a view of the batch's concatenated slots (host)
    old: np.ndarray | None    # int64[T] likewise
    new: np.ndarray | None


def _check_kv(name: str, kv, layout: KVLayout, device: torch.device) -> torch.Tensor:
    if not isinstance(kv, torch.Tensor):
        raise LayoutError(f"{name}: expected a tensor (2, L, T, H, D), got {type(kv).__name__}")
    L, _, H, _, D = layout.sizes
    shape = kv.shape
    if len(shape) != 5 or shape[0] != 2 or shape[1] != L or shape[3] != H or shape[4] != D:
        raise LayoutError(f"{name}: expected (2, L={L}, T, H={H}, D={D}), got {_fmt(kv)}")
    want = layout.storage_dtype
    dtype = kv.dtype
    if dtype is not want and storage_dtype(dtype) != want:
        raise LayoutError(f"{name}: expected dtype {layout.dtype} (the cache's), got {_fmt(kv)}")
    if kv.device != device:
        raise LayoutError(f"{name}: expected device {device} (the cache's), got {kv.device}")
    if not kv.is_contiguous():
        raise LayoutError(f"{name}: expected a contiguous tensor, got strides {kv.stride()}")
    # a view only where the dtype differs (fp8 as uint8): one tensor object less per item otherwise
    return kv if dtype is want else kv.view(want)


def _check_args(layout, rope, old_positions, new_positions) -> None:
    """The layout, the RoPE spec and whether positions come with it (the first checks of every call)."""
    if not isinstance(layout, KVLayout):
        raise LayoutError(f"layout: expected a KVLayout, got {type(layout).__name__}")
    if rope is not None and not isinstance(rope, RopeSpec):
        raise LayoutError(f"rope: expected a RopeSpec or None, got {type(rope).__name__}")
    if rope is None and (old_positions is not None or new_positions is not None):
        raise LayoutError("old_positions/new_positions: given without rope; pass rope= to shift keys")
    if rope is not None:
        if rope.head_size != layout.head_size:
            raise LayoutError(f"rope: head_size {rope.head_size} differs from the layout's D={layout.head_size}")
        if old_positions is None or new_positions is None:
            raise LayoutError("old_positions/new_positions: both are required when rope is given")
        if layout.storage_dtype != torch.uint8 and layout.dtype != rope.dtype:
            raise LayoutError(f"rope: dtype {rope.dtype} differs from the cache dtype {layout.dtype}")


def _prepare(kvs, caches, layout: KVLayout, slots, rope, old_positions, new_positions, k_scale, *, gather: bool,
             slots_checked: bool = False):
    _check_args(layout, rope, old_positions, new_positions)
    n = len(kvs)
    cache_views: dict[tuple, tuple[list[torch.Tensor], bool]] = {}
    items: list[_Item] = []
    raw_slots, raw_old, raw_new = [], [], []
    checked: dict[int, tuple] = {}
    device = None
    for i in range(n):
        c = caches[i]
        seen = checked.get(id(c))  # many items usually share one cache object: check it once
        if seen is None or seen[0] is not c:
            flats, per_layer = _cache_layers(c, layout, "cache" if n == 1 else f"caches[{i}]")
            key = tuple(f.data_ptr() for f in flats)
            cache_views.setdefault(key, (flats, per_layer))
            checked[id(c)] = seen = (c, key, flats)
        _, key, flats = seen
        device = device or flats[0].device
        if flats[0].device != device:
            raise LayoutError(f"caches[{i}]: all caches must be on one device ({device}), got {flats[0].device}")
        kv = _check_kv("kv" if n == 1 else f"kvs[{i}]", kvs[i], layout, device)
        T = kv.shape[2]
        sfx = "" if n == 1 else f"[{i}]"
        raw_slots.append(_index("slots" + sfx, slots[i], T))
        if rope is not None:
            raw_old.append(_index("old_positions" + sfx, old_positions[i], T))
            raw_new.append(_index("new_positions" + sfx, new_positions[i], T))
        items.append(_Item(kv, key, None, None, None))
    # Index tensors are small: they are checked and turned into launch tables on the host with
    # numpy (microseconds per operation, where torch's per-op dispatch costs more than the work).
    # CPU tensors are viewed, not copied; CUDA index tensors come over in one read each.
    all_slots = _host_cat(raw_slots)
    all_old = _host_cat(raw_old) if rope is not None else None
    all_new = _host_cat(raw_new) if rope is not None else None
    pos = 0
    for it in items:
        T = it.kv.shape[2]
        it.slots = all_slots[pos:pos + T]
        if all_old is not None:
            it.old, it.new = all_old[pos:pos + T], all_new[pos:pos + T]
        pos += T
    _check_aliasing(items, cache_views, ["out" if gather else "kv" if n == 1 else f"kvs[{i}]" for i in range(n)],
                    gather=gather)
    cache_ids = list(cache_views)
    _check_values(items, layout, rope, all_slots, all_old, all_new,
                  [cache_ids.index(it.cache_key) for it in items], check_duplicates=not gather and not slots_checked,
                  check_slots=not slots_checked)
    scale = None
    if layout.storage_dtype == torch.uint8 and rope is not None:
        scale = _k_scale(k_scale, layout.num_layers)
    elif k_scale is not None and layout.storage_dtype != torch.uint8:
        raise LayoutError("k_scale: only meaningful for fp8 (uint8) caches")
    return items, cache_views, device, scale


def _host_cat(parts: list[torch.Tensor]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.int64)
    if len(parts) == 1:
        return parts[0].detach().cpu().numpy()
    # int64 tensors never require grad, so host ones are viewed as numpy arrays directly
    if all(p.device.type == "cpu" for p in parts):
        return np.concatenate([p.numpy() for p in parts])
    # one concatenation (and at most one device read) instead of one conversion per item
    return torch.cat([p.detach() for p in parts]).cpu().numpy() if all(p.device == parts[0].device for p in parts) \
        else np.concatenate([p.detach().cpu().numpy() for p in parts])


def _check_values(items: list[_Item], layout: KVLayout, rope, all_slots, all_old, all_new, item_cache: list[int],
                  *, check_duplicates: bool, check_slots: bool = True) -> None:
    """Range checks of slots and positions and the no-duplicate-slot rule over the whole batch
    (host arrays); details are worked out only on failure. ``check_slots=False`` (with
    ``check_duplicates=False``): the caller has already proved every slot in ``[-1, num_slots)``
    and distinct within its cache; positions are still checked."""
    n, S = len(items), layout.num_slots
    if all_slots.size == 0:
        return
    bad = check_slots and bool(all_slots.min() < -1 or all_slots.max() >= S)
    valid = None
    if rope is not None and not bad:
        P = rope.num_positions
        # whole-array bounds first (the usual case); positions of skipped tokens are checked only if
        # that fails, since they are never read
        if not (all_old.min() >= 0 and all_old.max() < P and all_new.min() >= 0 and all_new.max() < P):
            valid = all_slots >= 0
            bad = bool((((all_old < 0) | (all_old >= P)) & valid).any()
                       or (((all_new < 0) | (all_new >= P)) & valid).any())
    if check_duplicates and not bad:  # two writes to one slot of one cache would race
        if valid is None:
            valid = all_slots >= 0
        ncache = max(item_cache) + 1
        if ncache == 1:
            key = all_slots[valid]
        else:
            counts = [it.kv.shape[2] for it in items]
            which = np.repeat(np.asarray(item_cache, dtype=np.int64), counts)
            key = (which * S + all_slots)[valid]
        bins = ncache * S
        if bins <= max(1 << 24, 16 * key.size):  # a byte map: O(T) writes, one O(bins) count
            seen = np.zeros(bins, dtype=np.uint8)
            seen[key] = 1
            dup = int(np.count_nonzero(seen)) != key.size
        else:
            srt = np.sort(key)
            dup = bool((srt[1:] == srt[:-1]).any())
        if dup:
            raise LayoutError("slots: the same destination slot appears more than once for one cache")
    if not bad:
        return
    for i, it in enumerate(items):  # find the first offending argument and describe it
        sfx = "" if n == 1 else f"[{i}]"
        sl = it.slots
        if sl.size and (int(sl.min()) < -1 or int(sl.max()) >= S):
            raise LayoutError(f"slots{sfx}: expected values in [-1, {S}) (num_blocks x block_size = "
                              f"{layout.num_blocks} x {layout.block_size}), got range [{int(sl.min())}, {int(sl.max())}]")
        if rope is not None:
            rope.check_positions("old_positions" + sfx, torch.from_numpy(it.old[sl >= 0]))
            rope.check_positions("new_positions" + sfx, torch.from_numpy(it.new[sl >= 0]))
    raise LayoutError("slots or positions: out of range")


def _k_scale(k_scale, L: int) -> torch.Tensor:
    if k_scale is None:
        return torch.ones(L, dtype=torch.float32)
    try:
        s = torch.as_tensor(k_scale, dtype=torch.float32).flatten().cpu()
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise LayoutError(f"k_scale: expected a positive finite float or float32[L={L}], got {k_scale!r}") from exc
    if s.numel() == 1:
        s = s.expand(L).clone()
    if s.numel() != L or not bool(torch.all(torch.isfinite(s) & (s > 0))):
        raise LayoutError(f"k_scale: expected a positive finite float or float32[L={L}], got {k_scale!r}")
    return s


# ---------------------------------------------------------------------------------- kernel tables
_VEC_PER = 2  # chunks of 8 elements per lane in kmesh_place_vec
_VEC_LPT = 4  # layers per lane in kmesh_place_vec


_RUNS = True  # use kmesh_place_runs where it applies (tests and benchmarks switch it off to compare)
_RUN_GROUPS = 1  # pair groups per lane in kmesh_place_runs (G)
_RUN_HEADS = 2  # heads per load batch in kmesh_place_runs (HB)
_RUN_VPL = 4  # 16-byte vectors in flight per lane on plain rows
_RUN_KVF = 1  # 1: a warp moves K and V of its run layer by layer (KVF); 0: K and V in separate warps
_RUN_UNITS = 4096  # enough warps to fill the GPU before a warp takes several layers


def _run_cap(layout: KVLayout, rope, gather: bool) -> int:
    """Longest run (tokens) for the run kernel, or 0 when the layout or RoPE does not fit it.

    A run's K rows hold ``cap * per_tok`` pair groups, one per lane (``_RUN_GROUPS`` per lane)."""
    epv = 16 // layout.storage_dtype.itemsize
    if layout.head_size % epv:
        return 0
    # offsets inside a run are 32-bit in the kernel: heads x head stride + tokens x token stride
    L, B, H, N, D = layout.sizes
    span = max(abs(st[2]) * H + abs(st[3]) * min(N, 32) + D for st in (layout.k_strides, layout.v_strides))
    if span >= 1 << 31:
        return 0
    if rope is None or gather:
        return 16
    rd = rope.rotary_dim
    per_tok = rd // 2 // epv if rope.is_neox_style else rd // epv
    if per_tok == 0 or (rope.is_neox_style and (rd // 2) % epv) or rd % epv:
        return 0
    return 32 * _RUN_GROUPS // per_tok


_GATES: dict = {}  # device index -> kmesh_gate_runs (csrc/gate.cu) as a CuPy Function


class _Launch:
    """A validated placement with its tables uploaded; ``run()`` submits the one launch.

    Benchmarks time ``run()`` alone to separate the kernel from validation and table building.
    ``tables["runs"]`` is not ``None`` when the run kernel (kmesh_place_runs) is used.
    """

    def __init__(self, items, cache_views, layout, device, rope, scale, backend: str, *, gather: bool):
        self.items, self.views, self.layout, self.device = items, cache_views, layout, device
        self.rope, self.scale, self.gather = rope, scale, gather
        self.backend = _backend.choose(backend, device)
        self.empty = not items or sum(it.kv.shape[2] for it in items) == 0
        self.tables = None
        if not self.empty and self.backend != "torch":
            self.tables = _tables(items, cache_views, layout, rope, scale, device)
            cap = _run_cap(layout, rope, gather) if _RUNS and self.backend == "cupy" and self.tables["vec16"] else 0
            if cap:
                runs = _run_table(self.tables["tok_host"], layout.block_size, cap, device)
                self.tables["runs"] = runs
                if runs is not None:
                    self.tables["run_args"] = (runs.data_ptr(), self.tables["old_pos"].data_ptr(),
                                               self.tables["layer_base"].data_ptr(), runs.shape[0])

    @classmethod
    def _built(cls, layout, device, rope, scale, backend: str, tables: dict) -> "_Launch":
        """A launch whose tables the fast path built (a cupy or warp backend, tokens to place)."""
        self = cls.__new__(cls)
        self.items = self.views = None
        self.layout, self.device, self.rope, self.scale, self.gather = layout, device, rope, scale, False
        self.backend, self.empty, self.tables = backend, False, tables
        return self

    def gate(self, got: int, want: int, nbytes: int, stream: int) -> bool:
        """Private (``kmesh_host.routes``): queue on the raw stream ``stream``, ahead of :meth:`run`
        there, a comparison of the ``nbytes`` bytes at device addresses ``got`` and ``want`` that
        empties this launch's run table (each run's length set to 0, so the run kernel writes
        nothing) unless they are equal (``csrc/gate.cu``). ``True`` once queued; ``False``, with
        nothing queued, where this launch has no run table on the device (other kernels, backends)
        or the driver refused: the caller then compares on the host before :meth:`run`."""
        tables = self.tables
        if self.empty or self.backend != "cupy" or tables is None or tables.get("runs") is None \
                or "run_args" not in tables or nbytes <= 0:
            return False
        runs, _, _, count = tables["run_args"]
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
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
        return _launch.launch(fn, (1,), (256,), stream, (got, want, nbytes, runs, count, _RUN_COLS, RUN_LEN_COL))

    def run(self) -> None:
        if self.empty:
            return
        if self.backend == "torch":
            torch_run(self.items, self.views, self.layout, self.rope, self.scale, gather=self.gather)
        elif self.backend == "cupy":
            plan = self.tables.get("driver_launch") if self.tables is not None else None
            if plan is not None and _place_driver.launch(plan):
                return
            from . import _place_cupy

            _place_cupy.run(self.tables, self.layout, self.device, gather=self.gather, rope=self.rope)
        else:
            from . import _place_warp

            L, _, H, N, D = self.layout.sizes
            rope = self.rope
            _place_warp.launch(self.tables, self.layout.storage_dtype, self.device, L=L, H=H, D=D, N=N,
                               total_tokens=self.tables["total"], gather=self.gather, rope=rope is not None,
                               neox=bool(rope and rope.is_neox_style), rd=rope.rotary_dim if rope else 0)


# ---------------------------------------------------------------------------------- fast path
_FAST = True  # prepare_place_many's fast path (tests switch it off to compare with the general path)
_COMPILED = True  # the fast path's compiled run-table builder (tests switch it off to compare with NumPy's)
_FACTS: dict = {}  # (cache address, shape, strides, dtype, device, id(layout), id(rope)) -> _Facts
_FACTS_MAX = 32


class _Facts:
    """What one (cache tensor, layout, RoPE spec) gives every placement into it, worked out once:
    the cache passed validation, its layer bases, slot and position bounds, alignment and the
    kernels' constant inputs. Keyed by the cache's address, shape and strides (not the tensor, which
    is not kept alive): another tensor with those passes the same checks."""

    __slots__ = ("layout", "rope", "device", "cuda", "layer_base", "bits", "ok", "S", "N", "P", "cap", "vec16",
                 "row", "kv_shape", "st", "vt", "consts", "params", "ring", "launches", "lane", "span", "spans")

    def __init__(self, cache, layout: KVLayout, rope, name: str):
        flats, per_layer = _cache_layers(cache, layout, name)  # raises LayoutError exactly as the general path
        L, _, H, N, D = layout.sizes
        itemsize = layout.storage_dtype.itemsize
        self.layout, self.rope = layout, rope
        self.device = flats[0].device
        self.cuda = self.device.type == "cuda"
        ranges = _ranges(flats)
        if per_layer:  # a tensor per layer (vLLM's own): each layer's base is its tensor's address
            self.layer_base = _i64([f.data_ptr() for f in flats])
            self.spans = sorted(ranges)
            # layers that overlap one another would race: the general path decides
            apart = all(a[1] <= b[0] for a, b in zip(self.spans, self.spans[1:]))
        else:
            self.layer_base = flats[0].data_ptr() + np.arange(L, dtype=np.int64) * (layout.k_strides[0] * itemsize)
            self.spans = None
            apart = True
        self.layer_base.setflags(write=False)
        # anything the fast path does not cover (the general path then decides, and raises); one
        # tensor's layers are addressed through one base table, which needs K and V to share the
        # layer stride; per-layer tensors have no layer stride
        self.ok = apart and (per_layer or layout.k_strides[0] == layout.v_strides[0])
        self.bits = _align_bits(layout, int(np.bitwise_or.reduce(self.layer_base)))
        self.S, self.N = layout.num_slots, N
        self.P = rope.num_positions if rope is not None else 0
        self.vec16 = _vec16(layout, self.bits)
        self.cap = (_RUN_GROUPS, _run_cap(layout, rope, False))  # (pair groups per lane, longest run)
        self.row = H * D * itemsize
        self.kv_shape = (L, H, D)
        self.st, self.vt = layout.k_strides, layout.v_strides
        self.consts = _consts(layout, rope, None, self.device)  # K scales of 1 (fp8 with RoPE: per call)
        self.params: dict = {}  # longest run -> the compiled run builder's constants (_host_tables.PARAMS)
        self.ring = None  # the device's table ring (_place_driver), looked up on first use; False: none
        self.launches = None  # kernel shape -> the run kernel's packed launch arguments (_place_driver)
        self.lane = None  # _place_driver.place_now's constants for this cache; False: it does not apply
        # the cache's bytes (sources must lie outside): [lowest, highest) over its layers
        self.span = (min(r[0] for r in ranges), max(r[1] for r in ranges))

    def aliases(self, ptr: int, nbytes: int) -> bool:
        """``[ptr, ptr + nbytes)`` shares bytes with the cache (with any layer of a per-layer one)."""
        if not (ptr < self.span[1] and self.span[0] < ptr + nbytes):
            return False
        return self.spans is None or _meets((ptr, ptr + nbytes), self.spans)


def _cache_key(cache) -> tuple | None:
    """What identifies ``cache`` (one tensor, or a list of per-layer tensors) for :data:`_FACTS`;
    ``None`` for anything else (the general path then decides)."""
    if isinstance(cache, torch.Tensor):
        return cache.data_ptr(), cache.shape, cache.stride(), cache.dtype, cache.device
    if type(cache) in (list, tuple) and cache and all(isinstance(t, torch.Tensor) for t in cache):
        return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in cache)
    return None


def _facts(cache, layout: KVLayout, rope, name: str) -> _Facts | None:
    """The facts of ``cache`` (a tensor or a list of per-layer tensors) for ``layout`` and ``rope``,
    worked out once; ``None`` for any other kind of cache; :class:`LayoutError` for an invalid one."""
    ident = _cache_key(cache)
    if ident is None:
        return None
    key = (ident, id(layout), id(rope))
    f = _FACTS.get(key)
    if f is None or f.layout is not layout or f.rope is not rope:
        f = _Facts(cache, layout, rope, name)
        if len(_FACTS) >= _FACTS_MAX:
            _FACTS.clear()
        _FACTS[key] = f
    return f


def _host_ints(seq, counts: list[int]) -> bool:
    """Every entry is a host int64[counts[i]] tensor (else the general path validates and raises)."""
    for x, c in zip(seq, counts):
        if type(x) is not torch.Tensor or x.dtype is not torch.int64 or not x.is_cpu or x.dim() != 1 \
                or x.shape[0] != c:
            return False
    return True


def _distinct(slots: np.ndarray, S: int) -> bool:
    """Every value of ``slots`` (all in [0, S)) occurs once."""
    if slots.size < 2 or (slots[1:] - slots[:-1]).min() > 0:  # strictly increasing: the usual case
        return True
    if S <= max(1 << 16, 16 * slots.size):  # a byte map: O(T) writes, one O(S) count
        seen = np.zeros(S, dtype=np.uint8)
        seen[slots] = 1
        return int(np.count_nonzero(seen)) == slots.size
    srt = np.sort(slots)
    return not bool((srt[1:] == srt[:-1]).any())


def _fast_prepare(kvs, cache, layout, slots, rope, olds, news, k_scale, backend: str, slots_checked: bool):
    """prepare_place_many for the common case: one cache tensor, host int64 index tensors, every
    item a contiguous (2, L, T, H, D) tensor on the cache's device, a cupy or warp backend.

    Checks the concatenated indices with a few whole-array reductions and builds only what the
    chosen kernel reads, in one host buffer and one upload. Returns ``None`` whenever anything is
    unusual or fails a check: the general path then decides, and describes any error exactly.
    """
    _check_args(layout, rope, olds, news)
    n = len(kvs)
    if n == 0:
        return None
    f = _facts(cache, layout, rope, "cache" if n == 1 else "caches[0]")
    if f is None or not f.ok:
        return None
    device = f.device
    try:
        be = _backend.choose(backend, device)
    except BackendError:
        return None
    if be == "torch":
        return None
    want = layout.storage_dtype
    L, H, D = f.kv_shape
    counts, ptrs, bits = [], [], f.bits
    for kv in kvs:
        if not isinstance(kv, torch.Tensor):
            return None
        s = kv.shape
        if len(s) != 5 or s[0] != 2 or s[1] != L or s[3] != H or s[4] != D:
            return None
        if (kv.dtype is not want and storage_dtype(kv.dtype) != want) or kv.device != device \
                or not kv.is_contiguous():
            return None
        p = kv.data_ptr()
        if f.aliases(p, kv.numel() * kv.element_size()):
            return None  # the source aliases the cache: the general path raises
        counts.append(s[2])
        ptrs.append(p)
        bits |= p
    return _fast_tables(f, be, layout, rope, slots, olds, news, k_scale, counts, ptrs, bits, slots_checked)


def _prepare_at(addresses, shapes, dtype: torch.dtype, device: torch.device, cache, layout, slots, *, rope=None,
                old_positions=None, new_positions=None, k_scale=None, backend: str = "auto",
                _slots_checked: bool = False):
    """:func:`prepare_place_many` for items given by address: item ``i`` is a contiguous ``dtype``
    array of shape ``shapes[i]`` at device address ``addresses[i]`` on ``device``. For callers that
    made that memory themselves (a restore's staging buffer), so that no tensor view is built before
    the launch. Returns the launch, or ``None`` whenever the fast path does not apply (the caller
    then passes tensor views to :func:`prepare_place_many`, which decides and names any error).

    Private: a wrong address or shape lets the launch read other memory; nothing public passes one.
    """
    n = len(addresses)
    if n == 0 or len(shapes) != n or len(slots) != n:
        return None
    if rope is not None and (old_positions is None or new_positions is None
                             or len(old_positions) != n or len(new_positions) != n):
        return None
    _check_args(layout, rope, old_positions, new_positions)
    f = _facts(cache, layout, rope, "cache")
    if f is None or not f.ok or device != f.device:
        return None
    try:
        be = _backend.choose(backend, device)
    except BackendError:
        return None
    want = layout.storage_dtype
    if be == "torch" or (dtype is not want and storage_dtype(dtype) != want):
        return None
    L, H, D = f.kv_shape
    bits = f.bits
    for s, p in zip(shapes, addresses):
        if len(s) != 5 or s[0] != 2 or s[1] != L or s[3] != H or s[4] != D:
            return None
        if f.aliases(p, 2 * L * s[2] * H * D * want.itemsize):
            return None
        bits |= p
    return _fast_tables(f, be, layout, rope, slots, old_positions, new_positions, k_scale,
                        [s[2] for s in shapes], list(addresses), bits, _slots_checked)


def _fast_tables(f: _Facts, be: str, layout, rope, slots, olds, news, k_scale, counts: list, ptrs: list, bits: int,
                 slots_checked: bool):
    """The part of :func:`_fast_prepare` after the items' checks: indices checked, tables built."""
    device, want, n = f.device, layout.storage_dtype, len(ptrs)
    L = f.kv_shape[0]
    T = sum(counts)
    if T == 0:
        return None
    scale = None
    if want == torch.uint8:
        if rope is not None:
            try:
                scale = _k_scale(k_scale, L)
            except LayoutError:
                return None
    elif k_scale is not None:
        return None
    if not (_host_ints(slots, counts) if rope is None else _host_ints((*slots, *olds, *news), counts * 3)):
        return None
    if f.cap[0] != _RUN_GROUPS:  # the kernel shape changed (tools that sweep it)
        f.cap = (_RUN_GROUPS, _run_cap(f.layout, f.rope, False))
    cap = f.cap[1] if _RUNS and be == "cupy" and f.vec16 and bits % 16 == 0 else 0
    counts_t = tuple(counts)
    if cap and _COMPILED:
        launch = _compiled_runs(f, layout, rope, scale, be, slots, counts_t, ptrs, olds, news, cap, slots_checked)
        if launch is not None:
            return launch
    sl = (torch.cat(slots) if n > 1 else slots[0]).numpy()
    lo, hi = int(np.minimum.reduce(sl)), int(np.maximum.reduce(sl))
    if not slots_checked and (lo < -1 or hi >= f.S):
        return None
    valid = None if lo >= 0 else sl >= 0
    diff = sl[1:] - sl[:-1]
    if not slots_checked:
        if valid is None:
            if diff.size and diff.min() <= 0 and not _distinct(sl, f.S):
                return None
        elif not _distinct(sl[valid], f.S):
            return None
    # the run kernel where it applies and pays; the per-token kernels otherwise
    starts, tok_item, row_off, step = _token_index(counts_t, f.row)
    if cap:
        bounds = starts[1:-1]  # where a new item begins (an empty last item would begin at T)
        first, length = _runs(sl, bounds if 0 not in counts_t else bounds[bounds < T], f.N, cap, valid, diff)
        if not _runs_pay(first, length, cap):
            cap = 0
    consts = f.consts if scale is None else _consts(layout, rope, scale, device)
    if not cap:  # per-token kernels: every per-token row
        old = new = None
        if rope is not None:
            pos = torch.cat(list(olds) + list(news)).numpy()
            old, new = pos[:T], pos[T:]
            if not _positions_ok(pos, f.P, valid):
                return None
        tables = _tok_tables(_i64(ptrs), counts_t, f.layer_base, None, sl, old, new, layout, rope, scale, device)
        return _Launch._built(layout, device, rope, scale, be, tables)
    # run kernel: one buffer [layer bases L | old, new positions 2 x T | runs R x _RUN_COLS]
    R = first.size
    host = torch.empty(L + 2 * T + R * _RUN_COLS, dtype=torch.int64, pin_memory=f.cuda)
    h = host.numpy()
    h[:L] = f.layer_base
    if rope is not None:
        torch.cat(list(olds) + list(news), out=host[L:L + 2 * T])
        if not _positions_ok(h[L:L + 2 * T], f.P, valid):
            return None
    else:
        h[L:L + 2 * T] = 0  # never read without RoPE
    t = h[L + 2 * T:].reshape(R, _RUN_COLS)
    t[:, 0], t[:, 1] = first, length
    item = tok_item[first]
    np.add(_i64(ptrs)[item], row_off[first], out=t[:, 2])
    t[:, 3] = step[first]
    s0 = sl[first]
    N = f.N
    blk, off = (s0 >> (N.bit_length() - 1), s0 & (N - 1)) if N & (N - 1) == 0 else (s0 // N, s0 % N)
    st, vt = f.st, f.vt
    dst = blk * st[1]
    dst += off * st[3]
    if st[1] == vt[1] and st[3] == vt[3]:  # K and V in one block/token arrangement (vLLM's layouts)
        np.add(dst, layout.k_offset, out=t[:, 4])
        np.add(dst, layout.v_offset, out=t[:, 5])
    else:
        np.add(dst, layout.k_offset, out=t[:, 4])
        t[:, 5] = blk * vt[1] + off * vt[3] + layout.v_offset
    t[:, 6] = 0  # one cache: its layer bases come first
    dev = host.to(device, non_blocking=True)
    p = dev.data_ptr()
    tables = {"total": T, "vec16": True, "runs": R, "run_args": (p + 8 * (L + 2 * T), p + 8 * L, p, R),
              "buffer": dev, "cos_sin": consts[0], "fp8_table": consts[1], "k_scale": consts[2]}
    return _Launch._built(layout, device, rope, scale, be, tables)


def _compiled_runs(f: _Facts, layout, rope, scale, be: str, slots, counts: tuple, ptrs: list, olds, news,
                   cap: int, slots_checked: bool):
    """The run kernel's launch built by the compiled builder (``_host_tables``) in one pass, or
    ``None`` (no Numba, a skipped token, slots not increasing, a position out of range, or runs too
    short to pay): the NumPy path then decides. The kernel reads the same table as the NumPy path
    builds; the slots travel in the same buffer (gathered by the one concatenation that gathers the
    positions), unread by the kernel. On CUDA with CuPy the build, the upload and the launch are
    compiled driver calls (``_place_driver``) where the driver is reachable; torch and CuPy
    otherwise."""
    L, T = f.kv_shape[0], sum(counts)
    starts = _token_index(counts, f.row)[0]
    params = _run_params(f, layout, cap)
    consts = f.consts if scale is None else _consts(layout, rope, scale, f.device)
    if f.cuda and be == "cupy":  # compiled driver calls build, upload and (at run) launch
        tables = _place_driver.prepare_runs(f, layout, rope, slots, olds, news, counts, ptrs, starts, params, cap,
                                            slots_checked, consts)
        if tables is not None:
            return _Launch._built(layout, f.device, rope, scale, be, tables) if tables else None
    build = _host_tables.builder()
    if build is None:
        return None
    # [layer bases L | old, new positions 2 x T | slots T | runs R x _RUN_COLS], sized for the most runs (T)
    host = torch.empty(L + 3 * T + T * _RUN_COLS, dtype=torch.int64, pin_memory=f.cuda)
    h = host.numpy()
    h[:L] = f.layer_base
    if rope is not None:
        torch.cat((*olds, *news, *slots), out=host[L:L + 3 * T])
        pos = h[L:L + 2 * T]
    else:
        h[L:L + 2 * T] = 0  # never read without RoPE
        torch.cat(slots, out=host[L + 2 * T:L + 3 * T])
        pos = h[:0]
    runs_at = L + 3 * T
    R = build(h[L + 2 * T:runs_at], starts, _i64(ptrs), params, not slots_checked, pos,
              h[runs_at:].reshape(T, _RUN_COLS))
    if R <= 0 or 2 * T < cap * R:  # runs average under cap / 2: the per-token kernel is faster
        return None
    dev = host[:runs_at + R * _RUN_COLS].to(f.device, non_blocking=True)
    p = dev.data_ptr()
    tables = {"total": T, "vec16": True, "runs": R, "run_args": (p + 8 * runs_at, p + 8 * L, p, R),
              "buffer": dev, "cos_sin": consts[0], "fp8_table": consts[1], "k_scale": consts[2]}
    return _Launch._built(layout, f.device, rope, scale, be, tables)


def _run_params(f: _Facts, layout, cap: int) -> np.ndarray:
    """The compiled run builder's constants for runs of at most ``cap`` tokens (``_host_tables.PARAMS``)."""
    params = f.params.get(cap)
    if params is None:
        st, vt = f.st, f.vt
        params = f.params[cap] = np.array([f.row, f.N, cap, f.S, f.P, st[1], st[3], layout.k_offset, vt[1], vt[3],
                                           layout.v_offset], dtype=np.int64)
    return params


def _positions_ok(pos: np.ndarray, P: int, valid) -> bool:
    """Old then new positions (``pos``: int64[2T]) of the placed tokens lie in [0, P): whole-array
    bounds first; only with skipped tokens are they masked, since those positions are never read."""
    if int(np.minimum.reduce(pos)) >= 0 and int(np.maximum.reduce(pos)) < P:
        return True
    if valid is None:
        return False
    return not bool((((pos < 0) | (pos >= P)).reshape(2, -1) & valid).any())


def prepare_place_many(kvs, caches, layout: KVLayout, slots, *, rope=None, old_positions=None, new_positions=None,
                       k_scale=None, backend: str = "auto", _slots_checked: bool = False) -> _Launch:
    """Validate and build the launch of :func:`place_many` without running it (``.run()`` does).

    ``_slots_checked`` (private; for callers that own a stricter check, e.g. the cache service,
    which bounds-checks every slot against the client's registration before it reserves blocks):
    skip only the slot range and duplicate-slot checks, which the caller guarantees it has already
    made on these very slot values for a single destination cache of ``layout``: every slot in
    ``[-1, layout.num_slots)``, no slot other than -1 twice. Everything else (types, shapes, dtypes,
    devices, the cache's extent, position ranges) is still validated. A wrong promise lets the
    launch write outside the cache, so nothing public passes it.
    """
    for name, seq in (("kvs", kvs), ("caches", caches), ("slots", slots)):
        if not isinstance(seq, (Sequence, torch.Tensor)) or isinstance(seq, (str, bytes)):
            raise LayoutError(f"{name}: expected a list, got {type(seq).__name__}")
    n = len(kvs)
    one = isinstance(caches, torch.Tensor)
    if one:
        cache, caches = caches, [caches] * n
    else:
        caches = list(caches)
        cache = caches[0] if caches and all(c is caches[0] for c in caches) else None
    if len(caches) != n or len(slots) != n:
        raise LayoutError(f"caches/slots: expected {n} entries like kvs, got {len(caches)} and {len(slots)}")
    if rope is not None and (old_positions is None or new_positions is None
                             or len(old_positions) != n or len(new_positions) != n):
        raise LayoutError(f"old_positions/new_positions: expected {n} entries each when rope is given")
    if _slots_checked and cache is None:
        raise LayoutError("_slots_checked: the caller's check covers one destination cache only")
    if _FAST and cache is not None:
        launch = _fast_prepare(kvs, cache, layout, slots, rope, old_positions, new_positions, k_scale, backend,
                               _slots_checked)
        if launch is not None:
            return launch
    items, views, device, scale = _prepare(list(kvs), caches, layout, list(slots), rope, old_positions,
                                           new_positions, k_scale, gather=False, slots_checked=_slots_checked)
    return _Launch(items, views, layout, device, rope, scale, backend, gather=False)


# ---------------------------------------------------------------------------------- public API
def place(kv: torch.Tensor, cache, layout: KVLayout, slots: torch.Tensor, *, rope: RopeSpec | None = None,
          old_positions: torch.Tensor | None = None, new_positions: torch.Tensor | None = None,
          k_scale=None, backend: str = "auto") -> None:
    """Write one segment's K/V into cache slots, shifting K to new positions when ``rope`` is given.

    Args:
        kv: ``(2, L, T, H, D)`` segment tensor in the cache dtype (K plane first; fp8 e4m3 as uint8
            or float8_e4m3fn), contiguous, on the cache's device. Keys are post-RoPE at ``old_positions``.
        cache: the paged cache described by ``layout`` (a tensor whose storage holds ``layout.extent``
            elements from its start), or a list of ``L`` per-layer tensors (layer stride ignored).
        layout: the cache's :class:`KVLayout`.
        slots: int64[T] destination slots in ``[-1, num_blocks*block_size)``; -1 skips a token.
        rope: the model's :class:`RopeSpec`; ``None`` copies K and V unchanged.
        old_positions, new_positions: int64[T] (required with ``rope``) in ``[0, rope.num_positions)``.
        k_scale: fp8 caches only: the per-tensor K scale (float, or float32[L] per layer); K is
            dequantised with it, rotated, and requantised with it. V is always copied bit for bit.
        backend: ``"auto"``, ``"torch"``, ``"warp"`` or ``"cupy"``.

    Nothing outside the addressed slots changes; nothing is written when validation fails
    (:class:`LayoutError` naming the argument).
    """
    items, views, device, scale = _prepare([kv], [cache], layout, [slots], rope,
                                           None if old_positions is None else [old_positions],
                                           None if new_positions is None else [new_positions], k_scale, gather=False)
    _Launch(items, views, layout, device, rope, scale, backend, gather=False).run()


def place_many(kvs: Sequence[torch.Tensor], caches, layout: KVLayout, slots: Sequence[torch.Tensor], *,
               rope: RopeSpec | None = None, old_positions: Sequence[torch.Tensor] | None = None,
               new_positions: Sequence[torch.Tensor] | None = None, k_scale=None, backend: str = "auto") -> None:
    """Place many segments in one launch (the batched form of :func:`place`).

    ``kvs[i]`` goes to ``slots[i]`` of ``caches[i]`` (``caches`` may also be one tensor shared by all
    items, e.g. one vLLM cache holding every child's blocks). All caches share ``layout``. Segment
    tensors stay where they are (a table of their addresses is passed), so nothing is concatenated.
    Slots must be distinct within each cache.
    """
    prepare_place_many(kvs, caches, layout, slots, rope=rope, old_positions=old_positions,
                       new_positions=new_positions, k_scale=k_scale, backend=backend).run()


def gather(cache, layout: KVLayout, slots: torch.Tensor, *, backend: str = "auto",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Read cache slots into a new ``(2, L, T, H, D)`` tensor (keys stay as stored, no shift).

    ``slots``: int64[T]; tokens with slot -1 are returned as zeros. ``out`` may supply the
    destination (contiguous, cache dtype, cache device).
    """
    flats, _ = _cache_layers(cache, layout, "cache")
    device = flats[0].device
    T = slots.shape[0] if isinstance(slots, torch.Tensor) and slots.dim() == 1 else -1
    if T < 0:
        raise LayoutError(f"slots: expected int64[T], got {slots!r}")
    L, _, H, _, D = layout.sizes
    given = out is not None
    if out is None:
        out = torch.zeros((2, L, T, H, D), dtype=layout.dtype, device=device)
    else:
        _check_kv("out", out, layout, device)
        if out.shape[2] != T:
            raise LayoutError(f"out: expected (2, L, T={T}, H, D) for {T} slots, got {_fmt(out)}")
    items, views, device, _ = _prepare([out], [cache], layout, [slots], None, None, None, None, gather=True)
    if given:  # skipped tokens come back as zeros, as with a new tensor
        skipped = np.flatnonzero(items[0].slots < 0)
        if skipped.size:
            items[0].kv.index_fill_(2, torch.from_numpy(skipped).to(out.device), 0)
    _Launch(items, views, layout, device, None, None, backend, gather=True).run()
    return out
