"""Test-only model helpers: transformers as the reference forward, and a GGUF writer.

``hf_logits`` runs the transformers implementation of a folder's architecture (eager attention),
which shares no code with ``kmesh_vllm.model``. ``write_gguf`` writes HF-named weights the way
llama.cpp's converter lays them out (its names; Llama's Q/K rows reordered for interleaved RoPE),
so the loader's renaming and un-permutation are checked against an independent forward permutation.
"""

from __future__ import annotations

import numpy as np
import torch

from kmesh_vllm.model import BlockTable


def rel(ours, ref) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def assert_close_fp32(ours, ref, what):
    """The fp32 criterion against transformers: allclose(rtol=1e-4, atol=1e-4 * max|ref|)."""
    print(f"\n{what}: max rel diff vs transformers {rel(ours, ref):.2e}")
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())), what


def run_prefill(model, ids, positions=None, *, layout_name="LBHNC", packing="content", seed=0):
    """Prefill one request at ``positions`` through a random block table; fp32 logits [S, vocab]."""
    S = ids.shape[0]
    positions = torch.arange(S) if positions is None else positions
    N = 16
    need = int(positions.max()) // N + 1
    layout = model.kv_layout(num_blocks=need + 3, block_size=N, name=layout_name, kv_packing=packing)
    cache = layout.allocate(fill=float("nan"))
    blocks = torch.randperm(need + 3, generator=torch.Generator().manual_seed(seed))[:need].tolist()
    slots = BlockTable(blocks, N).slots(positions)
    return model.prefill(ids, positions, cache, layout, slots)


_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def hf_model(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(model, token_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits ``[S, vocab]`` of one causal sequence through a transformers model."""
    kwargs = {} if positions is None else {"position_ids": positions[None]}
    return model(token_ids[None], **kwargs).logits[0].float()


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows [first half | second half] become interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, config, tensors: dict, *, arch: str = "llama", qtype=None, tokenizer=None,
               chat_template: str | None = None) -> None:
    """Write ``tensors`` (HF names) and ``config``'s metadata as a GGUF file (F32, or ``qtype`` for 2-D)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_rope_dimension_count(config.rotary_dim)
    w.add_vocab_size(config.vocab_size)
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        import json

        model = json.loads(tokenizer.to_str())["model"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        special = {a["content"] for a in json.loads(tokenizer.to_str())["added_tokens"] if a["special"]}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        if config.bos_token_id is not None:
            w.add_bos_token_id(config.bos_token_id)
        if config.eos_token_ids:
            w.add_eos_token_id(config.eos_token_ids[0])
        w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, t in tensors.items():
        a = t.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            a = llama_cpp_permute(a, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        if qtype is not None and a.ndim == 2:
            w.add_tensor(gguf_name(name), gguf.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
