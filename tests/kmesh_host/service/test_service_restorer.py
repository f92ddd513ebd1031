""":class:`kmesh_host.restore.ServiceRestorer`, the restore contract through the cache service (CPU
shared memory here; a CUDA cache takes the same calls): the same bits as the in-process restorer
over the same store (one key space), its report, its save, and what it leaves when a restore fails
(drained before the error is raised) or a close still finds copies pending.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from kmesh_gpu.errors import DrainError, KmeshError, LayoutError, SegmentNotFound
from kmesh_host import InProcessRestorer, RestoreItem, SegmentStore, ServiceRestorer
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from tests.kmesh_host.service.helpers import fingerprint, registration_of, small_layout, small_rope, socket_dir

POISON = 0x5A
FP = fingerprint()


@pytest.fixture(scope="module")
def world():
    root = tempfile.mkdtemp(prefix="kmesh-restorer-")
    try:
        with socket_dir() as d:
            cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), store_root=root,
                                allow_fault_injection=True, reap_interval_s=0.02, receive_spin_s=0.0)
            with CacheService(cfg) as svc:
                yield svc, SegmentStore(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _segments(store: SegmentStore, n: int = 2):
    g = torch.Generator().manual_seed(8)
    out = []
    for i in range(n):
        kv = torch.randn(2, 2, 4, 2, 8, generator=g).to(torch.bfloat16)
        pos = torch.arange(10 * i, 10 * i + 4, dtype=torch.int64)
        out.append(store.put(kv, pos + 100, pos, model_fingerprint=FP))
    return out


def _items(keys):
    return [RestoreItem(keys[0], torch.tensor([0, 1, 2, 3]), torch.tensor([40, 41, 42, 43])),
            RestoreItem(keys[1], torch.tensor([8, 9, -1, 11]))]


def test_the_same_bits_as_the_in_process_restorer_over_the_same_store(world):
    svc, store = world
    layout, rope = small_layout(), small_rope()
    keys = _segments(store)
    local = layout.allocate(fill=POISON)
    with InProcessRestorer(store, local, layout, model_fingerprint=FP, rope=rope) as here:
        here.restore(_items(keys))
    with CacheClient(svc.socket_path) as client, SharedCache(layout, fill=POISON) as cache:
        with ServiceRestorer(client, cache, layout, model_fingerprint=FP, rope=rope) as there:
            result = there.restore(_items(keys))
            report = result.report
            assert report.path == "service" and report.route == "socket" and report.objects == 2
            assert report.verification and report.placed and report.timings["restore_s"] > 0
            assert result.buffer is None and result.kv == []
            assert torch.equal(cache.tensor.view(torch.uint8), local.view(torch.uint8))
            reg = there.registration
        assert registration_of(client.status(), reg.reg_id) is None  # closed with the block


def test_save_publishes_into_the_store_under_the_store_key(world):
    svc, store = world
    layout = small_layout()
    with CacheClient(svc.socket_path) as client, SharedCache(layout, fill=0) as cache:
        cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(3))
                           .to(cache.tensor.dtype))
        with ServiceRestorer(client, cache, layout, model_fingerprint=FP) as restorer:
            key = restorer.save(torch.tensor([4, 5, 6, 7]), torch.tensor([1, 2, 3, 4]), torch.tensor([7, 8, 9, 10]))
            seg = store.get(key, model_fingerprint=FP)  # the in-process side reads it from the store
            from kmesh_gpu import gather

            assert torch.equal(seg.kv.view(torch.uint8), gather(cache.tensor, layout, torch.tensor([4, 5, 6, 7]))
                               .view(torch.uint8))
            assert seg.positions.tolist() == [7, 8, 9, 10] and seg.token_ids.tolist() == [1, 2, 3, 4]


def test_a_failed_restore_is_drained_before_it_raises_and_writes_nothing_when_refused(world, monkeypatch):
    svc, store = world
    layout, rope = small_layout(), small_rope()
    keys = _segments(store)
    with CacheClient(svc.socket_path) as client, SharedCache(layout, fill=POISON) as cache:
        restorer = ServiceRestorer(client, cache, layout, model_fingerprint=FP, rope=rope)
        reg = restorer.registration
        before = cache.tensor.view(torch.uint8).clone()
        with pytest.raises(SegmentNotFound, match="0" * 64):
            restorer.restore([RestoreItem("0" * 64, torch.tensor([0, 1, 2, 3]))])
        with pytest.raises(LayoutError, match="slots"):  # out of the registration's range
            restorer.restore([RestoreItem(keys[0], torch.tensor([0, 1, 2, 99]))])
        assert torch.equal(cache.tensor.view(torch.uint8), before)
        # a failure after the service submitted the copy: drained before the error reaches the caller
        real = client.restore
        monkeypatch.setattr(client, "restore", lambda r, items, **kw: real(r, items, inject={"fail_after_submit": True},
                                                                            **kw))
        with pytest.raises(KmeshError, match="injected failure") as info:
            restorer.restore(_items(keys))
        assert info.value.op_id is not None
        mine = registration_of(client.status(), reg.reg_id)
        assert mine["pending_ops"] == [] and mine["held_blocks"] == []
        # a drain refused too: raised as a DrainError, the copy's blocks held until a later drain
        monkeypatch.setattr(client, "restore", lambda r, items, **kw: real(
            r, items, inject={"fail_after_submit": True, "refuse_waits": 1}, **kw))
        with pytest.raises(DrainError) as info:
            restorer.restore(_items(keys))
        mine = registration_of(client.status(), reg.reg_id)
        assert len(mine["pending_ops"]) == 1
        client.drain(reg)
        monkeypatch.setattr(client, "restore", real)
        restorer.restore(_items(keys))  # and the restorer restores on
        restorer.close()
        restorer.close()  # idempotent


def test_constructor_and_item_checks(world):
    svc, store = world
    layout = small_layout()
    with CacheClient(svc.socket_path) as client, SharedCache(layout, fill=0) as cache:
        with pytest.raises(LayoutError, match="client"):
            ServiceRestorer(object(), cache, layout, model_fingerprint=FP)
        with pytest.raises(LayoutError, match="model_fingerprint"):
            ServiceRestorer(client, cache, layout, model_fingerprint=FP.to_dict())
        with pytest.raises(LayoutError, match="model_fingerprint"):  # another geometry than the layout's
            ServiceRestorer(client, cache, layout, model_fingerprint=fingerprint(num_layers=3))
        with ServiceRestorer(client, cache, layout, model_fingerprint=FP) as restorer:
            for bad in ([], RestoreItem("k" * 64, torch.tensor([0])), [("k", [0])]):
                with pytest.raises(LayoutError, match="items"):
                    restorer.restore(bad)
        assert client.status()["registrations"] == []
