"""A model's weights by their Hugging Face names, checked against its config, grouped per layer.

Names are the HF checkpoint's (``model.layers.3.self_attn.q_proj.weight``); every loader (HF
folder, GGUF file, random presets) produces a ``{name: tensor}`` dict and :func:`build_weights`
checks it (missing, unexpected or misshapen tensors are refused by name) and converts it once to
the requested dtype and device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import ModelError

# Buffers some checkpoints carry that a model rebuilds itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. Linear weights are ``[out, in]`` (``F.linear``'s convention)."""

    input_norm: torch.Tensor        # [E]
    q: torch.Tensor                 # [Hq*D, E]
    k: torch.Tensor                 # [Hkv*D, E]
    v: torch.Tensor                 # [Hkv*D, E]
    o: torch.Tensor                 # [E, Hq*D]
    post_norm: torch.Tensor         # [E]
    gate: torch.Tensor              # [I, E]
    up: torch.Tensor                # [I, E]
    down: torch.Tensor              # [E, I]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None   # [D] (Qwen3)
    k_norm: torch.Tensor | None = None   # [D] (Qwen3)
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor             # [V, E]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor              # [E]
    lm_head: torch.Tensor           # [V, E]; the embed tensor itself when tied


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, by HF name, with its shape."""
    c = config
    E, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, E), "model.norm.weight": (E,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, E)
    for i in range(c.num_layers):
        p = layer_prefix(i)
        proj = {"self_attn.q_proj": (c.q_size, E), "self_attn.k_proj": (c.kv_size, E),
                "self_attn.v_proj": (c.kv_size, E), "self_attn.o_proj": (E, c.q_size),
                "mlp.gate_proj": (I, E), "mlp.up_proj": (I, E), "mlp.down_proj": (E, I)}
        for name, shape in proj.items():
            shapes[f"{p}{name}.weight"] = shape
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if c.qkv_bias else ():
            shapes[f"{p}{name}.bias"] = proj[name][:1]
        if c.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (E,)
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") if c.mlp_bias else ():
            shapes[f"{p}{name}.bias"] = proj[name][:1]
        shapes[f"{p}input_layernorm.weight"] = (E,)
        shapes[f"{p}post_attention_layernorm.weight"] = (E,)
        if c.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (D,)
            shapes[f"{p}self_attn.k_norm.weight"] = (D,)
    return shapes


def check_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse a checkpoint whose names or shapes do not match ``config`` (the message names the tensor)."""
    expected = weight_shapes(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(f"{missing[0]}: missing from {source}{more} (architecture {config.architecture})")
    for name, t in tensors.items():
        if name in expected:
            if not t.is_floating_point():
                raise ModelError(f"{name}: expected a floating-point tensor, got {t.dtype} in {source}")
            if tuple(t.shape) != expected[name]:
                raise ModelError(f"{name}: expected shape {list(expected[name])} from the config, got "
                                 f"{list(t.shape)} in {source}")
        elif not (name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings)):
            raise ModelError(f"{name}: unexpected tensor in {source} for architecture {config.architecture}")


def build_weights(config: ModelConfig, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
                  device, source: str = "the checkpoint") -> Weights:
    """Check ``tensors`` against ``config`` and convert each once to ``dtype`` on ``device``."""
    check_tensors(config, tensors, source)

    def get(name):
        t = tensors.get(name)
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = layer_prefix(i)
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight"), post_norm=get(p + "post_attention_layernorm.weight"),
            q=get(a + "q_proj.weight"), k=get(a + "k_proj.weight"), v=get(a + "v_proj.weight"),
            o=get(a + "o_proj.weight"), q_bias=get(a + "q_proj.bias"), k_bias=get(a + "k_proj.bias"),
            v_bias=get(a + "v_proj.bias"), o_bias=get(a + "o_proj.bias"),
            q_norm=get(a + "q_norm.weight"), k_norm=get(a + "k_norm.weight"),
            gate=get(m + "gate_proj.weight"), up=get(m + "up_proj.weight"), down=get(m + "down_proj.weight"),
            gate_bias=get(m + "gate_proj.bias"), up_bias=get(m + "up_proj.bias"), down_bias=get(m + "down_proj.bias"),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    return Weights(embed=embed, layers=tuple(layers), norm=get("model.norm.weight"), lm_head=lm_head)
