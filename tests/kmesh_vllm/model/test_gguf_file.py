"""GGUF files: names, Llama's Q/K row order, tied heads, quantised tensors, the tokenizer, refusals;
and the real SmolLM2 GGUF against transformers' own GGUF loading."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kmesh_vllm.model import ModelConfig, ModelError, load_model, read_gguf
from kmesh_vllm.model.gguf_file import hf_name, unpermute_rows
from kmesh_vllm.model.presets import pretrained_gguf, random_tensors
from kmesh_vllm.model.tokenizer import tiny_tokenizer
from tests.helpers.model_craft import assert_close_fp32, hf_logits, llama_cpp_permute, run_prefill, write_gguf

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 2048, "rope_theta": 1e5, "bos_token_id": 1, "eos_token_id": 2}


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


def test_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ModelError, match="^rope_freqs.weight: a GGUF tensor"):
        hf_name("rope_freqs.weight")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_gguf_round_trip(tmp_path, tied):
    config = ModelConfig.from_hf(dict(LLAMA, tie_word_embeddings=tied))
    tensors = random_tensors(config, seed=1)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, tensors, tokenizer=tiny_tokenizer(), chat_template="{{ messages }}")
    ckpt = read_gguf(path)
    assert ckpt.config == config
    assert ckpt.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(ckpt.tensors[name], t), name
    assert ckpt.chat_template == "{{ messages }}"
    text = "The capital of France is Paris."
    assert ckpt.tokenizer.encode(text).ids == tiny_tokenizer().encode(text).ids
    model = load_model(path)
    assert model.config.tie_word_embeddings == tied and (model.weights.lm_head is model.weights.embed) == tied


def test_quantised_tensors_use_gguf_dequantisation(tmp_path):
    config = ModelConfig.from_hf(LLAMA)
    tensors = random_tensors(config, seed=2)
    path = tmp_path / "q8.gguf"
    write_gguf(path, config, tensors, qtype=gguf.GGMLQuantizationType.Q8_0)
    ckpt = read_gguf(path)
    name = "model.layers.1.mlp.down_proj.weight"
    want = gguf.dequantize(gguf.quantize(tensors[name].numpy(), gguf.GGMLQuantizationType.Q8_0),
                           gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(ckpt.tensors[name], torch.from_numpy(want))
    assert not torch.equal(ckpt.tensors[name], tensors[name])  # really quantised


def test_refuses_another_family(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelError, match="^general.architecture: 'gpt2' in gpt2.gguf is not supported"):
        read_gguf(path)


def test_refuses_missing_metadata_and_tensors(tmp_path):
    config = ModelConfig.from_hf(LLAMA)
    tensors = random_tensors(config)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_gguf(tmp_path / "m.gguf", config, tensors)
    with pytest.raises(ModelError, match="^model.layers.1.mlp.up_proj.weight: missing from"):
        load_model(tmp_path / "m.gguf")
    with pytest.raises(ModelError, match="not a readable GGUF"):
        (tmp_path / "bad.gguf").write_bytes(b"GGUF-not-really")
        read_gguf(tmp_path / "bad.gguf")


# ---------------------------------------------------------------------------------- the real SmolLM2 file
@pytest.mark.slow
def test_smollm2_equals_transformers_gguf_loading(smollm2):
    from transformers import AutoModelForCausalLM

    path = pretrained_gguf("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("What is the capital of France?", "In 1995, 12345 people  came.\n\n\tnaïve 日本 <|im_end|>"):
        assert smollm2.tokenizer.encode(text).ids == hf_tok.encode(text, add_special_tokens=False)
    state = hf.state_dict()
    w = smollm2.weights
    assert torch.equal(state["model.layers.7.self_attn.q_proj.weight"], w.layers[7].q)
    assert torch.equal(state["model.layers.7.self_attn.k_proj.weight"], w.layers[7].k)
    assert torch.equal(state["model.embed_tokens.weight"], w.embed)
    text = "The quick brown fox jumps over the lazy dog in 1995, and then"
    ids = torch.tensor(smollm2.tokenizer.encode(text).ids)
    assert_close_fp32(run_prefill(smollm2, ids, layout_name="BLNHC"), hf_logits(hf, ids), "smollm2 gguf fp32")
