"""Which internal path the host-staging route took (kmesh_host/restore/host_staging.py): the order
work is issued in, the reads queued first, landings grouped, the all-resident start, the driver's
copies, the short digest path, the gated placement, the one-call placement and the spare staging
buffer. Every test also checks the bytes: a path taken must give the same cache.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import kmesh_gpu
from kmesh_gpu import KVLayout, cuda
from kmesh_host import (HostTier, HostTierConfig, InProcessRestorer, IntegrityError, RestoreItem, RouteConfig,
                        SegmentStore)
from kmesh_host.restore import host_staging as host_staging_mod
from kmesh_host.restore import placement as placement_mod
from kmesh_host.restore import verifier as verifier_mod
from tests.helpers.restore import restore_once
from tests.helpers.route_model import DTYPE, FP, ROPE, D, H, L

TOKENS = [37, 64, 100]


def kv_for(i, T):
    return torch.randn((2, L, T, H, D), generator=torch.Generator().manual_seed(i)).to(DTYPE)


@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "store")


@pytest.fixture
def segments(store):
    out = []
    for i, T in enumerate(TOKENS):
        kv = kv_for(i, T)
        pos = torch.arange(T) + 5 * i
        out.append((store.put(kv, torch.arange(T), pos, model_fingerprint=FP), kv, pos))
    return out


def make_tier(store, device, **kw):
    kw.setdefault("verify", "none")
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("read_threads", 2)
    return HostTier(store, HostTierConfig(pin=torch.device(device).type == "cuda", **kw))


def cache_and_items(segments, device, *, layout=None, ordered=False):
    """A cache and shifted items for ``segments``: random slots, or (``ordered``) increasing runs of
    slots as a scheduler's block tables give them (host tensors)."""
    layout = layout or KVLayout.from_vllm("NHD", num_layers=L, num_blocks=32, block_size=16, num_kv_heads=H,
                                          head_size=D, dtype=DTYPE)
    cache = layout.allocate(device, fill=0x7F)
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(1))
    items, start = [], 0
    for key, kv, pos in segments:
        T = kv.shape[2]
        if ordered:
            items.append(RestoreItem(key, torch.arange(start + 3, start + 3 + T), torch.arange(T) + 200 + start))
            start += T + 7
        else:
            items.append(RestoreItem(key, perm[start: start + T].to(device), (torch.arange(T) + 200 + start).to(device)))
            start += T
    return layout, cache, items


def reference_cache(segments, items, layout, device):
    cache = layout.allocate(device, fill=0x7F)
    for (key, kv, pos), t in zip(segments, items):
        kmesh_gpu.place(kv.to(device), cache, layout, t.slots, rope=ROPE, old_positions=pos.to(device),
                        new_positions=t.new_positions)
    return cache


def restore(store, items, *, cache, layout, tier, **config):
    return restore_once(store, items, cache=cache, layout=layout, model_fingerprint=FP, rope=ROPE, tier=tier, **config)


def flip_payload_bit(store, key: str, at: int, mask: int) -> None:
    off = store.read_header(key).payload_offset
    with open(store.path(key), "r+b") as f:
        f.seek(off + at)
        byte = f.read(1)
        f.seek(off + at)
        f.write(bytes([byte[0] ^ mask]))


# ------------------------------------------------------------------ issue order (CPU, recorded streams)
class FakeEvent:
    def __init__(self, n, log):
        self.n, self.log = n, log

    def query(self):
        return False

    def synchronize(self):
        self.log.append(("fence waited", self.n))

    def __eq__(self, other):
        return other == self.n

    def __hash__(self):
        return hash(self.n)


class RecordingStreams:
    """Stands in for the route's CUDA streams on the CPU and records what was issued where."""

    work = None

    def __init__(self, device, log):
        self.log = log
        self.events = 0

    def on_copy(self):
        self.log.append(("copy",))
        return contextlib.nullcontext()

    def on_work(self):
        return contextlib.nullcontext()

    def copied(self):
        self.events += 1
        self.log.append(("event", self.events))
        return FakeEvent(self.events, self.log)

    def work_after(self, event):
        self.log.append(("wait", event.n))

    def on_digest(self, event):
        self.log.append(("wait", event.n))
        return contextlib.nullcontext()

    def digests_done(self):
        self.log.append(("digests done",))

    def join(self):
        self.log.append(("join",))

    def after_late_copies(self):
        pass

    def sync(self):
        pass

    def copy_handle(self):
        return None  # no CUDA stream: the route copies with torch


@pytest.fixture
def recorded(monkeypatch):
    log = []
    monkeypatch.setattr(host_staging_mod, "Streams", lambda device: RecordingStreams(device, log))
    real_prepare, real_digests, real_run = kmesh_gpu.PlacementPlan.prepare, kmesh_gpu.tree_digests, \
        placement_mod.Placement.run

    def prepare(*a, **k):
        log.append(("prepare",))
        return real_prepare(*a, **k)

    def digests(data, offsets, lengths, **k):
        log.append(("digest", tuple(offsets)))
        return real_digests(data, offsets, lengths, **k)

    def run(self):
        log.append(("place",))
        real_run(self)

    monkeypatch.setattr(kmesh_gpu.PlacementPlan, "prepare", prepare)
    monkeypatch.setattr(kmesh_gpu, "tree_digests", digests)
    monkeypatch.setattr(placement_mod.Placement, "run", run)
    return log


def check_issue_order(log, n_objects, *, digests):
    """Work-stream work (digests, placement) waits for copies issued before it; prepared first."""
    at = {entry: i for i, entry in enumerate(log)}
    place = at[("place",)]
    prepare = at[("prepare",)]
    events = [e for e in log if e[0] == "event"]
    assert events and all(at[("wait", e[1])] < place for e in events)  # every copy event waited
    last_copy = max(i for i, e in enumerate(log) if e[0] == "copy")
    assert any(at[e] > last_copy and at[("wait", e[1])] < place for e in events)
    dig = [i for i, e in enumerate(log) if e[0] == "digest"]
    assert len(dig) == (n_objects if digests else 0)
    for i in dig:  # each digest after a wait for the copies issued before it, after preparation
        waits = [j for j, e in enumerate(log[:i]) if e[0] == "wait"]
        copies = [j for j, e in enumerate(log[:i]) if e[0] == "copy"]
        assert waits and prepare < i and (not copies or max(waits) > max(copies))
    assert log[-1] == ("join",) and place < len(log) - 1 and not any(e[0] == "fence waited" for e in log)


def hold_landings_until_prepared(monkeypatch, tier, *, groups: bool = True) -> None:
    """Page-cache reads of small files can finish before the restoring thread reaches the placement's
    preparation (they are queued before it); on the GPU machine they take milliseconds. Hold each
    object's landing (its copy and digest) until the placement is being prepared, as a real read
    would, so that the order a test checks does not depend on timing. ``groups=False``: the engine
    reports no groups of landings (``on_batch`` dropped), so the restoring thread takes every
    landing once all loads have settled."""
    preparing = threading.Event()
    recorded_prepare, real_start = kmesh_gpu.PlacementPlan.prepare, tier.start_loads

    def prepare(*a, **k):
        preparing.set()
        return recorded_prepare(*a, **k)

    def start_loads(keys, *, on_done, **kw):
        def held(*args):
            preparing.wait(30)
            return on_done(*args)
        if not groups:
            kw["on_batch"] = None
        return real_start(keys, on_done=held, **kw)

    monkeypatch.setattr(kmesh_gpu.PlacementPlan, "prepare", prepare)
    monkeypatch.setattr(tier, "start_loads", start_loads)


def test_forced_read_issue_order(store, segments, recorded, monkeypatch):
    layout, cache, items = cache_and_items(segments, "cpu")
    tier = make_tier(store, "cpu")
    hold_landings_until_prepared(monkeypatch, tier)
    result = restore(store, items, cache=cache, layout=layout, tier=tier)
    assert result.report.placed and result.report.tier_sources == {"read": 3}
    check_issue_order(recorded, 3, digests=True)
    assert torch.equal(cache.view(torch.uint8), reference_cache(segments, items, layout, "cpu").view(torch.uint8))
    tier.close()


@pytest.mark.parametrize("hook", [True, False], ids=["per group the engine reports", "all once loads settled"])
def test_landings_are_copied_fenced_and_hashed_per_group(store, segments, recorded, monkeypatch, hook):
    """Objects that land together are copied, fenced and hashed together: one copy event per group
    of landings the engine reports (``on_batch``), and what no group took is taken by the restoring
    thread once every load has settled. Every object is copied once, every copy is fenced and waited
    for before its digest and the placement, and the cache is exact."""
    layout, cache, items = cache_and_items(segments, "cpu")
    tier = make_tier(store, "cpu", io_engine="threads")
    # not hook: the engine reports no groups, the restoring thread takes every landing at the end
    hold_landings_until_prepared(monkeypatch, tier, groups=hook)
    result = restore(store, items, cache=cache, layout=layout, tier=tier)
    assert result.report.placed and result.report.tier_sources == {"read": 3}
    events = [e for e in recorded if e[0] == "event"]
    assert sum(e == ("copy",) for e in recorded) == 3  # one whole-object copy each
    if not hook:
        assert len(events) == 1
    else:
        assert 1 <= len(events) <= 3
    check_issue_order(recorded, 3, digests=True)
    assert torch.equal(cache.view(torch.uint8), reference_cache(segments, items, layout, "cpu").view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


def test_resident_issue_order_copies_once_per_object(store, segments, recorded):
    layout, cache, items = cache_and_items(segments, "cpu")
    tier = make_tier(store, "cpu", retain=True)
    restore(store, items, cache=cache, layout=layout, tier=tier)
    recorded.clear()
    cache = layout.allocate("cpu", fill=0x7F)
    result = restore(store, items, cache=cache, layout=layout, tier=tier)
    assert result.report.tier_sources == {"hit": 3}
    assert result.report.bytes_moved == sum(h.padded_length for h in result.headers)
    # one block of whole-object copies (no chunking) and one event fencing them, issued before the
    # placement is prepared so the DMA overlaps the preparation
    assert sum(e[0] == "copy" for e in recorded) == 1 and sum(e[0] == "event" for e in recorded) == 1
    assert recorded.index(("copy",)) < recorded.index(("prepare",))
    check_issue_order(recorded, 3, digests=False)  # verified on entry: trusted, not hashed again
    assert torch.equal(cache.view(torch.uint8), reference_cache(segments, items, layout, "cpu").view(torch.uint8))
    tier.close()


def test_reads_go_out_before_the_staging_side_and_early_landings_wait(store, segments, monkeypatch):
    """A forced read's chunks are queued right after its headers, before the staging buffer, streams
    and verifier are made. A load that completes before those exist (here: every load,
    ``start_loads`` returns only once they all have) is parked and landed when the restoring thread
    arms the landings: copied, hashed once, placed exactly, its lease released."""
    steps, hashed = [], []
    real_digests, real_init, real_arm = kmesh_gpu.tree_digests, verifier_mod.Verifier.__init__, \
        host_staging_mod._HostStagingRestore._arm

    def digests(data, offsets, lengths, **k):
        hashed.extend(offsets)
        return real_digests(data, offsets, lengths, **k)

    def init(self, *a, **k):
        steps.append("staging side made")
        real_init(self, *a, **k)

    def arm(self):
        steps.append(f"landings armed ({len(self.parked)} parked)")
        real_arm(self)

    monkeypatch.setattr(kmesh_gpu, "tree_digests", digests)
    monkeypatch.setattr(verifier_mod.Verifier, "__init__", init)
    monkeypatch.setattr(host_staging_mod._HostStagingRestore, "_arm", arm)
    layout, cache, items = cache_and_items(segments, "cpu")
    tier = make_tier(store, "cpu", retain=True)
    real_start = tier.start_loads

    def start_loads(keys, *, on_done, **kw):  # returns once every load has been reported
        done = threading.Semaphore(0)

        def reported(*args):
            on_done(*args)
            done.release()
        real_start(keys, on_done=reported, **kw)
        for _ in keys:
            assert done.acquire(timeout=30)
        steps.append("reads queued")

    monkeypatch.setattr(tier, "start_loads", start_loads)
    result = restore(store, items, cache=cache, layout=layout, tier=tier)
    assert result.report.tier_sources == {"read": 3} and result.report.placed
    assert result.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    assert sorted(hashed) == sorted(result.offsets)
    assert steps == ["reads queued", "staging side made", "landings armed (3 parked)"]
    assert torch.equal(cache.view(torch.uint8), reference_cache(segments, items, layout, "cpu").view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


# ------------------------------------------------------------------ CUDA paths
@pytest.mark.gpu
@pytest.mark.parametrize("verify", ["device", "none"])
def test_read_objects_go_to_the_gpu_in_one_driver_copy_each_from_the_completion_thread(store, segments, monkeypatch,
                                                                                        verify):
    """A forced read's bytes are copied to the GPU from the reader's completion thread, each object in
    one driver copy once its last chunk has landed; a copy the driver refuses goes through torch.
    The objects and the placed cache are exact either way."""
    layout, cache, items = cache_and_items(segments, "cuda")
    expect = reference_cache(segments, items, layout, "cuda")
    calls, real = [], cuda.copy_htod

    def counted(*a):
        calls.append((a[0], a[2]))
        return False if len(calls) == 2 else real(*a)  # the second copy is refused: torch makes it

    monkeypatch.setattr(cuda, "copy_htod", counted)
    tier = make_tier(store, "cuda", chunk_bytes=8192)  # several chunks per object
    for _ in range(2):
        tier.evict()
        calls.clear()
        cache = layout.allocate("cuda", fill=0x7F)
        result = restore(store, items, cache=cache, layout=layout, tier=tier, verify=verify)
        assert result.report.tier_sources == {"read": len(segments)} and result.report.placed
        assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
        for (_, kv, _), got in zip(segments, result.kv):
            assert torch.equal(got.cpu(), kv)
        lo, hi = result.buffer.data_ptr(), result.buffer.data_ptr() + result.buffer.numel()
        calls[:] = [n for dst, n in calls if lo <= dst < hi]  # (not the gate's upload of the stored roots)
        assert sorted(calls) == sorted(h.padded_length for h in result.headers)  # one per object
    tier.close()


@pytest.mark.gpu
def test_repeated_forced_reads_check_every_object_on_the_short_digest_path(store, segments, monkeypatch):
    """A digest launch the route made before (the same objects together, on the same stream) is one
    launch into device rows and one driver copy of their roots (``tree_digests(out=, stream=)``);
    objects landing together share a launch. Every object is hashed exactly once per restore, the
    objects and cache stay exact, and an object corrupted on storage after the warm-up is still
    named, with nothing placed."""
    from kmesh_gpu import sha256

    monkeypatch.setattr(sha256, "_VALIDATED", {})  # no digest of this shape checked before
    calls, real = [], sha256._tree_launch  # (offsets, took the short path)

    def counted(data, offsets, *a):
        calls.append((offsets, real(data, offsets, *a)))
        return calls[-1][1]

    monkeypatch.setattr(sha256, "_tree_launch", counted)
    layout, cache, items = cache_and_items(segments, "cuda")
    expect = reference_cache(segments, items, layout, "cuda")
    tier = make_tier(store, "cuda", retain=False)
    shorts = []
    for child in range(3):
        calls.clear()
        cache = layout.allocate("cuda", fill=0x7F)
        result = restore(store, items, cache=cache, layout=layout, tier=tier, verify="device")
        assert result.report.tier_sources == {"read": len(segments)}
        assert result.report.verified == {"device kmesh-tree-sha256 root (this call)": len(segments)}
        assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
        # each object in exactly one launch
        assert sorted(o for offsets, _ in calls for o in offsets) == sorted(result.offsets)
        shorts += [short for _, short in calls]
    assert shorts and not shorts[0]  # the first digest of a shape is prepared (later ones of it are short)
    key = segments[1][0]
    flip_payload_bit(store, key, 100, 0x20)
    cache = layout.allocate("cuda", fill=0x7F)
    before = cache.clone()
    calls.clear()
    with pytest.raises(IntegrityError, match=key) as err:
        restore(store, items, cache=cache, layout=layout, tier=tier, verify="device")
    assert segments[0][0] not in str(err.value) and segments[2][0] not in str(err.value)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert len(sorted(o for offsets, _ in calls for o in offsets)) == len(segments)
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gated", "gate refused"])
def test_placement_behind_the_device_root_check_writes_nothing_for_a_corrupt_object(store, segments, monkeypatch,
                                                                                     case):
    """With device verification a forced read's placement is launched behind a device comparison of
    the roots, before the host compares them (``Verifier.gate``, ``Launch.gate``): a good child is
    placed exactly; with an object corrupted on storage the gate empties the run table on the
    device, so the cache keeps every byte and the error names that object. A gate the driver
    refuses leaves the placement after the host's comparison, with the same results."""
    gates, real = [], kmesh_gpu.Launch.gate
    steps, real_run, real_finish = [], placement_mod.Placement.run, verifier_mod.Verifier.finish

    def gate(self, *a):
        gates.append(False if case == "gate refused" else real(self, *a))
        return gates[-1]

    def run(self):
        steps.append("placement launched")
        real_run(self)

    def finish(self):
        steps.append("roots compared")
        return real_finish(self)

    monkeypatch.setattr(kmesh_gpu.Launch, "gate", gate)
    monkeypatch.setattr(placement_mod.Placement, "run", run)
    monkeypatch.setattr(verifier_mod.Verifier, "finish", finish)
    # blocks of 32 slots filled in order: runs the run kernel takes (the gate's table)
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=16, block_size=32, num_kv_heads=H, head_size=D,
                                dtype=DTYPE)
    items, start = [], 0
    for key, kv, pos in segments:
        T = kv.shape[2]
        items.append(RestoreItem(key, torch.arange(start, start + T, device="cuda"),
                                 torch.arange(T, device="cuda") + 300 + start))
        start = -(-(start + T) // 32) * 32
    expect = reference_cache(segments, items, layout, "cuda")
    tier = make_tier(store, "cuda", retain=False)
    for child in range(2):
        gates.clear()
        steps.clear()
        cache = layout.allocate("cuda", fill=0x7F)
        result = restore(store, items, cache=cache, layout=layout, tier=tier, verify="device")
        assert result.report.placed and torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
        if case == "gated":
            assert gates == [True] and steps == ["placement launched", "roots compared"]
        else:
            assert gates == [False] and steps == ["roots compared", "placement launched"]
    key = segments[1][0]
    flip_payload_bit(store, key, 2000, 0x08)
    gates.clear()
    cache = layout.allocate("cuda", fill=0x7F)
    before = cache.clone()
    with pytest.raises(IntegrityError, match=key) as err:
        restore(store, items, cache=cache, layout=layout, tier=tier, verify="device")
    assert segments[0][0] not in str(err.value) and segments[2][0] not in str(err.value)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert gates == ([True] if case == "gated" else [False])
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("verify", ["device", "none"])
def test_resident_child_starts_in_one_step_and_places_what_the_general_start_places(store, segments, monkeypatch,
                                                                                     device, verify):
    """A child whose objects are all resident, page-locked and trusted is leased and its first copy
    queued in one step (``HostTier.acquire_ready``); a child that is not (its first restore reads)
    takes the general start. Both give the same cache and objects."""
    layout, cache, items = cache_and_items(segments, "cuda")
    tier = make_tier(store, "cuda", retain=True)
    got, real = [], tier.acquire_ready

    def counted(*a, **k):
        out = real(*a, **k)
        got.append(out is not None)
        return out

    monkeypatch.setattr(tier, "acquire_ready", counted)
    cache = layout.allocate(device, fill=0x7F)
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, rope=ROPE, tier=tier,
                           config=RouteConfig(verify=verify)) as restorer:
        restorer.restore(items)
        assert got == [False]  # nothing resident yet: read, then the general path
        expect = reference_cache(segments, items, layout, "cuda")
        for _ in range(2):
            cache.fill_(0x7F)
            got.clear()
            result = restorer.restore(items)
            assert got == [True]
            assert result.report.tier_sources == {"hit": len(segments)} and result.report.placed
            assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
            for (_, kv, _), out in zip(segments, result.kv):
                assert torch.equal(out.cpu(), kv)
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("refused", ["none", "the first copy", "the other copies"])
def test_resident_child_copies_exactly_whichever_driver_copy_is_refused(store, segments, monkeypatch, refused):
    """A trusted resident child queues its first object's copy alone, before anything else, then the
    others in one call; where the driver refuses either, torch copies what is left, in order."""
    layout, cache, items = cache_and_items(segments, "cuda")
    tier = make_tier(store, "cuda", retain=True)
    restore(store, items, cache=cache, layout=layout, tier=tier)
    expect = reference_cache(segments, items, layout, "cuda")
    calls = []
    real_one, real_many = cuda.copy_htod, cuda.copies_htod

    def one(*a):
        calls.append("one")
        return False if refused == "the first copy" else real_one(*a)

    def many(desc, count, stream):
        calls.append(("many", count))
        return 0 if refused == "the other copies" else real_many(desc, count, stream)

    monkeypatch.setattr(cuda, "copy_htod", one)
    monkeypatch.setattr(cuda, "copies_htod", many)
    cache = layout.allocate("cuda", fill=0x7F)
    result = restore(store, items, cache=cache, layout=layout, tier=tier)
    n = len(segments)
    assert calls == ["one", ("many", n - 1 if refused != "the first copy" else n)]
    assert result.report.tier_sources == {"hit": 3} and result.report.placed
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    for (_, kv, _), got in zip(segments, result.kv):
        assert torch.equal(got.cpu(), kv)
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["one call", "declined"])
def test_resident_child_places_exactly_in_one_call_or_in_steps(store, segments, monkeypatch, case):
    """The trusted resident child's placement prepared and launched in one compiled call
    (``PlacementPlan.place``; host slots in increasing order, as a scheduler's block tables give
    them), or declined by that call (slots in random order on the GPU: nothing queued, prepared in
    steps after it): the same cache and objects every time."""
    from kmesh_gpu.plan import PlacementPlan

    if case == "declined":
        layout, cache, items = cache_and_items(segments, "cuda")
    else:  # blocks of 64: runs long enough for the run kernel to pay
        layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=8, block_size=64, num_kv_heads=H, head_size=D,
                                    dtype=DTYPE)
        layout, cache, items = cache_and_items(segments, "cuda", layout=layout, ordered=True)
    tier = make_tier(store, "cuda", retain=True)
    restore(store, items, cache=cache, layout=layout, tier=tier)
    expect = reference_cache(segments, items, layout, "cuda")
    launched, real = [], PlacementPlan._place_in_one_call

    def counted(self, *a, **k):
        launched.append(real(self, *a, **k))
        return launched[-1]

    monkeypatch.setattr(PlacementPlan, "_place_in_one_call", counted)
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, rope=ROPE, tier=tier) as restorer:
        for _ in range(3):
            cache.fill_(0x7F)
            result = restorer.restore(items)
            assert result.report.tier_sources == {"hit": 3} and result.report.placed
            assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
            for (_, kv, _), got in zip(segments, result.kv):
                assert torch.equal(got.cpu(), kv)
    assert launched == {"one call": [True] * 3, "declined": [False] * 3}[case]
    tier.close()


@pytest.mark.gpu
def test_ready_child_takes_the_spare_staging_buffer_of_its_stream_and_size(store, segments):
    """A ready child (every object resident, pinned, trusted) leaves a fresh staging buffer of its
    size for the restorer's next one on the same device and stream, which takes it (its result lives
    in that very buffer) and leaves another. A child on another stream, or of another size, does not
    take it. Every result equals the in-memory path and the objects read; ``close`` frees what is
    kept."""
    layout, cache, items = cache_and_items(segments, "cuda")
    tier = make_tier(store, "cuda", retain=True)
    restorer = InProcessRestorer(store, cache, layout, model_fingerprint=FP, rope=ROPE, tier=tier)
    restorer.restore(items)  # reads: the general start keeps no spare
    assert restorer.spares.kept() == {}
    expect = reference_cache(segments, items, layout, "cuda")
    by_key = {k: kv for k, kv, _ in segments}

    def child(its=items, stream=None):
        cache.fill_(0x7F)
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            result = restorer.restore(its)
        torch.cuda.synchronize()
        assert result.report.tier_sources == {"hit": len(its)} and result.report.placed
        for t, out in zip(its, result.kv):
            assert torch.equal(out.cpu(), by_key[t.key])
        return result

    first = child()
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    (key, spare), = restorer.spares.kept().items()
    assert key == (0, torch.cuda.current_stream().cuda_stream) and spare.numel() == first.buffer.numel()
    second = child()
    assert second.buffer.data_ptr() == spare.data_ptr()  # the spare, not a new allocation
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    (again,) = restorer.spares.kept().values()
    assert again.data_ptr() not in (spare.data_ptr(), first.buffer.data_ptr())
    side = torch.cuda.Stream()
    third = child(stream=side)  # another stream: its own spare, the default stream's kept
    assert third.buffer.data_ptr() != again.data_ptr() and len(restorer.spares.kept()) == 2
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    fewer = items[:2]  # another size: the spare is not used (and no longer kept), a new one is
    fourth = child(fewer)
    assert fourth.buffer.data_ptr() != again.data_ptr()
    assert restorer.spares.kept()[(0, torch.cuda.current_stream().cuda_stream)].numel() == fourth.buffer.numel()
    restorer.close()
    assert restorer.spares.kept() == {}
    tier.close()
