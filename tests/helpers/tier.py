"""Shared set-up of the host-tier tests: a model fingerprint, small seeded segments, a tier with test
settings (unpinned, small chunks), and a bounded wait."""

from __future__ import annotations

import torch

from kmesh_host import HostTier, HostTierConfig, ModelFingerprint, SegmentStore
from tests.helpers.waiting import settle

FP = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", {"base": 1e6})
OTHER_FP = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", {"base": 1e4})
OBJ = 8192  # padded payload of a T=64 segment: (2, 2, 64, 2, 8) bf16


def kv_for(seed: int, T: int = 64) -> torch.Tensor:
    return torch.randn((2, 2, T, 2, 8), generator=torch.Generator().manual_seed(seed)).bfloat16()


def put_segments(store: SegmentStore, n: int, T: int = 64) -> list[str]:
    """Keys of ``n`` segments of seeds 0..n-1 put into ``store``."""
    return [store.put(kv_for(i, T), torch.arange(T), torch.arange(T), model_fingerprint=FP) for i in range(n)]


def tier_for(store, **kw) -> HostTier:
    kw.setdefault("pin", False)
    kw.setdefault("read_threads", 2)
    kw.setdefault("chunk_bytes", 4096)
    return HostTier(store, HostTierConfig(**kw))


def wait_until(cond, timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds (tests/helpers/waiting.py:settle); fail after ``timeout``."""
    if not settle(cond, timeout, 0.002):
        raise AssertionError("condition not reached")
