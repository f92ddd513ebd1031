"""ModelConfig from HF config dicts (transformers' own classes write them), RoPE and fingerprints."""

from __future__ import annotations

import json

import pytest
import torch

from kmesh_gpu import KmeshError, RopeSpec
from kmesh_host import ModelFingerprint
from kmesh_vllm.model import ModelConfig, ModelError

BASE = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}


def hf_dict(kind: str, **kw) -> dict:
    """A config.json as transformers 5 writes it."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    d = cls(**{**BASE, **kw}).to_dict()
    d["architectures"] = [cls.__name__.replace("Config", "ForCausalLM")]
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_reads_transformers_configs(kind):
    c = ModelConfig.from_hf(hf_dict(kind, rope_theta=5e5, head_dim=48))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (512, 128, 256, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (4, 2, 48, 5e5)
    assert c.rope_scaling is None and c.rotary_dim == 48
    assert c.qkv_bias == (kind == "qwen2") and c.qk_norm == (kind == "qwen3") and not c.o_bias
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_head_dim_defaults_and_biases():
    c = ModelConfig.from_hf(hf_dict("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    assert c.head_dim == 32 and c.qkv_bias and c.o_bias and c.mlp_bias and c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)


def test_rope_scaling_and_rope_parameters_agree():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 1024}
    old = dict(BASE, architectures=["LlamaForCausalLM"], rope_theta=5e5, rope_scaling=dict(llama3))
    new = hf_dict("llama", rope_parameters=dict(llama3, rope_theta=5e5))
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert a.rope_scaling == b.rope_scaling and a.rope_theta == b.rope_theta == 5e5
    spec = a.rope_spec(torch.bfloat16)
    assert spec == RopeSpec(head_size=32, rotary_dim=32, base=5e5, is_neox_style=True, max_position=4096,
                            dtype=torch.bfloat16, scaling=llama3)
    legacy = dict(old, rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(legacy).rope_spec(torch.float32).scaling_type == "linear"


def test_yarn_spec_uses_the_original_context():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    spec = ModelConfig.from_hf(hf_dict("qwen2", rope_parameters=dict(yarn, rope_theta=1e6))).rope_spec(torch.float32)
    assert spec.max_position == 1024 and spec.num_positions == 4096


def test_partial_rotary_factor():
    c = ModelConfig.from_hf(dict(BASE, architectures=["LlamaForCausalLM"], rope_theta=1e4, partial_rotary_factor=0.5))
    assert c.rotary_dim == 16 and c.rope_spec(torch.float32).rotary_dim == 16


def test_fingerprint():
    c = ModelConfig.from_hf(hf_dict("qwen2", rope_theta=1e6))
    fp = c.fingerprint(torch.bfloat16)
    assert fp == ModelFingerprint("Qwen2ForCausalLM", 2, 2, 32, "bfloat16", c.rope_spec(torch.bfloat16).to_dict())
    assert fp != c.fingerprint(torch.float32)


@pytest.mark.parametrize("change,field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": None, "model_type": "mistral"}, "architectures"),
    ({"model_type": "qwen3"}, "model_type"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": 130}, "head_dim"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
    ({"rope_parameters": None, "rope_theta": None}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"eos_token_id": 9999}, "eos_token_id"),
    ({"dtype": "int8"}, "dtype"),
])
def test_refuses_bad_configs_by_field(change, field):
    d = dict(hf_dict("qwen2", rope_theta=1e6), **change)
    with pytest.raises(ModelError, match=f"^{field}:") as exc:
        ModelConfig.from_hf(d)
    assert isinstance(exc.value, KmeshError)


def test_from_file_errors(tmp_path):
    with pytest.raises(ModelError, match="config: .* does not exist"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not readable JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
