"""The small model the route tests restore for: its sizes, RoPE spec and fingerprint."""

from __future__ import annotations

import torch

from kmesh_gpu import RopeSpec
from kmesh_host import ModelFingerprint

L, H, D = 2, 2, 16
DTYPE = torch.bfloat16
ROPE = RopeSpec(head_size=D, rotary_dim=D, base=10000.0, is_neox_style=True, max_position=4096, dtype=DTYPE)
FP = ModelFingerprint("Qwen2ForCausalLM", L, H, D, "bfloat16",
                      {"base": 10000.0, "rotary_dim": D, "is_neox_style": True, "max_position": 4096})
