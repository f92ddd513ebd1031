"""The connector in vLLM's default multi-process mode (engine-core and worker processes) with the real
SmolLM2-135M-Instruct: the document-QA workload's leader and four children, requests without params,
vLLM's own layers through VllmModel, and a corrupt segment.

A plain vLLM engine (single-process, in the test's process; no connector; started first) gives the
references and the model module for VllmModel; the connector's engine runs in its own processes.
"""

from __future__ import annotations

import pytest
import torch

from .engines import (child_params, first_difference, generate, kmesh_blend, kmesh_params, make_engine, save_params,
                      shutdown, token_logprobs, tokens)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
KV_BYTES = 160 << 20  # 30 layers x 3 KV heads x 64 x fp32: ~46 KB a token


@pytest.fixture(scope="module")
def smol():
    from kmesh_vllm.model import load_model, pretrained_folder

    return pretrained_folder("smollm2-135m"), load_model("smollm2-135m")


@pytest.fixture(scope="module")
def workload(smol):
    from kmesh_vllm.workload import document_qa

    return document_qa(smol[1].tokenizer, chat_template=smol[1].chat_template)


@pytest.fixture(scope="module")
def plain(smol):
    llm = make_engine(smol[0], multiprocess=False, kv_cache_bytes=KV_BYTES)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def engine(plain, smol, tmp_path_factory):
    # after `plain`: vLLM 0.32 cannot start an in-process engine once llvmlite (KMesh's numba
    # kernels) is loaded (triton_utils/dispatcher.py:_rebind_kernels reads vars() of every module
    # attribute; llvmlite's _lib_fn_wrapper answers with no dict)
    store = tmp_path_factory.mktemp("store")
    llm = make_engine(smol[0], store_root=store, multiprocess=True, kv_cache_bytes=KV_BYTES)
    llm.store_root = store
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def leader(engine, workload):
    r = workload.leader_request()
    return generate(engine, [r.token_ids], [save_params(r)], max_tokens=1)[0]


@pytest.fixture(scope="module")
def children(engine, workload, leader):
    rs = workload.requests()
    return generate(engine, [r.token_ids for r in rs], [child_params(r) for r in rs], max_tokens=MAX_TOKENS)


def test_leader_in_its_prefill_step_returns_its_keys(leader, workload):
    """max_tokens=1: the request ends in the step that computes its prompt; the keys still come back."""
    p = kmesh_params(leader)
    assert [s["name"] for s in p["saved"]] == [s.name for s in workload.leader_request().segments], p


def test_children_reuse_and_match_kmesh_blend(children, workload, smol):
    want = kmesh_blend(smol[1], workload, max_new_tokens=MAX_TOKENS)
    diffs = []
    for r, out, w in zip(workload.requests(), children, want):
        assert kmesh_params(out).get("reused") is True, kmesh_params(out)
        if d := first_difference(tokens(out), w):
            diffs.append(f"{r.name}: {d}")
    assert not diffs, "; ".join(diffs)


def test_requests_without_params_are_plain_vllm(engine, plain, workload, children):
    prompts = [r.token_ids for r in workload.requests()]
    got = generate(engine, prompts, [None] * 4, max_tokens=MAX_TOKENS, logprobs=True)
    want = generate(plain, prompts, [None] * 4, max_tokens=MAX_TOKENS, logprobs=True)
    for g, w in zip(got, want):
        assert tokens(g) == tokens(w) and token_logprobs(g) == token_logprobs(w)


def test_vllm_model_greedy_tokens_equal_kmesh_runner(plain, smol, workload):
    from kmesh_vllm.connector import VllmModel
    from kmesh_vllm.model import BlockTable
    from kmesh_vllm.vllm_plugin import loaded_model

    vc = plain.llm_engine.vllm_config
    ours, ref = VllmModel(loaded_model(vc), vc.model_config.hf_config.to_dict()), smol[1]
    assert (ours.rope, ours.fingerprint) == (ref.rope, ref.fingerprint)
    prompt = workload.requests()[0].token_ids
    table = BlockTable(range(1, 18), 32)
    got = []
    for m in (ours, ref):
        layout = m.kv_layout(18, 32, kv_packing="planes")
        with torch.inference_mode(False):
            got.append(m.generate(prompt, table, layout.allocate(fill=0), layout, max_new_tokens=12).token_ids)
    assert got[0] == got[1], first_difference(*got)


def test_corrupt_segment_recomputes_without_reuse(engine, plain, workload, leader):
    from kmesh_host import SegmentStore

    store = SegmentStore(engine.store_root)
    key = kmesh_params(leader)["saved"][0]["key"]
    header = store.read_header(key)
    with open(store.path(key), "r+b") as f:
        f.seek(header.payload_offset + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    child = next(r for r in workload.requests() if r.segments[0].name == workload.leader_request().segments[0].name
                 or any(s.name == workload.leader_request().segments[0].name for s in r.segments))
    out = generate(engine, [child.token_ids], [child_params(child)], max_tokens=MAX_TOKENS)[0]
    assert kmesh_params(out)["reused"] is False and "IntegrityError" in kmesh_params(out)["fallback"]
    assert tokens(out) == tokens(generate(plain, [child.token_ids], [None], max_tokens=MAX_TOKENS)[0])
