"""Shared set-up of the in-process restore tests: a cache that holds given segments, their items,
one-call restores through a fresh :class:`~kmesh_host.InProcessRestorer`, and the in-memory
reference placement."""

from __future__ import annotations

import torch

import kmesh_gpu
from kmesh_gpu import KVLayout
from kmesh_host import InProcessRestorer, RestoreItem, RouteConfig


def cache_for(store, keys, device="cpu", *, block_size: int = 16, fill: int = 0x7F, name: str = "NHD"):
    """``(layout, cache, items)``: a paged cache (``name`` layout, the segments' geometry and dtype)
    with room for every segment of ``keys``, and an item per key on consecutive slots, placed as
    stored (no ``new_positions``). A key listed twice gets its own slots each time."""
    headers = [store.read_header(k) for k in keys]
    _, L, _, H, D = headers[0].shape
    total = sum(h.num_tokens for h in headers)
    layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=max(1, -(-total // block_size)), block_size=block_size,
                                num_kv_heads=H, head_size=D, dtype=headers[0].torch_dtype)
    cache = layout.allocate(device, fill=fill)
    items, start = [], 0
    for k, h in zip(keys, headers):
        items.append(RestoreItem(k, torch.arange(start, start + h.num_tokens, device=device)))
        start += h.num_tokens
    return layout, cache, items


def restore_once(store, items, *, cache, layout, model_fingerprint, rope=None, tier=None, k_scale=None, **config):
    """One restore of ``items`` through a fresh restorer (``config``: :class:`RouteConfig` fields),
    closed afterwards (its private tier with it, when ``tier`` is None)."""
    with InProcessRestorer(store, cache, layout, model_fingerprint=model_fingerprint, rope=rope, tier=tier,
                           config=RouteConfig(**config), k_scale=k_scale) as restorer:
        return restorer.restore(items)


def fetch(store, keys, *, model_fingerprint, device="cpu", tier=None, **config):
    """Restore ``keys`` as stored into a cache made for them (:func:`cache_for`); returns the
    :class:`RestoreResult` (its ``kv`` views the landed objects)."""
    layout, cache, items = cache_for(store, keys, device)
    return restore_once(store, items, cache=cache, layout=layout, model_fingerprint=model_fingerprint, tier=tier,
                        **config)


def reference_cache(store, items, layout, device="cpu", *, rope=None, fill: int = 0x7F, fingerprint=None):
    """The in-memory path: the same placement of the segments ``SegmentStore.get`` returns (shifted
    items with ``rope``, the others as stored)."""
    cache = layout.allocate(device, fill=fill)
    for it in items:
        seg = store.get(it.key, model_fingerprint=fingerprint or store.read_header(it.key).fingerprint)
        if rope is None or it.new_positions is None:
            kmesh_gpu.place(seg.kv.to(device), cache, layout, it.slots)
        else:
            kmesh_gpu.place(seg.kv.to(device), cache, layout, it.slots, rope=rope,
                            old_positions=seg.positions.to(device), new_positions=it.new_positions)
    return cache


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical tensors of one dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
