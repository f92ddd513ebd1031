"""load_model: presets, folders and GGUF files by one name; refusals before any work."""

from __future__ import annotations

import pytest
import torch

from kmesh_vllm.model import ModelError, load_model


def test_loads_in_the_requested_dtype(tiny_dir):
    m = load_model(tiny_dir, dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16 and m.weights.layers[0].q.dtype == torch.bfloat16
    assert m.rope.dtype == torch.bfloat16 and m.fingerprint.dtype == "bfloat16"
    assert m.kv_layout(4).dtype == torch.bfloat16


def test_load_model_refuses_unknown_specs(tmp_path):
    with pytest.raises(ModelError, match="^spec: 'nope' is neither a preset"):
        load_model("nope")
    with pytest.raises(ModelError, match="^dtype"):
        load_model("tiny", dtype=torch.int8)
    with pytest.raises(ModelError, match="has no config.json"):
        load_model(tmp_path)
