"""vLLM engines for the connector's tests, and KMesh's own blend of the same children (the reference).

Engines run eagerly on the CPU with a small fixed KV cache, prefix caching off and blocks of 32
tokens (a 512-token prompt spans 16 blocks). ``multiprocess=False`` is vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler and worker in the test's process; one such engine
at a time per process, since vLLM keeps its worker connector process-wide); ``True`` runs vLLM's
engine-core and worker processes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import torch

BLOCK_SIZE = 32


@contextlib.contextmanager
def _multiprocessing(on: bool):
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@contextlib.contextmanager
def _llvmlite_hidden(on: bool):
    """Work around a vLLM 0.32 bug for in-process engines: the worker's init
    (``triton_utils/dispatcher.py:_rebind_kernels``) calls ``vars(x).get`` on every module attribute,
    and llvmlite's ``ffi.lib`` (loaded with Numba, e.g. by KMesh's tree digest of segments over
    256 KiB, or by other test modules) answers ``__dict__`` with a function wrapper: the engine fails
    to start with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. The module
    attributes holding that object are taken away while the engine starts, then put back."""
    hidden = []
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if on and ffi is not None:
        lib_type = type(ffi.lib)
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict):
                for name, value in list(namespace.items()):
                    if type(value) is lib_type:
                        hidden.append((module, name, value))
                        delattr(module, name)
    try:
        yield
    finally:
        for module, name, value in hidden:
            setattr(module, name, value)


def transfer_config(store_root, *, kv_load_failure_policy: str = "recompute", **extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KMeshConnector", kv_connector_module_path="kmesh_vllm.connector",
                            kv_role="kv_both", kv_load_failure_policy=kv_load_failure_policy,
                            kv_connector_extra_config={"store_root": str(store_root), **extra})


def make_engine(model, *, store_root=None, multiprocess: bool, kv_cache_bytes: int = 64 << 20,
                dtype: str = "float32", max_model_len: int = 2048, enable_prefix_caching: bool = False,
                kv_load_failure_policy: str = "recompute", **extra_config):
    """An ``LLM`` for ``model``, with the KMesh connector when ``store_root`` is given
    (``extra_config``: more ``kv_connector_extra_config``)."""
    from vllm import LLM

    kv = (transfer_config(store_root, kv_load_failure_policy=kv_load_failure_policy, **extra_config)
          if store_root is not None else None)
    with _multiprocessing(multiprocess), _llvmlite_hidden(not multiprocess):
        return LLM(model=str(model), dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=kv_cache_bytes,
                   enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len, block_size=BLOCK_SIZE,
                   seed=0, kv_transfer_config=kv)


def shutdown(llm) -> None:
    """Stop the engine (its processes in multi-process mode, the worker connector in single-process)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def generate(llm, prompts, params, *, max_tokens: int, logprobs: bool = False):
    """Greedy outputs of ``prompts`` (token id lists), request ``i`` with ``kv_transfer_params`` ``params[i]``."""
    from vllm import SamplingParams

    sps = [SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0 if logprobs else None,
                          extra_args=None if p is None else {"kv_transfer_params": p}) for p in params]
    outs = llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], sps, use_tqdm=False)
    return outs


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def token_logprobs(out) -> list[float]:
    return [step[t].logprob for t, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]


def kmesh_params(out) -> dict:
    return (out.kv_transfer_params or {}).get("kmesh", {})


def save_params(request) -> dict:
    return {"kmesh": {"save": [{"name": s.name, "start": s.start, "length": s.length} for s in request.segments]}}


def child_params(request, *, prefix: str = "", ratio: float | None = None) -> dict:
    p = {"segments": [{"name": prefix + s.name, "start": s.start} for s in request.segments]}
    if ratio is not None:
        p["recompute_ratio"] = ratio
    return {"kmesh": p}


def kmesh_blend(model, workload, *, max_new_tokens: int, ratio: float = 0.15) -> list[list[int]]:
    """KMesh's own run of ``workload``: its runner (``model``, a ``kmesh_vllm.model.Model`` on the same
    weights) prefills the leader, the in-memory test restorer keeps its segments (no store: see
    :func:`make_engine`), the Blender blends each child at ``ratio``; the children's greedy tokens."""
    from kmesh_vllm.blend import BlendConfig, Blender, block_tables
    from tests.helpers.memory_restorer import MemoryRestorer

    leader, children = workload.leader_request(), workload.requests()
    capacities = [len(leader)] + [len(r) + max_new_tokens for r in children]
    layout = model.kv_layout(sum(-(-c // BLOCK_SIZE) for c in capacities), BLOCK_SIZE, kv_packing="planes")
    cache = layout.allocate(fill=0)
    with MemoryRestorer(cache, layout, model_fingerprint=model.fingerprint, rope=model.rope) as restorer:
        blender = Blender(model, restorer, BlendConfig(blend_recompute_ratios=(ratio,), max_new_tokens=max_new_tokens))
        tables = block_tables(layout, capacities)
        saved = blender.save_segments(workload, tables[0])
        with torch.inference_mode(False):
            return [blender.blend(c).token_ids for c in blender.children(workload, saved, tables[1:])]


def first_difference(got: list[int], want: list[int]) -> str:
    """'' when equal, else where and how two token lists first differ."""
    if got == want:
        return ""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"first differing position {i}: vLLM {got[i] if i < len(got) else 'end'} vs KMesh "
            f"{want[i] if i < len(want) else 'end'} (vLLM {got}, KMesh {want})")
