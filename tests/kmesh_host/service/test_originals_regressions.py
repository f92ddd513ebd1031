"""Regressions of the cache service's shared originals found by an audit (each failed before its fix;
ported to the originals on the service's store and host tier):

1. A store original retained in the host tier was served without its model-fingerprint check.
2. ``get`` of an original larger than ``max_body_bytes`` closed the connection without a reply
   (and orphaned the registrations attached to it).
3. The host tier charged a store original's kv bytes but kept the whole file image alive; now: a
   ``get`` hands out a copy, never a view that keeps the tier's buffer alive.
4. With a segment store configured, an absent key read without a fingerprint was a generic
   ``KmeshError``, not ``SegmentNotFound``.
5. ``held_sources`` counted a key once per item, not once per pending operation.
6. A restore looks its originals up before it holds them: an evict in between, then the restore's
   first use on a GPU, left a device copy of the evicted key in the device tier (taking budget until
   least-recently-used pressure removed it).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from kmesh_gpu.errors import FingerprintMismatch, KmeshError, SegmentNotFound
from kmesh_host import SegmentStore
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from kmesh_host.service.originals import DeviceOriginals, Originals
from kmesh_host.service.server import _Service
from tests.kmesh_host.service.helpers import fingerprint, put_original, registration_of, small_layout, socket_dir

T = 4
FP = fingerprint()
FP_OTHER = fingerprint(architecture="LlamaForCausalLM")


def _kv(seed: int, t: int = T) -> torch.Tensor:
    return torch.randn(2, 2, t, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture
def store_root():
    root = tempfile.mkdtemp(prefix="kmesh-fail-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store_service(store_root):
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), store_root=store_root,
                            allow_fault_injection=True, receive_spin_s=0.0, reap_interval_s=0.02)
        with CacheService(cfg) as svc:
            yield svc


# ---------------------------------------------------------------------------------- 1
def test_store_original_retained_in_the_host_tier_keeps_its_fingerprint_check(store_root, store_service):
    """The first restore by the right model retains the original in the host tier; every later
    restore and get by another model is still refused, typed and naming the key."""
    layout = small_layout()
    key = SegmentStore(store_root).put(_kv(1), torch.arange(T), torch.arange(T), model_fingerprint=FP)
    with CacheClient(store_service.socket_path) as c, SharedCache(layout, fill=0x5A) as cache, \
            SharedCache(layout, fill=0x5A) as other_cache:
        reg = c.register(cache, layout, model_fingerprint=FP)
        c.restore(reg, [(key, [0, 1, 2, 3])])  # retained now
        assert c.status()["originals"]["host_keys"] == 1
        other = c.register(other_cache, layout, model_fingerprint=FP_OTHER)
        before = other_cache.tensor.view(torch.uint8).clone()
        with pytest.raises(FingerprintMismatch, match=key):
            c.restore(other, [(key, [4, 5, 6, 7])])
        with pytest.raises(FingerprintMismatch, match=key):
            c.get(key, model_fingerprint=FP_OTHER)
        assert torch.equal(other_cache.tensor.view(torch.uint8), before)
        c.restore(reg, [(key, [4, 5, 6, 7])])  # the right model still works
        assert c.close_registration(reg) is True and c.close_registration(other) is True


# ---------------------------------------------------------------------------------- 2
def test_get_of_an_original_larger_than_max_body_is_a_typed_error_and_keeps_the_connection():
    """An original published by a save (or read from the store) may be larger than max_body_bytes;
    its get reply could not be encoded and the connection was closed without a reply (the
    registration attached to it then orphaned and reaped)."""
    layout = small_layout()  # 32 slots: a save of all of them is 4096 bytes of kv
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), max_body_bytes=4096,
                            receive_spin_s=0.0, reap_interval_s=0.02)
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as c, SharedCache(layout, fill=0x11) as cache:
            reg = c.register(cache, layout, model_fingerprint=FP)
            key = c.save(reg, list(range(32)), list(range(32)), list(range(32)))
            with pytest.raises(KmeshError, match=key) as info:
                c.get(key, model_fingerprint=FP)
            assert "connection" not in str(info.value)
            st = c.status()  # the same connection still answers
            r = registration_of(st, reg.reg_id)
            assert r is not None and r["state"] == "open", r
            assert st["counters"]["internal_errors"] == 0
            assert c.evict(key) is True
            assert c.close_registration(reg) is True


# ---------------------------------------------------------------------------------- 3
def test_a_get_hands_out_a_copy_not_the_tiers_buffer(store_root):
    originals = Originals(store_root, private_dir=store_root, host_budget_bytes=1 << 20, device_budget_bytes=0,
                          pin=False)
    try:
        key = originals.put(_kv(2), torch.arange(T), torch.arange(T), model_fingerprint=FP)
        seg = originals.get(key, model_fingerprint=FP)
        assert seg.kv.untyped_storage().nbytes() == 512  # its own bytes: the tier's buffer is not kept alive
        stats = originals.stats()
        assert stats["host_keys"] == 1 and stats["host_bytes"] == originals.tier.pool.held_bytes
    finally:
        originals.close()


# ---------------------------------------------------------------------------------- 4
def test_absent_key_is_not_found_also_with_a_store(store_service):
    layout = small_layout()
    with CacheClient(store_service.socket_path) as c, SharedCache(layout, fill=0) as cache:
        with pytest.raises(SegmentNotFound, match="absent"):
            c.get("absent", model_fingerprint=FP)
        with pytest.raises(SegmentNotFound, match="0" * 64):
            c.get("0" * 64, model_fingerprint=FP)  # a well-formed segment key that is not stored
        reg = c.register(cache, layout, model_fingerprint=FP)
        with pytest.raises(SegmentNotFound, match="0" * 64):
            c.restore(reg, [("0" * 64, [0, 1, 2, 3])])
        key = put_original(c, _kv(3))
        assert c.evict(key) is True
        c.restore(reg, [(key, [0, 1, 2, 3])])  # evicted from RAM, read from the store again
        assert c.close_registration(reg) is True


# ---------------------------------------------------------------------------------- 5
def test_held_sources_counts_pending_operations(store_service):
    layout = small_layout()
    with CacheClient(store_service.socket_path) as c, SharedCache(layout, fill=0) as cache:
        key = put_original(c, _kv(4))
        reg = c.register(cache, layout, model_fingerprint=FP)
        op = c.restore(reg, [(key, [0, 1, 2, 3]), (key, [4, 5, 6, 7])], wait=False, inject={"refuse_waits": 1})
        st = c.status()
        assert len(st["pending_ops"]) == 1
        assert st["held_sources"] == {key: 1}
        with pytest.raises(KmeshError):
            c.drain(reg, [op])
        c.drain(reg, [op])
        assert c.evict(key) is True
        assert c.close_registration(reg) is True


# ---------------------------------------------------------------------------------- 6
class _CountingUploads(DeviceOriginals):
    """The device tier's bookkeeping as it is, its upload a copy in host memory (no GPU here)."""

    uploads = 0

    def _upload(self, lease, index):
        self.uploads += 1
        return lease.kv.clone(), None


def test_device_tier_keeps_copies_of_current_originals_only(store_root):
    originals = Originals(store_root, private_dir=store_root, host_budget_bytes=1 << 20, device_budget_bytes=1 << 20,
                          pin=False)
    tier = originals.device
    tier.__class__ = _CountingUploads  # the service's own tier and is_current, no GPU
    device = torch.device("cuda", 0)
    try:
        a = originals.put(_kv(1), torch.arange(T), torch.arange(T), model_fingerprint=FP)
        (lease,) = originals.lease_many([a], FP)
        first = tier.add(a, lease, device)
        lease.release()
        assert first is not None and tier.get_many([a], device) == [first] and tier.uploads == 1  # kept, reused
        b = originals.put(_kv(2), torch.arange(T), torch.arange(T), model_fingerprint=FP)
        (looked_up,) = originals.lease_many([b], FP)  # a restore's lookup ...
        assert originals.evict(b)  # ... an evict (host first, then device copies) ...
        assert tier.add(b, looked_up, device) is None  # ... then the restore's first use: not kept
        looked_up.release()
        assert tier.stats()["device_keys"] == 1 and tier.stats()["device_bytes"] == 512
    finally:
        originals.close()


def test_evict_between_a_restores_lookup_and_its_first_use_leaves_no_device_copy(tmp_path):
    svc = _Service(ServiceConfig(socket_path=str(tmp_path / "s.sock")))
    try:
        svc.originals.device.__class__ = _CountingUploads  # the service's own tier and is_current, no GPU
        key = svc.originals.put(_kv(4), torch.arange(T), torch.arange(T), model_fingerprint=FP)
        leases = svc.originals.lease_many([key], FP)  # the restore has looked it up, holds nothing yet
        reply, _ = svc.handlers.evict({"key": key}, b"", None)
        assert reply == {"key": key, "evicted": True}
        assert svc.originals.device.add(key, leases[0], torch.device("cuda", 0)) is None
        leases[0].release()
        assert svc.originals.device.stats()["device_keys"] == 0
        fresh = svc.originals.lease_many([key], FP)  # read again: its copy is kept
        assert svc.originals.device.add(key, fresh[0], torch.device("cuda", 0)) is not None
        fresh[0].release()
        assert svc.originals.device.stats()["device_keys"] == 1
    finally:
        svc.originals.close()


def test_restore_first_use_right_after_the_evicts_device_drop_keeps_no_copy(tmp_path):
    """The other interleaving: the restore's first use lands just after evict dropped the device
    copies. The host tier must already have let the key go by then (evict drops it first)."""
    svc = _Service(ServiceConfig(socket_path=str(tmp_path / "s.sock")))
    try:
        tier = svc.originals.device
        tier.__class__ = _CountingUploads
        key = svc.originals.put(_kv(6), torch.arange(T), torch.arange(T), model_fingerprint=FP)
        leases = svc.originals.lease_many([key], FP)
        seen = []
        real_drop = tier.drop

        def drop_then_restore(k):
            n = real_drop(k)
            seen.append(tier.add(k, leases[0], torch.device("cuda", 0)))
            return n

        tier.drop = drop_then_restore
        assert svc.handlers.evict({"key": key}, b"", None)[0]["evicted"] is True
        assert seen == [None] and tier.stats()["device_keys"] == 0
        leases[0].release()
    finally:
        svc.originals.close()
