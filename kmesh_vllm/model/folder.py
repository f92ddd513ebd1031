"""Hugging Face model folders: read one (config, safetensors weights, tokenizer), write one atomically.

A folder holds ``config.json``, ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``), and optionally ``tokenizer.json``, ``tokenizer_config.json``
(with the chat template) and ``generation_config.json``: what transformers and vLLM load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ModelError
from .tokenizer import load_tokenizer, read_chat_template

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class Checkpoint:
    """What a model folder or GGUF file holds, before it becomes a :class:`~.runner.Model`."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]        # HF names -> CPU tensors as stored
    tokenizer: object | None = None         # tokenizers.Tokenizer
    chat_template: str | None = None
    source: str = "checkpoint"
    pad_token_id: int | None = None


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{what}: {path} is not readable JSON: {exc}") from exc


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "weight index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"weight index: {index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelError(f"weight index: {index} names {f.name}, which does not exist")
        return files
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise ModelError(f"weights: {folder} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    return [single]


def read_folder(folder) -> Checkpoint:
    """Read an HF model folder: config, every weight tensor (on the CPU, as stored), tokenizer."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelError(f"config: {folder} has no config.json")
    config = ModelConfig.from_file(folder / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(folder):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    if name in tensors:
                        raise ModelError(f"{name}: stored twice (again in {f.name})")
                    tensors[name] = st.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"weights: {f} is not a readable safetensors file: {exc}") from exc
    tok_file = folder / "tokenizer.json"
    tokenizer = load_tokenizer(tok_file) if tok_file.is_file() else None
    return Checkpoint(config, tensors, tokenizer, read_chat_template(folder), source=str(folder))


def tokenizer_config(tokenizer, config: ModelConfig, chat_template: str | None, *, pad_token_id=None) -> dict:
    """A ``tokenizer_config.json`` for a fast tokenizer: special tokens by name, the chat template."""
    def name(i):
        return None if i is None else tokenizer.id_to_token(i)

    d = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
         "model_max_length": config.max_position_embeddings,
         "bos_token": name(config.bos_token_id),
         "eos_token": name(config.eos_token_ids[0]) if config.eos_token_ids else None,
         "pad_token": name(pad_token_id)}
    if chat_template is not None:
        d["chat_template"] = chat_template
    return {k: v for k, v in d.items() if v is not None}


def generation_config(config: ModelConfig, *, pad_token_id=None) -> dict:
    eos = list(config.eos_token_ids)
    d = {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
         "pad_token_id": pad_token_id, "do_sample": False}
    return {k: v for k, v in d.items() if v is not None}


def write_folder(directory, config: ModelConfig, tensors: Mapping[str, torch.Tensor], *, tokenizer=None,
                 chat_template: str | None = None, pad_token_id: int | None = None) -> Path:
    """Write a complete HF model folder at ``directory``, atomically.

    Everything is written into a temporary folder beside ``directory`` and renamed into place, so
    a crash never leaves a half-written folder. ``directory`` must not exist, or be empty.
    ``tensors`` are saved as given (HF names, their dtypes; contiguous CPU copies).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ModelError(f"directory: {directory} exists and is not an empty folder")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary one
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE),
                  metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
            cfg = tokenizer_config(tokenizer, config, chat_template, pad_token_id=pad_token_id)
            (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config(config, pad_token_id=pad_token_id), indent=2) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if directory.exists():
            directory.rmdir()  # empty (checked above); rename cannot replace a folder that exists
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
