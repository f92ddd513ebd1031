"""A decoder model's shape and RoPE, read from a Hugging Face ``config.json``.

Supported families (all pre-norm decoders with RMSNorm, rotary attention with grouped KV heads and
a SwiGLU MLP): ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v projections always carry a bias)
and ``Qwen3ForCausalLM`` (an RMSNorm over each head of q and k before RoPE). Everything is checked
when the config is built, so a model that cannot run is refused before any weight is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kmesh_gpu import LayoutError, RopeSpec
from kmesh_host import ModelFingerprint

from .errors import ModelError

#: architecture name -> HF ``model_type``
FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_ARCH_OF_TYPE = {v: k for k, v in FAMILIES.items()}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ROPE_KEYS_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


def _field(d: Mapping, name: str, kind=int, *, default=None, required: bool = True):
    if name not in d or d[name] is None:
        if required:
            raise ModelError(f"{name}: missing from the model config")
        return default
    v = d[name]
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelError(f"{name}: expected a positive integer, got {v!r}")
        return v
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ModelError(f"{name}: expected a positive finite number, got {v!r}")
        return float(v)
    if kind is bool:
        if not isinstance(v, bool):
            raise ModelError(f"{name}: expected true or false, got {v!r}")
        return v
    raise AssertionError(kind)


def _token_ids(d: Mapping, name: str, vocab: int) -> tuple[int, ...]:
    v = d.get(name)
    ids = () if v is None else tuple(v) if isinstance(v, (list, tuple)) else (v,)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise ModelError(f"{name}: expected token ids in [0, vocab_size={vocab}), got {v!r}")
    return ids


def _architecture(d: Mapping) -> str:
    archs, model_type = d.get("architectures"), d.get("model_type")
    if archs is not None and (not isinstance(archs, list) or len(archs) != 1):
        raise ModelError(f"architectures: expected one architecture name, got {archs!r}")
    arch = archs[0] if archs else _ARCH_OF_TYPE.get(model_type)
    if arch not in FAMILIES:
        raise ModelError(f"architectures: {archs or model_type!r} is not supported; expected one of "
                         f"{sorted(FAMILIES)} (model_type {sorted(_ARCH_OF_TYPE)})")
    if model_type is not None and model_type != FAMILIES[arch]:
        raise ModelError(f"model_type: {model_type!r} does not match architectures {archs!r}")
    return arch


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one decoder model (immutable; build it with :meth:`from_hf` or :meth:`from_file`).

    Attributes:
        architecture: ``"LlamaForCausalLM"``, ``"Qwen2ForCausalLM"`` or ``"Qwen3ForCausalLM"``.
        vocab_size, hidden_size (E), intermediate_size (I), num_layers (L): the model's sizes.
        num_heads (Hq), num_kv_heads (Hkv), head_dim (D): attention heads; Hq is a multiple of Hkv.
        rms_norm_eps: every RMSNorm's epsilon.
        rope_theta: RoPE base; rope_scaling: None or RopeSpec's scaling items (``rope_type`` first).
        partial_rotary_factor: the rotated fraction of each head (rotary_dim = D * factor).
        max_position_embeddings: the model's context length.
        tie_word_embeddings: the LM head is the input embedding.
        qkv_bias, o_bias, mlp_bias: which projections carry a bias; qk_norm: Qwen3's per-head norm.
        bos_token_id, eos_token_ids: from the config (None / empty when it names none).
        dtype: the checkpoint's dtype as the config states it (None when it does not).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, d: Mapping) -> "ModelConfig":
        """Read an HF config dict (``config.json`` as transformers 4 or 5 writes it)."""
        if not isinstance(d, Mapping):
            raise ModelError(f"config: expected a JSON object, got {type(d).__name__}")
        arch = _architecture(d)
        family = FAMILIES[arch]
        heads = _field(d, "num_attention_heads")
        hidden = _field(d, "hidden_size")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {d['hidden_act']!r}")
        if d.get("use_sliding_window"):
            raise ModelError("use_sliding_window: sliding-window attention is not supported")
        layer_types = d.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ModelError(f"layer_types: only full_attention layers are supported, got {sorted(set(layer_types))}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ModelError(f"rope_parameters: expected an object, got {rope!r}")
        if any(isinstance(v, Mapping) for v in rope.values()):
            raise ModelError("rope_parameters: per-layer-type RoPE parameters are not supported")
        theta_src = rope if "rope_theta" in rope else d
        theta = _field(theta_src, "rope_theta", float)
        prf_src = rope if "partial_rotary_factor" in rope else d
        partial = _field(prf_src, "partial_rotary_factor", float, default=1.0, required=False)
        scaling = {k: v for k, v in rope.items() if k not in _ROPE_KEYS_NOT_SCALING}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        else:
            scaling = dict(scaling, rope_type=scaling.get("rope_type", scaling.get("type")))
            scaling.pop("type", None)
        attention_bias = _field(d, "attention_bias", bool, default=False, required=False)
        dtype_name = d.get("dtype", d.get("torch_dtype"))
        if dtype_name is not None and dtype_name not in _DTYPES:
            raise ModelError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype_name!r}")
        vocab = _field(d, "vocab_size")
        bos = _token_ids(d, "bos_token_id", vocab)
        if len(bos) > 1:
            raise ModelError(f"bos_token_id: expected one id, got {d['bos_token_id']!r}")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_field(d, "intermediate_size"),
            num_layers=_field(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_field(d, "num_key_value_heads", default=heads, required=False),
            head_dim=_field(d, "head_dim", default=hidden // heads if hidden % heads == 0 else None,
                            required=hidden % heads != 0),
            rms_norm_eps=_field(d, "rms_norm_eps", float),
            rope_theta=theta,
            rope_scaling=None if scaling is None else tuple(scaling.items()),
            partial_rotary_factor=partial,
            max_position_embeddings=_field(d, "max_position_embeddings"),
            tie_word_embeddings=_field(d, "tie_word_embeddings", bool, default=False, required=False),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=_field(d, "mlp_bias", bool, default=False, required=False) if family == "llama" else False,
            qk_norm=family == "qwen3",
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=_token_ids(d, "eos_token_id", vocab),
            dtype=None if dtype_name is None else _DTYPES[dtype_name],
        )

    @classmethod
    def from_file(cls, path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelError(f"config: {path} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(f"config: {path} is not readable JSON: {exc}") from exc
        return cls.from_hf(d)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_key_value_heads: {self.num_kv_heads} does not divide "
                             f"num_attention_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ModelError(f"head_dim: expected an even size (RoPE pairs), got {self.head_dim}")
        rd = self.head_dim * self.partial_rotary_factor
        if not (0 < self.partial_rotary_factor <= 1) or rd != int(rd) or int(rd) % 2:
            raise ModelError(f"partial_rotary_factor: {self.partial_rotary_factor} x head_dim={self.head_dim} "
                             "must give an even rotary size in (0, head_dim]")
        try:
            self.rope_spec(torch.float32)
        except LayoutError as exc:
            raise ModelError(f"rope_parameters: {exc}") from exc

    # ------------------------------------------------------------------ derived values
    @property
    def model_type(self) -> str:
        return FAMILIES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_spec(self, dtype: torch.dtype) -> RopeSpec:
        """The model's rotary embedding in ``dtype`` (neox pairs, as these families rotate).

        For YaRN the spec's ``max_position`` is the scaling's original context (as vLLM builds it);
        its ``num_positions`` is then the scaled one.
        """
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        max_position = self.max_position_embeddings
        if scaling is not None and scaling["rope_type"] == "yarn" and "original_max_position_embeddings" in scaling:
            max_position = int(scaling["original_max_position_embeddings"])
        return RopeSpec(head_size=self.head_dim, rotary_dim=self.rotary_dim, base=self.rope_theta,
                        is_neox_style=True, max_position=max_position, dtype=dtype, scaling=scaling)

    def fingerprint(self, dtype: torch.dtype) -> ModelFingerprint:
        """What a saved segment records about the model whose KV (in ``dtype``) it holds."""
        return ModelFingerprint(architecture=self.architecture, num_layers=self.num_layers,
                                num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=dtype,
                                rope=self.rope_spec(dtype).to_dict())

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict (transformers 5 field names) that :meth:`from_hf` reads back."""
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        rope["rope_theta"] = self.rope_theta
        if self.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        d = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (None if not self.eos_token_ids else self.eos_token_ids[0]
                             if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)),
            "use_cache": True,
        }
        if self.model_type != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        else:
            d["use_sliding_window"] = False
        if self.dtype is not None:
            d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d
