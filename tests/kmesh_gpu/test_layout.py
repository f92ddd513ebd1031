"""KVLayout: named vLLM layouts, CPU planes, legacy shapes, general strides, validation."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import KVLayout, LayoutError
from tests.helpers.kvref import ALL_CASES, build

DIMS = dict(L=3, B=5, H=2, N=4, D=8)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_strides_address_the_logical_views(case):
    """Every (K|V, l, b, h, n, d) offset from the strides hits the element the torch view names."""
    layout, views = build(case, dtype=torch.float32, **DIMS)
    t = torch.arange(torch.Size(layout.physical_shape).numel(), dtype=torch.float32).view(layout.physical_shape)
    K, V = views(t)
    for which, view in (("k", K), ("v", V)):
        for l in range(DIMS["L"]):
            for h in range(DIMS["H"]):
                blocks = torch.arange(DIMS["B"]).view(-1, 1)
                toks = torch.arange(DIMS["N"]).view(1, -1)
                offs = layout.element_offsets(which, l, blocks, h, toks)  # [B, N, D]
                assert torch.equal(offs.float(), view[l, :, h, :, :])


@pytest.mark.parametrize("name,perm_shape", [
    ("LBHNC", (3, 5, 2, 4, 16)), ("LBNHC", (3, 5, 4, 2, 16)), ("LHBNC", (3, 2, 5, 4, 16)),
    ("BLHNC", (5, 3, 2, 4, 16)), ("BLNHC", (5, 3, 4, 2, 16)), ("BHLNC", (5, 2, 3, 4, 16)),
])
def test_physical_shape_of_named_layouts(name, perm_shape):
    lay = KVLayout.from_vllm(name, num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8,
                             dtype=torch.bfloat16)
    assert lay.physical_shape == perm_shape
    assert lay.allocate().shape == perm_shape
    assert lay.v_offset == 8 and lay.k_strides[4] == 1


def test_aliases_and_planes():
    kw = dict(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    assert KVLayout.from_vllm("NHD", **kw).k_strides == KVLayout.from_vllm("LBNHC", **kw).k_strides
    assert KVLayout.from_vllm("HND", **kw).k_strides == KVLayout.from_vllm("LBHNC", **kw).k_strides
    planes = KVLayout.from_vllm("LBHNC", kv_packing="planes", **kw)
    # within each (block, head): K plane [D, N] (vLLM's CPU backend stores keys transposed), V plane [N, D]
    assert planes.physical_shape == (2, 3, 2, 2, 4, 8)
    assert planes.v_offset == 4 * 8 and planes.k_strides[3:] == (1, 4) and planes.v_strides[3:] == (8, 1)


def test_legacy_shapes():
    kw = dict(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=5, head_size=8, dtype=torch.float32)
    assert KVLayout.from_vllm_legacy("first", "NHD", **kw).physical_shape == (2, 2, 3, 4, 5, 8)
    assert KVLayout.from_vllm_legacy("first", "HND", **kw).physical_shape == (2, 2, 3, 5, 4, 8)
    assert KVLayout.from_vllm_legacy("second", "NHD", **kw).physical_shape == (2, 3, 2, 4, 5, 8)
    assert KVLayout.from_vllm_legacy("second", "HND", **kw).physical_shape == (2, 3, 2, 5, 4, 8)


def test_from_layer_tensors_views_one_storage():
    big = torch.zeros(3, 2, 4, 6, 2, 8)  # (L, 2, B, N, H, D): legacy kv-first NHD, layers adjacent
    layers = [big[i] for i in range(3)]
    layout, base = KVLayout.from_layer_tensors(layers, "first", "NHD")
    assert layout.sizes == (3, 4, 2, 6, 8)
    assert base.data_ptr() == big.data_ptr()
    ref = KVLayout.from_vllm_legacy("first", "NHD", num_layers=3, num_blocks=4, block_size=6, num_kv_heads=2,
                                    head_size=8, dtype=torch.float32)
    assert layout.k_strides == ref.k_strides and layout.v_offset == ref.v_offset


def test_from_layer_tensors_rejects_separate_allocations():
    layers = [torch.zeros(2, 4, 6, 2, 8) for _ in range(3)]
    with pytest.raises(LayoutError, match="same storage"):
        KVLayout.from_layer_tensors(layers, "first", "NHD")


def test_dict_round_trip():
    lay = KVLayout.from_vllm("BLNHC", num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8,
                             dtype=torch.bfloat16, kv_packing="planes")
    assert KVLayout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize("kwargs,match", [
    (dict(sizes=(2, 3, 2, 4), k_strides=(1,) * 5, v_strides=(1,) * 5), "sizes"),
    (dict(sizes=(2, 3, 2, 4, 8), k_strides=(-1, 1, 1, 1, 1), v_strides=(1,) * 5), "k_strides"),
    (dict(sizes=(2, 3, 2, 4, 7), k_strides=(1,) * 5, v_strides=(1,) * 5), "head size"),
    (dict(sizes=(2, 3, 2, 4, 8), k_strides=(192, 64, 32, 8, 1), v_strides=(192, 64, 32, 8, 1)), "overlap"),
])
def test_bad_strides(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        KVLayout.from_strides(dtype=torch.float16, **kwargs)


def test_bad_names():
    kw = dict(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    with pytest.raises(LayoutError, match="name"):
        KVLayout.from_vllm("LNBHC", **kw)
    with pytest.raises(LayoutError, match="kv_packing"):
        KVLayout.from_vllm("LBHNC", kv_packing="interleaved", **kw)
    with pytest.raises(LayoutError, match="dtype"):
        KVLayout.from_vllm("LBHNC", **dict(kw, dtype=torch.int32))
    with pytest.raises(LayoutError, match="positive"):
        KVLayout.from_vllm("LBHNC", **dict(kw, num_blocks=0))
