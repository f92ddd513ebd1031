"""vLLM's own model modules through the row-wise steps of :class:`kmesh_vllm.model.Model`.

:class:`VllmModel` wraps the ``nn.Module`` a vLLM worker loaded (Llama, Qwen2 and Qwen3 families:
``model.embed_tokens``, ``model.layers[i]`` with ``input_layernorm``, ``self_attn.qkv_proj`` (+
Qwen3's ``q_norm``/``k_norm``), ``self_attn.rotary_emb``, ``self_attn.o_proj``,
``post_attention_layernorm``, ``mlp``, then ``model.norm`` and ``compute_logits``) so that the
blender runs vLLM's layers, weights and kernels over vLLM's paged cache:

* ``embed``, ``qkv`` (input norm, the fused q/k/v projection, vLLM's rotary embedding), ``finish``
  (``o_proj`` + residual, post-attention norm, vLLM's MLP + residual) and ``logits`` (final norm,
  ``compute_logits``) call vLLM's modules;
* ``write_kv`` and ``attend`` are :class:`~kmesh_vllm.model.Model`'s own, over any
  :class:`kmesh_gpu.KVLayout` (vLLM's attention kernel runs one engine batch from its metadata; it
  is not a row-wise step). ``attend`` is KMesh's position-masked attention in fp32.

The wrapper owns nothing: the module and its weights stay vLLM's. Tensor and pipeline
parallelism are not supported (the projections would hold one rank's heads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kmesh_vllm.model import Model, ModelConfig, ModelError


@dataclass(frozen=True)
class _Embedding:
    """What :class:`Model` reads from its weights outside the per-layer steps: the embedding table
    (vLLM's, ``[V', E]``, ``V' >= vocab`` when vLLM pads the vocabulary)."""

    embed: torch.Tensor


class VllmModel(Model):
    """``model`` (a vLLM ``*ForCausalLM`` module) with the config ``hf_config`` (the HF
    ``config.json`` as a mapping: vLLM's ``model_config.hf_config.to_dict()``).

    The dtype and device are those of vLLM's weights. Raises :class:`ModelError` for a model whose
    modules do not have the families' shape.
    """

    def __init__(self, model: torch.nn.Module, hf_config: Mapping, *, name: str = "vllm"):
        config = ModelConfig.from_hf(hf_config)
        inner = getattr(model, "model", None)
        parts = [getattr(inner, n, None) for n in ("embed_tokens", "layers", "norm")]
        if inner is None or any(p is None for p in parts) or not callable(getattr(model, "compute_logits", None)):
            raise ModelError(f"model: {type(model).__name__} is not a vLLM decoder of the Llama/Qwen2/Qwen3 families "
                             "(expected .model.embed_tokens, .model.layers, .model.norm and .compute_logits)")
        embed, layers, norm = parts
        if len(layers) != config.num_layers:
            raise ModelError(f"model: {len(layers)} decoder layers, the config says {config.num_layers}")
        weight = embed.weight
        if weight.dim() != 2 or weight.shape[0] < config.vocab_size or weight.shape[1] != config.hidden_size:
            raise ModelError(f"model.embed_tokens: weight {list(weight.shape)} does not hold {config.vocab_size} "
                             f"tokens of width {config.hidden_size} (tensor parallelism is not supported)")
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (config.num_heads, config.num_kv_heads,
                                                                     config.head_dim):
                raise ModelError(f"model.layers[{i}].self_attn: {attn.num_heads}/{attn.num_kv_heads} heads of "
                                 f"{attn.head_dim}, the config says {config.num_heads}/{config.num_kv_heads} of "
                                 f"{config.head_dim} (tensor parallelism is not supported)")
        super().__init__(config, _Embedding(weight), dtype=weight.dtype, device=weight.device, name=name)
        self.module = model
        self._layers, self._norm = layers, norm

    # The per-layer math of Model, with vLLM's modules (the public steps check their arguments and
    # call these; prefill, forward_layer and generate run over them too).
    def _qkv(self, layer, hidden, positions):
        c, block = self.config, self._layers[layer]
        attn = block.self_attn
        S = hidden.shape[0]
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        if c.qk_norm:
            q = attn.q_norm(q.reshape(S, c.num_heads, c.head_dim)).reshape(S, c.q_size)
            k = attn.k_norm(k.reshape(S, c.num_kv_heads, c.head_dim)).reshape(S, c.kv_size)
        q, k = attn.rotary_emb(positions, q, k)
        return (q.reshape(S, c.num_heads, c.head_dim), k.reshape(S, c.num_kv_heads, c.head_dim),
                v.reshape(S, c.num_kv_heads, c.head_dim))

    def _finish(self, layer, hidden_in, attn_out):
        block = self._layers[layer]
        out, _ = block.self_attn.o_proj(attn_out)
        h = hidden_in + out
        return h + block.mlp(block.post_attention_layernorm(h))

    def _logits(self, hidden):
        logits = self.module.compute_logits(self._norm(hidden))
        if logits is None or logits.shape[-1] != self.config.vocab_size:
            raise ModelError(f"compute_logits: expected [S, {self.config.vocab_size}] logits, got "
                             f"{None if logits is None else list(logits.shape)}")
        return logits.float()
