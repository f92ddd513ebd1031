"""The runner against transformers' forward of the same weights, over paged caches in every layout.

Tolerance against transformers (fp32): ``torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * max|ref|)``.
bf16: our error against the fp32 reference is at most twice transformers' own bf16 error (plus
1e-3 * max|ref|). The measured ``max|ours - ref| / max|ref|`` is printed (``pytest -s``).
"""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import LayoutError
from kmesh_gpu.layout import VLLM_LAYOUTS
from kmesh_vllm.model import BlockTable, ModelConfig, ModelError, load_model, write_random_model
from tests.helpers.model_craft import assert_close_fp32, hf_logits, hf_model, rel, run_prefill

SMALL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
         "rope_theta": 1e4, "bos_token_id": 1, "eos_token_id": 2}
CASES = {
    "llama-untied": dict(SMALL, architectures=["LlamaForCausalLM"], num_key_value_heads=1),
    "llama-tied-biases": dict(SMALL, architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                              attention_bias=True, mlp_bias=True),
    "qwen3-qknorm-tied": dict(SMALL, architectures=["Qwen3ForCausalLM"], head_dim=48, tie_word_embeddings=True),
    "qwen2-untied": dict(SMALL, architectures=["Qwen2ForCausalLM"], rope_theta=1e6),
    "llama3-rope": dict(SMALL, architectures=["LlamaForCausalLM"], rope_theta=5e5, max_position_embeddings=1024,
                        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
                                         "rope_theta": 5e5}),
}


def tokens(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------- against transformers
def test_tiny_preset_fp32_matches_transformers(tiny, tiny_dir):
    ids = tokens(48, 512)
    assert_close_fp32(run_prefill(tiny, ids), hf_logits(hf_model(tiny_dir), ids), "tiny fp32")


def test_tiny_preset_bf16_within_bf16_rounding(tiny_dir):
    ids = tokens(48, 512, seed=1)
    ref = hf_logits(hf_model(tiny_dir), ids)
    theirs = hf_logits(hf_model(tiny_dir, torch.bfloat16), ids)
    ours = run_prefill(load_model(tiny_dir, dtype=torch.bfloat16), ids)
    print(f"\ntiny bf16: max rel diff vs fp32 transformers: ours {rel(ours, ref):.2e}, "
          f"transformers bf16 {rel(theirs, ref):.2e}; ours vs transformers bf16 {rel(ours, theirs):.2e}")
    assert float((ours - ref).abs().max()) <= 2 * float((theirs - ref).abs().max()) + 1e-3 * float(ref.abs().max())


@pytest.mark.parametrize("case", CASES)
def test_random_configs_match_transformers(case, tmp_path):
    config = ModelConfig.from_hf(CASES[case])
    folder = write_random_model(config, tmp_path / case, seed=3)
    ours = load_model(folder)
    assert ours.config == ModelConfig.from_file(folder / "config.json")
    ids = tokens(40, 512, seed=2)
    positions = torch.arange(40) + (300 if case == "llama3-rope" else 0)  # past the original 128 positions
    assert_close_fp32(run_prefill(ours, ids, positions), hf_logits(hf_model(folder), ids, positions), case)


def test_partial_rotary_leaves_the_tail_unrotated(tmp_path):
    # transformers' Llama ignores partial_rotary_factor (it rotates the whole head); vLLM's get_rope
    # honours it, and so does this runner: only the first head_dim * factor dims are rotated.
    config = ModelConfig.from_hf(dict(CASES["llama-untied"], partial_rotary_factor=0.5))
    model = load_model(write_random_model(config, tmp_path / "partial"))
    h = model.embed(tokens(5, 512))
    positions = torch.arange(5) + 7
    q, k, _ = model.qkv(0, h, positions)
    q0, k0, _ = model.qkv(0, h, torch.zeros(5, dtype=torch.int64))
    assert model.rope.rotary_dim == 16
    assert torch.equal(k[..., 16:], k0[..., 16:]) and torch.equal(q[..., 16:], q0[..., 16:])
    assert not torch.equal(k[..., :16], k0[..., :16])


# ---------------------------------------------------------------------------------- paged cache, every layout
LAYOUTS = [(name, packing) for name in VLLM_LAYOUTS for packing in ("content", "planes")]
S_FULL = 45


@pytest.fixture(scope="module")
def full_reference(tiny):
    ids = tokens(S_FULL, 512, seed=5)
    return ids, run_prefill(tiny, ids)


def poison_rows(model, cache, layout, slots):
    nan = torch.full((slots.shape[0], model.config.num_kv_heads, model.config.head_dim), float("nan"))
    for layer in range(model.num_layers):
        model.write_kv(layer, nan, nan, cache, layout, slots)


@pytest.mark.parametrize("name,packing", LAYOUTS, ids=[f"{n}-{p}" for n, p in LAYOUTS])
def test_subset_prefill_and_decode_in_every_layout(tiny, full_reference, name, packing):
    ids, reference = full_reference
    g = torch.Generator().manual_seed(hash((name, packing)) % 1000)
    layout = tiny.kv_layout(num_blocks=9, block_size=8, name=name, kv_packing=packing)
    table = BlockTable(torch.randperm(9, generator=g)[:6].tolist(), 8)
    slots, positions = table.context(S_FULL)

    cache = layout.allocate(fill=float("nan"))
    full = tiny.prefill(ids, positions, cache, layout, slots)
    assert torch.equal(full, reference)  # another layout and block table: the same bits

    # a random subset recomputed, the rest already in the cache (the subset's own K/V poisoned first)
    subset = torch.sort(torch.randperm(S_FULL, generator=g)[:17]).values
    partial = cache.clone()
    poison_rows(tiny, partial, layout, slots[subset])
    got = tiny.prefill(ids[subset], positions[subset], partial, layout, slots[subset],
                       context_slots=slots, context_positions=positions)
    assert torch.allclose(got, full[subset], rtol=0, atol=1e-5 * float(full.abs().max()))
    assert torch.equal(partial.isnan(), cache.isnan())

    # the prefix, then the rest given the prefix in the cache
    split = 21
    staged = layout.allocate(fill=float("nan"))
    tiny.prefill(ids[:split], positions[:split], staged, layout, slots[:split])
    got = tiny.prefill(ids[split:], positions[split:], staged, layout, slots[split:],
                       context_slots=slots, context_positions=positions)
    assert torch.allclose(got, full[split:], rtol=0, atol=1e-5 * float(full.abs().max()))

    # greedy decoding after the prompt equals a prefill of the longer prompt, row by row
    prompt = ids[:30]
    dec = layout.allocate(fill=float("nan"))
    gen = tiny.generate(prompt, table, dec, layout, max_new_tokens=5, eos_token_ids=[])
    longer = torch.cat([prompt, torch.tensor(gen.token_ids[:-1])])
    fresh = layout.allocate(fill=float("nan"))
    s, p = table.context(longer.shape[0])
    again = tiny.prefill(longer, p, fresh, layout, s)
    assert len(gen.token_ids) == 5
    assert torch.allclose(gen.logits, again[29:], rtol=0, atol=1e-5 * float(again.abs().max()))
    assert gen.token_ids == again[29:].argmax(-1).tolist()


def test_row_steps_equal_prefill_and_are_deterministic(tiny):
    ids = tokens(20, 512, seed=9)
    layout = tiny.kv_layout(num_blocks=4, block_size=8, name="NHD")
    table = BlockTable([3, 1, 0], 8)
    slots, positions = table.context(20)
    a, b = layout.allocate(fill=0), layout.allocate(fill=0)
    logits = tiny.prefill(ids, positions, a, layout, slots)
    h = tiny.embed(ids)
    for layer in range(tiny.num_layers):
        q, k, v = tiny.qkv(layer, h, positions)
        tiny.write_kv(layer, k, v, b, layout, slots)
        out = tiny.attend(layer, q, positions, b, layout, slots, positions)
        h = tiny.finish(layer, h, out)
    assert torch.equal(tiny.logits(h), logits) and torch.equal(a, b)
    assert torch.equal(tiny.prefill(ids, positions, b, layout, slots), logits)
    # fewer rows through the LM head: another GEMM shape, so equal only to rounding
    some = tiny.prefill(ids, positions, b, layout, slots, logits_rows=[-1, 3])
    assert torch.allclose(some, logits[[19, 3]], rtol=0, atol=1e-5 * float(logits.abs().max()))


def test_generate_with_the_prompt_partly_prefilled(tiny):
    ids = tokens(20, 512, seed=4)
    layout = tiny.kv_layout(num_blocks=6, block_size=8)
    table = BlockTable([5, 2, 4, 0], 8)
    a, b = layout.allocate(fill=0), layout.allocate(fill=0)
    whole = tiny.generate(ids, table, a, layout, max_new_tokens=4, eos_token_ids=[])
    s, p = table.context(12)
    tiny.prefill(ids[:12], p, b, layout, s)
    rest = tiny.generate(ids, table, b, layout, max_new_tokens=4, prefilled=12, eos_token_ids=[])
    assert rest.token_ids == whole.token_ids
    assert torch.allclose(rest.logits, whole.logits, rtol=0, atol=1e-5 * float(whole.logits.abs().max()))


# ---------------------------------------------------------------------------------- bad input
@pytest.fixture()
def setup(tiny):
    layout = tiny.kv_layout(num_blocks=4, block_size=8)
    return tiny, layout, layout.allocate(fill=0)


def test_refuses_positions_past_the_limit(setup):
    model, layout, cache = setup
    ids = torch.tensor([1, 2])
    with pytest.raises(ModelError, match=r"positions: positions must lie in \[0, 4096\)"):
        model.prefill(ids, torch.tensor([4095, 4096]), cache, layout, torch.tensor([0, 1]))
    with pytest.raises(ModelError, match="positions"):
        model.qkv(0, model.embed(ids), torch.tensor([-1, 0]))


def test_refuses_bad_slots_before_any_work(setup):
    model, layout, cache = setup
    ids, pos = torch.tensor([1, 2]), torch.tensor([0, 1])
    before = cache.clone()
    with pytest.raises(LayoutError, match=r"slots: expected -1 \(skip\) or slots in \[0, 32\)"):
        model.prefill(ids, pos, cache, layout, torch.tensor([0, 32]), context_slots=torch.tensor([0, 1]),
                      context_positions=pos)
    with pytest.raises(LayoutError, match="a slot appears twice"):
        model.prefill(ids, pos, cache, layout, torch.tensor([3, 3]), context_slots=torch.tensor([3]),
                      context_positions=torch.tensor([0]))
    with pytest.raises(LayoutError, match=r"slots: expected int64\[2\], got int32"):
        model.prefill(ids, pos, cache, layout, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(LayoutError, match=r"context_slots: expected slots in \[0, 32\)"):
        model.prefill(ids, pos, cache, layout, torch.tensor([0, 1]), context_slots=torch.tensor([0, 99]),
                      context_positions=pos)
    assert torch.equal(cache, before)


def test_refuses_bad_arguments(setup):
    model, layout, cache = setup
    h = model.embed(torch.tensor([1, 2]))
    pos = torch.tensor([0, 1])
    with pytest.raises(ModelError, match=r"token_ids: expected ids in \[0, 512\)"):
        model.embed(torch.tensor([512]))
    with pytest.raises(ModelError, match=r"hidden: expected float32\[S, 128\]"):
        model.qkv(0, h.bfloat16(), pos)
    with pytest.raises(ModelError, match="layer: expected an int in"):
        model.qkv(4, h, pos)
    with pytest.raises(ModelError, match=r"attn_out: expected float32\[2, 128\]"):
        model.finish(0, h, torch.zeros(3, 128))
    other = model.kv_layout(num_blocks=4, block_size=8).__class__.from_vllm(
        "LBHNC", num_layers=4, num_blocks=4, block_size=8, num_kv_heads=4, head_size=32, dtype=torch.float32)
    q, k, v = model.qkv(0, h, pos)
    with pytest.raises(LayoutError, match="the model needs"):
        model.write_kv(0, k, v, other.allocate(), other, pos)
    with pytest.raises(LayoutError, match="cache: expected the layout's dtype"):
        model.write_kv(0, k, v, cache.bfloat16(), layout, pos)
    with pytest.raises(ModelError, match="sees no context entry"):
        model.attend(0, q, pos, cache, layout, torch.tensor([5]), torch.tensor([3]))
    with pytest.raises(ModelError, match="needs 33 positions, the table holds 32"):
        model.generate(torch.tensor([1, 2]), BlockTable([0, 1, 2, 3], 8), cache, layout, max_new_tokens=32)
    with pytest.raises(LayoutError, match="do not fit layout"):
        model.generate(torch.tensor([1, 2]), BlockTable([7], 8), cache, layout, max_new_tokens=2)
