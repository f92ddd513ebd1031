"""Regressions of the cache service's shared originals found by an audit (each failed before its fix):

1. A store original retained in the host tier was served without its model-fingerprint check.
2. ``get`` of an original larger than ``max_body_bytes`` closed the connection without a reply
   (and orphaned the registrations attached to it).
3. The host tier charged a store original's kv bytes but kept the whole file image alive.
4. With a segment store configured, an absent key read without a fingerprint was a generic
   ``KmeshError``, not ``SegmentNotFound``.
5. ``held_sources`` counted a key once per item, not once per pending operation.
6. A restore looks its originals up before it holds them: an evict in between, then the restore's
   first use on a GPU, left a device copy of the evicted key in the device tier (taking budget until
   least-recently-used pressure removed it); a store original served without a place in the host
   tier was copied into the device tier at every request though never reused.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from kmesh_gpu.errors import FingerprintMismatch, KmeshError, SegmentNotFound
from kmesh_host import ModelFingerprint, SegmentStore
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from kmesh_host.service.server import _Service
from kmesh_host.service.sources import DeviceOriginals, HostOriginals, SourceSegment, StoreSource, TieredSource
from tests.helpers.service import registration_of, small_layout, small_rope, socket_dir

T = 4
FP = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", small_rope().to_dict())
FP_OTHER = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "bfloat16", small_rope().to_dict())


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
    """sources.py TieredSource.get/get_many: a store hit is retained in the host tier, and host hits
    are returned without looking at the request's model_fingerprint. The first restore with the
    right fingerprint made every later restore (and get) of the key succeed with another model's
    fingerprint, or with none, where the store refuses both."""
    layout = small_layout()
    key = SegmentStore(store_root).put(_kv(1), torch.arange(T), torch.arange(T), model_fingerprint=FP)
    with CacheClient(store_service.socket_path) as c, SharedCache(layout, fill=0x5A) as cache:
        reg = c.register(cache, layout)
        c.restore(reg, [(key, [0, 1, 2, 3])], model_fingerprint=FP.to_dict())  # retained now
        assert c.status()["sources"]["host_keys"] == 1
        before = cache.tensor.view(torch.uint8).clone()
        with pytest.raises(FingerprintMismatch, match=key):
            c.restore(reg, [(key, [4, 5, 6, 7])], model_fingerprint=FP_OTHER.to_dict())
        with pytest.raises(KmeshError, match="model_fingerprint"):
            c.restore(reg, [(key, [4, 5, 6, 7])])
        with pytest.raises(FingerprintMismatch, match=key):
            c.call({"op": "get", "key": key, "model_fingerprint": FP_OTHER.to_dict()})
        assert torch.equal(cache.tensor.view(torch.uint8), before)
        c.restore(reg, [(key, [4, 5, 6, 7])], model_fingerprint=FP.to_dict())  # the right model still works
        assert c.close_registration(reg) is True


# ---------------------------------------------------------------------------------- 2
def test_get_of_an_original_larger_than_max_body_is_a_typed_error_and_keeps_the_connection():
    """server.py op_get / _send: an original published by a save (or read from the store) may be larger
    than max_body_bytes; its get reply could not be encoded, _send returned False and the
    connection was closed without a reply. The registration attached to that connection was then
    orphaned and reaped: the client lost its registration because it asked for an original."""
    layout = small_layout()  # 32 slots: a save of all of them is 4096 bytes of kv
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), max_body_bytes=4096,
                            receive_spin_s=0.0, reap_interval_s=0.02)
        with CacheService(cfg) as svc, CacheClient(svc.socket_path) as c, SharedCache(layout, fill=0x11) as cache:
            reg = c.register(cache, layout)
            c.save(reg, "big", list(range(32)), list(range(32)))
            with pytest.raises(KmeshError, match="big") as info:
                c.get("big")
            assert "connection" not in str(info.value)
            st = c.status()  # the same connection still answers
            r = registration_of(st, reg.reg_id)
            assert r is not None and r["state"] == "open", r
            assert st["counters"]["internal_errors"] == 0
            assert c.evict("big") is True
            assert c.close_registration(reg) is True


# ---------------------------------------------------------------------------------- 3
def test_host_tier_keeps_no_more_memory_than_it_charges(store_root):
    """sources.py HostOriginals.put: a store hit's kv is a view of the whole file image read by the
    store (payload padded to the chunk size, Arrow framing, header). The host tier charged
    kv.nbytes (512 B for this segment) while keeping the ~9.8 KB image alive, so its budget did
    not bound the memory it holds."""
    key = SegmentStore(store_root).put(_kv(2), torch.arange(T), torch.arange(T), model_fingerprint=FP)
    tiers = TieredSource(HostOriginals(1 << 20), StoreSource(store_root))
    seg = tiers.get(key, model_fingerprint=FP)
    charged = tiers.stats()["host_bytes"]
    assert charged == 512
    kept = seg.kv.untyped_storage().nbytes()
    assert kept == charged, f"charged {charged} bytes, keeps {kept}"


# ---------------------------------------------------------------------------------- 4
def test_absent_key_is_not_found_also_with_a_store(store_service):
    """sources.py StoreSource.get: with store_root configured, a key in neither tier read without a
    model_fingerprint raised a plain KmeshError ('reading the segment store needs the request's
    model_fingerprint', code 'kmesh') before looking for it: the SourceProvider contract says
    SegmentNotFound, and a client catching SegmentNotFound (e.g. for an evicted key) broke as soon
    as a store was configured."""
    layout = small_layout()
    with CacheClient(store_service.socket_path) as c, SharedCache(layout, fill=0) as cache:
        with pytest.raises(SegmentNotFound, match="absent"):
            c.get("absent")
        with pytest.raises(SegmentNotFound, match="0" * 64):
            c.get("0" * 64)  # a well-formed segment key that is not stored
        c.put("evicted", _kv(3), torch.arange(T))
        assert c.evict("evicted") is True
        reg = c.register(cache, layout)
        with pytest.raises(SegmentNotFound, match="evicted"):
            c.restore(reg, [("evicted", [0, 1, 2, 3])])
        assert c.close_registration(reg) is True


# ---------------------------------------------------------------------------------- 5
def test_held_sources_counts_pending_operations(store_service):
    """registry.py _source_holds: documented as 'key -> number of pending operations that read or
    write it', it counted every item: one restore with the key in two items reported 2."""
    layout = small_layout()
    with CacheClient(store_service.socket_path) as c, SharedCache(layout, fill=0) as cache:
        c.put("k", _kv(4), torch.arange(T))
        reg = c.register(cache, layout)
        op = c.restore(reg, [("k", [0, 1, 2, 3]), ("k", [4, 5, 6, 7])], wait=False, inject={"refuse_waits": 1})
        st = c.status()
        assert len(st["pending_ops"]) == 1
        assert st["held_sources"] == {"k": 1}
        with pytest.raises(KmeshError):
            c.drain(reg, [op])
        c.drain(reg, [op])
        assert c.evict("k") is True
        assert c.close_registration(reg) is True


class _CountingUploads(DeviceOriginals):
    """The device tier's bookkeeping as it is, its upload a copy in host memory (no GPU here)."""

    uploads = 0

    def _upload(self, segment, index):
        self.uploads += 1
        return segment.kv.clone(), None


def _segment(seed: int) -> SourceSegment:
    return SourceSegment(_kv(seed), torch.arange(T), None)


def test_device_tier_keeps_copies_of_current_originals_only():
    host = HostOriginals(1 << 20)
    tier = _CountingUploads(1 << 20, is_current=lambda key, seg: host.get_many((key,))[0] is seg)
    device = torch.device("cuda", 0)
    host.put("a", _segment(1))
    seg = host.get("a")
    first = tier.get("a", seg, device)
    assert first is not None and tier.get("a", seg, device) is first and tier.uploads == 1  # kept, reused
    host.put("b", _segment(2))
    looked_up = host.get("b")  # a restore's lookup ...
    assert host.delete("b") and tier.drop("b") == 0  # ... an evict (host first, then device copies) ...
    assert tier.get("b", looked_up, device) is None  # ... then the restore's first use: not kept
    assert tier.stats()["device_keys"] == 1 and tier.stats()["device_bytes"] == seg.nbytes
    stray = _segment(3)  # a store original the host tier did not take
    assert tier.get("c", stray, device) is None and tier.stats()["device_keys"] == 1


def test_evict_between_a_restores_lookup_and_its_first_use_leaves_no_device_copy(tmp_path):
    svc = _Service(ServiceConfig(socket_path=str(tmp_path / "s.sock")))
    svc.device_originals.__class__ = _CountingUploads  # the service's own tier and is_current, no GPU
    svc.sources.put("k", _segment(4))
    segs = svc.sources.get_many(["k"])  # the restore has looked it up, holds nothing yet
    reply, _ = svc.op_evict({"key": "k"}, b"", None, 0)
    assert reply == {"key": "k", "evicted": True}
    assert svc.device_originals.get_many(["k"], segs, torch.device("cuda", 0)) == [None]
    assert svc.device_originals.stats()["device_keys"] == 0
    svc.sources.put("k", _segment(5))  # published again: its copy is kept
    fresh = svc.sources.get_many(["k"])
    assert svc.device_originals.get_many(["k"], fresh, torch.device("cuda", 0))[0] is not None
    assert svc.device_originals.stats()["device_keys"] == 1


def test_restore_first_use_right_after_the_evicts_device_drop_keeps_no_copy(tmp_path):
    """The other interleaving: the restore's first use lands just after evict dropped the device
    copies. The host tier must already have let the key go by then (evict deletes it first)."""
    svc = _Service(ServiceConfig(socket_path=str(tmp_path / "s.sock")))
    tier = svc.device_originals
    tier.__class__ = _CountingUploads
    svc.sources.put("k", _segment(6))
    segs = svc.sources.get_many(["k"])
    seen = []
    real_drop = tier.drop

    def drop_then_restore(key):
        n = real_drop(key)
        seen.append(tier.get_many([key], segs, torch.device("cuda", 0))[0])
        return n

    tier.drop = drop_then_restore
    assert svc.op_evict({"key": "k"}, b"", None, 0)[0]["evicted"] is True
    assert seen == [None] and tier.stats()["device_keys"] == 0
