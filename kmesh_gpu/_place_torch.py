"""The torch backend of ``kmesh_gpu.place`` (the reference): each item's rows moved with advanced
indexing into flat views of the cache, K shifted by :func:`kmesh_gpu.rope.shift_fp32` first. Any
device torch runs on; the other backends are checked bit for bit against it."""

from __future__ import annotations

import numpy as np
import torch

from ._tables import _fp8_table
from .layout import KVLayout
from .rope import RopeSpec, shift_fp32

FP8_MAX = 448.0


def _offsets(layout: KVLayout, which: int, layer, slots: torch.Tensor, per_layer: bool) -> torch.Tensor:
    """int64 element offsets, shape (L or 1, T, H, D), for K (which=0) or V (which=1)."""
    st = layout.k_strides if which == 0 else layout.v_strides
    off = layout.k_offset if which == 0 else layout.v_offset
    dev = slots.device
    N = layout.block_size
    blk, pos = slots // N, slots % N
    h = torch.arange(layout.num_kv_heads, device=dev)
    d = torch.arange(layout.head_size, device=dev)
    lyr = torch.as_tensor(layer, device=dev).reshape(-1, 1, 1, 1)
    lstride = 0 if per_layer else st[0]
    return (off + lyr * lstride + (blk * st[1] + pos * st[3]).reshape(1, -1, 1, 1)
            + (h * st[2]).reshape(1, 1, -1, 1) + (d * st[4]).reshape(1, 1, 1, -1))


def _shifted_keys(k: torch.Tensor, old, new, rope: RopeSpec, scale, layout: KVLayout) -> torch.Tensor:
    """K (L, T, H, D) in storage dtype -> shifted K in storage dtype (one rounding)."""
    if layout.storage_dtype == torch.uint8:
        s = scale.to(k.device).reshape(-1, 1, 1, 1)
        x = _fp8_table(str(k.device))[k.long()] * s
        y = shift_fp32(x, old, new, rope)
        return (y / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return shift_fp32(k.float(), old, new, rope).to(k.dtype)


def torch_run(items, cache_views, layout, rope, scale, *, gather: bool) -> None:
    """Place (or, ``gather``, read back) every item of a validated launch (``place._Launch``'s
    items and cache views)."""
    for it in items:
        flats, per_layer = cache_views[it.cache_key]
        dev = it.kv.device
        valid = it.slots >= 0
        if not bool(valid.any()):
            continue
        vidx = torch.from_numpy(np.flatnonzero(valid)).to(dev)
        sl = torch.from_numpy(it.slots[valid]).to(dev)
        src = it.kv.index_select(2, vidx)  # (2, L, T', H, D)
        if rope is not None and not gather:
            k = _shifted_keys(src[0], torch.from_numpy(it.old[valid]).to(dev), torch.from_numpy(it.new[valid]).to(dev),
                              rope, scale, layout)
            src = torch.stack((k, src[1]))
        layers = range(layout.num_layers)
        for which in (0, 1):
            if per_layer:
                for l in layers:
                    off = _offsets(layout, which, 0, sl, True)[0]
                    if gather:
                        it.kv[which, l, vidx] = flats[l][off]
                    else:
                        flats[l][off] = src[which, l]
            else:
                off = _offsets(layout, which, torch.arange(layout.num_layers), sl, False)
                if gather:
                    it.kv[which][:, vidx] = flats[0][off]
                else:
                    flats[0][off] = src[which]
