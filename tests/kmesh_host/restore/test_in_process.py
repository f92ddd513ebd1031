"""The in-process restorer as the contract's callers use it (kmesh_host/restore/in_process.py): a
leader saves through it, children restore through it into the same cache many times, per-layer
caches, and a failed restore leaves it usable. (The routes: test_host_staging*.py, test_direct.py.)"""

from __future__ import annotations

import pytest
import torch

import kmesh_gpu
from kmesh_gpu import KVLayout
from kmesh_host import (HostTier, HostTierConfig, InProcessRestorer, IntegrityError, RestoreItem, Restorer,
                        RouteConfig, SegmentStore)
from kmesh_host.restore import in_process
from tests.helpers.devices import DEVICES
from tests.helpers.restore import same
from tests.helpers.route_model import DTYPE, FP, ROPE, D, H, L


def layout_of(blocks: int = 32) -> KVLayout:
    return KVLayout.from_vllm("NHD", num_layers=L, num_blocks=blocks, block_size=16, num_kv_heads=H, head_size=D,
                              dtype=DTYPE)


@pytest.mark.parametrize("device", DEVICES)
def test_a_leader_saves_and_children_restore_through_one_restorer(tmp_path, device):
    """``save`` gathers the leader's slots into a store segment (its key the store's); children then
    restore it elsewhere in the same cache, shifted, as the in-memory placement does, again and
    again through the one plan."""
    store = SegmentStore(tmp_path / "s")
    layout = layout_of()
    cache = layout.allocate(device, fill=0)
    T = 50
    kv = torch.randn((2, L, T, H, D), generator=torch.Generator().manual_seed(4)).to(DTYPE)
    leader_slots = torch.arange(T, device=device) + 3
    kmesh_gpu.place(kv.to(device), cache, layout, leader_slots)
    tier = HostTier(store, HostTierConfig(pin=torch.device(device).type == "cuda", verify="none", chunk_bytes=4096))
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, rope=ROPE, tier=tier) as restorer:
        assert isinstance(restorer, Restorer)
        key = restorer.save(leader_slots, torch.arange(T), torch.arange(T) + 7)
        assert key == store.put(kv, torch.arange(T), torch.arange(T) + 7, model_fingerprint=FP)
        for child in range(3):
            slots = torch.arange(T, device=device) + 100 + 60 * child
            new = torch.arange(T, device=device) + 30 * child
            result = restorer.restore([RestoreItem(key, slots, new)])
            assert result.report.path == "in_process" and result.report.placed
            assert result.report.tier_sources == ({"read": 1} if child == 0 else {"hit": 1})
            want = layout.allocate(device, fill=0)
            kmesh_gpu.place(kv.to(device), want, layout, slots, rope=ROPE, old_positions=torch.arange(T, device=device) + 7,
                            new_positions=new)
            assert same(kmesh_gpu.gather(cache, layout, slots), kmesh_gpu.gather(want, layout, slots))
            assert same(result.kv[0].cpu(), kv)
    tier.close()


def test_per_layer_caches_restore_like_one_tensor(tmp_path):
    """vLLM allocates one tensor per layer: the restorer takes the list and places into each."""
    store = SegmentStore(tmp_path / "s")
    layout = layout_of()
    T = 40
    kv = torch.randn((2, L, T, H, D), generator=torch.Generator().manual_seed(5)).to(DTYPE)
    key = store.put(kv, torch.arange(T), torch.arange(T), model_fingerprint=FP)
    whole = layout.allocate("cpu", fill=0)
    layers = [torch.zeros_like(whole[i]) for i in range(L)]  # LBNHC: layer-major, one tensor per layer
    item = RestoreItem(key, torch.arange(T) * 3, torch.arange(T) + 11)
    for cache in (whole, layers):
        with InProcessRestorer(store, cache, layout, model_fingerprint=FP, rope=ROPE,
                               config=RouteConfig(verify="host")) as restorer:
            assert restorer.restore([item]).report.placed
    for i in range(L):
        assert same(layers[i], whole[i])


def test_a_failed_restore_leaves_the_restorer_usable_and_waits_for_its_streams(tmp_path, monkeypatch):
    store = SegmentStore(tmp_path / "s")
    layout = layout_of()
    cache = layout.allocate("cpu", fill=0)
    T = 20
    key = store.put(torch.randn((2, L, T, H, D)).to(DTYPE), torch.arange(T), torch.arange(T), model_fingerprint=FP)
    quiesced = []
    real = in_process.InProcessRestorer._quiesce
    monkeypatch.setattr(in_process.InProcessRestorer, "_quiesce", lambda self: quiesced.append(1) or real(self))
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP) as restorer:
        with open(store.path(key), "r+b") as f:  # corrupt on storage
            off = store.read_header(key).payload_offset
            f.seek(off + 5)
            b = f.read(1)
            f.seek(off + 5)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(IntegrityError, match=key):
            restorer.restore([RestoreItem(key, torch.arange(T))])
        assert quiesced == [1]
        good = store.put(torch.ones((2, L, T, H, D), dtype=DTYPE), torch.arange(T), torch.arange(T),
                         model_fingerprint=FP)
        assert restorer.restore([RestoreItem(good, torch.arange(T))]).report.placed
        assert quiesced == [1]
    assert torch.equal(kmesh_gpu.gather(cache, layout, torch.arange(T)), torch.ones((2, L, T, H, D), dtype=DTYPE))
