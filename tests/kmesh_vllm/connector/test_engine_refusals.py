"""Engine-wide refusals in real engines (tiny preset, single-process): vLLM's CPU attention on its
``amx`` ISA (a bf16 model on an AMX host) is refused at registration, after which nothing is saved
or reused and vLLM runs as without a connector; with prefix caching on, or vLLM's default
kv_load_failure_policy, children are not claimed (leaders still save)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cpu_features import CpuFeatures, cpu_attn_isa

from .engines import child_params, generate, kmesh_params, make_engine, save_params, shutdown, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOST = CpuFeatures.of_this_host()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from kmesh_vllm.model import write_preset

    return write_preset("tiny", tmp_path_factory.mktemp("presets") / "tiny")


@pytest.fixture(scope="module")
def workload():
    from kmesh_vllm.workload import synthetic

    return synthetic(512, children=1, segments=2, segment_tokens=64, prompt_tokens=256, seed=1)


def run_leader_and_child(llm, workload):
    leader, child = workload.leader_request(), workload.requests()[0]
    lo = generate(llm, [leader.token_ids], [save_params(leader)], max_tokens=1)[0]
    co, plain = generate(llm, [child.token_ids] * 2, [child_params(child), None], max_tokens=6)
    return kmesh_params(lo), kmesh_params(co), tokens(co) == tokens(plain)


@pytest.mark.skipif(not HOST.x86_64 or cpu_attn_isa(HOST, torch.bfloat16, 32, 32) != "amx",
                    reason=f"needs a host where vLLM's CPU attention picks the amx ISA (AMX tiles); this host: "
                           f"{HOST.describe()}")
def test_amx_cache_is_refused_and_vllm_runs_as_without_a_connector(tiny_dir, workload, tmp_path):
    llm = make_engine(tiny_dir, store_root=tmp_path, multiprocess=False, dtype="bfloat16")
    try:
        leader, child, same = run_leader_and_child(llm, workload)
    finally:
        shutdown(llm)
    assert leader["saved"] == [] and "'amx' ISA" in leader["error"], leader
    assert child["reused"] is False and "'amx' ISA" in child["reason"], child
    assert same


def test_prefix_caching_on_refuses_children_not_leaders(tiny_dir, workload, tmp_path):
    llm = make_engine(tiny_dir, store_root=tmp_path, multiprocess=False, enable_prefix_caching=True)
    try:
        leader, child, same = run_leader_and_child(llm, workload)
    finally:
        shutdown(llm)
    assert len(leader["saved"]) == 2 and "error" not in leader, leader
    assert child["reused"] is False and "prefix caching is on" in child["reason"], child
    assert same


def test_failure_policy_fail_refuses_children(tiny_dir, workload, tmp_path):
    """With vLLM's default kv_load_failure_policy ("fail") a failed restore would fail the request."""
    llm = make_engine(tiny_dir, store_root=tmp_path, multiprocess=False, kv_load_failure_policy="fail")
    try:
        leader, child, same = run_leader_and_child(llm, workload)
    finally:
        shutdown(llm)
    assert len(leader["saved"]) == 2, leader
    assert child["reused"] is False and "kv_load_failure_policy is 'fail'" in child["reason"], child
    assert same
