"""Per-layer caches (a list of one tensor per layer, as vLLM allocates them): bit-identical to the
torch reference and to one stacked tensor, for every backend; sources are checked against each
layer's own bytes (a segment between two layers' tensors is placed, one inside a layer refused);
layers that are interleaved strided views of one buffer are placed as the whole buffer would be.
CPU cases use Warp's CPU kernels; the CUDA cases (``-m gpu``) Warp and CuPy. That a per-layer
cache builds the run table of one tensor, with each layer's own base, is in test_plan_paths.py."""

from __future__ import annotations

import pytest
import torch

from kmesh_gpu import KVLayout, LayoutError, RopeSpec, place, place_many
from tests.helpers.devices import DEVICES, backends_for

L, B, N, H, D = 3, 16, 16, 2, 64


def _layout(name: str = "NHD") -> KVLayout:
    return KVLayout.from_vllm(name, num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=D,
                              dtype=torch.bfloat16)


def _layers(layout: KVLayout, device: str, fill: float = 0.25) -> list[torch.Tensor]:
    view = layout.per_layer()
    return [torch.full(view.physical_shape, fill, dtype=torch.bfloat16, device=device) for _ in range(L)]


def _items(device: str, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    kvs, slots, olds, news = [], [], [], []
    start = 5
    for i, T in enumerate((40, 33, 64)):
        kvs.append(torch.randn(2, L, T, H, D, generator=gen).to(torch.bfloat16).to(device))
        slots.append(torch.arange(start, start + T, dtype=torch.int64))
        olds.append(torch.arange(T, dtype=torch.int64) + 100 * i)
        news.append(torch.arange(T, dtype=torch.int64) + start + 7)
        start += T + 9
    return kvs, slots, olds, news


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["NHD", "HND"])
def test_per_layer_list_is_bit_identical_to_torch(device, name):
    layout = _layout(name)
    rope = RopeSpec(D, D, 1e6, True, 4096, torch.bfloat16)
    kvs, slots, olds, news = _items(device)
    want = _layers(layout, device)
    place_many(kvs, [want] * 3, layout, slots, rope=rope, old_positions=olds, new_positions=news, backend="torch")
    for backend in [b for b in backends_for(device) if b != "torch"]:
        got = _layers(layout, device)
        place_many(kvs, [got] * 3, layout, slots, rope=rope, old_positions=olds, new_positions=news, backend=backend)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), backend
        # without a shift
        got = _layers(layout, device)
        ref = _layers(layout, device)
        place_many([kvs[1]], [got], layout, [slots[1]], backend=backend)
        place(kvs[1], ref, layout, slots[1], backend="torch")
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, ref)), backend


@pytest.mark.parametrize("device", DEVICES)
def test_source_between_two_layers_is_placed_and_one_inside_a_layer_refused(device):
    """Sources are checked against each layer's bytes, not the span from the first layer to the
    last: a segment in the gap between two layers' tensors is not the cache."""
    layout = _layout()
    per = layout.per_layer().extent  # elements of one layer
    T = 8
    seg = 2 * L * T * H * D
    pool = torch.zeros(3 * per + seg, dtype=torch.bfloat16, device=device)
    view = layout.per_layer().physical_shape
    layers = [pool[0:per].view(view), pool[per + seg:2 * per + seg].view(view), pool[2 * per + seg:].view(view)]
    gap = pool[per:per + seg].view(2, L, T, H, D)
    gap.copy_(torch.randn(2, L, T, H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
    slots = torch.arange(20, 20 + T, dtype=torch.int64)
    for backend in [b for b in backends_for(device) if b != "torch"]:
        ref = _layers(layout, device, fill=0.0)
        place(gap.clone(), ref, layout, slots, backend="torch")
        for x in layers:
            x.zero_()
        place_many([gap], [layers], layout, [slots], backend=backend)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(layers, ref)), backend
        inside = layers[1].view(-1)[:seg].view(2, L, T, H, D)
        before = [x.clone() for x in layers]
        with pytest.raises(LayoutError, match="shares memory"):
            place_many([inside], [layers], layout, [slots], backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(layers, before)), backend


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_interleaved_layer_views_are_placed_as_the_whole_buffer(backend):
    """Layers that are strided views of one buffer with their bytes interleaved (layer-inner
    layouts) overlap one another's spans: each layer is addressed from its own view."""
    layout = KVLayout.from_vllm("BLHNC", num_layers=L, num_blocks=4, block_size=4, num_kv_heads=H, head_size=16,
                                dtype=torch.bfloat16)
    flat = layout.allocate(fill=0).view(-1)
    st = layout.k_strides
    views = [flat.as_strided((4, H, 4, 32), (st[1], st[2], st[3], 1), l * st[0]) for l in range(L)]
    kv = torch.randn(2, L, 5, H, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    stacked = layout.allocate(fill=0)
    place_many([kv], [views], layout, [torch.arange(5)], backend=backend)
    place(kv, stacked, layout, torch.arange(5), backend=backend)
    assert torch.equal(flat.view(torch.uint8), stacked.view(-1).view(torch.uint8))
