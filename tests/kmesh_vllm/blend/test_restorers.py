"""The blender over the real in-process restorer (segment files in a store, host staging, placement):
the same bits as over the in-memory test restorer, and its failures fall back."""

from __future__ import annotations

import torch

from kmesh_host import SegmentStore
from kmesh_host.restore import InProcessRestorer
from kmesh_vllm.blend import BlendConfig, Blender, block_tables
from tests.helpers.blend_setup import MAX_NEW, build, same, small_workload, snapshot


def in_process(s, tmp_path):
    """The same workload saved through an InProcessRestorer into its own cache (NaN) and store."""
    cache = s.layout.allocate(fill=float("nan"))
    restorer = InProcessRestorer(SegmentStore(tmp_path / "store"), cache, s.layout,
                                 model_fingerprint=s.model.fingerprint, rope=s.model.rope)
    blender = Blender(s.model, restorer, BlendConfig(max_new_tokens=MAX_NEW))
    lead, *tables = block_tables(s.layout, [len(s.workload.leader_request())] +
                                 [len(c) + MAX_NEW for c in s.children])
    children = blender.children(s.workload, blender.save_segments(s.workload, lead), tables)
    return restorer, blender, children


def test_in_process_restorer_gives_the_same_bits(tiny, tmp_path):
    s = build(tiny, small_workload(seed=2))
    restorer, blender, children = in_process(s, tmp_path)
    with restorer:
        ours = [snapshot(o) for o in blender.blend_group(children, mode="exact")]
        assert all(o["fallback"] is None for o in ours)
        assert all(same(a, snapshot(s.blender.blend(c))) for a, c in zip(ours, s.children))
        assert all(o.restore_report.path == "in_process" for o in blender.blend_group(children, mode="batched"))


def test_in_process_failures_fall_back(tiny, tmp_path):
    s = build(tiny, small_workload(seed=2))
    restorer, blender, children = in_process(s, tmp_path)
    with restorer:
        lost = children[0].segments[0].segment.key
        restorer.store.delete(lost)
        out = blender.blend(children[0])
        assert "SegmentNotFound" in out.fallback
        full = s.blender.full(s.children[0])
        assert out.token_ids == full.token_ids and torch.equal(out.step_logits, full.step_logits)
        group = blender.blend_group(children, mode="batched")              # every child uses the lost one
        assert all("SegmentNotFound" in o.fallback for o in group)
