"""Placement of saved KV segments into paged caches (with the RoPE shift of K), and the reverse.

Functions over :class:`kmesh_gpu.PlacementPlan` for one-off calls (a caller that places into one
cache again and again keeps a plan):

* ``place``      — one segment into one cache.
* ``place_many`` — many segments into one cache (one launch), or into several caches (one launch each).
* ``gather``     — read cache slots back into a ``(2, L, T, H, D)`` segment tensor (used when saving).

Backends: ``"torch"`` (reference, any device), ``"warp"`` (CPU and CUDA), ``"cupy"`` (CUDA,
``csrc/place.cu``). All give identical bits: the fp32 shift uses one fixed operation order without
fused multiply-adds (see :mod:`kmesh_gpu.rope`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import _cache_layers, _check_args, _check_caches_apart, _meets, _ranges
from .errors import LayoutError
from .layout import KVLayout
from .plan import PlacementPlan
from .rope import RopeSpec


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
    _check_args(layout, rope, old_positions, new_positions)
    PlacementPlan(cache, layout, rope=rope, backend=backend).place(
        [kv], [slots], old_positions=None if rope is None else [old_positions],
        new_positions=None if rope is None else [new_positions], k_scale=k_scale)


def place_many(kvs: Sequence[torch.Tensor], caches, layout: KVLayout, slots: Sequence[torch.Tensor], *,
               rope: RopeSpec | None = None, old_positions: Sequence[torch.Tensor] | None = None,
               new_positions: Sequence[torch.Tensor] | None = None, k_scale=None, backend: str = "auto") -> None:
    """Place many segments (the batched form of :func:`place`).

    ``kvs[i]`` goes to ``slots[i]`` of ``caches[i]`` (``caches`` may also be one tensor shared by all
    items, e.g. one vLLM cache holding every child's blocks: one launch). All caches share ``layout``;
    items into distinct caches are launched per cache, after every item of every cache is validated.
    Segment tensors stay where they are (a table of their addresses is passed), so nothing is
    concatenated. Slots must be distinct within each cache.
    """
    for name, seq in (("kvs", kvs), ("caches", caches), ("slots", slots)):
        if not isinstance(seq, (Sequence, torch.Tensor)) or isinstance(seq, (str, bytes)):
            raise LayoutError(f"{name}: expected a list, got {type(seq).__name__}")
    _check_args(layout, rope, old_positions, new_positions)
    n = len(kvs)
    if isinstance(caches, torch.Tensor):
        groups = [(caches, list(range(n)), None)]
    else:
        caches = list(caches)
        if len(caches) != n:
            raise LayoutError(f"caches: expected {n} entries like kvs, got {len(caches)}")
        # one group per destination memory, not per object: two tensor objects over one cache (a
        # view of it, a reshaped one) are one cache, whose slots must be distinct across both
        groups, by_object, by_memory = [], {}, {}
        for i, c in enumerate(caches):
            g = by_object.get(id(c))
            if g is None:
                flats, per_layer = _cache_layers(c, layout, "cache" if n == 1 else f"caches[{i}]")
                memory = (per_layer, tuple(f.data_ptr() for f in flats))
                g = by_memory.get(memory)
                if g is None:
                    g = by_memory[memory] = len(groups)
                    groups.append((c, [], flats))
                by_object[id(c)] = g
            groups[g][1].append(i)
    if len(slots) != n:
        raise LayoutError(f"slots: expected {n} entries like kvs, got {len(slots)}")
    if rope is not None and (len(old_positions) != n or len(new_positions) != n):
        raise LayoutError(f"old_positions/new_positions: expected {n} entries each when rope is given")
    if n == 0:
        return
    if len(groups) == 1:
        cache = groups[0][0]
        PlacementPlan(cache, layout, rope=rope, backend=backend).place(
            list(kvs), list(slots), old_positions=None if rope is None else list(old_positions),
            new_positions=None if rope is None else list(new_positions), k_scale=k_scale)
        return
    # several destination caches: all validated (apart from one another, no source inside any),
    # then one launch each
    views = [flats for _, _, flats in groups]
    _check_caches_apart(views)
    every = [r for v in views for r in _ranges(v)]
    for i, kv in enumerate(kvs):
        if isinstance(kv, torch.Tensor) and kv.numel() and \
                _meets((kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()), every):
            raise LayoutError(f"kvs[{i}]: shares memory with a cache it is placed into; copy it first")
    launches = []
    for cache, idx, _ in groups:
        plan = PlacementPlan(cache, layout, rope=rope, backend=backend)
        # errors name the item by its index in this call, not in its cache's group
        launches.append(plan._prepare([kvs[i] for i in idx], [slots[i] for i in idx],
                                      None if rope is None else [old_positions[i] for i in idx],
                                      None if rope is None else [new_positions[i] for i in idx], k_scale,
                                      labels=tuple(idx)))
    for launch in launches:
        launch.run()


def gather(cache, layout: KVLayout, slots: torch.Tensor, *, backend: str = "auto",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Read cache slots into a new ``(2, L, T, H, D)`` tensor (keys stay as stored, no shift).

    ``slots``: int64[T]; tokens with slot -1 are returned as zeros. ``out`` may supply the
    destination (contiguous, cache dtype, cache device).
    """
    return PlacementPlan(cache, layout, backend=backend).gather(slots, out=out)
