"""Regressions of the cache service's shared originals found by an audit (each failed before its fix):

1. A store original retained in the host tier was served without its model-fingerprint check.
2. ``get`` of an original larger than ``max_body_bytes`` closed the connection without a reply
   (and orphaned the registrations attached to it).
3. The host tier charged a store original's kv bytes but kept the whole file image alive.
4. With a segment store configured, an absent key read without a fingerprint was a generic
   ``KmeshError``, not ``SegmentNotFound``.
5. ``held_sources`` counted a key once per item, not once per pending operation.
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
from kmesh_host.service.sources import HostOriginals, StoreSource, TieredSource
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
