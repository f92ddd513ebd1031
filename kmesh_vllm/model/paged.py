"""Reading and writing one layer's K/V at cache slots, through any :class:`kmesh_gpu.KVLayout`.

A layout is affine: the K element ``(l, b, h, n, d)`` lives at ``k_offset + l*k_strides[0] +
b*k_strides[1] + h*k_strides[2] + n*k_strides[3] + d*k_strides[4]`` elements from the cache's start
(likewise V). A slot ``s`` is block ``s // N``, offset ``s % N`` (vLLM's slot mapping). So the
elements of T slots are one int64 index tensor ``[T, H, D]``, and reads and writes are one
``index_select`` / ``index_copy_`` on a flat view of the cache: every layout and packing
(``content``, ``planes``) is the same code. :class:`BlockTable` turns a request's block ids into
slots, as vLLM's block table does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh_gpu import KVLayout, LayoutError


def _fmt(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def flat_cache(cache: torch.Tensor, layout: KVLayout, name: str = "cache") -> torch.Tensor:
    """A 1-D view of the ``layout.extent`` elements the layout addresses from ``cache``'s first element.

    ``cache`` is the tensor the layout describes (``layout.allocate()``, or vLLM's own tensor for the
    layout); its storage must hold ``layout.extent`` elements from that element on.
    """
    if not isinstance(layout, KVLayout):
        raise LayoutError(f"layout: expected a KVLayout, got {type(layout).__name__}")
    if not isinstance(cache, torch.Tensor):
        raise LayoutError(f"{name}: expected a tensor, got {type(cache).__name__}")
    if cache.dtype != layout.dtype:
        raise LayoutError(f"{name}: expected the layout's dtype {layout.dtype}, got {cache.dtype}")
    held = cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset()
    if held < layout.extent:
        raise LayoutError(f"{name}: its storage holds {held} elements from its start, the layout "
                          f"{layout.name} addresses {layout.extent}")
    return cache.as_strided((layout.extent,), (1,))


def check_slots(name: str, slots, count: int | None, layout: KVLayout, device, *, allow_skip: bool) -> torch.Tensor:
    """``slots`` as int64[count] (any length when ``count`` is None) on ``device``, each in
    ``[0, num_slots)`` (or -1 when ``allow_skip``)."""
    if (not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1
            or (count is not None and slots.shape[0] != count)):
        got = _fmt(slots) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise LayoutError(f"{name}: expected int64[{'T' if count is None else count}], got {got}")
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < (-1 if allow_skip else 0) or hi >= layout.num_slots:
            low = "-1 (skip) or " if allow_skip else ""
            raise LayoutError(f"{name}: expected {low}slots in [0, {layout.num_slots}) of layout {layout.name}, "
                              f"got range [{lo}, {hi}]")
    return slots.to(device)


def check_write_slots(slots, count: int | None, layout: KVLayout, device) -> torch.Tensor:
    """Destination slots: int64[count], each -1 (skipped) or in ``[0, num_slots)``, no slot twice."""
    slots = check_slots("slots", slots, count, layout, device, allow_skip=True)
    kept = slots[slots >= 0]
    if torch.unique(kept).numel() != kept.numel():
        raise LayoutError("slots: a slot appears twice (the write would depend on the order)")
    return slots


def slot_offsets(layout: KVLayout, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 element offsets ``[T, H, D]`` of K and V of ``slots`` (all >= 0) in ``layer``."""
    N = layout.block_size
    block, offset = slots // N, slots % N
    heads = torch.arange(layout.num_kv_heads, dtype=torch.int64, device=slots.device)
    dims = torch.arange(layout.head_size, dtype=torch.int64, device=slots.device)
    out = []
    for st, base in ((layout.k_strides, layout.k_offset), (layout.v_strides, layout.v_offset)):
        token = base + layer * st[0] + block * st[1] + offset * st[3]
        out.append(token[:, None, None] + heads[None, :, None] * st[2] + dims[None, None, :] * st[4])
    return out[0], out[1]


def _check_layer(layer, layout: KVLayout) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layout.num_layers:
        raise LayoutError(f"layer: expected an int in [0, {layout.num_layers}), got {layer!r}")
    return layer


def read_kv(cache: torch.Tensor, layout: KVLayout, layer: int, slots: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` at ``slots`` (int64[T], each in ``[0, num_slots)``): two ``[T, H, D]`` tensors
    in the cache dtype on the cache's device (copies; the cache is not changed)."""
    flat = flat_cache(cache, layout)
    layer = _check_layer(layer, layout)
    slots = check_slots("slots", slots, None, layout, cache.device, allow_skip=False)
    return read_flat(flat, layout, layer, slots)


def read_flat(flat: torch.Tensor, layout: KVLayout, layer: int, slots: torch.Tensor):
    """:func:`read_kv` on a :func:`flat_cache` view with arguments already checked."""
    k_idx, v_idx = slot_offsets(layout, slots, layer)
    k = flat.index_select(0, k_idx.reshape(-1)).view(k_idx.shape)
    return k, flat.index_select(0, v_idx.reshape(-1)).view(v_idx.shape)


def write_kv(cache: torch.Tensor, layout: KVLayout, layer: int, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write ``k``, ``v`` (``[T, H, D]``, the cache dtype) of ``layer`` to ``slots`` (int64[T]; -1 skips
    a token; the others distinct). Nothing outside the addressed elements changes."""
    flat = flat_cache(cache, layout)
    layer = _check_layer(layer, layout)
    T = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else None
    shape = (T, layout.num_kv_heads, layout.head_size)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != layout.dtype:
            got = _fmt(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise LayoutError(f"{name}: expected {str(layout.dtype).removeprefix('torch.')}"
                              f"[T, {shape[1]}, {shape[2]}], got {got}")
        if t.device != cache.device:
            raise LayoutError(f"{name}: on {t.device}, the cache is on {cache.device}")
    slots = check_write_slots(slots, T, layout, cache.device)
    write_flat(flat, layout, layer, slots, k, v)


def write_flat(flat: torch.Tensor, layout: KVLayout, layer: int, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """:func:`write_kv` on a :func:`flat_cache` view with arguments already checked."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_idx, v_idx = slot_offsets(layout, slots, layer)
    flat.index_copy_(0, k_idx.reshape(-1), k.reshape(-1))
    flat.index_copy_(0, v_idx.reshape(-1), v.reshape(-1))


@dataclass(frozen=True)
class BlockTable:
    """One request's blocks, in order: position ``p`` lives in slot
    ``block_ids[p // block_size] * block_size + p % block_size`` (vLLM's block table and slot mapping).

    The table does not own the blocks (whoever allocates the cache hands them out); it only maps
    positions to slots. Block ids are checked against a layout when the slots are used.
    """

    block_ids: tuple[int, ...]
    block_size: int

    def __init__(self, block_ids: Sequence[int], block_size: int):
        ids = tuple(block_ids)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in ids):
            raise LayoutError(f"block_ids: expected non-negative ints, got {list(block_ids)!r}")
        if len(set(ids)) != len(ids):
            raise LayoutError(f"block_ids: a block appears twice in {list(ids)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise LayoutError(f"block_size: expected a positive int, got {block_size!r}")
        object.__setattr__(self, "block_ids", ids)
        object.__setattr__(self, "block_size", block_size)

    @property
    def capacity(self) -> int:
        """Positions the table holds: ``0 .. capacity-1``."""
        return len(self.block_ids) * self.block_size

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 slots of ``positions`` (int64, any shape, each in ``[0, capacity)``), on their device."""
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64:
            got = _fmt(positions) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise LayoutError(f"positions: expected an int64 tensor, got {got}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.capacity):
            raise LayoutError(f"positions: expected positions in [0, {self.capacity}) (the table's "
                              f"{len(self.block_ids)} blocks of {self.block_size}), got range "
                              f"[{int(positions.min())}, {int(positions.max())}]")
        table = torch.tensor(self.block_ids, dtype=torch.int64, device=positions.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def context(self, length: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, positions)`` of positions ``0 .. length-1``: a request's whole context so far."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.capacity:
            raise LayoutError(f"length: expected an int in [0, {self.capacity}], got {length!r}")
        positions = torch.arange(length, dtype=torch.int64, device=device)
        return self.slots(positions), positions
