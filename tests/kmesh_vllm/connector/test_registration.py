"""register_caches: vLLM's per-layer [B, H, N, 2D] views of one buffer as one KVLayout, checked against
what vLLM's CPU attention writes; every cache KMesh cannot address is refused with what differs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cpu_features import CpuFeatures, missing_for_cache_write

pytestmark = pytest.mark.vllm

L, B, H, N, D = 3, 4, 2, 32, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
HOST = CpuFeatures.of_this_host()


def vllm_views(dtype=torch.float32, *, gap: int = 0, order=None):
    """Per-layer views as vLLM 0.32's create_kv_cache_views makes them for LBHNC: one buffer, layer
    ``l`` at ``l * (B*H*N*2D + gap)`` elements, each ``[B, H, N, 2D]`` contiguous."""
    per = B * H * N * 2 * D
    buf = torch.zeros(L * (per + gap), dtype=dtype)
    views = {n: buf[i * (per + gap): i * (per + gap) + per].view(B, H, N, 2 * D) for i, n in enumerate(NAMES)}
    if order is not None:
        views = {n: views[n] for n in order}
    return buf, views


def register(views, **kw):
    from kmesh_vllm.connector import register_caches

    args = dict(layout_name="LBHNC", backend="CPU_ATTN", isa="vec", num_kv_heads=H, head_size=D,
                dtype=torch.float32, cache_dtype="auto")
    args.update(kw)
    return register_caches(views, **args)


def test_layout_is_from_vllm_planes_over_the_buffer():
    from kmesh_gpu import KVLayout

    buf, views = vllm_views(order=list(reversed(NAMES)))  # vLLM's dict order is not trusted
    reg = register(views)
    assert reg.layout == KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H,
                                            head_size=D, dtype=torch.float32, kv_packing="planes")
    assert reg.layer_names == tuple(NAMES) and (reg.backend, reg.isa) == ("CPU_ATTN", "vec")
    assert reg.cache.data_ptr() == buf.data_ptr() and reg.cache.numel() == reg.layout.extent


def test_gpu_backends_pack_content():
    _, views = vllm_views()
    reg = register(views, backend="FLASH_ATTN", isa=None)
    assert reg.layout.name == "LBHNC/content" and reg.isa is None


@pytest.mark.skipif(missing_for_cache_write(HOST, "vec") is not None, reason=f"needs vLLM's vec kernels; this host: "
                                                                            f"{HOST.describe()}")
def test_what_vllm_writes_is_read_through_the_layout():
    """vLLM's cpu_attn_reshape_and_cache (vec ISA) into each layer's view; KMesh's read_kv of the
    registered cache returns the same K and V, bit for bit, and writes nothing else."""
    from vllm import _custom_ops as ops

    from kmesh_vllm.model import read_kv

    _, views = vllm_views()
    reg = register(views)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(B * N, generator=gen)[:50].to(torch.int64)
    written = []
    for name in NAMES:
        k, v = (torch.randn(50, H, D, generator=gen) for _ in range(2))
        key_cache, value_cache = views[name].view(B, H, 2 * N, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        written.append((k, v))
    for layer, (k, v) in enumerate(written):
        got_k, got_v = read_kv(reg.cache, reg.layout, layer, slots)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert int(torch.count_nonzero(reg.cache)) == 2 * L * 50 * H * D


def test_the_cache_is_writable_outside_inference_mode():
    """vLLM allocates in inference mode; the registered cache is a plain tensor over the same memory."""
    with torch.inference_mode():
        buf, views = vllm_views()
    reg = register(views)
    assert not reg.cache.is_inference()
    reg.cache[7] = 3.0
    assert float(buf[7]) == 3.0


@pytest.mark.parametrize("kw, match", [
    ({"isa": "amx"}, "runs the 'amx' ISA here: it tiles the K/V planes"),
    ({"isa": "neon"}, "runs the 'neon' ISA here: it writes a cache layout KMesh has not checked"),
    ({"backend": "FLASHINFER", "isa": None}, "attention backend 'FLASHINFER': its cache packing is not known"),
    ({"cache_dtype": "fp8"}, "cache_dtype: 'fp8'"),
    ({"num_kv_heads": 4}, r"does not hold 4 KV heads of size 64"),
    ({"dtype": torch.bfloat16}, r"expected bfloat16\[4, 2, 32, 128\]"),
    ({"layout_name": "BLHNC"}, r"strides .* differ from the BLHNC/planes layout's"),
], ids=["amx", "neon", "unknown-backend", "fp8", "heads", "dtype", "other-layout"])
def test_refusals_say_what_differs(kw, match):
    from kmesh_vllm.connector import ConnectorError

    _, views = vllm_views()
    with pytest.raises(ConnectorError, match=match):
        register(views, **kw)


def test_layers_not_where_the_layout_puts_them_are_refused():
    from kmesh_vllm.connector import ConnectorError

    _, views = vllm_views(gap=64)
    with pytest.raises(ConnectorError, match="starts .* bytes after layer 0"):
        register(views)
    views = {n: torch.zeros(B, H, N, 2 * D) for n in NAMES}  # separate allocations
    with pytest.raises(ConnectorError, match="not in the buffer of layer 0"):
        register(views)


@pytest.mark.parametrize("names, match", [
    (["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"], r"layer numbers \[0, 2\]"),
    (["model.embed.attn"], "holds no layer number"),
], ids=["gap", "unnumbered"])
def test_layer_names_must_number_every_layer(names, match):
    from kmesh_vllm.connector import ConnectorError

    with pytest.raises(ConnectorError, match=match):
        register({n: torch.zeros(B, H, N, 2 * D) for n in names})
