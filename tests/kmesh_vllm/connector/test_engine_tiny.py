"""The connector in a real vLLM engine (single-process mode) with the tiny preset: a leader, four
children of the seed's shape (four 104-token segments in 512-token prompts), requests without
params, vLLM's own layers through VllmModel, and every failure falling back to recomputation.

One plain vLLM engine (no connector) runs first for the reference outputs and is shut down; then
one engine with the connector serves every test of the module.
"""

from __future__ import annotations

import pytest
import torch

from .engines import (child_params, first_difference, generate, kmesh_blend, kmesh_params, make_engine, save_params,
                      shutdown, token_logprobs, tokens)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from kmesh_vllm.model import write_preset

    return write_preset("tiny", tmp_path_factory.mktemp("presets") / "tiny")


@pytest.fixture(scope="module")
def workload():
    from kmesh_vllm.workload import synthetic

    return synthetic(512, children=4, segments=4, segment_tokens=104, prompt_tokens=512, seed=0)


@pytest.fixture(scope="module")
def plain(tiny_dir, workload):
    """Plain vLLM (no connector) on the children's prompts: tokens and logprobs."""
    llm = make_engine(tiny_dir, multiprocess=False)
    try:
        outs = generate(llm, [r.token_ids for r in workload.requests()], [None] * 4, max_tokens=MAX_TOKENS,
                        logprobs=True)
        return [(tokens(o), token_logprobs(o)) for o in outs]
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def engine(plain, tiny_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    llm = make_engine(tiny_dir, store_root=store, multiprocess=False)
    llm.store_root = store
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def leader(engine, workload):
    r = workload.leader_request()
    return generate(engine, [r.token_ids], [save_params(r)], max_tokens=MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def children(engine, workload, leader):
    rs = workload.requests()
    return generate(engine, [r.token_ids for r in rs], [child_params(r) for r in rs], max_tokens=MAX_TOKENS)


def worker_side():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def test_leader_saves_its_segments_by_name(engine, workload, leader):
    from kmesh_host import SegmentStore
    from kmesh_vllm.connector.records import ConnectorRecords

    p = kmesh_params(leader)
    assert "error" not in p, p
    spans = workload.leader_request().segments
    assert [(s["name"], s["start"], s["length"]) for s in p["saved"]] == [(s.name, s.start, s.length) for s in spans]
    store = SegmentStore(engine.store_root)
    names = ConnectorRecords(engine.store_root, namespace="default", engine_id="any")
    for s, span in zip(p["saved"], spans):
        header = store.verify(s["key"])
        assert header.positions.tolist() == list(range(span.start, span.end))
        assert header.token_ids.tolist() == workload.segment_ids(span.name).tolist()
        assert names.lookup(span.name) == s["key"]


def test_children_reuse_and_match_kmesh_blend(engine, workload, children, tiny_dir):
    """The children's tokens equal KMesh's own runner blending the same segments with the same weights."""
    from kmesh_vllm.model import load_model

    want = kmesh_blend(load_model(tiny_dir), workload, max_new_tokens=MAX_TOKENS)
    diffs = []
    for r, out, w in zip(workload.requests(), children, want):
        p = kmesh_params(out)
        assert p.get("reused") is True, p
        assert p["path"] == "in_process" and p["prompt_tokens"] == len(r)
        assert p["restored_tokens"] == sum(s.length for s in r.segments) - (r.segments[-1].end == len(r))
        if d := first_difference(tokens(out), w):
            diffs.append(f"{r.name}: {d}")
    assert not diffs, "; ".join(diffs)


def test_requests_without_params_are_plain_vllm(engine, workload, plain, children):
    """Bit-identical tokens and logprobs to an engine without the connector."""
    outs = generate(engine, [r.token_ids for r in workload.requests()], [None] * 4, max_tokens=MAX_TOKENS,
                    logprobs=True)
    for out, (want_tokens, want_logprobs) in zip(outs, plain):
        assert out.kv_transfer_params is None
        assert tokens(out) == want_tokens and token_logprobs(out) == want_logprobs


def test_vllm_model_greedy_tokens_equal_kmesh_runner(engine, tiny_dir, workload):
    """VllmModel (vLLM's modules of this engine) through the runner's steps on a KMesh cache."""
    from kmesh_vllm.connector import VllmModel
    from kmesh_vllm.model import BlockTable, load_model
    from kmesh_vllm.vllm_plugin import loaded_model

    module = loaded_model(engine.llm_engine.vllm_config)
    assert module is not None, "the plugin did not record the engine's model"
    ours = VllmModel(module, engine.llm_engine.vllm_config.model_config.hf_config.to_dict())
    ref = load_model(tiny_dir)
    assert (ours.rope, ours.fingerprint, ours.dtype) == (ref.rope, ref.fingerprint, ref.dtype)
    prompt = workload.requests()[0].token_ids
    table = BlockTable(range(1, 18), 32)
    got = []
    for m in (ours, ref):
        layout = m.kv_layout(18, 32, kv_packing="planes")
        with torch.inference_mode(False):
            got.append(m.generate(prompt, table, layout.allocate(fill=0), layout, max_new_tokens=12).token_ids)
    assert got[0] == got[1], first_difference(*got)


@pytest.fixture(scope="module")
def no_reuse(engine, workload, children):
    """The children's prompts in this engine without params (equal to plain vLLM, tested above)."""
    return [tokens(o) for o in generate(engine, [r.token_ids for r in workload.requests()], [None] * 4,
                                        max_tokens=MAX_TOKENS)]


def test_corrupt_segment_recomputes_without_reuse(engine, workload, leader, no_reuse):
    """A second leader (its prompt one token later: other positions, other keys) saves 'c-' names;
    one payload byte flipped on disk; the child that uses it is recomputed by vLLM."""
    from kmesh_host import SegmentStore

    r = workload.leader_request()
    shifted = torch.cat([torch.tensor([5]), r.token_ids])
    p = save_params(r)
    for s in p["kmesh"]["save"]:
        s.update(name="c-" + s["name"], start=s["start"] + 1)
    saved = kmesh_params(generate(engine, [shifted], [p], max_tokens=1)[0])["saved"]
    store = SegmentStore(engine.store_root)
    victim = saved[2]["key"]
    header = store.read_header(victim)
    with open(store.path(victim), "r+b") as f:
        f.seek(header.payload_offset + header.payload_length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    i, child = next((i, c) for i, c in enumerate(workload.requests()) if any(s.name == "seg2" for s in c.segments))
    out = generate(engine, [child.token_ids], [child_params(child, prefix="c-")], max_tokens=MAX_TOKENS)[0]
    p = kmesh_params(out)
    assert p["reused"] is False and "IntegrityError" in p["fallback"], p
    assert tokens(out) == no_reuse[i]


def test_missing_and_foreign_segments_are_not_claimed(engine, workload, no_reuse):
    from kmesh_host import ModelFingerprint, SegmentStore
    from kmesh_vllm.connector.records import ConnectorRecords

    child = workload.requests()[1]
    seg = child.segments[0]
    other = ModelFingerprint("Qwen2ForCausalLM", 4, 2, 32, "bfloat16", {})
    kv = torch.zeros(2, 4, seg.length, 2, 32, dtype=torch.bfloat16)
    key = SegmentStore(engine.store_root).put(kv, workload.segment_ids(seg.name), torch.arange(seg.length),
                                              model_fingerprint=other)
    ConnectorRecords(engine.store_root, namespace="default", engine_id="any").bind("foreign", key)
    cases = {"missing": [{"name": "never-saved", "start": seg.start}],
             "foreign": [{"name": "foreign", "start": seg.start}],
             "misplaced": [{"name": seg.name, "start": seg.start + 1}]}
    outs = generate(engine, [child.token_ids] * 3, [{"kmesh": {"segments": c}} for c in cases.values()],
                    max_tokens=MAX_TOKENS)
    reasons = [kmesh_params(o).get("reason", "") for o in outs]
    assert "is not saved in namespace 'default'" in reasons[0]
    assert "saved by a different model (dtype" in reasons[1]
    assert "the prompt's token at position" in reasons[2]
    for o in outs:
        assert kmesh_params(o)["reused"] is False and tokens(o) == no_reuse[1]


def test_fault_during_repair_recomputes_only_that_child(engine, workload, children, no_reuse, monkeypatch):
    """A fault in vLLM's layers during one child's repair: that child is recomputed by vLLM (its
    tokens are those of no reuse); a child and a plain request in the same step are unaffected."""
    w = worker_side()
    real = w.model.finish
    calls = {"n": 0}

    def finish(layer, hidden_in, attn_out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault in layer 1")
        return real(layer, hidden_in, attn_out)

    monkeypatch.setattr(w.model, "finish", finish)
    rs = workload.requests()
    outs = generate(engine, [rs[0].token_ids, rs[1].token_ids, rs[2].token_ids],
                    [child_params(rs[0]), child_params(rs[1]), None], max_tokens=MAX_TOKENS)
    failed, good, plain_one = outs
    assert kmesh_params(failed)["reused"] is False and "injected fault" in kmesh_params(failed)["fallback"]
    assert tokens(failed) == no_reuse[0]
    assert kmesh_params(good)["reused"] is True and tokens(good) == tokens(children[1])
    assert tokens(plain_one) == no_reuse[2]


def test_malformed_params_run_plain_and_say_why(engine, workload, no_reuse):
    r = workload.requests()[3]
    out = generate(engine, [r.token_ids], [{"kmesh": {"segments": [{"name": "seg0"}]}}], max_tokens=MAX_TOKENS)[0]
    assert kmesh_params(out) == {"error": "kv_transfer_params.kmesh.segments[0].start: missing"}
    assert tokens(out) == no_reuse[3]
