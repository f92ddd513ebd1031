"""Attention of query rows over a request's context, by positions (GQA, fp32 softmax).

The context is whatever K/V entries the caller names (read from the paged cache); a query at
position ``p`` attends to every entry whose position is ``<= p``. That is the causal mask of a
prefill, a decode step and a partial recomputation alike, whatever the order of rows and entries.
"""

from __future__ import annotations

import torch


def context_attention(q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_positions: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with the position mask, computed in fp32.

    Args:
        q: ``[S, Hq, D]`` queries (post-RoPE), any float dtype.
        q_positions: int64[S].
        k, v: ``[C, Hkv, D]`` context keys (post-RoPE) and values; Hq is a multiple of Hkv and query
            head ``h`` reads KV head ``h // (Hq // Hkv)``.
        k_positions: int64[C].
    Returns:
        ``[S, Hq*D]`` in ``q``'s dtype (the heads concatenated, as ``o_proj`` reads them).

    Every query must see at least one entry (the caller checks; otherwise its row is NaN).
    """
    S, Hq, D = q.shape
    C, Hkv, _ = k.shape
    group = Hq // Hkv
    # [Hkv, group*S, D]: the query heads that share a KV head become rows of one matmul.
    qg = q.float().view(S, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * S, D)
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)          # [Hkv, C, D]
    scores = torch.matmul(qg, kf.transpose(1, 2)) * (D ** -0.5)            # [Hkv, group*S, C]
    visible = k_positions[None, :] <= q_positions[:, None]                 # [S, C]
    scores = scores.view(Hkv, group, S, C).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(Hkv, group * S, C)
    out = torch.matmul(probs, vf)                                           # [Hkv, group*S, D]
    return out.view(Hkv, group, S, D).permute(2, 0, 1, 3).reshape(S, Hq * D).to(q.dtype)
