"""HF model folders: single and sharded safetensors, refusals naming the file or tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kmesh_vllm.model import ModelError, load_model, read_folder, write_preset


def test_sharded_folder_equals_single_file(tiny, tmp_path):
    folder = write_preset("tiny", tmp_path / "t")
    ckpt = read_folder(folder)
    names = sorted(ckpt.tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: ckpt.tensors[n] for n in part}, str(folder / file))
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_model(folder)
    assert all(torch.equal(a, b) for a, b in zip(sharded.weights.layers[1].__dict__.values(),
                                                 tiny.weights.layers[1].__dict__.values()) if a is not None)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="names model-00002-of-00002.safetensors, which does not exist"):
        read_folder(folder)


def test_folder_refusals(tmp_path):
    folder = write_preset("tiny", tmp_path / "t")
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match="is not a readable safetensors file"):
        read_folder(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="holds neither model.safetensors"):
        read_folder(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, architectures=["MistralForCausalLM"],
                                                        model_type="mistral")))
    with pytest.raises(ModelError, match="^architectures: "):
        read_folder(folder)
