"""Position-masked GQA attention against torch's scaled_dot_product_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kmesh_vllm.model.attention import context_attention


def test_equals_causal_sdpa_for_a_prompt_in_any_row_order():
    g = torch.Generator().manual_seed(0)
    S, Hq, Hkv, D = 11, 6, 2, 16
    q = torch.randn(S, Hq, D, generator=g)
    k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    pos = torch.arange(S)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                         v.repeat_interleave(3, 1).transpose(0, 1), is_causal=True)
    ref = ref.transpose(0, 1).reshape(S, Hq * D)
    assert torch.allclose(context_attention(q, pos, k, v, pos), ref, atol=1e-6)
    perm = torch.randperm(S, generator=g)  # context entries in any order, queries a subset in any order
    rows = perm[:4]
    out = context_attention(q[rows], pos[rows], k[perm], v[perm], pos[perm])
    assert torch.allclose(out, ref[rows], atol=1e-6)


def test_bf16_inputs_are_computed_in_fp32():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, 8, generator=g).bfloat16() for _ in range(3))
    pos = torch.arange(5)
    out = context_attention(q, pos, k, v, pos)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, context_attention(q.float(), pos, k.float(), v.float(), pos).bfloat16())
