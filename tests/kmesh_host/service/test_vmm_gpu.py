"""Virtual-memory (``cuMemCreate``) caches through the cache service on a GPU (``-m gpu``): the
chunks exported as POSIX descriptors, imported and mapped side by side in the service process, and
restores landing bit-exact in the client's memory. The CPU twin with a stand-in driver:
``test_service_vmm.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from kmesh_gpu import KVLayout, place_many
from tests.kmesh_host.service.helpers import fingerprint, put_original, running_service, small_rope

pytestmark = pytest.mark.gpu


def _layout(num_blocks: int) -> KVLayout:
    return KVLayout.from_vllm("NHD", num_layers=2, num_blocks=num_blocks, block_size=16, num_kv_heads=2, head_size=8,
                              dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


def _restore_and_compare(client, cache_obj, tensor, layout, key):
    rope = small_rope()
    kv = torch.randn(2, 2, 24, 2, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pos = torch.arange(24, dtype=torch.int64)
    key = put_original(client, kv, pos)
    slots = list(range(layout.num_slots - 24, layout.num_slots))  # the last chunk's blocks
    new = list(range(500, 524))
    tensor.view(torch.uint8).fill_(0x5A)
    ref = layout.allocate("cuda")
    ref.view(torch.uint8).fill_(0x5A)
    place_many([kv.cuda()], ref, layout, [torch.tensor(slots)], rope=rope, old_positions=[pos],
               new_positions=[torch.tensor(new)])
    torch.cuda.synchronize()
    reg = client.register(cache_obj, layout, model_fingerprint=fingerprint(), rope=rope)
    try:
        assert reg.handle.kind == "cuda_vmm"
        client.restore(reg, [(key, slots, new)])
        torch.cuda.synchronize()
        assert torch.equal(tensor.view(torch.uint8), ref.view(torch.uint8))
    finally:
        assert client.close_registration(reg) is True


@pytest.mark.parametrize("chunk_mib", [None, 2])  # one chunk; 2 MiB chunks side by side
def test_vmm_cache_registers_and_restores_bit_exact(service, chunk_mib):
    from kmesh_host.service import CacheClient
    from kmesh_host.service.vmm import VmmCache

    layout = _layout(4096)  # 8 MiB
    with CacheClient(service.socket_path) as client, \
            VmmCache(layout, 0, chunk_bytes=None if chunk_mib is None else chunk_mib << 20) as cache:
        _restore_and_compare(client, cache, cache.tensor, layout, f"vmm-{chunk_mib}-{os.getpid()}")


def test_expandable_segments_tensor_registers_as_vmm(service):
    """A cache allocated by PyTorch with expandable segments (cuMemCreate memory, no CUDA IPC handle)
    is found to be virtual memory and registered through its chunks' descriptors."""
    from kmesh_host.service import CacheClient

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached cudaMalloc block may serve the allocation below
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        layout = _layout(16384)  # 32 MiB: a new segment
        cache = layout.allocate("cuda")
        with CacheClient(service.socket_path) as client:
            _restore_and_compare(client, cache, cache, layout, f"vmm-expandable-{os.getpid()}")
        del cache
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
