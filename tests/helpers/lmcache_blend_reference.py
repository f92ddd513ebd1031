"""LMCache's CacheBlend selection, restated line for line from ``LMCBlender.process_qkv``
(``lmcache/v1/compute/blend/blender.py``) so that tests compare KMesh's ``CacheBlendSelection``
with it without importing lmcache (not installed). ``k`` and ``old_k`` are ``[T, Hkv*D]`` as
LMCache holds them (the projections' output rows, post-RoPE; ``old_k`` the retrieved buffer)."""

from __future__ import annotations

import torch


def lmcache_check_layer(k: torch.Tensor, old_k: torch.Tensor, recomp_ratios: list[float]) -> torch.Tensor:
    diff_k = torch.sum(
        (k.to(torch.float32) - old_k.to(torch.float32)) ** 2, dim=[1]
    )
    total_len = diff_k.shape[0]

    topk_num = int(total_len * recomp_ratios[0])
    topk_num = max(topk_num, 1)

    top_indices = torch.topk(diff_k, k=topk_num).indices
    top_indices, _ = torch.sort(top_indices)
    return top_indices
