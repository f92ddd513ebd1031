"""Validation of placement arguments, shared by :mod:`kmesh_gpu.plan` and :mod:`kmesh_gpu.place`.

Everything is checked before anything is written; each error is a :class:`LayoutError` naming the
argument. Index values (slots, positions) are checked on the host with NumPy, for all items at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import LayoutError
from .layout import KVLayout, storage_dtype
from .rope import RopeSpec


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


def _check_caches_apart(views: list[list[torch.Tensor]]) -> None:
    """Distinct destination caches (their flat views) must not share memory: concurrent writes to
    one element race on a GPU, and the backends write in different orders."""
    ranges = [_ranges(v) for v in views]
    for a in range(len(ranges)):
        for b in range(a + 1, len(ranges)):
            if any(_meets(r, ranges[b]) for r in ranges[a]):
                raise LayoutError("caches: two destination caches share memory (pass one tensor for both, "
                                  "or caches that do not overlap)")


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


def _check_args(layout, rope, old_positions, new_positions, *, positions_follow: bool = True) -> None:
    """The layout, the RoPE spec and (``positions_follow``) whether positions come with it."""
    if not isinstance(layout, KVLayout):
        raise LayoutError(f"layout: expected a KVLayout, got {type(layout).__name__}")
    if rope is not None and not isinstance(rope, RopeSpec):
        raise LayoutError(f"rope: expected a RopeSpec or None, got {type(rope).__name__}")
    if positions_follow and rope is None and (old_positions is not None or new_positions is not None):
        raise LayoutError("old_positions/new_positions: given without rope; pass rope= to shift keys")
    if rope is not None:
        if rope.head_size != layout.head_size:
            raise LayoutError(f"rope: head_size {rope.head_size} differs from the layout's D={layout.head_size}")
        if positions_follow and (old_positions is None or new_positions is None):
            raise LayoutError("old_positions/new_positions: both are required when rope is given")
        if layout.storage_dtype != torch.uint8 and layout.dtype != rope.dtype:
            raise LayoutError(f"rope: dtype {rope.dtype} differs from the cache dtype {layout.dtype}")


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


def _check_values(items: list[_Item], layout: KVLayout, rope, all_slots, all_old, all_new, *,
                  check_duplicates: bool, labels=None) -> None:
    """Range checks of slots and positions and the no-duplicate-slot rule over the whole batch into
    one cache (host arrays); details are worked out only on failure. ``labels``: each item's index
    in the caller's call, for the message (``None``: the items' own order)."""
    n, S = len(items), layout.num_slots
    if all_slots.size == 0:
        return
    bad = bool(all_slots.min() < -1 or all_slots.max() >= S)
    valid = None
    if rope is not None and not bad:
        P = rope.num_positions
        # whole-array bounds first (the usual case); positions of skipped tokens are checked only if
        # that fails, since they are never read
        if not (all_old.min() >= 0 and all_old.max() < P and all_new.min() >= 0 and all_new.max() < P):
            valid = all_slots >= 0
            bad = bool((((all_old < 0) | (all_old >= P)) & valid).any()
                       or (((all_new < 0) | (all_new >= P)) & valid).any())
    if check_duplicates and not bad:  # two writes to one slot would race
        if valid is None:
            valid = all_slots >= 0
        key = all_slots[valid]
        if S <= max(1 << 24, 16 * key.size):  # a byte map: O(T) writes, one O(S) count
            seen = np.zeros(S, dtype=np.uint8)
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
        sfx = f"[{labels[i]}]" if labels is not None else "" if n == 1 else f"[{i}]"
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
