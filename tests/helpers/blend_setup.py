"""Blender test setups: a cache poisoned with NaN, the in-memory restorer, a workload's leader saved,
one table per child, and spare blocks that nothing may write."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kmesh_vllm.blend import BlendConfig, Blender, block_tables
from kmesh_vllm.model import BlockTable, read_kv
from kmesh_vllm.workload import synthetic
from tests.helpers.memory_restorer import MemoryRestorer

MAX_NEW = 4


def build(model, workload, *, config: BlendConfig = BlendConfig(max_new_tokens=MAX_NEW), spare_blocks: int = 2,
          layout_name: str = "LBHNC", kv_packing: str = "content"):
    """Tables for the leader and each child (consecutive blocks), then ``spare_blocks`` that belong
    to nobody; the leader's segments saved; the children built."""
    requests = workload.requests()
    leader = workload.leader_request()
    lead = len(leader) if leader is not None else max(len(s) for s in workload.segments.values())
    caps = [lead] + [len(r) + config.max_new_tokens for r in requests]
    blocks = sum(-(-c // 16) for c in caps) + spare_blocks
    layout = model.kv_layout(num_blocks=blocks, block_size=16, name=layout_name, kv_packing=kv_packing)
    cache = layout.allocate(fill=float("nan"))
    restorer = MemoryRestorer(cache, layout, model_fingerprint=model.fingerprint, rope=model.rope)
    blender = Blender(model, restorer, config)
    tables = block_tables(layout, caps)
    saved = blender.save_segments(workload, tables[0])
    children = blender.children(workload, saved, tables[1:])
    return SimpleNamespace(model=model, layout=layout, cache=cache, restorer=restorer, blender=blender, saved=saved,
                           children=children, digests=restorer.digests(), workload=workload,
                           spare=list(range(blocks - spare_blocks, blocks)))


def small_workload(seed: int = 0, **kw):
    """Three children of 80 tokens reusing three 16-token segments (random ids, tiny's vocabulary)."""
    args = dict(children=3, segments=3, segment_tokens=16, prompt_tokens=80, seed=seed)
    args.update(kw)
    return synthetic(512, **args)


def blender_for(s, **config) -> Blender:
    return Blender(s.model, s.restorer, BlendConfig(**{"max_new_tokens": MAX_NEW, **config}))


def block_kv(s, block: int) -> torch.Tensor:
    """``(2, L, N, H, D)``: everything one block holds."""
    slots = BlockTable([block], s.layout.block_size).slots(torch.arange(s.layout.block_size))
    ks, vs = zip(*(read_kv(s.cache, s.layout, layer, slots) for layer in range(s.model.num_layers)))
    return torch.stack([torch.stack(ks), torch.stack(vs)])


def spare_untouched(s) -> bool:
    """The blocks no table names still hold NaN everywhere."""
    return all(bool(block_kv(s, b).isnan().all()) for b in s.spare)


def snapshot(outcome) -> dict:
    """What must match bit for bit between two paths, read now (the K/V of the prompt included)."""
    return {"name": outcome.name, "step_logits": outcome.step_logits.clone(), "tokens": list(outcome.token_ids),
            "recompute": [r.clone() for r in outcome.recompute], "restored": outcome.restored.clone(),
            "kv": outcome.prompt_kv(), "fallback": outcome.fallback}


def same(a: dict, b: dict) -> bool:
    """Two snapshots bit-identical (NaN compared as equal)."""
    return (a["tokens"] == b["tokens"] and torch.equal(a["step_logits"], b["step_logits"])
            and len(a["recompute"]) == len(b["recompute"])
            and all(torch.equal(x, y) for x, y in zip(a["recompute"], b["recompute"]))
            and torch.equal(a["restored"], b["restored"])
            and torch.equal(a["kv"].nan_to_num(7.0), b["kv"].nan_to_num(7.0)))
