"""KVLayout against the KV caches vLLM 0.32 really allocates, built and written by vLLM's own code.

What vLLM 0.32 does (RFC #42082; backends no longer have ``get_kv_cache_shape`` /
``get_kv_cache_stride_order``):

- ``vllm/v1/kv_cache_layout.py``: ``KVCacheLayout`` names a memory order of the logical
  ``[L, B, H, N, C]`` cache (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC).
- ``vllm/v1/core/kv_cache_utils.py:get_kv_cache_config_from_groups`` places the layers of one
  group in one ``KVCacheTensor`` (``layer_stride``/``block_stride`` from ``compute_layout_strides``);
  ``vllm/v1/worker/utils.py:allocate_kv_cache`` allocates one int8 buffer and
  ``vllm/v1/kv_cache_interface.py:create_kv_cache_views`` gives every layer an ``as_strided``
  ``[B, H, N, C]`` byte view, then ``.view(dtype)``: ``C = 2*D`` (K then V, ``state_content_size_bytes``).
  The GPU and CPU model runners both call it (``initialize_kv_cache_tensors``).
- GPU backends (FlashAttention, Triton, Flex) split a layer's cache with
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` -> K, V as ``[B, N, H, D]``.
- The CPU backend (``cpu_attn.py``) supports only LBHNC and splits a layer's ``[B, H, N, 2D]`` cache
  with ``view(B, H, 2N, D).chunk(2, dim=2)``; its write op ``cpu_attn_reshape_and_cache`` (``vec`` and
  ``vec16`` ISAs) stores K *transposed* in its plane, ``[D, N]``, and V as ``[N, D]``. The ``amx`` ISA
  (bf16 on AMX hosts) tiles both planes; no affine layout describes it. Which ISA vLLM picks, and which
  of its kernels exist, depends on the host's CPU (``tests/helpers/cpu_features.py``): tests of a kernel
  the host lacks (FP8 caches without AVX-512, ``amx`` without AMX) skip naming the feature.

Every test writes through vLLM's conventions (or vLLM's own op) and reads through KMesh, or the
reverse, on the same storage, comparing bit patterns.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kmesh_gpu import KVLayout, gather, place
from kmesh_gpu.layout import VLLM_ALIASES, VLLM_LAYOUTS
from tests.helpers.cpu_features import FP8_NEEDS, CpuFeatureMissing, CpuFeatures, cpu_attn_isa, missing_for_cache_write

pytestmark = pytest.mark.vllm

NAMES = list(VLLM_LAYOUTS)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
# (L, B, H, N, D)
SIZES = {"small": (2, 3, 2, 16, 64), "wide": (3, 2, 4, 32, 128)}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@pytest.fixture(scope="module")
def vl():
    """vLLM's allocation API and CPU attention backend (imported lazily: the module must collect
    without vLLM, where the conftest skips it)."""
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.cache import _LAYOUT_COMPAT_ALIASES
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl, _get_attn_isa
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return SimpleNamespace(**locals())


def vllm_caches(vl, name: str, *, L, B, H, N, D, dtype, kernel_block_size=None):
    """Allocate like the model runner: KV cache config from vLLM's planner, then allocate_kv_cache.

    Returns ``(per-layer views [B, H, N, 2D] in layer order, flat dtype view of the whole buffer)``.
    """
    layout = vl.KVCacheLayout[name]
    spec = vl.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=dtype)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    groups = [vl.KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)]
    # The planner reads only these fields of the engine config.
    engine = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None))
    config = vl.get_kv_cache_config_from_groups(engine, groups, B * L * spec.page_size_bytes)
    assert config.num_blocks == B
    views = vl.allocate_kv_cache(config, torch.device("cpu"), layout,
                                 None if kernel_block_size is None else [kernel_block_size])
    caches = [views[n] for n in layers]
    storage = caches[0].untyped_storage()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    flat = torch.empty(0, dtype=dtype).set_(storage, 0, (storage.nbytes() // itemsize,), (1,))
    return caches, flat


def gpu_kv_views(cache: torch.Tensor, head_size: int):
    """K, V ``[B, N, H, D]`` exactly as flash_attn.py / triton_attn.py / flex_attention.py split them."""
    return cache.transpose(1, 2).split(head_size, dim=-1)


def cpu_kv_views(cache: torch.Tensor):
    """key_cache, value_cache ``[B, H, N, D]`` exactly as cpu_attn.py's do_kv_cache_update makes them."""
    num_blocks, num_kv_heads, block_size, _ = cache.size()
    return cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)


def cpu_vec_layout(*, L, B, H, N, D, dtype) -> KVLayout:
    """What cpu_attn_reshape_and_cache (vec/vec16) writes into an LBHNC buffer, stated independently of
    ``from_vllm``: per (layer, block, head) a K plane [D, N] then a V plane [N, D]."""
    plane = N * D
    head, block, layer = 2 * plane, H * 2 * plane, B * H * 2 * plane
    return KVLayout.from_strides((L, B, H, N, D), (layer, block, head, 1, N), (layer, block, head, D, 1),
                                 0, plane, dtype=dtype, physical_shape=(L, B, H, 2, N, D), name="vllm-cpu-vec")


def tag_rounds(n: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Integer bit patterns (same width as ``dtype``), finite as floats, such that the tuple over
    rounds is distinct for each of the ``n`` elements: one round for 4-byte dtypes, base-P digits of
    a permuted index (P = the number of finite patterns) for narrower ones."""
    size = torch.empty(0, dtype=dtype).element_size()
    if size == 4:
        return [(0x3F800000 + torch.randperm(n, generator=gen)).to(torch.int32)]  # floats in [1, 2)
    pats = torch.arange(1 << (8 * size))
    exp = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float8_e4m3fn: 0x7F}.get(dtype)
    if exp is not None:
        pats = pats[(pats & exp) != exp]  # drop inf/NaN encodings
    pats = torch.where(pats >= 1 << (8 * size - 1), pats - (1 << 8 * size), pats) if size == 2 else pats
    idx = torch.randperm(n, generator=gen)
    rounds, span = 1, pats.numel()
    while span < n:
        rounds, span = rounds + 1, span * pats.numel()
    return [pats[(idx // pats.numel() ** r) % pats.numel()].to(_INT[size]) for r in range(rounds)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def random_slots(num_slots: int, T: int, gen: torch.Generator) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=gen)[:T].to(torch.int64)
    slots[1] = -1  # vLLM's padding slot
    return slots


def stored_by_slot(tag_k, tag_v, slots, N):
    """(2, L, T, H, D) bit patterns expected at ``slots`` from per-layer tags [L, B, H, N, D]."""
    b, n = slots.clamp(min=0) // N, slots.clamp(min=0) % N
    out = torch.stack([tag_k.transpose(2, 3)[:, b, n], tag_v.transpose(2, 3)[:, b, n]])  # (2, L, T, H, D)
    out[:, :, slots < 0] = 0
    return out


# ------------------------------------------------------------------ named layouts (GPU backends)
def test_named_layouts_are_vllms(vl):
    assert {m.name: m.value for m in vl.KVCacheLayout} == VLLM_LAYOUTS
    assert dict(vl._LAYOUT_COMPAT_ALIASES) == VLLM_ALIASES
    # The backends that pin a layout: CPU reads head-major interiors, Flex flattens (B, N).
    assert vl.CPUAttentionBackend.supported_kv_cache_layouts() == (vl.KVCacheLayout.LBHNC,)
    assert vl.FlexAttentionBackend.supported_kv_cache_layouts() == (vl.KVCacheLayout.LBNHC,)


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES, ids=str)
def test_gpu_layout_addresses_every_element(vl, name, dt, size):
    """Tags written through the GPU backends' K/V views are found by KVLayout.element_offsets."""
    L, B, H, N, D = SIZES[size]
    dtype = DTYPES[dt]
    layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    numel = L * B * H * N * D
    for tags in tag_rounds(2 * numel, dtype, gen):
        caches, flat = vllm_caches(vl, name, L=L, B=B, H=H, N=N, D=D, dtype=dtype)
        assert flat.numel() == math.prod(layout.physical_shape)
        tag_k, tag_v = tags.view(2, L, B, H, N, D)
        for l, cache in enumerate(caches):
            k, v = gpu_kv_views(cache, D)
            bits(k).copy_(tag_k[l].transpose(1, 2))
            bits(v).copy_(tag_v[l].transpose(1, 2))
            # FlashInfer's permute(layer_view_order) is KMesh's memory order without the layer axis.
            per_layer_shape = tuple(s for a, s in zip(name, layout.physical_shape) if a != "L")
            assert cache.permute(*vl.KVCacheLayout[name].layer_view_order).shape == per_layer_shape
        flat_bits = bits(flat)
        blocks, toks = torch.arange(B).view(-1, 1), torch.arange(N).view(1, -1)
        for which, tag in (("k", tag_k), ("v", tag_v)):
            for l in range(L):
                for h in range(H):
                    got = flat_bits[layout.element_offsets(which, l, blocks, h, toks)]  # [B, N, D]
                    assert torch.equal(got, tag[l, :, h]), f"{which} layer {l} head {h}"


@pytest.mark.parametrize("dt", ["bf16", "fp8"], ids=str)
@pytest.mark.parametrize("name", NAMES, ids=str)
def test_gpu_layout_gather_and_place(vl, name, dt):
    """gather/place on vLLM's buffer (stacked) and on its per-layer views agree with vLLM's K/V views."""
    L, B, H, N, D = SIZES["small"]
    dtype = DTYPES[dt]
    layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=dtype)
    gen = torch.Generator().manual_seed(11)
    tags = tag_rounds(2 * L * B * H * N * D, dtype, gen)[0]
    tag_k, tag_v = tags.view(2, L, B, H, N, D)
    slots = random_slots(B * N, 20, gen)
    want = stored_by_slot(tag_k, tag_v, slots, N)

    caches, flat = vllm_caches(vl, name, L=L, B=B, H=H, N=N, D=D, dtype=dtype)
    for l, cache in enumerate(caches):
        k, v = gpu_kv_views(cache, D)
        bits(k).copy_(tag_k[l].transpose(1, 2))
        bits(v).copy_(tag_v[l].transpose(1, 2))
    assert torch.equal(bits(gather(flat, layout, slots)), want)
    assert torch.equal(bits(gather(caches, layout, slots)), want)

    # place writes exactly where vLLM's views read, and nothing else (the buffer starts poisoned).
    for target in ("stacked", "per-layer"):
        caches, flat = vllm_caches(vl, name, L=L, B=B, H=H, N=N, D=D, dtype=dtype)
        bits(flat).fill_(0x55)
        place(want.view(dtype), flat if target == "stacked" else caches, layout, slots)
        expect = torch.full((2, L, B, N, H, D), 0x55, dtype=want.dtype)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                expect[:, :, s // N, s % N] = want[:, :, t]
        for l, cache in enumerate(caches):
            k, v = gpu_kv_views(cache, D)
            assert torch.equal(bits(k), expect[0, l]) and torch.equal(bits(v), expect[1, l]), (target, l)


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC"], ids=str)
def test_kernel_block_split_uses_kernel_block_size(vl, name):
    """With kernel blocks smaller than the manager block, vLLM views each layer as [B*r, H, N/r, C];
    slot numbers are unchanged, and KVLayout must be built with the kernel block size and count."""
    L, B, H, N, D = 2, 3, 2, 32, 64
    Nk = 16
    dtype = torch.bfloat16
    caches, flat = vllm_caches(vl, name, L=L, B=B, H=H, N=N, D=D, dtype=dtype, kernel_block_size=Nk)
    assert caches[0].shape == (B * N // Nk, H, Nk, 2 * D)
    layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=B * N // Nk, block_size=Nk, num_kv_heads=H,
                                head_size=D, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    tags = tag_rounds(2 * L * B * H * N * D, dtype, gen)[0]
    tag_k, tag_v = tags.view(2, L, B * N // Nk, H, Nk, D)
    for l, cache in enumerate(caches):
        k, v = gpu_kv_views(cache, D)
        bits(k).copy_(tag_k[l].transpose(1, 2))
        bits(v).copy_(tag_v[l].transpose(1, 2))
    slots = random_slots(B * N, 40, gen)
    assert torch.equal(bits(gather(flat, layout, slots)), stored_by_slot(tag_k, tag_v, slots, Nk))
    manager = KVLayout.from_vllm(name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                 dtype=dtype)
    # Token-major pages split into identical memory; head-major pages do not.
    same = torch.equal(bits(gather(flat, manager, slots)), stored_by_slot(tag_k, tag_v, slots, Nk))
    assert same == (name == "LBNHC")


# ------------------------------------------------------------------ CPU backend
HOST_CPU = CpuFeatures.of_this_host()
CPU_CASES = {  # id: (dtype, kv_cache_dtype, N, D, the planes ISA vLLM writes the case with where AMX does not apply)
    "fp32-N32-D64": (torch.float32, "auto", 32, 64, "vec"),
    "bf16-N16-D128": (torch.bfloat16, "auto", 16, 128, "vec16"),
    "fp16-N32-D80": (torch.float16, "auto", 32, 80, "vec16"),
    "bf16-N64-D128": (torch.bfloat16, "auto", 64, 128, "vec"),
    "fp8-N32-D64": (torch.bfloat16, "fp8", 32, 64, "vec"),
}
X86_ONLY = pytest.mark.skipif(not HOST_CPU.x86_64, reason=f"needs an x86-64 CPU (vLLM's vec/vec16/amx ISAs); "
                                                          f"this host: {HOST_CPU.describe()}")


def needs_cache_write(isa: str, kv_cache_dtype: str = "auto"):
    """Skip unless this host runs vLLM's cpu_attn_reshape_and_cache for ``isa`` and the cache dtype."""
    missing = missing_for_cache_write(HOST_CPU, isa, kv_cache_dtype)
    return pytest.mark.skipif(missing is not None, reason=f"needs {missing}; this host: {HOST_CPU.describe()}")


def cpu_cases(names) -> list:
    """``names`` of CPU_CASES as parameters, each skipped where this host lacks its write kernel."""
    return [pytest.param(n, id=n, marks=needs_cache_write(CPU_CASES[n][4], CPU_CASES[n][1])) for n in names]


@pytest.fixture(scope="module")
def cpu_impls(vl):
    """CPUAttentionBackendImpl per model dtype (its __init__ reads the current engine config's dtype)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for kv_cache_dtype in ("auto", "fp8"):
            engine = vl.VllmConfig()
            engine.model_config = SimpleNamespace(dtype=dtype)
            with vl.set_current_vllm_config(engine):
                out[dtype, kv_cache_dtype] = vl.CPUAttentionBackendImpl(
                    num_heads=4, head_size=64, scale=1.0, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
                    kv_cache_dtype=kv_cache_dtype)
    return out


def cpu_write(vl, cpu_impls, case, *, L, B, H, N, D, key, value, slots):
    """Allocate an LBHNC cache like the CPU model runner and write K/V with the backend's own update."""
    dtype, kv_cache_dtype, _, _, isa = CPU_CASES[case]
    cache_dtype = torch.uint8 if kv_cache_dtype == "fp8" else dtype
    caches, flat = vllm_caches(vl, "LBHNC", L=L, B=B, H=H, N=N, D=D, dtype=cache_dtype)
    layer = SimpleNamespace(isa=isa, _k_scale_float=0.5, _v_scale_float=0.25)
    impl = cpu_impls[dtype, kv_cache_dtype]
    for l, cache in enumerate(caches):
        impl.do_kv_cache_update(layer, key[l], value[l], cache, slots)
    return caches, flat


def cpu_inputs(case, *, L, H, T, D, gen):
    dtype = CPU_CASES[case][0]
    return (torch.randn(L, T, H, D, generator=gen).to(dtype), torch.randn(L, T, H, D, generator=gen).to(dtype))


@X86_ONLY
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_cpu_isa_choice(vl, case):
    """vLLM picks what its rule gives for this host's features: the case's planes ISA, or ``amx`` (the
    tiled layout no KVLayout describes) on AMX hosts, or refuses an FP8 cache without AVX-512 or AMX."""
    dtype, kv_cache_dtype, N, D, planes_isa = CPU_CASES[case]
    try:
        want = cpu_attn_isa(HOST_CPU, dtype, N, D, kv_cache_dtype)
    except CpuFeatureMissing:
        with pytest.raises(NotImplementedError, match=FP8_NEEDS):
            vl._get_attn_isa(dtype, N, D, kv_cache_dtype)
        return
    assert vl._get_attn_isa(dtype, N, D, kv_cache_dtype) == want
    assert want in (planes_isa, "amx")


@pytest.mark.parametrize("case", cpu_cases(CPU_CASES))
def test_cpu_backend_write_matches_gather_and_place(vl, cpu_impls, case):
    """vLLM's cpu_attn_reshape_and_cache output is read back by gather and reproduced by place."""
    dtype, kv_cache_dtype, N, D, _ = CPU_CASES[case]
    L, B, H, T = 2, 3, 2, 40
    gen = torch.Generator().manual_seed(5)
    key, value = cpu_inputs(case, L=L, H=H, T=T, D=D, gen=gen)
    slots = random_slots(B * N, T, gen)
    caches, flat = cpu_write(vl, cpu_impls, case, L=L, B=B, H=H, N=N, D=D, key=key, value=value, slots=slots)
    layout = cpu_vec_layout(L=L, B=B, H=H, N=N, D=D, dtype=flat.dtype)

    got = gather(flat, layout, slots)
    assert torch.equal(bits(gather(caches, layout, slots)), bits(got))
    if kv_cache_dtype == "auto":
        want = torch.stack([key, value])
        want[:, :, slots < 0] = 0
        assert torch.equal(bits(got), bits(want))
    else:  # fp8: vLLM quantised with the layer scales (its rounding is its own: compare within a step)
        valid = slots >= 0
        for stored, x, scale in ((got[0], key, 0.5), (got[1], value, 0.25)):
            decoded = stored[:, valid].view(torch.float8_e4m3fn).float() * scale
            torch.testing.assert_close(decoded, x[:, valid].float(), rtol=2 ** -3, atol=scale * 2 ** -8)

    # place(what vLLM wrote) into a fresh vLLM allocation reproduces vLLM's bytes everywhere.
    fresh_caches, fresh = vllm_caches(vl, "LBHNC", L=L, B=B, H=H, N=N, D=D, dtype=flat.dtype)
    place(got, fresh, layout, slots)
    assert torch.equal(bits(fresh), bits(flat))
    fresh_caches, fresh = vllm_caches(vl, "LBHNC", L=L, B=B, H=H, N=N, D=D, dtype=flat.dtype)
    place(got, fresh_caches, layout, slots)
    assert torch.equal(bits(fresh), bits(flat))


@pytest.mark.parametrize("case", cpu_cases(["fp32-N32-D64", "bf16-N16-D128"]))
def test_cpu_views_see_the_planes(vl, cpu_impls, case):
    """The CPU backend's key_cache/value_cache views are the two planes: K plane bytes hold [D, N]."""
    dtype, _, N, D, _ = CPU_CASES[case]
    L, B, H, T = 1, 2, 2, N
    gen = torch.Generator().manual_seed(9)
    key, value = cpu_inputs(case, L=L, H=H, T=T, D=D, gen=gen)
    slots = torch.arange(N, 2 * N)  # block 1, tokens in order
    caches, _ = cpu_write(vl, cpu_impls, case, L=L, B=B, H=H, N=N, D=D, key=key, value=value, slots=slots)
    key_cache, value_cache = cpu_kv_views(caches[0])
    assert torch.equal(bits(value_cache[1]), bits(value[0].transpose(0, 1)))  # [H, N, D]
    k_plane = key_cache[1].reshape(H, D, N)
    assert torch.equal(bits(k_plane), bits(key[0].permute(1, 2, 0)))


@pytest.mark.parametrize("case", ["fp32-N32-D64", "bf16-N16-D128", "fp16-N32-D80"], ids=str)
def test_from_vllm_planes_is_the_cpu_layout(case):
    """``from_vllm(..., kv_packing="planes")`` must be the layout the CPU backend writes."""
    dtype, _, N, D, _ = CPU_CASES[case]
    dims = dict(L=3, B=4, H=2, N=N, D=D)
    planes = KVLayout.from_vllm("LBHNC", num_layers=3, num_blocks=4, block_size=N, num_kv_heads=2, head_size=D,
                                dtype=dtype, kv_packing="planes")
    truth = cpu_vec_layout(dtype=dtype, **dims)
    assert (planes.k_strides, planes.v_strides, planes.k_offset, planes.v_offset) == \
        (truth.k_strides, truth.v_strides, truth.k_offset, truth.v_offset)


@needs_cache_write("amx")
def test_cpu_amx_isa_is_not_planes(vl, cpu_impls):
    """vLLM's AMX write tiles the planes (16-token tiles, VNNI pairs): no KVLayout describes it, so
    KMesh must not be used with the CPU backend when vLLM picks ``amx`` (bf16, block % 32 == 0)."""
    L, B, H, N, D = 1, 2, 1, 32, 64
    gen = torch.Generator().manual_seed(13)
    key, value = cpu_inputs("bf16-N64-D128", L=L, H=H, T=B * N, D=D, gen=gen)
    slots = torch.arange(B * N)
    caches, flat = vllm_caches(vl, "LBHNC", L=L, B=B, H=H, N=N, D=D, dtype=torch.bfloat16)
    key_cache, value_cache = cpu_kv_views(caches[0])
    vl.ops.cpu_attn_reshape_and_cache(key[0], value[0], key_cache, value_cache, slots, "amx")
    got = gather(flat, cpu_vec_layout(L=L, B=B, H=H, N=N, D=D, dtype=torch.bfloat16), slots)
    assert not torch.equal(bits(got[0]), bits(key)) and not torch.equal(bits(got[1]), bits(value))
