"""RopeSpec's cos/sin cache (vLLM's construction) and rope_shift."""

from __future__ import annotations

import math

import pytest
import torch

from kmesh_gpu import LayoutError, RopeSpec, rope_shift

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def _spec(kind, dtype=torch.float32, rd=32, neox=True):
    return RopeSpec(64, rd, 10000.0, neox, 256 if kind == "yarn" else 1024, dtype, SCALINGS[kind])


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_cache_shape_and_float64_agreement(kind):
    """Independent float64 formulas agree with the fp32 cache to fp32 accuracy."""
    spec = _spec(kind)
    cache = spec.cos_sin_cache()
    rd = spec.rotary_dim
    assert cache.shape == (spec.num_positions, rd) and cache.dtype == torch.float32
    i = torch.arange(0, rd, 2, dtype=torch.float64) / rd
    inv = 1.0 / (10000.0 ** i)
    t = torch.arange(spec.num_positions, dtype=torch.float64)
    mag = 1.0
    if kind == "linear":
        t = t / 2.0
    elif kind == "dynamic":
        base = 10000.0 * ((2.0 * 1024 / 1024) - 1) ** (rd / (rd - 2))
        inv = 1.0 / (base ** i)
    elif kind == "llama3":
        wave = 2 * math.pi / inv
        smooth = (512 / wave - 1.0) / (4.0 - 1.0)
        inv = torch.where(wave < 512 / 4.0, inv, torch.where(wave > 512 / 1.0, inv / 8.0,
                                                             (1 - smooth) * inv / 8.0 + smooth * inv))
    elif kind == "yarn":
        def corr(rot):
            return rd * math.log(256 / (rot * 2 * math.pi)) / (2 * math.log(10000.0))
        low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), rd - 1)
        ramp = torch.clamp((torch.arange(rd // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        inv = (inv / 4.0) * ramp + inv * (1 - ramp)
        mag = 0.1 * math.log(4.0) + 1.0
    ang = t[:, None] * inv[None, :]
    expect = torch.cat((ang.cos(), ang.sin()), -1) * mag
    # fp32 angles of large positions carry ~ulp(angle) error: allow it, scaled by position
    tol = 1e-6 + 2e-7 * t.max().item()
    assert float((cache.double() - expect).abs().max()) < tol


def test_cache_is_cast_to_the_model_dtype():
    assert _spec("default", torch.bfloat16).cos_sin_cache().dtype == torch.bfloat16
    assert torch.equal(_spec("default", torch.bfloat16).cos_sin_fp32(),
                       _spec("default", torch.float32).cos_sin_cache().to(torch.bfloat16).float())


@pytest.mark.vllm
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_cache_equals_vllm_bit_for_bit(kind):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    spec = _spec(kind, torch.bfloat16, rd=48, neox=kind != "linear")
    params = {"rope_theta": spec.base, "partial_rotary_factor": spec.rotary_dim / spec.head_size}
    params.update(SCALINGS[kind] or {})
    with set_current_vllm_config(VllmConfig()):
        theirs = get_rope(spec.head_size, spec.max_position, is_neox_style=spec.is_neox_style,
                          rope_parameters=params, dtype=torch.bfloat16).cos_sin_cache
    assert torch.equal(spec.cos_sin_cache(), theirs.to(torch.bfloat16))


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_shift_round_trip_and_untouched_dims(neox):
    gen = torch.Generator().manual_seed(0)
    spec = RopeSpec(64, 32, 10000.0, neox, 1024, torch.float32)
    k = torch.randn(3, 10, 2, 64, generator=gen)
    p = torch.randint(0, 1024, (10,), generator=gen)
    q = torch.randint(0, 1024, (10,), generator=gen)
    moved = rope_shift(k, p, q, spec)
    back = rope_shift(moved, q, p, spec)
    assert torch.allclose(back, k, atol=1e-5)
    rotated = torch.arange(32) if neox else torch.arange(32)  # both styles rotate the first rd dims
    assert torch.equal(moved[..., 32:], k[..., 32:])
    assert not torch.equal(moved[..., rotated], k[..., rotated])
    same = rope_shift(k, p, p, spec)
    assert torch.allclose(same, k, atol=1e-6)


def test_shift_preserves_pair_norms():
    gen = torch.Generator().manual_seed(1)
    spec = RopeSpec(8, 8, 10000.0, False, 64, torch.float32)
    k = torch.randn(1, 4, 1, 8, generator=gen)
    moved = rope_shift(k, torch.tensor([0, 5, 9, 63]), torch.tensor([63, 1, 2, 3]), spec)
    norms = lambda x: x[..., 0::2] ** 2 + x[..., 1::2] ** 2  # GPT-J pairs (2i, 2i+1)
    assert torch.allclose(norms(moved), norms(k), atol=1e-5)


@pytest.mark.parametrize("args,match", [
    (dict(rotary_dim=65), "rotary_dim"),
    (dict(rotary_dim=7), "rotary_dim"),
    (dict(base=0.5), "base"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(max_position=0), "max_position"),
    (dict(scaling={"rope_type": "longrope", "factor": 2}), "rope_type"),
    (dict(scaling={"rope_type": "yarn", "factor": 2}), "original_max_position_embeddings"),
])
def test_bad_specs(args, match):
    kw = dict(head_size=64, rotary_dim=64, base=10000.0, is_neox_style=True, max_position=128, dtype=torch.float16)
    kw.update(args)
    with pytest.raises(LayoutError, match=match):
        RopeSpec(**kw)


def test_bad_shift_inputs():
    spec = RopeSpec(16, 16, 10000.0, True, 32, torch.float16)
    k = torch.zeros(4, 2, 16, dtype=torch.float16)
    with pytest.raises(LayoutError, match=r"old_positions: expected int64\[T=4\]"):
        rope_shift(k, torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), spec)
    with pytest.raises(LayoutError, match=r"new_positions: positions must lie in \[0, 32\)"):
        rope_shift(k, torch.zeros(4, dtype=torch.int64), torch.full((4,), 32), spec)
    with pytest.raises(LayoutError, match="k: expected"):
        rope_shift(torch.zeros(4, 2, 8), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), spec)


def test_dict_round_trip():
    spec = _spec("llama3", torch.bfloat16)
    assert RopeSpec.from_dict(spec.to_dict()) == spec
    assert hash(spec) == hash(RopeSpec.from_dict(spec.to_dict()))


def test_concurrent_first_use_builds_one_table():
    """Threads asking at once for the table of a spec nobody has used yet get one and the same
    tensor (the cache service sets up many clients' first placements in parallel threads; each
    used to build and keep its own copy)."""
    import threading

    specs = [RopeSpec(64, 32, 12345.0, True, 4096, torch.float32, None) for _ in range(12)]  # equal, distinct
    barrier = threading.Barrier(len(specs))
    got = [None] * len(specs)

    def run(i):
        barrier.wait()
        got[i] = specs[i].cos_sin_fp32()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is got[0] for g in got)
    assert got[0].shape == (4096, 32) and got[0].dtype == torch.float32


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_apply_then_shift_equals_apply_at_the_new_position(neox):
    gen = torch.Generator().manual_seed(2)
    spec = RopeSpec(64, 48, 10000.0, neox, 2048, torch.float32)
    x = torch.randn(3, 12, 2, 64, generator=gen)
    p = torch.randint(0, 2048, (12,), generator=gen)
    q = torch.randint(0, 2048, (12,), generator=gen)
    at_p = spec.apply(x, p)
    assert torch.equal(at_p[..., 48:], x[..., 48:])  # dims past rotary_dim untouched
    assert torch.allclose(rope_shift(at_p, p, q, spec), spec.apply(x, q), atol=2e-5)
    assert torch.equal(spec.apply(x, torch.zeros(12, dtype=torch.int64)), x)  # position 0: cos 1, sin 0


@pytest.mark.vllm
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_apply_matches_vllm_rotary_embedding_in_fp32(neox):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    spec = RopeSpec(64, 64, 1e5, neox, 4096, torch.float32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(9, 3, 64, generator=gen)
    k = torch.randn(9, 1, 64, generator=gen)
    pos = torch.randint(0, 4096, (9,), generator=gen)
    with set_current_vllm_config(VllmConfig()):
        theirs = get_rope(64, 4096, is_neox_style=neox, rope_parameters={"rope_theta": 1e5}, dtype=torch.float32)
        q_ref, k_ref = theirs.forward_native(pos, q.reshape(9, -1).clone(), k.reshape(9, -1).clone())
    assert torch.allclose(spec.apply(q, pos), q_ref.reshape(9, 3, 64), atol=1e-5)
    assert torch.allclose(spec.apply(k, pos), k_ref.reshape(9, 1, 64), atol=1e-5)


def test_apply_bad_inputs():
    spec = RopeSpec(8, 8, 10000.0, True, 16, torch.float32)
    with pytest.raises(LayoutError, match="positions: expected int64"):
        spec.apply(torch.zeros(2, 1, 8), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(LayoutError, match="positions must lie in"):
        spec.apply(torch.zeros(2, 1, 8), torch.tensor([0, 16]))
    with pytest.raises(LayoutError, match="x: expected a tensor"):
        spec.apply(torch.zeros(2, 1, 4), torch.tensor([0, 1]))
