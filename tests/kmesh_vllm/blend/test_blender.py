"""The blender on the tiny preset: the layer flow, ratio 1 against full recomputation, the group
modes against serial blends, originals and untouched memory, fallbacks and refused input."""

from __future__ import annotations

import pytest
import torch

from kmesh_vllm.blend import BlendChild, BlendConfig, BlendError, Blender, SegmentUse, block_tables
from kmesh_vllm.model import BlockTable, read_kv
from kmesh_vllm.workload import ChildSpec, SegmentRef, Workload
from tests.helpers.blend_setup import (MAX_NEW, block_kv, blender_for, build, same, small_workload, snapshot,
                                      spare_untouched)
from tests.helpers.memory_restorer import MemoryRestorer


def close(a, b, scale=1e-5):
    return torch.allclose(a, b, rtol=0, atol=scale * float(b.abs().max()))


def check_clean(s):
    assert s.restorer.digests() == s.digests, "a saved original changed"
    assert spare_untouched(s), "a block outside every table was written"


# ---------------------------------------------------------------------------------- the layer flow
def test_recompute_choices_follow_cacheblend(setup):
    s = setup
    child = s.children[0]
    out = blender_for(s, blend_recompute_ratios=(0.25,)).blend(child)
    T = len(child)
    restored = out.restored
    assert out.fallback is None and not bool(restored[-1])
    assert int(restored.sum()) == sum(len(u.segment) for u in child.segments) - (child.segments[-1].end == T)
    assert len(out.recompute) == s.model.num_layers
    assert torch.equal(out.recompute[0], torch.arange(T - 1))               # before the check layer: every row
    kept = out.recompute[1]
    gaps = torch.nonzero(~restored[:-1]).flatten()
    assert bool(torch.isin(gaps, kept).all())                                # rows without restored data, always
    n_restored = int(restored.sum())
    assert int(restored[kept].sum()) == max(int(n_restored * 0.25), 1)       # LMCache's count over restored rows
    assert all(torch.equal(r, kept) for r in out.recompute[2:])              # fixed after the check layer
    assert all(torch.equal(r, torch.sort(r).values) and r.dtype == torch.int64 for r in out.recompute)
    assert out.recomputed_position_layers == n_restored + 3 * max(int(n_restored * 0.25), 1)
    check_clean(s)


def test_cache_holds_restored_kv_where_rows_were_not_recomputed(setup):
    s = setup
    child = s.children[1]
    out = blender_for(s, blend_recompute_ratios=(0.2,)).blend(child)
    kv = out.prompt_kv()
    # the restored K/V alone: the same restore into a copy of the cache
    ref = MemoryRestorer(s.cache.clone(), s.layout, model_fingerprint=s.model.fingerprint, rope=s.model.rope)
    ref.originals = s.restorer.originals
    ref.restore(Blender(s.model, ref, BlendConfig(max_new_tokens=MAX_NEW))._prepare(child, 0).items)
    placed = []
    for layer in range(s.model.num_layers):
        placed.append(torch.stack(read_kv(ref.cache, s.layout, layer, out.prompt_slots)))
    placed = torch.stack(placed).transpose(0, 1)                             # (2, L, T, H, D)
    restored = out.restored
    for layer in range(1, s.model.num_layers):
        fresh = torch.zeros_like(restored)
        fresh[out.recompute[layer]] = True
        stale = restored & ~fresh
        assert torch.equal(kv[:, layer, stale], placed[:, layer, stale])    # not recomputed: the restored K/V
        assert not torch.equal(kv[:, layer, restored & fresh], placed[:, layer, restored & fresh])
    assert not bool(kv[:, :, :-1].isnan().any())                            # every prompt row written or restored


def test_ratio_one_equals_full_recomputation(setup):
    s = setup
    for child in s.children:
        full = snapshot(s.blender.full(child))
        out = blender_for(s, blend_recompute_ratios=(1.0,)).blend(child)
        assert out.fallback is None
        assert all(torch.equal(r, torch.arange(len(child) - 1)) for r in out.recompute)
        assert out.token_ids == full["tokens"]
        assert close(out.step_logits, full["step_logits"])
        assert close(out.prompt_kv(), full["kv"])
    check_clean(s)


@pytest.mark.parametrize("policy", ["cacheblend", "kmesh"])
def test_no_segments_is_full_recomputation(tiny, policy):
    w = Workload({"a": (5, 6, 7)}, None, (ChildSpec("plain", ((9, 10, 11, 12, 13, 14),)),))
    s = build(tiny, w)
    child = s.children[0]
    for mode in ("exact", "batched"):
        out = blender_for(s, policy=policy).blend_group([child], mode=mode)[0]
        full = s.blender.full(child)
        assert out.fallback is None and not bool(out.restored.any()) and s.restorer.calls == []
        assert out.token_ids == full.token_ids and close(out.logits, full.logits)


@pytest.mark.parametrize("case", ["start-and-end", "adjacent", "one-token", "all-restored", "one-token-prompt"])
def test_segment_placements(tiny, case):
    segs = {"a": tuple(range(20, 36)), "b": tuple(range(40, 52)), "c": (77,)}
    parts = {
        "start-and-end": (SegmentRef("a"), (3, 4, 5, 6, 7), SegmentRef("b")),      # the last token is b's last
        "adjacent": ((3, 4), SegmentRef("a"), SegmentRef("b"), SegmentRef("c"), (8, 9)),   # empty gaps
        "one-token": ((3, 4, 5), SegmentRef("c"), (6, 7, 8), SegmentRef("c"), (9,)),
        "all-restored": (SegmentRef("a"),),
        "one-token-prompt": (SegmentRef("c"),),
    }[case]
    w = Workload(segs, (SegmentRef("a"), (1, 2), SegmentRef("b"), (1,), SegmentRef("c")), (ChildSpec("x", parts),))
    s = build(tiny, w)
    child = s.children[0]
    T = len(child)
    for policy in ("kmesh", "cacheblend"):
        out = blender_for(s, policy=policy).blend(child)
        assert out.fallback is None
    for ratio in (0.0, 0.5, 1.0):
        out = blender_for(s, blend_recompute_ratios=(ratio,)).blend(child)
        assert out.fallback is None
        assert not bool(out.restored[-1]) and out.restored.shape[0] == T
        n_restored = int(out.restored.sum())
        after = out.recompute[-1]
        want = max(int(n_restored * ratio), 1) if n_restored else 0
        assert int(out.restored[after].sum()) == want
        assert int((~out.restored[after]).sum()) == T - 1 - n_restored
    full = s.blender.full(child)
    assert out.token_ids == full.token_ids and close(out.step_logits, full.step_logits)
    check_clean(s)


def test_without_a_leader_each_segment_is_saved_from_position_zero(tiny):
    w = small_workload(seed=3)
    w = Workload(w.segments, None, w.children)
    s = build(tiny, w)
    assert all(torch.equal(seg.positions, torch.arange(len(seg))) for seg in s.saved.values())
    for child in s.children:
        out = blender_for(s, blend_recompute_ratios=(1.0,)).blend(child)
        full = s.blender.full(child)
        assert out.fallback is None and out.token_ids == full.token_ids and close(out.logits, full.logits)
    check_clean(s)


@pytest.mark.parametrize("layout_name,packing", [("NHD", "content"), ("HND", "planes"), ("BLHNC", "content")])
def test_any_layout_gives_the_same_bits(tiny, layout_name, packing):
    w = small_workload(seed=1)
    base = build(tiny, w)
    other = build(tiny, w, layout_name=layout_name, kv_packing=packing)
    for a, b in zip(base.children, other.children):
        x, y = snapshot(base.blender.blend(a)), snapshot(other.blender.blend(b))
        assert same(x, y)


# ---------------------------------------------------------------------------------- groups
@pytest.mark.parametrize("policy", [dict(), dict(policy="kmesh"), dict(blend_check_layers=(1, 2),
                                                                      blend_recompute_ratios=(0.5, 0.4))])
def test_exact_group_is_bit_identical_to_serial(setup, policy):
    s = setup
    b = blender_for(s, **policy)
    serial = [snapshot(b.blend(c)) for c in s.children]
    seen = []
    group = b.blend_group(s.children, mode="exact", on_layer=lambda i, layer: seen.append((i, layer)))
    assert all(same(snapshot(o), ref) for o, ref in zip(group, serial))
    L, C = s.model.num_layers, len(s.children)
    assert seen == [(i, layer) for layer in range(L) for i in range(C)]      # layer-major
    check_clean(s)


@pytest.mark.parametrize("policy", [dict(), dict(policy="kmesh", kmesh_check_layer=2, kmesh_sink_tokens=3)])
def test_batched_group_agrees_with_serial(setup, policy):
    s = setup
    b = blender_for(s, **policy)
    serial = [snapshot(b.blend(c)) for c in s.children]
    group = [snapshot(o) for o in b.blend_group(s.children, mode="batched")]
    for o, ref in zip(group, serial):
        assert o["fallback"] is None and o["tokens"] == ref["tokens"]
        assert close(o["step_logits"], ref["step_logits"])
        assert close(o["kv"].nan_to_num(0), ref["kv"].nan_to_num(0))
        assert all(torch.equal(x, y) for x, y in zip(o["recompute"], ref["recompute"]))
    check_clean(s)


def test_children_write_only_their_own_blocks(setup):
    s = setup
    for c in s.children:
        before = [blocks_of(s, other) for other in s.children if other is not c]
        s.blender.blend(c)
        after = [blocks_of(s, other) for other in s.children if other is not c]
        assert all(torch.equal(x.nan_to_num(7), y.nan_to_num(7)) for x, y in zip(before, after))
    check_clean(s)


def blocks_of(s, child):
    return torch.stack([block_kv(s, b) for b in child.table.block_ids])


# ---------------------------------------------------------------------------------- failures
def test_missing_segment_falls_back_to_full(setup):
    s = setup
    child = s.children[0]
    lost = child.segments[1].segment
    del s.restorer.originals[lost.key]
    out = s.blender.blend(child)
    assert out.fallback is not None and "SegmentNotFound" in out.fallback and lost.key in out.fallback
    assert not bool(out.restored.any())
    full = snapshot(s.blender.full(child))
    assert same(snapshot(out), full)                                          # the recomputation's own bits


def test_corrupt_restore_poisons_nothing(setup):
    s = setup
    child = s.children[2]
    s.restorer.corrupt(child.segments[0].segment.key)
    out = s.blender.blend(child)
    assert "IntegrityError" in out.fallback
    snap = snapshot(out)
    assert not bool(snap["kv"][:, :, :-1].isnan().any())                     # the NaN it left were recomputed
    assert same(snap, snapshot(s.blender.full(child)))


@pytest.mark.parametrize("mode", ["exact", "batched"])
def test_a_fault_in_one_child_leaves_its_siblings_alone(setup, mode):
    s = setup
    b = blender_for(s, blend_recompute_ratios=(0.3,))
    serial = [snapshot(b.blend(c)) for c in s.children]
    fulls = [snapshot(b.full(c)) for c in s.children]

    def fail_b(i, layer):
        if i == 1 and layer == 0:
            raise RuntimeError("injected after child B's first layer")

    group = b.blend_group(s.children, mode=mode, on_layer=fail_b)
    snaps = [snapshot(o) for o in group]
    assert "injected" in group[1].fallback and group[0].fallback is None and group[2].fallback is None
    assert same(snaps[1], fulls[1])                                           # B: the whole prompt without reuse
    for i in (0, 2):
        if mode == "exact":
            assert same(snaps[i], serial[i])
        else:
            assert snaps[i]["tokens"] == serial[i]["tokens"]
            assert close(snaps[i]["step_logits"], serial[i]["step_logits"])
    check_clean(s)


def test_batched_group_restore_failure_falls_back_only_that_child(setup):
    s = setup
    s.restorer.fail_after(1)                                                  # the group's one restore call fails
    lost = s.children[2].segments[0].segment
    del s.restorer.originals[lost.key]
    others = [c for c in s.children if lost.key not in [u.segment.key for u in c.segments]]
    group = s.blender.blend_group(s.children, mode="batched")
    assert "SegmentNotFound" in group[2].fallback
    for c, o in zip(s.children, group):
        if c in others:
            assert o.fallback is None


def test_a_failing_restore_after_placement_falls_back(setup):
    s = setup
    s.restorer.fail_after(1)
    out = s.blender.blend(s.children[0])
    assert "DrainError" in out.fallback
    assert same(snapshot(out), snapshot(s.blender.full(s.children[0])))


# ---------------------------------------------------------------------------------- refused input
def untouched(s, fn, match):
    before = s.cache.clone()
    calls = len(s.restorer.calls)
    with pytest.raises(BlendError, match=match):
        fn()
    assert torch.equal(before.nan_to_num(7), s.cache.nan_to_num(7)) and len(s.restorer.calls) == calls


def test_refuses_segment_tokens_that_do_not_match_the_prompt(setup):
    s = setup
    c = s.children[0]
    u = c.segments[1]
    ids = c.token_ids.clone()
    ids[u.start + 3] = (ids[u.start + 3] + 1) % 512
    bad = BlendChild(c.name, ids, c.segments, c.table)
    untouched(s, lambda: s.blender.blend(bad),
              rf"child 'child0': segment '{u.segment.name}' at start {u.start}: the prompt's tokens differ .* "
              rf"position {u.start + 3}")
    shifted = BlendChild(c.name, c.token_ids, (SegmentUse(u.segment, u.start + 1),), c.table)
    untouched(s, lambda: s.blender.blend(shifted), "the prompt's tokens differ")


def test_refuses_bad_children_before_any_work(setup, tiny):
    s = setup
    c = s.children[0]
    seg = c.segments[0].segment
    long = BlendChild("long", torch.arange(4094) % 500 + 3, (), BlockTable(range(300), 16))
    untouched(s, lambda: s.blender.blend(long), "past the model's limit of 4096")
    overlap = BlendChild("o", torch.cat([seg.token_ids, seg.token_ids]), (SegmentUse(seg, 0), SegmentUse(seg, 3)),
                         c.table)
    untouched(s, lambda: s.blender.blend(overlap), "not overlapping")
    past = BlendChild("p", seg.token_ids[:5], (SegmentUse(seg, 0),), c.table)
    untouched(s, lambda: s.blender.blend(past), "pass the prompt's end")
    small = BlendChild("s", c.token_ids, c.segments, BlockTable(c.table.block_ids[:2], 16))
    untouched(s, lambda: s.blender.blend(small), r"child 's': table: \d+ positions needed")
    outside = BlendChild("x", c.token_ids, c.segments, BlockTable([0, 1, 2, 999, 5, 6], 16))
    untouched(s, lambda: s.blender.blend(outside), "outside the cache")
    ids = c.token_ids.clone()
    ids[0] = 512
    untouched(s, lambda: s.blender.blend(BlendChild("v", ids, (), c.table)), r"token_ids: expected ids in \[0, 512\)")
    shared = [s.children[0], BlendChild("twin", s.children[1].token_ids, s.children[1].segments, c.table)]
    untouched(s, lambda: s.blender.blend_group(shared), "share block")
    untouched(s, lambda: s.blender.blend_group(s.children, mode="fast"), "mode: expected one of")


def test_refuses_a_restorer_that_does_not_fit(tiny):
    layout = tiny.kv_layout(num_blocks=4, block_size=16)
    cache = layout.allocate(fill=0)
    no_rope = MemoryRestorer(cache, layout, model_fingerprint=tiny.fingerprint)
    with pytest.raises(BlendError, match="restorer.rope: expected the model's RoPE spec"):
        Blender(tiny, no_rope)
    other = layout.__class__.from_vllm("LBHNC", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2,
                                       head_size=32, dtype=torch.float32)
    with pytest.raises(BlendError, match=r"restorer.layout: .* the model needs"):
        Blender(tiny, MemoryRestorer(other.allocate(), other, model_fingerprint=tiny.fingerprint, rope=tiny.rope))
    with pytest.raises(BlendError, match="blend_check_layers: layer 7 does not exist"):
        Blender(tiny, MemoryRestorer(cache, layout, model_fingerprint=tiny.fingerprint, rope=tiny.rope),
                BlendConfig(blend_check_layers=(7,)))


def test_block_tables_are_disjoint_and_checked(tiny):
    layout = tiny.kv_layout(num_blocks=6, block_size=16)
    a, b = block_tables(layout, [17, 40])
    assert a.block_ids == (0, 1) and b.block_ids == (2, 3, 4)
    with pytest.raises(BlendError, match="need 8 blocks"):
        block_tables(layout, [17, 40, 33])


def test_a_fault_during_a_serial_blend_falls_back(setup):
    s = setup
    child = s.children[0]

    def fail(i, layer):
        if layer == 2:
            raise ValueError("injected at layer 2")

    out = s.blender.blend(child, on_layer=fail)
    assert out.fallback.startswith("on_layer(0, 2): ValueError: injected")
    assert same(snapshot(out), snapshot(s.blender.full(child)))
    check_clean(s)


# ---------------------------------------------------------------------------------- repair only
def test_repair_is_the_blend_without_its_decode(setup):
    """``repair`` (what the vLLM connector runs) restores and repairs the prompt rows exactly as
    ``blend`` does: the same recompute choices and the same K/V in the child's prompt rows."""
    s = setup
    child = s.children[2]
    fixed = s.blender.repair(child)
    after_repair = _rows_kv(s, child)
    out = s.blender.blend(child)
    assert len(fixed.recompute) == len(out.recompute) == s.model.num_layers
    assert all(torch.equal(a, b) for a, b in zip(fixed.recompute, out.recompute))
    assert torch.equal(fixed.restored, out.restored)
    assert fixed.recomputed_position_layers == out.recomputed_position_layers
    assert torch.equal(after_repair.nan_to_num(7.0), _rows_kv(s, child).nan_to_num(7.0))
    check_clean(s)


def _rows_kv(s, child) -> torch.Tensor:
    """(2, L, T-1, H, D): every layer's K/V of the prompt's rows 0 .. T-2 (the last is the decode's)."""
    slots = child.table.slots(torch.arange(len(child) - 1))
    ks, vs = zip(*(read_kv(s.cache, s.layout, layer, slots) for layer in range(s.model.num_layers)))
    return torch.stack([torch.stack(ks), torch.stack(vs)])


def test_repair_raises_reuse_failed_when_a_segment_is_missing(setup):
    from kmesh_vllm.blend import ReuseFailed

    s = setup
    child = s.children[0]
    lost = child.segments[0].segment
    del s.restorer.originals[lost.key]
    with pytest.raises(ReuseFailed, match="SegmentNotFound") as info:
        s.blender.repair(child)
    assert info.value.__cause__ is not None
    assert spare_untouched(s)
