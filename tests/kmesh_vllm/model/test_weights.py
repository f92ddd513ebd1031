"""Checkpoint tensors checked against the config by name and shape."""

from __future__ import annotations

import pytest
import torch

from kmesh_vllm.model import ModelError
from kmesh_vllm.model.presets import RANDOM_PRESETS, random_tensors
from kmesh_vllm.model.weights import build_weights, weight_shapes

CONFIG = RANDOM_PRESETS["tiny"].config


def test_names_and_shapes():
    shapes = weight_shapes(CONFIG)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (64, 128)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (64,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes and "lm_head.weight" in shapes
    assert len(shapes) == 3 + 4 * 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_build_converts_once(dtype):
    tensors = random_tensors(CONFIG)
    w = build_weights(CONFIG, tensors, dtype=dtype, device="cpu")
    gate = tensors["model.layers.2.mlp.gate_proj.weight"]
    assert w.layers[2].gate.dtype == dtype and torch.equal(w.layers[2].gate, gate.to(dtype))
    assert w.layers[0].o_bias is None and w.layers[0].q_norm is None


def test_refuses_missing_misshapen_unexpected_tensors():
    tensors = random_tensors(CONFIG)
    missing = dict(tensors)
    del missing["model.layers.2.self_attn.v_proj.bias"]
    with pytest.raises(ModelError, match="^model.layers.2.self_attn.v_proj.bias: missing from the checkpoint"):
        build_weights(CONFIG, missing, dtype=torch.float32, device="cpu")
    bad = dict(tensors, **{"model.norm.weight": torch.ones(127)})
    with pytest.raises(ModelError, match=r"^model.norm.weight: expected shape \[128\] from the config, got \[127\]"):
        build_weights(CONFIG, bad, dtype=torch.float32, device="cpu")
    extra = dict(tensors, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(32)})
    with pytest.raises(ModelError, match="^model.layers.0.self_attn.q_norm.weight: unexpected tensor"):
        build_weights(CONFIG, extra, dtype=torch.float32, device="cpu")
    ints = dict(tensors, **{"model.norm.weight": torch.ones(128, dtype=torch.int32)})
    with pytest.raises(ModelError, match="floating-point"):
        build_weights(CONFIG, ints, dtype=torch.float32, device="cpu")
    ignored = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)})
    build_weights(CONFIG, ignored, dtype=torch.float32, device="cpu")
