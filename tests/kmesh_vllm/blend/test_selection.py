"""Selection policies: LMCache's choice restated, counting, ties, batched top-k, the kmesh budget."""

from __future__ import annotations

import pytest
import torch

from kmesh_vllm.blend import (BlendConfig, BlendError, CacheBlendSelection, CheckView, KMeshSelection, cacheblend_cost,
                              k_deviation, kmesh_count, lmcache_topk, selection_for)
from tests.helpers.lmcache_blend_reference import lmcache_check_layer

H, D = 2, 8


def view(n, seed=0, *, check_index=0, positions=None, offsets=None, restored_count=None, fresh=None):
    g = torch.Generator().manual_seed(seed)
    fk = torch.randn(n, H, D, generator=g) if fresh is None else fresh
    rk = torch.randn(n, H, D, generator=g)
    fv, rv = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    positions = torch.arange(n) * 2 + 3 if positions is None else positions
    offsets = torch.arange(n) % 5 + 20 if offsets is None else offsets
    count = n if restored_count is None else restored_count
    return CheckView(1, check_index, positions, fk, fv, rk, rv, offsets, count)


# ---------------------------------------------------------------------------------- LMCache's lines
@pytest.mark.parametrize("ratio", [0.0, 0.01, 0.15, 0.3, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("n", [1, 2, 7, 415])
def test_cacheblend_is_lmcache_restated(n, ratio):
    v = view(n, seed=n)
    got = CacheBlendSelection((1,), (ratio,)).select([v])[0]
    ref = lmcache_check_layer(v.fresh_k.reshape(n, H * D), v.restored_k.reshape(n, H * D), [ratio])
    assert torch.equal(got, v.positions[ref])
    assert got.shape[0] == max(int(n * ratio), 1)
    assert torch.equal(got, torch.sort(got).values)


def test_counts_follow_lmcache_rounding():
    diff = torch.rand(415)
    assert lmcache_topk(diff, 0.15).shape[0] == 62         # int(62.25)
    assert lmcache_topk(diff, 0.0).shape[0] == 1           # at least one
    assert lmcache_topk(diff, 1.0).shape[0] == 415
    assert lmcache_topk(torch.zeros(0), 0.15).shape[0] == 0  # no restored rows: nothing to choose
    assert torch.equal(lmcache_topk(torch.tensor([0.1, 5.0, 0.2, 4.0]), 0.5), torch.tensor([1, 3]))


def test_k_deviation_is_lmcache_diff_k_in_fp32():
    a = torch.randn(9, H, D).bfloat16()
    b = torch.randn(9, H, D).bfloat16()
    ref = torch.sum((a.reshape(9, -1).float() - b.reshape(9, -1).float()) ** 2, dim=[1])
    assert k_deviation(a, b).dtype == torch.float32 and torch.equal(k_deviation(a, b), ref)


def test_ties_match_lmcache_and_batched_keeps_the_count():
    fresh = torch.zeros(10, H, D)
    v = view(10, fresh=fresh)
    v = CheckView(1, 0, v.positions, fresh, v.fresh_v, fresh.clone(), v.restored_v, v.segment_offsets,
                  10)                                                 # every deviation 0: all tied
    got = CacheBlendSelection((1,), (0.3,)).select([v])[0]
    ref = lmcache_check_layer(fresh.reshape(10, -1), fresh.reshape(10, -1), [0.3])
    assert torch.equal(got, v.positions[ref])
    batched = CacheBlendSelection((1,), (0.3,)).select([v, view(4)])
    assert batched[0].shape[0] == 3 and bool(torch.isin(batched[0], v.positions).all())


def test_batched_selection_equals_one_by_one():
    views = [view(n, seed=n, check_index=i % 2) for i, n in enumerate([5, 40, 1, 17, 0])]
    sel = CacheBlendSelection((1, 3), (0.3, 0.5))
    one = [sel.select([v])[0] if v.positions.numel() else torch.zeros(0, dtype=torch.int64) for v in views]
    together = sel.select(views)
    assert all(torch.equal(a, b) for a, b in zip(one, together))
    assert [t.shape[0] for t in together] == [1, 20, 1, 8, 0]   # a second check layer keeps 0.5


def test_several_check_layers_use_their_ratio_then_the_last():
    sel = CacheBlendSelection((1, 2, 3), (0.5, 0.25))
    assert [sel.ratio(i) for i in range(3)] == [0.5, 0.25, 0.25]
    assert cacheblend_cost(100, 5, (1, 2, 3), (0.5, 0.25)) == 100 + 50 + 12 + 3 + 3


def test_cacheblend_cost_of_the_default():
    # SmolLM2 (30 layers), 415 restored rows: layer 0 all, layers 1..29 the 62 kept
    assert cacheblend_cost(415, 30, (1,), (0.15,)) == 415 + 29 * 62
    assert cacheblend_cost(0, 30, (1,), (0.15,)) == 0
    assert cacheblend_cost(415, 30, (1,), (1.0,)) == 415 * 30


# ---------------------------------------------------------------------------------- kmesh
@pytest.mark.parametrize("check_layer", [0, 1, 2, 5])
@pytest.mark.parametrize("restored", [1, 37, 415])
def test_kmesh_count_spends_the_budget(check_layer, restored):
    budget = cacheblend_cost(restored, 30, (1,), (0.15,))
    k = kmesh_count(restored, 30, budget, check_layer)
    cost = restored * check_layer + (30 - check_layer) * k
    assert 1 <= k <= restored
    if restored * check_layer + 30 - check_layer <= budget:                # the budget affords a row
        assert cost <= budget and budget - cost < 30 - check_layer
    assert kmesh_count(0, 30, budget, check_layer) == 0


def kmesh(**kw):
    return KMeshSelection(BlendConfig(policy="kmesh", **kw), 30)


def test_kmesh_without_its_ideas_equals_cacheblend():
    v = view(415, seed=3)
    cb = CacheBlendSelection((1,), (0.15,)).select([v])[0]
    assert torch.equal(cb, kmesh(kmesh_sink_tokens=0, kmesh_value_weight=0.0).select([v])[0])


def test_kmesh_keeps_sinks_first_then_deviation():
    offsets = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5] * 10)
    v = view(100, offsets=offsets)
    sel = kmesh(kmesh_sink_tokens=1, kmesh_value_weight=0.0, blend_recompute_ratios=(0.3,))
    got = sel.select([v])[0]
    k = sel.count(100)
    assert got.shape[0] == k and bool(torch.isin(v.positions[offsets == 0], got).all())
    rest = v.positions[offsets > 0]
    dev = k_deviation(v.fresh_k, v.restored_k)[offsets > 0]
    want = rest[torch.topk(dev, k=k - 20).indices]
    assert bool(torch.isin(want, got).all())


def test_kmesh_value_weight_changes_the_ranking():
    v = view(50, seed=5)
    plain = kmesh(kmesh_sink_tokens=0, kmesh_value_weight=0.0, blend_recompute_ratios=(0.2,)).select([v])[0]
    with_v = kmesh(kmesh_sink_tokens=0, kmesh_value_weight=5.0, blend_recompute_ratios=(0.2,)).select([v])[0]
    assert plain.shape == with_v.shape and not torch.equal(plain, with_v)


def test_kmesh_batched_equals_one_by_one():
    views = [view(n, seed=n, offsets=torch.arange(n) % 9) for n in [5, 40, 1, 17]]
    sel = kmesh()
    assert all(torch.equal(sel.select([v])[0], b) for v, b in zip(views, sel.select(views)))


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs,match", [
    (dict(blend_check_layers=()), "blend_check_layers: expected a non-empty"),
    (dict(blend_check_layers=(2, 1)), "increasing layers"),
    (dict(blend_recompute_ratios=(1.5,)), r"blend_recompute_ratios: expected .* in \[0.0, 1.0\]"),
    (dict(policy="lmcache"), "policy: expected one of"),
    (dict(kmesh_check_layer=-1), "kmesh_check_layer: expected an int >= 0"),
    (dict(kmesh_sink_tokens=1.5), "kmesh_sink_tokens: expected an int >= 0"),
    (dict(kmesh_value_weight=-1), "kmesh_value_weight: expected a number >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens: expected an int >= 1"),
])
def test_config_refuses(kwargs, match):
    with pytest.raises(BlendError, match=match):
        BlendConfig(**kwargs)


def test_check_layers_must_exist_in_the_model():
    with pytest.raises(BlendError, match="blend_check_layers: layer 4 does not exist"):
        selection_for(BlendConfig(blend_check_layers=(1, 4)), 4)
    with pytest.raises(BlendError, match="kmesh_check_layer: layer 4 does not exist"):
        selection_for(BlendConfig(policy="kmesh", kmesh_check_layer=4), 4)
    assert isinstance(selection_for(BlendConfig(policy="kmesh"), 4), KMeshSelection)
