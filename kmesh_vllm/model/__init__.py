"""The model harness: HF-architecture decoders (Llama, Qwen2, Qwen3) run layer by layer over a
paged KV cache in any :class:`kmesh_gpu.KVLayout`, loaded from HF folders, GGUF files or presets.

Public names:

* :func:`load_model` (``spec``: preset name, HF folder or ``.gguf``) -> :class:`Model` with the
  steps ``embed``, ``qkv``, ``write_kv``, ``attend``, ``finish``, ``logits`` and the passes
  ``forward_layer``, ``prefill``, ``generate``; :class:`BlockTable` maps positions to slots.
* :class:`ModelConfig` (``from_hf``, ``from_file``, ``rope_spec``, ``fingerprint``).
* presets: ``PRESETS``, :func:`write_preset`, :func:`write_random_model`, :func:`cache_dir`.
* files: :func:`read_folder`, :func:`write_folder`, :func:`read_gguf`, :func:`convert_gguf`.
* :func:`read_kv` reads one layer's K/V at slots (any layout); chat prompts: :func:`apply_chat_template`.
* :class:`ModelError`, a :class:`kmesh_gpu.KmeshError`.
"""

from .config import FAMILIES, ModelConfig
from .errors import ModelError
from .folder import Checkpoint, read_folder, write_folder
from .gguf_file import convert_gguf, read_gguf
from .loader import load_model
from .paged import BlockTable, read_kv
from .presets import PRESETS, cache_dir, pretrained_folder, write_preset, write_random_model
from .runner import Generation, Model
from .tokenizer import apply_chat_template

__all__ = [
    "FAMILIES", "ModelConfig", "ModelError", "Checkpoint", "read_folder", "write_folder", "convert_gguf",
    "read_gguf", "load_model", "BlockTable", "read_kv", "PRESETS", "cache_dir", "pretrained_folder",
    "write_preset", "write_random_model", "Generation", "Model", "apply_chat_template",
]
