"""Paged K/V access through every vLLM layout, bit for bit against kmesh_gpu's gather and place."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import KVLayout, LayoutError, gather, place
from kmesh_gpu.layout import VLLM_LAYOUTS
from kmesh_vllm.model import BlockTable, read_kv
from kmesh_vllm.model.paged import write_kv

L, B, H, N, D = 3, 6, 2, 8, 32
LAYOUTS = [(name, packing) for name in VLLM_LAYOUTS for packing in ("content", "planes")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make(name, packing, dtype):
    layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                                dtype=dtype, kv_packing=packing)
    return layout, layout.allocate(fill=float("nan"))


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("name,packing", LAYOUTS, ids=[f"{n}-{p}" for n, p in LAYOUTS])
def test_write_equals_place_and_read_equals_gather(name, packing, dt):
    dtype = DTYPES[dt]
    g = torch.Generator().manual_seed(7)
    layout, ours = make(name, packing, dtype)
    theirs = ours.clone()
    T = 19
    slots = torch.randperm(B * N, generator=g)[:T]
    kv = torch.randn(2, L, T, H, D, generator=g).to(dtype)
    for layer in range(L):
        write_kv(ours, layout, layer, slots, kv[0, layer], kv[1, layer])
    place(kv, theirs, layout, slots, backend="torch")
    assert torch.equal(bits(ours), bits(theirs))  # the same elements written, the NaN canaries untouched
    back = gather(ours, layout, slots, backend="torch")
    for layer in range(L):
        k, v = read_kv(ours, layout, layer, slots)
        assert torch.equal(bits(k), bits(back[0, layer])) and torch.equal(bits(v), bits(back[1, layer]))


def test_write_skips_minus_one():
    layout, cache = make("LBHNC", "content", torch.float32)
    before = cache.clone()
    k = torch.randn(3, H, D)
    write_kv(cache, layout, 1, torch.tensor([-1, 5, -1]), k, k + 1)
    kk, vv = read_kv(cache, layout, 1, torch.tensor([5]))
    assert torch.equal(kk[0], k[1]) and torch.equal(vv[0], k[1] + 1)
    changed = ~(cache.isnan() & before.isnan())
    assert int(changed.sum()) == 2 * H * D


@pytest.mark.parametrize("slots,match", [
    (torch.tensor([0, 48]), r"slots: expected -1 \(skip\) or slots in \[0, 48\)"),
    (torch.tensor([-2, 1]), r"slots: expected -1"),
    (torch.tensor([3, 3]), "a slot appears twice"),
    (torch.tensor([0, 1], dtype=torch.int32), r"slots: expected int64\[2\], got int32\[2\]"),
    (torch.tensor([0, 1, 2]), r"slots: expected int64\[2\]"),
])
def test_bad_slots(slots, match):
    layout, cache = make("NHD", "content", torch.float32)
    k = torch.zeros(2, H, D)
    with pytest.raises(LayoutError, match=match):
        write_kv(cache, layout, 0, slots, k, k)


def test_bad_arguments():
    layout, cache = make("NHD", "content", torch.float32)
    k = torch.zeros(2, H, D)
    with pytest.raises(LayoutError, match="layer"):
        write_kv(cache, layout, L, torch.tensor([0, 1]), k, k)
    with pytest.raises(LayoutError, match="k: expected float32"):
        write_kv(cache, layout, 0, torch.tensor([0, 1]), k.bfloat16(), k)
    with pytest.raises(LayoutError, match="cache: expected the layout's dtype"):
        read_kv(cache.bfloat16(), layout, 0, torch.tensor([0]))
    with pytest.raises(LayoutError, match="cache: its storage holds"):
        read_kv(torch.zeros(100), layout, 0, torch.tensor([0]))
    with pytest.raises(LayoutError, match=r"slots: expected slots in \[0, 48\)"):
        read_kv(cache, layout, 0, torch.tensor([-1]))


def test_block_table():
    table = BlockTable([4, 0, 2], 8)
    assert table.capacity == 24
    assert table.slots(torch.tensor([0, 7, 8, 23])).tolist() == [32, 39, 0, 23]
    slots, pos = table.context(10)
    assert pos.tolist() == list(range(10)) and slots.tolist() == list(range(32, 40)) + [0, 1]
    with pytest.raises(LayoutError, match=r"positions: expected positions in \[0, 24\)"):
        table.slots(torch.tensor([24]))
    with pytest.raises(LayoutError, match="block_ids: a block appears twice"):
        BlockTable([1, 1], 8)
    with pytest.raises(LayoutError, match="block_ids"):
        BlockTable([-1], 8)
    with pytest.raises(LayoutError, match="length"):
        table.context(25)
