"""Per-layer CUDA registrations through the cache service (``-m gpu``): one torch allocation per
layer, as vLLM allocates its KV caches, each exported on its own (CUDA IPC) and restored into
bit-exact against in-process placement into the same per-layer list. CPU twin: ``test_service_layers.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from kmesh_gpu import KVLayout, gather, place_many
from tests.helpers.service import registration_of, running_service, small_rope

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


@pytest.mark.parametrize("lane", [False, True], ids=["socket", "lane"])
@pytest.mark.parametrize("name", ["NHD", "HND"])
def test_per_layer_cuda_allocations_restore_bit_exact(service, name, lane):
    from kmesh_host.service import CacheClient

    layout = KVLayout.from_vllm(name, num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16)
    view = layout.per_layer()
    rope = small_rope(head_size=64)
    kv = torch.randn(2, 4, 40, 2, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    pos = torch.arange(40, dtype=torch.int64)
    slots, new = list(range(100, 140)), list(range(700, 740))
    layers = [torch.full(view.physical_shape, 0.5, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    ref = [x.clone() for x in layers]
    # the reference through torch: the service's compiled path is not checked against itself
    place_many([kv.cuda()], [ref], layout, [torch.tensor(slots)], rope=rope, old_positions=[pos],
               new_positions=[torch.tensor(new)], backend="torch")
    torch.cuda.synchronize()
    key = f"layers-{name}-{lane}-{os.getpid()}"
    with CacheClient(service.socket_path, fast_lane=lane) as client:
        client.put(key, kv, pos)
        reg = client.register(layers, layout, rope=rope)
        try:
            assert registration_of(client.status(), reg.reg_id)["memory"] == "cuda_ipc"
            before = client.status()["counters"]["placements_one_array"]
            client.restore(reg, [(key, slots, new)])
            if lane:  # served by the fast lane's compiled loop
                assert client.lane_counts == {"lane": 1, "socket": 0}
            else:  # per-layer allocations take the one compiled preparation, as one allocation does
                assert client.status()["counters"]["placements_one_array"] == before + 1
            torch.cuda.synchronize()
            for got, want in zip(layers, ref):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            client.save(reg, key + "-saved", slots, new)
            saved, _, _ = client.get(key + "-saved")
            at = torch.tensor(slots)
            assert torch.equal(saved.view(torch.uint8), gather(layers, layout, at).cpu().view(torch.uint8))
        finally:
            assert client.close_registration(reg) is True
