"""Chat templates and GGUF-style byte-level BPE tokenizers."""

from __future__ import annotations

import pytest

from kmesh_vllm.model import ModelError, apply_chat_template
from kmesh_vllm.model.tokenizer import CHATML_TEMPLATE, byte_level_bpe, tiny_tokenizer


def test_chatml_template():
    text = apply_chat_template(CHATML_TEMPLATE, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not apply_chat_template(CHATML_TEMPLATE, [{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=False).endswith("assistant\n")


def test_template_errors_are_model_errors():
    with pytest.raises(ModelError, match="chat_template: no system"):
        apply_chat_template("{{ raise_exception('no system') }}", [])
    with pytest.raises(ModelError, match="chat_template"):
        apply_chat_template("{% for %}", [])


def test_tiny_tokenizer_is_fixed():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 512
    assert a.token_to_id("<|im_end|>") == 2


def test_byte_level_bpe_from_vocab_and_merges():
    tokens = ["a", "b", "Ġ", "ab", "Ġab", "<s>", "1", "2"]
    tok = byte_level_bpe(tokens, ["a b", "Ġ ab"], token_types=[1] * 5 + [3, 1, 1], pre="smollm",
                         bos_token_id=5, add_bos=True)
    assert tok.encode("ab ab").tokens == ["<s>", "ab", "Ġab"]
    assert tok.encode("12").ids == [5, 6, 7]
    assert tok.decode(tok.encode("ab ab").ids) == "ab ab"
    with pytest.raises(ModelError, match="tokenizer.ggml.merges"):
        byte_level_bpe(tokens, ["a zz"])
    with pytest.raises(ModelError, match="tokenizer.ggml.pre"):
        byte_level_bpe(tokens, [], pre="unknown")
