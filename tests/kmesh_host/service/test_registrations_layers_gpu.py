"""Per-layer CUDA registrations through the cache service (``-m gpu``): one torch allocation per
layer, as vLLM allocates its KV caches, each exported on its own (CUDA IPC) and restored into
bit-exact against in-process placement into the same per-layer list. CPU twin: ``test_service_layers.py``.
"""

from __future__ import annotations


import pytest
import torch

from kmesh_gpu import KVLayout, gather, place_many
from tests.kmesh_host.service.helpers import fingerprint_of, put_original, registration_of, running_service, small_rope

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


@pytest.mark.parametrize("channel", [False, True], ids=["socket", "channel"])
@pytest.mark.parametrize("name", ["NHD", "HND"])
def test_per_layer_cuda_allocations_restore_bit_exact(service, name, channel):
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
    fp = fingerprint_of(layout)
    with CacheClient(service.socket_path, channel=channel) as client:
        key = put_original(client, kv, pos, fp=fp)
        reg = client.register(layers, layout, model_fingerprint=fp, rope=rope)
        try:
            assert registration_of(client.status(), reg.reg_id)["memory"] == "cuda_ipc"
            before = client.status()["counters"]["placements_one_prepare"]
            client.restore(reg, [(key, slots, new)])
            if channel:  # served by the channel's compiled loop
                assert client.route_counts == {"channel": 1, "socket": 0}
            else:  # per-layer allocations take one prepare of the registration's plan, as one allocation does
                assert client.status()["counters"]["placements_one_prepare"] == before + 1
            torch.cuda.synchronize()
            for got, want in zip(layers, ref):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            saved_key = client.save(reg, slots, slots, new)
            saved = client.get(saved_key, model_fingerprint=fp).kv
            at = torch.tensor(slots)
            assert torch.equal(saved.view(torch.uint8), gather(layers, layout, at).cpu().view(torch.uint8))
        finally:
            assert client.close_registration(reg) is True
