"""The random presets' folders as vLLM reads them (its config and tokenizer loaders)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_reads_the_tiny_folder(tiny, tiny_dir):
    from vllm.tokenizers.registry import get_tokenizer
    from vllm.transformers_utils.config import get_config

    config = get_config(str(tiny_dir), trust_remote_code=False)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (4, 128, 2)
    assert config.head_dim == 32 and config.tie_word_embeddings is False
    tok = get_tokenizer(str(tiny_dir))
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>"
    assert tok.encode(text, add_special_tokens=False) == tiny.tokenizer.encode(text).ids
    assert tok.eos_token_id == 2
