"""Regressions of the placement API found by an audit on CPU (torch and Warp backends; each failed
before its fix): strided cache views written outside the view, K and V of large layouts overlapping,
RoPE specs with unusable scaling values, untyped errors and silent coercions (float sizes, "false"
as a neox flag, meta tensors, k_scale strings), layouts beyond int64, ``gather(out=)`` naming the
wrong argument and keeping skipped rows, sources or ``gather`` outputs inside the cache and caches
sharing memory (the backends wrote different bits), Warp's fp8 store turning a shifted NaN key
into -448 where torch keeps NaN (the CUDA kernels' clamp had the same pattern), and a refused
``gather(out=)`` that had already zeroed ``out``'s skipped rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from kmesh_gpu import KmeshError, KVLayout, LayoutError, RopeSpec, gather, place, place_many

BACKENDS = ["torch", "warp"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _small(dtype=torch.float32, L=2, B=4, N=4, H=2, D=8, name="LBHNC"):
    return KVLayout.from_vllm(name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", ["every-other-layer", "fewer-blocks", "every-other-element"])
def test_cache_view_that_skips_memory_is_refused_and_nothing_written(backend, view):
    """A cache tensor must hold every element the layout addresses. A strided view spans enough
    memory, but the layout's addresses then fall between its elements: place wrote there (outside
    the view) and left the view's own elements alone."""
    lay = _small()
    if view == "every-other-layer":
        big = torch.zeros((2 * lay.num_layers,) + lay.physical_shape[1:])
        cache = big[::2]
    elif view == "fewer-blocks":
        big = torch.zeros((lay.num_layers, 2 * lay.num_blocks) + lay.physical_shape[2:])
        cache = big[:, :lay.num_blocks]
    else:
        big = torch.zeros(lay.physical_shape[:-1] + (2 * lay.physical_shape[-1],))
        cache = big[..., ::2]
    before = big.clone()
    kv = torch.randn(2, lay.num_layers, 3, lay.num_kv_heads, lay.head_size)
    with pytest.raises(LayoutError, match="cache"):
        place(kv, cache, lay, torch.tensor([0, 5, 15]), backend=backend)
    assert torch.equal(_bits(big), _bits(before))


def test_large_layout_with_overlapping_k_and_v_is_refused():
    """K and V addresses must be disjoint at every size. Above 2**24 addressed elements the check
    only compared the two offsets, so V one element after K (V[d] is K[d+1]) was accepted."""
    B = 1 << 19  # 2 * 1 * B * 1 * 16 * 2 = 2**25 addressed elements
    st = (B * 32, 32, 32, 2, 1)
    with pytest.raises(LayoutError, match="overlap"):
        KVLayout.from_strides((1, B, 1, 16, 2), st, st, 0, 1, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="overlap"):
        KVLayout.from_dict({"sizes": [1, B, 1, 16, 2], "k_strides": list(st), "v_strides": list(st), "k_offset": 0,
                            "v_offset": 1, "dtype": "uint8", "physical_shape": [B * 32 + 1], "name": "custom"})


_BASE = dict(head_size=64, rotary_dim=64, base=10000.0, is_neox_style=True, max_position=128, dtype=torch.float32)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("change", [
    dict(base=math.inf),
    dict(scaling={"rope_type": "linear", "factor": math.nan}),
    dict(scaling={"rope_type": "linear", "factor": math.inf}),
    dict(scaling={"rope_type": "linear", "factor": "abc"}),
    dict(scaling={"rope_type": "linear", "factor": None}),
    dict(scaling=dict(_LLAMA3, low_freq_factor=math.nan)),
    dict(scaling=dict(_LLAMA3, original_max_position_embeddings=-64)),
    dict(scaling=dict(_YARN, factor=math.nan)),
    dict(scaling=dict(_YARN, original_max_position_embeddings=math.nan)),
    dict(scaling=dict(_YARN, original_max_position_embeddings=-5)),
    dict(scaling=dict(_YARN, beta_fast=math.nan)),
    dict(scaling={"rope_type": "dynamic", "factor": 4.0, "max_trained_positions": 10000}),
    dict(scaling={"rope_type": "dynamic", "factor": 4.0, "max_trained_positions": 0}),
    dict(rotary_dim=2, scaling={"rope_type": "dynamic", "factor": 2.0}),
], ids=lambda c: repr(c)[:60])
def test_rope_spec_refuses_values_its_table_cannot_be_built_from(change):
    """Non-finite or non-positive RoPE parameters are refused when the spec is made, with a
    LayoutError. They were accepted: place then failed with a bare ValueError/OverflowError
    (num_positions of a NaN factor), or the table silently held NaN (llama3) or the real part of a
    complex base (dynamic)."""
    with pytest.raises(LayoutError):
        RopeSpec(**dict(_BASE, **change))


def test_rope_spec_with_nan_llama3_factor_never_reaches_the_cache():
    lay = _small()
    cache = lay.allocate(fill=0)
    kv = torch.randn(2, lay.num_layers, 3, lay.num_kv_heads, lay.head_size)
    with pytest.raises(LayoutError):
        rope = RopeSpec(8, 8, 10000.0, True, 64, torch.float32, dict(_LLAMA3, low_freq_factor=math.nan))
        place(kv, cache, lay, torch.tensor([0, 1, 2]), rope=rope, old_positions=torch.tensor([1, 2, 3]),
              new_positions=torch.tensor([4, 5, 6]))
    assert not bool(cache.any())


_KW = dict(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)


@pytest.mark.parametrize("call", [
    lambda: KVLayout.from_vllm("LBHNC", **dict(_KW, num_layers="abc")),
    lambda: KVLayout.from_vllm("LBHNC", **dict(_KW, num_blocks=2.5)),  # was silently 2
    lambda: KVLayout.from_strides((1, 1, 1, 1, 2), (2, 2, 2, 2, 1), (2, 2, 2, 2, 1), 0, 1, dtype=torch.float32,
                                  physical_shape=("x",)),
    lambda: KVLayout.from_strides((1, 1, 1, 1, 2), (4, 4, 4, 4, 1), (4, 4, 4, 4, 1), 0, 2, dtype=torch.float32,
                                  physical_shape=(-2, -2)),
    lambda: RopeSpec.from_dict(dict(RopeSpec(**_BASE).to_dict(), head_size="abc")),
    lambda: RopeSpec.from_dict(dict(RopeSpec(**_BASE).to_dict(), head_size=64.9)),  # was silently 64
    lambda: RopeSpec.from_dict(dict(RopeSpec(**_BASE).to_dict(), is_neox_style="false")),  # was True
], ids=["sizes-str", "sizes-float", "physical-str", "physical-negative", "rope-head-str", "rope-head-float",
        "rope-neox-str"])
def test_malformed_descriptions_raise_layout_error(call):
    with pytest.raises(LayoutError):
        call()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["k_scale-str", "k_scale-meta", "slots-meta", "positions-meta", "caches-none",
                                  "slots-none"])
def test_malformed_arguments_raise_kmesh_error_and_write_nothing(backend, case):
    lay = _small(torch.uint8)
    rope = RopeSpec(8, 8, 10000.0, True, 64, torch.bfloat16)
    kv = torch.randint(0, 100, (2, lay.num_layers, 3, lay.num_kv_heads, lay.head_size), dtype=torch.uint8)
    cache = lay.allocate(fill=0)
    sl, old, new = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    kw = dict(rope=rope, old_positions=old, new_positions=new, backend=backend)
    with pytest.raises(KmeshError):
        if case == "k_scale-str":
            place(kv, cache, lay, sl, k_scale="x", **kw)
        elif case == "k_scale-meta":
            place(kv, cache, lay, sl, k_scale=torch.ones(2, device="meta"), **kw)
        elif case == "slots-meta":
            place(kv, cache, lay, sl.to("meta"), **kw)
        elif case == "positions-meta":
            place(kv, cache, lay, sl, **dict(kw, old_positions=old.to("meta")))
        elif case == "caches-none":
            place_many([kv], None, lay, [sl], backend=backend)
        else:
            place_many([kv], cache, lay, None, backend=backend)
    assert not bool(cache.any())


@pytest.mark.parametrize("blocks", [1 << 62, 1 << 59])
def test_layout_whose_addresses_overflow_int64_is_refused(blocks):
    """num_blocks * block_size * ... beyond int64 (the documented index width): refused when the
    layout is made, not by a RuntimeError from allocate()."""
    with pytest.raises(LayoutError):
        KVLayout.from_vllm("LBHNC", **dict(_KW, num_blocks=blocks, block_size=16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_out_errors_name_out_and_skipped_rows_are_zero(backend):
    """gather's ``out``: a wrong one is named ``out`` (was "kv: ..." or "slots: expected int64[4]");
    tokens with slot -1 come back as zeros, as the docstring says (they kept out's old values)."""
    lay = _small()
    cache = torch.randn(lay.physical_shape, generator=torch.Generator().manual_seed(2))
    sl = torch.tensor([0, -1, 15])
    with pytest.raises(LayoutError, match="^out"):
        gather(cache, lay, sl, out=torch.zeros(2, 2, 3, 2, 8, dtype=torch.float16), backend=backend)
    with pytest.raises(LayoutError, match="^out"):
        gather(cache, lay, sl, out=torch.zeros(2, 2, 4, 2, 8), backend=backend)
    out = torch.full((2, 2, 3, 2, 8), 7.0)
    gather(cache, lay, sl, out=out, backend=backend)
    assert torch.equal(out, gather(cache, lay, sl, backend=backend))
    assert not bool(out[:, :, 1].any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_gather_leaves_out_untouched(backend):
    """gather(out=) with a bad slot: refused, and ``out`` keeps every value (its skipped rows were
    zeroed before the slots were checked)."""
    lay = _small()
    cache = torch.randn(lay.physical_shape, generator=torch.Generator().manual_seed(3))
    out = torch.full((2, 2, 3, 2, 8), 7.0)
    for bad in (torch.tensor([0, -1, 16]), torch.tensor([-2, -1, 3])):
        with pytest.raises(LayoutError, match="slots"):
            gather(cache, lay, bad, out=out, backend=backend)
        assert bool((out == 7.0).all())


# ------------------------------------------------------------------ 3. sources that alias the cache
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("api", ["place", "place_many"])
def test_source_inside_the_destination_cache_is_refused(backend, api):
    """A segment tensor that is a view of the cache it is placed into: torch copies the sources
    first, the Warp kernel reads and writes in one pass, so the two backends wrote different bits.
    Refused (LayoutError naming kv), nothing written."""
    lay = _small(B=8)
    cache = torch.randn(lay.physical_shape, generator=torch.Generator().manual_seed(0))
    before = cache.clone()
    T = 6
    kv = cache.view(-1)[:2 * lay.num_layers * T * lay.num_kv_heads * lay.head_size].view(
        2, lay.num_layers, T, lay.num_kv_heads, lay.head_size)
    slots = torch.arange(T) + 1
    with pytest.raises(LayoutError, match="kv"):
        if api == "place":
            place(kv, cache, lay, slots, backend=backend)
        else:
            place_many([kv], cache, lay, [slots], backend=backend)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_out_inside_the_cache_is_refused(backend):
    lay = _small(B=8)
    cache = torch.randn(lay.physical_shape, generator=torch.Generator().manual_seed(1))
    before = cache.clone()
    out = cache.view(-1)[:2 * lay.num_layers * 3 * lay.num_kv_heads * lay.head_size].view(
        2, lay.num_layers, 3, lay.num_kv_heads, lay.head_size)
    with pytest.raises(LayoutError, match="out"):
        gather(cache, lay, torch.tensor([20, 21, 22]), out=out, backend=backend)
    assert torch.equal(cache, before)


# ------------------------------------------------------------------ 4. destinations that alias each other
@pytest.mark.parametrize("backend", BACKENDS)
def test_place_many_into_overlapping_caches_is_refused(backend):
    """Two cache tensors that share memory (layer 1 of one is layer 0 of the other): slot 0 of
    both is one element, written twice in one launch (torch: the last item wins, Warp: the first).
    Refused like a duplicate slot, nothing written."""
    lay = _small()
    big = torch.zeros((lay.num_layers + 1,) + lay.physical_shape[1:])
    a, b = big[0:lay.num_layers], big[1:lay.num_layers + 1]
    kv1 = torch.full((2, lay.num_layers, 1, lay.num_kv_heads, lay.head_size), 1.0)
    kv2 = torch.full_like(kv1, 2.0)
    with pytest.raises(LayoutError, match="share memory"):
        place_many([kv1, kv2], [a, b], lay, [torch.tensor([0]), torch.tensor([0])], backend=backend)
    assert not bool(big.any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_layer_list_with_one_tensor_for_two_layers_is_refused(backend):
    lay = _small()
    layer = torch.zeros(lay.physical_shape[1:])
    kv = torch.randn(2, lay.num_layers, 3, lay.num_kv_heads, lay.head_size)
    with pytest.raises(LayoutError, match="same memory"):
        place(kv, [layer, layer], lay, torch.tensor([0, 1, 2]), backend=backend)
    assert not bool(layer.any())


# ------------------------------------------------------------------ 5. Warp's fp8 store of NaN
def test_warp_fp8_shift_keeps_nan_like_torch():
    """fp8 e4m3 keys holding NaN (0x7f / 0xff): torch writes NaN back, Warp wrote 0xfe (-448.0),
    a finite value, because wp.clamp maps NaN to the lower bound."""
    lay = _small(torch.uint8, L=1, B=1, N=4, H=1, D=4)
    rope = RopeSpec(4, 4, 10000.0, True, 64, torch.bfloat16)
    kv = torch.tensor([0x7F, 0xFF, 0x7E, 0x01], dtype=torch.uint8).view(1, 1, 4, 1, 1).expand(2, 1, 4, 1, 4)
    kv = kv.contiguous()
    outs = {}
    for backend in BACKENDS:
        cache = lay.allocate(fill=0)
        place(kv, cache, lay, torch.arange(4), rope=rope, old_positions=torch.tensor([1, 2, 3, 4]),
              new_positions=torch.tensor([5, 6, 7, 8]), k_scale=0.5, backend=backend)
        outs[backend] = cache.clone()
    assert torch.equal(outs["torch"], outs["warp"])
    k = gather(outs["warp"], lay, torch.arange(4))[0].view(torch.float8_e4m3fn).float()
    assert bool(k[0, :2].isnan().all())


@pytest.mark.gpu
def test_cuda_fp8_shift_keeps_nan_like_torch():
    """The same on CUDA, for every backend there (the CuPy kernels' store clamped NaN the same way)."""
    from tests.helpers.devices import backends_for

    lay = _small(torch.uint8, L=1, B=1, N=4, H=1, D=4)
    rope = RopeSpec(4, 4, 10000.0, True, 64, torch.bfloat16)
    kv = torch.tensor([0x7F, 0xFF, 0x7E, 0x01], dtype=torch.uint8).view(1, 1, 4, 1, 1).expand(2, 1, 4, 1, 4)
    kv = kv.contiguous().cuda()
    outs = {}
    for backend in backends_for("cuda"):
        cache = lay.allocate(fill=0, device="cuda")
        place(kv, cache, lay, torch.arange(4, device="cuda"), rope=rope,
              old_positions=torch.tensor([1, 2, 3, 4], device="cuda"),
              new_positions=torch.tensor([5, 6, 7, 8], device="cuda"), k_scale=0.5, backend=backend)
        outs[backend] = cache.cpu()
    for backend, got in outs.items():
        assert torch.equal(got, outs["torch"]), backend
    k = gather(outs["torch"], lay, torch.arange(4))[0].view(torch.float8_e4m3fn).float()
    assert bool(k[0, :2].isnan().all())
