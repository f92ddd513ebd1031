"""Adversarial checks of the in-process restorer's host-staging route on device "cpu".

What this file adds to test_host_staging.py / test_tier_adversarial.py:

* seeded random children (several items, different lengths, every ``KVLayout.from_vllm`` name,
  content and planes packing, with and without a RoPE shift, skip slots ``-1``, a key repeated with
  other slots) restored with a private tier, a shared tier with retention on/off and singleflight
  on/off, and every verify mode: the cache equals ``kmesh_gpu.place_many`` of the segments read
  with ``SegmentStore.get``, bit for bit, and ``result.kv`` equals the stored KV;
* all-or-nothing for the verify modes and tier configurations the older tests leave out: one bad
  item (corrupt, missing, another model, truncated, bad slots) leaves every slot of the cache as
  it was, releases every lease, leaves no descriptor or thread behind, and the next good restore
  places exactly;
* the report: bytes read equal the padded payloads the store holds for the objects read, sources
  per item are what happened (hit / read / joined), intervals are nested, the verified counts
  cover every object, the mechanism names O_DIRECT only when it was used;
* concurrency: children on threads restore overlapping key sets through one shared tier: bit-exact,
  each key read once with singleflight, reports adding up to the tier's counters;
* bad arguments to the restorer and its ``RouteConfig``: typed errors, or the documented behaviour;
* the tier's settings seen through the route: bad slots or positions, one bad object among four,
  payloads that are not multiples of 4096, a private tier that leaks nothing.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import zlib

import pytest
import torch

import kmesh_gpu
from kmesh_gpu import KVLayout
from kmesh_gpu.errors import BackendError, StorageError
from kmesh_host import (
    FingerprintMismatch,
    HostTier,
    HostTierConfig,
    InProcessRestorer,
    IntegrityError,
    LayoutError,
    ModelFingerprint,
    RestoreItem,
    RestoreReport,
    RestoreResult,
    RouteConfig,
    SegmentNotFound,
    SegmentStore,
)
from kmesh_host import uring
from kmesh_host.direct_io import DirectFile
from tests.helpers.io import refuse_o_direct_at_open
from tests.helpers.restore import cache_for, fetch, restore_once, same
from tests.helpers.waiting import settle
from tests.helpers.route_model import DTYPE, FP, ROPE, D, H, L

OTHER = ModelFingerprint("Qwen2ForCausalLM", L, H, D, "bfloat16", {"base": 1.0})
LAYOUT_NAMES = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "NHD", "HND"]
VERIFY = ["device", "device-batched", "host", "none"]
ENGINES = ["threads", "io_uring"] if uring.available()[0] else ["threads"]


def kv_for(seed: int, T: int) -> torch.Tensor:
    return torch.randn((2, L, T, H, D), generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def make_store(tmp_path, n=6, seed=0):
    """``n`` segments of random lengths (1 .. 150 tokens, most not page multiples), store chunk 512."""
    rng = random.Random(seed)
    store = SegmentStore(tmp_path / "store", chunk_size=512)
    keys = []
    for i in range(n):
        T = rng.randint(1, 150)
        pos = torch.arange(T) + rng.randint(0, 100)
        keys.append(store.put(kv_for(1000 * seed + i, T), torch.arange(T), pos, model_fingerprint=FP))
    return store, keys


def layout_for(name: str, packing: str = "content") -> KVLayout:
    return KVLayout.from_vllm(name, num_layers=L, num_blocks=64, block_size=16, num_kv_heads=H, head_size=D,
                              dtype=DTYPE, kv_packing=packing)


def random_child(store, keys, layout, rng: random.Random, *, shifted: bool, skip: bool = True,
                 repeat: bool = False) -> list[RestoreItem]:
    """Items for a random subset of ``keys`` on distinct random slots (some ``-1``)."""
    chosen = rng.sample(keys, rng.randint(1, len(keys)))
    if repeat:
        chosen.append(chosen[0])  # the same segment again, to other slots
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    out, start = [], 0
    for key in chosen:
        T = store.read_header(key).num_tokens
        slots = perm[start:start + T].clone()
        start += T
        if skip and T > 2:
            slots[rng.randrange(T)] = -1
        new = (torch.arange(T) + rng.randint(0, 2000)) if shifted else None
        out.append(RestoreItem(key, slots, new))
    return out


def reference(store, items, layout, *, rope, fill=0x7F) -> torch.Tensor:
    """``place_many`` of the segments as ``SegmentStore.get`` returns them."""
    cache = layout.allocate("cpu", fill=fill)
    segs = [store.get(t.key, model_fingerprint=FP) for t in items]
    kmesh_gpu.place_many([s.kv for s in segs], cache, layout, [t.slots for t in items], rope=rope,
                         old_positions=[s.positions for s in segs] if rope else None,
                         new_positions=[t.new_positions for t in items] if rope else None)
    return cache


def tier_of(store, **kw) -> HostTier:
    kw.setdefault("verify", "none")
    kw.setdefault("pin", False)
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("read_threads", 2)
    kw.setdefault("io_engine", "threads")
    return HostTier(store, HostTierConfig(**kw))


def restore(store, items, *, cache, layout, tier=None, rope=None, fingerprint=FP, **config):
    return restore_once(store, items, cache=cache, layout=layout, model_fingerprint=fingerprint, rope=rope,
                        tier=tier, **config)


def kmesh_threads() -> set:
    return {t.ident for t in threading.enumerate() if t.name.startswith("kmesh")}


def open_fds() -> set:
    return set(int(f) for f in os.listdir("/proc/self/fd"))


def back_to(fds, threads, timeout=30.0):
    settle(lambda: not (kmesh_threads() - threads), timeout)
    assert not (kmesh_threads() - threads), "kmesh threads left running"
    gc.collect()
    assert not (open_fds() - fds), "descriptors left open"


def leases_released(tier: HostTier) -> None:
    assert tier.in_flight() == 0
    assert tier.pool.in_use_bytes == tier.resident_bytes


# ============================================================================ 1. correctness
TIERS = {
    "private": None,
    "retain+sf": dict(retain=True, singleflight=True),
    "retain, no sf": dict(retain=True, singleflight=False),
    "no retain+sf": dict(retain=False, singleflight=True),
    "no retain, no sf": dict(retain=False, singleflight=False, io_engine="auto"),
}


@pytest.mark.parametrize("tier_kind", list(TIERS))
@pytest.mark.parametrize("verify", VERIFY)
def test_random_children_place_like_place_many(tmp_path, tier_kind, verify):
    """Three children per case over a shared store; layouts, shifts, skips and a repeated key vary
    with the seed; each restore is compared with the in-process reference bit for bit."""
    seed = zlib.crc32(f"{tier_kind}|{verify}".encode()) % 1000
    rng = random.Random(seed)
    store, keys = make_store(tmp_path, n=5, seed=seed % 7)
    cfg = TIERS[tier_kind]
    tier = None if cfg is None else tier_of(store, **cfg)
    for child in range(3):
        name = rng.choice(LAYOUT_NAMES)
        packing = "planes" if name in ("LBHNC", "HND") and rng.random() < 0.5 else "content"
        layout = layout_for(name, packing)
        shifted = rng.random() < 0.6
        rope = ROPE if shifted else None
        items = random_child(store, keys, layout, rng, shifted=shifted, repeat=child == 1)
        cache = layout.allocate("cpu", fill=0x7F)
        result = restore(store, items, cache=cache, layout=layout, tier=tier, rope=rope, verify=verify,
                         trust_verified=child != 2)
        assert isinstance(result, RestoreResult) and isinstance(result.report, RestoreReport)
        assert result.report.placed and result.report.objects == len(items)
        assert same(cache, reference(store, items, layout, rope=rope)), (name, packing, shifted, child)
        for t, kv, seg in zip(items, result.kv, result.segments()):
            want = store.get(t.key, model_fingerprint=FP)
            assert same(kv, want.kv) and seg.key == t.key
            assert torch.equal(seg.positions, want.positions) and torch.equal(seg.token_ids, want.token_ids)
        if tier is not None:
            leases_released(tier)
            if not cfg["retain"]:
                assert tier.resident_bytes == 0
    if tier is not None:
        tier.close()


def test_second_placement_over_a_filled_cache_changes_only_the_items_slots(tmp_path):
    """Slots the child does not name (and its ``-1`` tokens) keep what the cache held before."""
    store, keys = make_store(tmp_path, n=4, seed=3)
    layout = layout_for("BHLNC")
    tier = tier_of(store)
    rng = random.Random(5)
    cache = layout.allocate("cpu", fill=0)
    cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape,
                                                generator=torch.Generator().manual_seed(9), dtype=torch.uint8))
    before = cache.clone()
    items = random_child(store, keys, layout, rng, shifted=True)
    restore(store, items, cache=cache, layout=layout, tier=tier, rope=ROPE)
    expect = before.clone()
    segs = [store.get(t.key, model_fingerprint=FP) for t in items]
    kmesh_gpu.place_many([s.kv for s in segs], expect, layout, [t.slots for t in items], rope=ROPE,
                         old_positions=[s.positions for s in segs], new_positions=[t.new_positions for t in items])
    assert same(cache, expect)
    tier.close()


# ============================================================================ 2. all or nothing
def _flip(store, key, at=100):
    path, off = store.path(key), store.read_header(key).payload_offset
    with open(path, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ 0x10]))


def _make_bad(case, store, keys, items, layout):
    """Break item 1; returns (items, expected exception, the bad key)."""
    bad = items[1].key
    if case == "corrupt":
        _flip(store, bad)
        return items, IntegrityError, bad
    if case == "missing":
        store.delete(bad)
        return items, SegmentNotFound, bad
    if case == "another model":
        T = store.read_header(bad).num_tokens
        other = store.put(kv_for(77, T), torch.arange(T), torch.arange(T), model_fingerprint=OTHER)
        t = items[1]
        return [items[0], RestoreItem(other, t.slots, t.new_positions), *items[2:]], FingerprintMismatch, other
    if case == "truncated":
        h = store.read_header(bad)
        os.truncate(store.path(bad), h.payload_offset + h.padded_length // 2)
        return items, IntegrityError, bad
    if case == "bad slots":
        t = items[1]
        slots = t.slots.clone()
        slots[0] = layout.num_slots + 3
        return [items[0], RestoreItem(t.key, slots, t.new_positions), *items[2:]], LayoutError, "slots[1]"
    raise AssertionError(case)


ALL_OR_NOTHING = [(c, v, t) for c, v, t in [
    ("corrupt", "device-batched", "retain+sf"), ("corrupt", "device", "no retain, no sf"),
    ("corrupt", "host", "private"), ("corrupt", "device-batched", "private"),
    ("missing", "none", "retain+sf"), ("missing", "device-batched", "no retain+sf"), ("missing", "device", "private"),
    ("another model", "none", "retain, no sf"), ("another model", "device-batched", "private"),
    ("truncated", "none", "retain+sf"), ("truncated", "device-batched", "no retain, no sf"),
    ("truncated", "host", "private"),
    ("bad slots", "none", "no retain+sf"), ("bad slots", "device-batched", "retain+sf"), ("bad slots", "host", "private"),
]]


@pytest.mark.parametrize("case,verify,tier_kind", ALL_OR_NOTHING)
def test_one_bad_item_leaves_every_slot_as_it_was(tmp_path, case, verify, tier_kind):
    """Promise (the contract): a failure raises and nothing of the child is placed; so every slot,
    the other items' included, keeps its bytes; leases, fds and threads all come back."""
    store, keys = make_store(tmp_path, n=4, seed=11)
    layout = layout_for("HND")
    fds, threads = open_fds(), kmesh_threads()
    cfg = TIERS[tier_kind]
    tier = None if cfg is None else tier_of(store, **cfg)
    if tier is not None:
        with tier.acquire(keys[0], model_fingerprint=FP):
            pass  # resident where retained
    items = random_child_fixed(store, keys, layout)  # all four, in order: item 1 is keys[1]
    items, exc, bad = _make_bad(case, store, keys, items, layout)
    cache = layout.allocate("cpu", fill=0x3C)
    before = cache.clone()
    with pytest.raises(exc) as err:
        restore(store, items, cache=cache, layout=layout, tier=tier, rope=ROPE, verify=verify)
    assert bad in str(err.value)
    assert same(cache, before)  # none of the other items' slots changed either
    if tier is not None:
        leases_released(tier)
        if case in ("corrupt", "truncated"):
            assert bad not in tier
        # the next good child on the same tier places exactly
        good = [t for t in items if t.key != items[1].key]
        result = restore(store, good, cache=cache, layout=layout, tier=tier, rope=ROPE, verify=verify)
        assert result.report.placed
        assert same(cache, reference(store, good, layout, rope=ROPE, fill=0x3C))
        leases_released(tier)
        tier.close()
    back_to(fds, threads)


def random_child_fixed(store, keys, layout):
    """All ``keys`` in order on disjoint slots (with one skip), shifted positions."""
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(21))
    out, start = [], 0
    for i, key in enumerate(keys):
        T = store.read_header(key).num_tokens
        slots = perm[start:start + T].clone()
        start += T
        if T > 3:
            slots[2] = -1
        out.append(RestoreItem(key, slots, torch.arange(T) + 50 * i))
    return out


def test_verify_none_places_a_corrupt_object_as_documented(tmp_path):
    """``verify="none"`` checks nothing (documented): the corrupt bytes are placed as stored."""
    store, keys = make_store(tmp_path, n=3, seed=12)
    layout = layout_for("NHD")
    items = random_child_fixed(store, keys, layout)
    _flip(store, keys[1])
    tier = tier_of(store)
    cache = layout.allocate("cpu", fill=0)
    result = restore(store, items, cache=cache, layout=layout, tier=tier, rope=ROPE, verify="none")
    assert result.report.placed and result.report.verified == {"not verified": 3}
    assert result.report.verification == "none"
    with pytest.raises(IntegrityError):
        store.get(keys[1], model_fingerprint=FP)
    leases_released(tier)
    # nothing marked verified: a later checked restore still refuses it
    with pytest.raises(IntegrityError, match=keys[1]):
        restore(store, items, cache=cache, layout=layout, tier=tier, rope=ROPE, verify="host")
    tier.close()


# ============================================================================ 3. the report
def _nested(rep: RestoreReport, outer: float) -> None:
    t = rep.timings
    assert set(t) >= {"read_s", "verify_s", "prepare_s", "tail_s", "restore_s"}
    assert all(v >= 0 for v in t.values())
    for inner in ("read_s", "verify_s", "prepare_s", "tail_s"):
        assert t[inner] <= t["restore_s"], (inner, t)
    assert t["restore_s"] <= outer


@pytest.mark.parametrize("verify", VERIFY)
def test_report_counts_what_happened_reads_hits_and_bytes(direct_dir, verify):
    store, keys = make_store(direct_dir, n=5, seed=13)
    padded = {k: store.read_header(k).padded_length for k in keys}
    tier = tier_of(store, retain=True)
    with tier.acquire(keys[1], model_fingerprint=FP), tier.acquire(keys[3], model_fingerprint=FP):
        pass
    layout = layout_for("LHBNC")
    items = random_child_fixed(store, keys, layout)
    cache = layout.allocate("cpu", fill=0)
    t0 = time.perf_counter()
    result = restore(store, items, cache=cache, layout=layout, tier=tier, rope=ROPE, verify=verify,
                     trust_verified=False)
    outer = time.perf_counter() - t0
    rep = result.report
    read = [keys[i] for i in (0, 2, 4)]
    assert rep.path == "in_process" and rep.route == "host_staging" and rep.device == "cpu"
    assert rep.objects == 5 and rep.placed
    assert rep.tier_sources == {"hit": 2, "read": 3}
    assert rep.bytes_read == sum(padded[k] for k in read)
    assert rep.bytes_moved == sum(padded.values())
    assert sum(rep.verified.values()) == 5
    if verify == "none":
        assert rep.verified == {"not verified": 5}
    else:
        assert all("this call" in k for k in rep.verified)
    assert rep.o_direct is True and rep.mechanism.startswith("O_DIRECT reads") and rep.pinned is False
    assert "host memcpy (no GPU)" in rep.mechanism and rep.io_engine == "threads"
    landed = rep.facts["loads_done_s"]
    assert [x is not None for x in landed] == [True, False, True, False, True]
    assert all(0 <= x <= rep.timings["restore_s"] for x in landed if x is not None)
    _nested(rep, outer)
    d = rep.to_dict()
    assert d["bytes_read"] == rep.bytes_read and d["tier_sources"] == rep.tier_sources
    # the store's own account of those objects: the bytes read are their padded payloads
    for k in read:
        h = store.read_header(k)
        assert os.path.getsize(store.path(k)) >= h.payload_offset + h.padded_length
    # all resident and trusted (marked by this call unless verify="none")
    t1 = time.perf_counter()
    again = restore(store, items, cache=cache, layout=layout, tier=tier, rope=ROPE, verify=verify)
    rep2 = again.report
    assert rep2.tier_sources == {"hit": 5} and rep2.bytes_read == 0 and rep2.bytes_moved == sum(padded.values())
    assert rep2.o_direct is None and rep2.mechanism.startswith("host tier") and "O_DIRECT" not in rep2.mechanism
    assert rep2.timings["read_s"] == 0.0 and rep2.timings["tail_s"] == 0.0
    if verify == "none":
        assert rep2.verified == {"not verified": 5}
    else:
        assert sum(v for k, v in rep2.verified.items() if k.startswith("trusted: ")) == 5
    _nested(rep2, time.perf_counter() - t1)
    leases_released(tier)
    tier.close()


def test_report_never_claims_o_direct_when_the_fallback_was_taken(tmp_path, monkeypatch):
    store, keys = make_store(tmp_path, n=3, seed=14)
    refuse_o_direct_at_open(monkeypatch)
    tier = tier_of(store, retain=True)
    with tier.acquire(keys[0], model_fingerprint=FP):
        pass
    result = fetch(store, keys, model_fingerprint=FP, tier=tier, verify="device")
    rep = result.report
    assert rep.tier_sources == {"hit": 1, "read": 2} and rep.o_direct is False
    assert "O_DIRECT reads" not in rep.mechanism and rep.mechanism.startswith("page-cache reads")
    assert any("O_DIRECT" in n for n in rep.notes[1:])  # the fallback's reason is a note
    for k, kv in zip(keys, result.kv):
        assert same(kv, store.get(k, model_fingerprint=FP).kv)
    leases_released(tier)
    tier.close()


def test_report_sources_say_joined_when_another_child_led_the_read(tmp_path, monkeypatch):
    """Child B starts while child A's reads are held: B joins A's loads (one read per key) and its
    report says ``joined`` with no bytes read; A's says ``read``. (Retention on: without it a joiner
    can read again.)"""
    store, keys = make_store(tmp_path, n=3, seed=15)
    gate, entered = threading.Event(), threading.Event()
    real = DirectFile.pread_into

    def held(self, view, offset):
        entered.set()
        assert gate.wait(60)
        return real(self, view, offset)

    monkeypatch.setattr(DirectFile, "pread_into", held)
    tier = tier_of(store, retain=True, singleflight=True, parallel_loads=4)
    out = {}

    def child(name):
        out[name] = fetch(store, keys, model_fingerprint=FP, tier=tier, verify="host")

    a = threading.Thread(target=child, args=("a",))
    a.start()
    assert entered.wait(30)
    b = threading.Thread(target=child, args=("b",))
    b.start()
    settle(lambda: sum(tier.waiting(k) for k in keys) >= 3)
    gate.set()
    a.join(30)
    b.join(30)
    assert set(out) == {"a", "b"}
    ra, rb = out["a"].report, out["b"].report
    assert ra.tier_sources == {"read": 3} and ra.bytes_read == sum(store.read_header(k).padded_length for k in keys)
    assert rb.tier_sources == {"joined": 3} and rb.bytes_read == 0 and rb.o_direct is None
    assert "O_DIRECT" not in rb.mechanism
    assert tier.stats["reads"] == 3 and tier.stats["joins"] == 3
    for r in (out["a"], out["b"]):
        for k, kv in zip(keys, r.kv):
            assert same(kv, store.get(k, model_fingerprint=FP).kv)
    leases_released(tier)
    tier.close()


# ============================================================================ 4. concurrency
@pytest.mark.parametrize("singleflight", [True, False])
def test_threads_restoring_overlapping_sets_through_one_tier(tmp_path, singleflight):
    store, keys = make_store(tmp_path, n=6, seed=16)
    padded = {k: store.read_header(k).padded_length for k in keys}
    tier = tier_of(store, retain=True, singleflight=singleflight, read_threads=3, parallel_loads=4)
    fds, threads = open_fds(), kmesh_threads()
    rng = random.Random(17)
    layouts = [layout_for(n) for n in ("NHD", "HND", "BLNHC", "LHBNC", "BHLNC", "LBHNC")]
    children = []
    for i, layout in enumerate(layouts):
        sub = keys[i % 3: i % 3 + 4]  # overlapping windows
        perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        ts, start = [], 0
        for k in sub:
            T = store.read_header(k).num_tokens
            ts.append(RestoreItem(k, perm[start:start + T].clone(), torch.arange(T) + rng.randint(0, 900)))
            start += T
        children.append((layout, ts, layout.allocate("cpu", fill=0x11)))
    results, errors = [None] * len(children), []
    barrier = threading.Barrier(len(children))

    def run(i):
        layout, ts, cache = children[i]
        try:
            barrier.wait(60)
            results[i] = restore(store, ts, cache=cache, layout=layout, tier=tier, rope=ROPE,
                                 verify=["device", "host"][i % 2])
        except BaseException as exc:  # asserted below
            errors.append(exc)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(len(children))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not errors and all(r is not None for r in results)
    for (layout, ts, cache), r in zip(children, results):
        assert same(cache, reference(store, ts, layout, rope=ROPE, fill=0x11))
        src = r.report.tier_sources
        assert sum(src.values()) == len(ts) and set(src) <= {"hit", "read", "joined"}
        assert r.report.bytes_read <= sum(padded[t.key] for t in ts)
    total_read = sum(r.report.tier_sources.get("read", 0) for r in results)
    total_bytes = sum(r.report.bytes_read for r in results)
    assert total_read == tier.stats["reads"] and total_bytes == tier.stats["bytes_read"]
    used = {t.key for _, ts, _ in children for t in ts}
    if singleflight:
        assert tier.reads_by_key == {k: 1 for k in used}  # every key read exactly once
        assert total_bytes == sum(padded[k] for k in used)
    else:
        assert set(tier.reads_by_key) == used and all(v >= 1 for v in tier.reads_by_key.values())
    leases_released(tier)
    tier.close()
    back_to(fds, threads)


# ============================================================================ 5. bad arguments
def test_bad_arguments_are_typed(tmp_path):
    store, keys = make_store(tmp_path, n=2, seed=18)
    tier = tier_of(store)
    layout, cache, ok = cache_for(store, keys)
    for route in ["Host_staging", "", None, "gds", "host-staging"]:
        with pytest.raises(ValueError, match="route"):
            RouteConfig(route=route)
    with pytest.raises(ValueError, match="verify"):
        RouteConfig(verify="sha256")
    with pytest.raises(TypeError):
        RouteConfig(verfy="host")
    with pytest.raises(LayoutError, match="trust_verified"):
        RouteConfig(trust_verified=1)
    with pytest.raises(LayoutError, match="config"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP, tier=tier, config={"verify": "host"})
    with pytest.raises(LayoutError, match="store"):
        InProcessRestorer(str(tmp_path), cache, layout, model_fingerprint=FP)
    with tier_of(SegmentStore(tmp_path / "other")) as foreign, pytest.raises(LayoutError, match="tier"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP, tier=foreign)
    with pytest.raises(LayoutError, match="model_fingerprint"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP.to_dict(), tier=tier)
    with pytest.raises(LayoutError, match="layout"):
        InProcessRestorer(store, cache, "NHD", model_fingerprint=FP, tier=tier)
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, tier=tier) as restorer:
        with pytest.raises(LayoutError, match="at least one"):
            restorer.restore([])
        with pytest.raises(LayoutError, match="at least one"):
            restorer.restore(iter(()))
        with pytest.raises(LayoutError, match=r"items\[1\]: expected a RestoreItem"):
            restorer.restore([ok[0], keys[1]])
        with pytest.raises(LayoutError, match="items"):
            restorer.restore(ok[0])
        with pytest.raises(SegmentNotFound):
            restorer.restore([RestoreItem("../" + keys[0], ok[0].slots)])
    # the direct route on CPU: a typed refusal that says why
    with pytest.raises(BackendError, match="not a CUDA device"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP, config=RouteConfig(route="direct"))
    with pytest.raises(LayoutError, match="tier"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP, tier=tier, config=RouteConfig(route="direct"))
    assert tier.stats["reads"] == 0
    leases_released(tier)
    tier.close()


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu")])
def test_cpu_device_spellings_restore_alike(tmp_path, device):
    store, keys = make_store(tmp_path, n=2, seed=19)
    result = fetch(store, keys, model_fingerprint=FP, device=device, verify="device")
    assert result.buffer.device.type == "cpu" and result.report.device.startswith("cpu")
    for k, kv in zip(keys, result.kv):
        assert same(kv, store.get(k, model_fingerprint=FP).kv)


def test_duplicate_items_and_a_key_repeated_to_other_slots(tmp_path):
    """Identical items twice name the same slots twice: refused (typed) before anything is
    placed; the same key to other slots is placed at both."""
    store, keys = make_store(tmp_path, n=3, seed=20)
    layout = layout_for("BLHNC")
    tier = tier_of(store, retain=True, singleflight=True)
    base = random_child_fixed(store, keys, layout)
    cache = layout.allocate("cpu", fill=0x55)
    before = cache.clone()
    with pytest.raises(LayoutError, match="same destination slot"):
        restore(store, base + [base[1]], cache=cache, layout=layout, tier=tier, rope=ROPE)
    assert same(cache, before)
    leases_released(tier)
    used = set(torch.cat([t.slots for t in base]).tolist())
    free = torch.tensor([s for s in range(layout.num_slots) if s not in used][:base[1].slots.numel()])
    again = RestoreItem(base[1].key, free, base[1].new_positions + 7)
    tier.evict()
    result = restore(store, base + [again], cache=cache, layout=layout, tier=tier, rope=ROPE, verify="device")
    src = result.report.tier_sources
    assert sum(src.values()) == 4 and src.get("read") == 3  # one read per distinct key (singleflight)
    assert result.report.bytes_read == sum(store.read_header(k).padded_length for k in keys)
    assert same(cache, reference(store, base + [again], layout, rope=ROPE, fill=0x55))
    assert same(result.kv[1], result.kv[3])
    leases_released(tier)
    tier.close()


# ============================================================================ 6. the tier's settings through the route
# (moved from test_tier_adversarial.py)
RTOKENS = [37, 64, 100, 5]


def rkv(i, T):
    return torch.randn((2, L, T, H, D), generator=torch.Generator().manual_seed(100 + i)).to(DTYPE)


def route_setup(tmp_path, *, chunk_size=4096, tokens=RTOKENS):
    store = SegmentStore(tmp_path / "rs", chunk_size=chunk_size)
    segs = []
    for i, T in enumerate(tokens):
        kv, pos = rkv(i, T), torch.arange(T) + 3 * i
        segs.append((store.put(kv, torch.arange(T), pos, model_fingerprint=FP), kv, pos))
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=32, block_size=16, num_kv_heads=H, head_size=D,
                                dtype=DTYPE)
    return store, segs, layout


def route_targets(segs, layout, seed=1):
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(seed))
    out, start = [], 0
    for key, kv, pos in segs:
        T = kv.shape[2]
        out.append(RestoreItem(key, perm[start:start + T].clone(), torch.arange(T) + 1000 + start))
        start += T
    return out


def route_reference(segs, targets, layout):
    cache = layout.allocate("cpu", fill=0x7F)
    for (key, kv, pos), t in zip(segs, targets):
        kmesh_gpu.place(kv, cache, layout, t.slots, rope=ROPE, old_positions=pos, new_positions=t.new_positions)
    return cache


def route_tier(store, **kw):
    kw.setdefault("io_engine", "auto")
    return tier_of(store, **kw)


def _replace(targets, i, **kw):
    t = targets[i]
    targets = list(targets)
    targets[i] = RestoreItem(kw.get("key", t.key), kw.get("slots", t.slots), kw.get("new_positions", t.new_positions))
    return targets


BAD_PLACEMENT = {
    "slot past the end": (lambda t, L: _replace(t, 2, slots=torch.cat([t[2].slots[:-1], torch.tensor([L.num_slots])])),
                          "slots[2]"),
    "slot -2": (lambda t, L: _replace(t, 2, slots=torch.cat([t[2].slots[:-1], torch.tensor([-2])])), "slots[2]"),
    "slot repeated in one target": (lambda t, L: _replace(t, 2, slots=torch.cat([t[2].slots[:-1], t[2].slots[:1]])),
                                    "same destination slot"),
    "slot repeated across targets": (lambda t, L: _replace(t, 3, slots=t[0].slots[:5].clone()),
                                     "same destination slot"),
    "slots one short": (lambda t, L: _replace(t, 1, slots=t[1].slots[:-1], new_positions=t[1].new_positions[:-1]),
                        "slots[1]"),
    # (an item of int32 slots, or of positions that do not match its slots, is refused when it is made)
    "slots int32": (lambda t, L: _replace(t, 1, slots=t[1].slots.int()), "slots: expected an int64"),
    "positions one short": (lambda t, L: _replace(t, 3, new_positions=t[3].new_positions[:-1]), "new_positions"),
    "positions negative": (lambda t, L: _replace(t, 0, new_positions=t[0].new_positions - 5000), "new_positions[0]"),
    "positions past rope range": (lambda t, L: _replace(t, 0, new_positions=t[0].new_positions + 4096),
                                  "new_positions[0]"),
}
# (an item without new_positions is placed as stored: test_host_staging.py's mixed restore)


@pytest.mark.parametrize("case", list(BAD_PLACEMENT))
def test_route_bad_slots_or_positions_place_nothing_and_release_everything(tmp_path, case):
    store, segs, layout = route_setup(tmp_path)
    tier = route_tier(store, retain=True)
    with tier.acquire(segs[1][0], model_fingerprint=FP):
        pass  # one object resident, three read
    good = route_targets(segs, layout)
    mutate, names = BAD_PLACEMENT[case]
    cache = layout.allocate("cpu", fill=0x7F)
    before = cache.clone()
    with pytest.raises(LayoutError, match=names.replace("[", r"\[")):
        restore(store, mutate(good, layout), cache=cache, layout=layout, tier=tier, rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == tier.resident_bytes
    result = restore(store, good, cache=cache, layout=layout, tier=tier, rope=ROPE)
    assert result.report.placed
    assert torch.equal(cache.view(torch.uint8), route_reference(segs, good, layout).view(torch.uint8))
    tier.close()


def _truncate(store, key):
    h = store.read_header(key)
    os.truncate(store.path(key), h.payload_offset + h.padded_length // 2)


BAD_OBJECT = ["corrupt payload", "missing file", "another model", "truncated file", "read error"]


@pytest.mark.parametrize("verify", ["device", "host"])
@pytest.mark.parametrize("case", BAD_OBJECT)
def test_route_one_bad_object_among_four_places_nothing(tmp_path, monkeypatch, case, verify):
    store, segs, layout = route_setup(tmp_path)
    targets = route_targets(segs, layout)
    bad = segs[2][0]
    expect = {"corrupt payload": IntegrityError, "missing file": SegmentNotFound,
              "another model": FingerprintMismatch, "truncated file": IntegrityError,
              "read error": StorageError}[case]
    if case == "corrupt payload":
        flip_payload_byte(store, bad, 4097)
    elif case == "missing file":
        store.delete(bad)
    elif case == "another model":
        T = segs[2][1].shape[2]
        bad = store.put(rkv(2, T), torch.arange(T), torch.arange(T), model_fingerprint=OTHER)
        targets = _replace(targets, 2, key=bad)
    elif case == "truncated file":
        _truncate(store, bad)
    else:
        real = DirectFile.pread_into
        bad_path = store.path(bad)

        def failing(self, view, offset):
            if self.path == bad_path:
                raise StorageError(f"read of {self.path} at {offset} failed: injected")
            return real(self, view, offset)

        monkeypatch.setattr(DirectFile, "pread_into", failing)
    tier = route_tier(store, retain=True, io_engine="threads")
    with tier.acquire(segs[0][0], model_fingerprint=FP):
        pass  # resident
    cache = layout.allocate("cpu", fill=0x7F)
    before = cache.clone()
    with pytest.raises(expect) as err:
        restore(store, targets, cache=cache, layout=layout, tier=tier, rope=ROPE, verify=verify)
    assert bad in str(err.value)
    assert not any(k in str(err.value) for k, _, _ in segs if k != bad)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # nothing of the child placed
    assert bad not in tier and tier.in_flight() == 0
    assert tier.pool.in_use_bytes == tier.resident_bytes  # every lease released
    tier.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_route_payloads_not_multiples_of_4096_bit_exact(direct_dir, engine):
    """Store chunk 512: padded payloads of 512 .. 12800 bytes, none page multiples except one; read
    through O_DIRECT in 4 KiB chunks, one object resident, one key restored twice; bytes and cache
    equal the in-memory path."""
    tokens = [1, 3, 17, 63, 64, 65, 100]
    store, segs, layout = route_setup(direct_dir, chunk_size=512, tokens=tokens)
    assert sum(store.read_header(k).padded_length % 4096 != 0 for k, _, _ in segs) == 5
    tier = route_tier(store, retain=True, io_engine=engine, read_threads=3)
    with tier.acquire(segs[4][0], model_fingerprint=FP):
        pass
    targets = route_targets(segs, layout)
    cache = layout.allocate("cpu", fill=0x7F)
    result = restore(store, targets, cache=cache, layout=layout, tier=tier, rope=ROPE, verify="host")
    assert result.report.tier_sources == {"hit": 1, "read": 6} and result.report.o_direct is True
    for (key, kv, pos), got in zip(segs, result.kv):
        assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    assert torch.equal(cache.view(torch.uint8), route_reference(segs, targets, layout).view(torch.uint8))
    # the same key twice in one child, to other slots
    dup_layout, dup_cache, dup = cache_for(store, [segs[2][0], segs[5][0], segs[2][0]])
    tier.evict()
    again = restore(store, dup, cache=dup_cache, layout=dup_layout, tier=tier, verify="device")
    for (i, got) in zip([2, 5, 2], again.kv):
        assert torch.equal(got.view(torch.uint8), segs[i][1].view(torch.uint8))
    src = again.report.tier_sources
    assert sum(src.values()) == 3 and src.get("read", 0) >= 2
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


def test_private_tier_routes_leak_nothing_on_success_or_failure(tmp_path):
    store, segs, layout = route_setup(tmp_path)
    fds, threads = open_fds(), kmesh_threads()
    keys = [k for k, _, _ in segs]
    for _ in range(3):
        result = fetch(store, keys, model_fingerprint=FP, verify="host")
        assert all(torch.equal(g, kv) for (_, kv, _), g in zip(segs, result.kv))
    flip_payload_byte(store, segs[3][0], 10)
    for verify in ["host", "device"]:
        with pytest.raises(IntegrityError, match=segs[3][0]):
            fetch(store, keys, model_fingerprint=FP, verify=verify)
    with pytest.raises(FingerprintMismatch):
        fetch(store, keys, model_fingerprint=OTHER)
    del result
    back_to(fds, threads)


def flip_payload_byte(store: SegmentStore, key: str, at: int) -> None:
    path, off = store.path(key), store.read_header(key).payload_offset
    with open(path, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ 0x20]))
