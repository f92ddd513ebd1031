"""GGUF files (llama.cpp's format) read through the ``gguf`` package, as HF-named fp32 weights.

* The metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...) becomes an HF config
  for the ``llama``, ``qwen2`` and ``qwen3`` architectures; any other is refused.
* Every tensor is dequantised with ``gguf``'s own dequantisation and renamed to its HF name. For
  ``llama``, llama.cpp's converter reorders the rows of each Q and K head for its interleaved
  (GPT-J) rotation; they are put back so the weights equal the HF checkpoint's (neox pairs).
  Without ``output.weight`` the LM head is the token embedding (tied).
* A ``gpt2`` tokenizer (byte-level BPE) is rebuilt from ``tokenizer.ggml.*``; the chat template
  is ``tokenizer.chat_template``. Other tokenizer models give no tokenizer (token ids still work).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import torch

from .config import FAMILIES
from .errors import ModelError
from .folder import Checkpoint, write_folder
from .tokenizer import byte_level_bpe

_ARCHS = {v: k for k, v in FAMILIES.items()}  # GGUF architecture names are the HF model types

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The HF checkpoint name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelError(f"{gguf_name}: a GGUF tensor this loader does not know")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order for interleaved RoPE: within each head its rows were
    ``[r0, r_half, r1, r_half+1, ...]``; HF's (neox) order is ``[r0, r1, ..., r_half, ...]``."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelError(f"attn_q/attn_k: {rows} rows do not split into {n_heads} heads of pairs")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shortest(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (``9.99999974e-06`` -> ``1e-05``)."""
    return float(str(np.float32(x)))


class _Meta:
    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=None, *, required: bool = False):
        field = self.fields.get(key)
        if field is None:
            if required:
                raise ModelError(f"{key}: missing from the GGUF metadata of {self.path.name}")
            return default
        return field.contents()


def _config_dict(meta: _Meta, arch: str, tensor_names: set[str]) -> dict:
    def key(k, **kw):
        return meta.get(f"{arch}.{k}", **kw)

    heads = key("attention.head_count", required=True)
    kv_heads = key("attention.head_count_kv", default=heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ModelError(f"{arch}.attention.head_count_kv: per-layer head counts are not supported")
    hidden = key("embedding_length", required=True)
    head_dim = key("attention.key_length", default=hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens")
    d = {
        "architectures": [_ARCHS[arch]], "model_type": arch,
        "vocab_size": key("vocab_size", default=len(tokens) if tokens else None),
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": _shortest(key("attention.layer_norm_rms_epsilon", required=True)),
        "max_position_embeddings": key("context_length", required=True),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    rope = {"rope_type": "default", "rope_theta": _shortest(key("rope.freq_base", default=10000.0))}
    rotary = key("rope.dimension_count", default=head_dim)
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    kind = key("rope.scaling.type", default="none")
    if kind in ("linear", "yarn"):
        rope.update(rope_type=kind, factor=_shortest(key("rope.scaling.factor", required=True)))
        if kind == "yarn":
            rope["original_max_position_embeddings"] = key("rope.scaling.original_context_length", required=True)
    elif kind != "none":
        raise ModelError(f"{arch}.rope.scaling.type: {kind!r} is not supported (none, linear, yarn)")
    d["rope_parameters"] = rope
    if arch != "qwen2":
        d["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return d


def _tokenizer(meta: _Meta):
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return None
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return byte_level_bpe(meta.get("tokenizer.ggml.tokens", required=True),
                          meta.get("tokenizer.ggml.merges", required=True),
                          token_types=meta.get("tokenizer.ggml.token_type"),
                          pre=meta.get("tokenizer.ggml.pre", "gpt2"), bos_token_id=bos,
                          add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))


def read_gguf(path) -> Checkpoint:
    """Read a GGUF file: its config, its tensors dequantised to fp32 under HF names (CPU), its
    tokenizer and chat template. Refuses other architectures and unknown tensors by name."""
    import gguf

    from .config import ModelConfig

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"gguf: {path} is not a readable GGUF file: {exc}") from exc
    meta = _Meta(reader, path)
    arch = meta.get("general.architecture", required=True)
    if arch not in _ARCHS:
        raise ModelError(f"general.architecture: {arch!r} in {path.name} is not supported; expected one of "
                         f"{sorted(_ARCHS)}")
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_hf(_config_dict(meta, arch, names))
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        try:
            w = gguf.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelError(f"{t.name}: {exc}") from exc
        w = np.asarray(w, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        if not w.flags.writeable:  # F32 tensors come back as views of the read-only file map
            w = w.copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    return Checkpoint(config, tensors, _tokenizer(meta), meta.get("tokenizer.chat_template"), source=str(path),
                      pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))


def convert_gguf(path, directory) -> Path:
    """Write the GGUF file at ``path`` as an HF model folder (fp32 weights) at ``directory``, atomically."""
    ckpt = read_gguf(path)
    config = dataclasses.replace(ckpt.config, dtype=torch.float32)
    return write_folder(directory, config, ckpt.tensors, tokenizer=ckpt.tokenizer,
                        chat_template=ckpt.chat_template, pad_token_id=ckpt.pad_token_id)
