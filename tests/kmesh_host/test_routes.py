"""Storage routes end to end: read, verify where the bytes landed, place; reports say what ran.

The same bodies run on CPU (host side: the "H2D" is a memcpy) and, with ``-m gpu``, on CUDA. The
direct route needs CUDA and KvikIO.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import kmesh_gpu
import kmesh_host.routes as routes_mod
from kmesh_host import uring
from kmesh_host.direct_io import DirectFile
from kmesh_gpu import KVLayout
from kmesh_gpu.errors import BackendError, StorageError
from kmesh_host import (
    FingerprintMismatch,
    HostTier,
    HostTierConfig,
    IntegrityError,
    ModelFingerprint,
    RestoreTarget,
    SegmentStore,
    restore,
    restore_direct,
    restore_host_staging,
)
from tests.helpers.devices import DEVICES
from tests.helpers.io import refuse_o_direct_at_open
from tests.helpers.route_model import DTYPE, FP, ROPE, D, H, L

TOKENS = [37, 64, 100]  # three segments, none a multiple of a 4 KiB page


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
    kw.setdefault("verify", "none")  # the routes verify where the data landed
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("read_threads", 2)
    return HostTier(store, HostTierConfig(pin=torch.device(device).type == "cuda", **kw))


def cache_and_targets(segments, device, *, shifted):
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=32, block_size=16, num_kv_heads=H, head_size=D,
                                dtype=DTYPE)
    cache = layout.allocate(device, fill=0x7F)
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(1))
    targets, start = [], 0
    for key, kv, pos in segments:
        T = kv.shape[2]
        slots = perm[start: start + T].to(device)
        start += T
        new = (torch.arange(T) + 200 + start).to(device) if shifted else None
        targets.append(RestoreTarget(key, slots, new))
    return layout, cache, targets


def reference_cache(segments, targets, layout, device, *, rope):
    """The in-memory path: the same placement from the segments held in RAM."""
    cache = layout.allocate(device, fill=0x7F)
    for (key, kv, pos), t in zip(segments, targets):
        if rope is None:
            kmesh_gpu.place(kv.to(device), cache, layout, t.slots)
        else:
            kmesh_gpu.place(kv.to(device), cache, layout, t.slots, rope=rope, old_positions=pos.to(device),
                            new_positions=t.new_positions)
    return cache


def flip_payload_bit(store, key: str, at: int, mask: int) -> None:
    """Corrupt segment ``key`` on storage: payload byte ``at`` XOR ``mask``."""
    off = store.read_header(key).payload_offset
    with open(store.path(key), "r+b") as f:
        f.seek(off + at)
        byte = f.read(1)
        f.seek(off + at)
        f.write(bytes([byte[0] ^ mask]))


# ------------------------------------------------------------------ host staging
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verify,engine", [("device", "io_uring"), ("device-batched", "auto"), ("host", "threads"),
                                           ("none", "auto"), ("device", "threads")])
def test_host_staging_bytes_are_exact(store, segments, device, verify, engine):
    if engine == "io_uring" and not uring.available()[0]:  # required but absent: a typed refusal
        with pytest.raises(StorageError, match="io_uring"):
            make_tier(store, device, io_engine=engine)
        engine = "auto"  # ... and "auto" reads on threads instead
    tier = make_tier(store, device, io_engine=engine)
    result = restore_host_staging(store, [RestoreTarget(k) for k, _, _ in segments], model_fingerprint=FP,
                                  device=device, tier=tier, verify=verify)
    rep = result.report
    assert rep.route == "host_staging" and rep.objects == 3 and not rep.placed
    assert rep.tier_sources == {"read": 3} and rep.bytes_read == rep.bytes_moved > 0
    assert rep.o_direct is True and "O_DIRECT reads" in rep.mechanism
    want = "io_uring" if engine != "threads" and uring.available()[0] else "threads"
    assert rep.io_engine == tier.io_engine.engine == want
    assert rep.timings["restore_s"] >= rep.timings["read_s"] >= 0
    for (key, kv, pos), got, seg in zip(segments, result.kv, result.segments()):
        assert got.device.type == torch.device(device).type
        assert torch.equal(got.cpu().view(torch.uint8), kv.view(torch.uint8))
        assert torch.equal(seg.positions, pos) and seg.key == key
    if torch.device(device).type == "cuda":
        assert rep.pinned is True and "pinned host RAM" in rep.mechanism and "cudaMemcpyAsync" in rep.mechanism
    tier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shifted", [False, True], ids=["copy", "rope-shift"])
def test_host_staging_places_like_the_in_memory_path(store, segments, device, shifted):
    layout, cache, targets = cache_and_targets(segments, device, shifted=shifted)
    rope = ROPE if shifted else None
    tier = make_tier(store, device)
    result = restore_host_staging(store, targets, model_fingerprint=FP, device=device, tier=tier, cache=cache,
                                  layout=layout, rope=rope)
    assert result.report.placed
    expect = reference_cache(segments, targets, layout, device, rope=rope)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    if not shifted:
        for (key, kv, pos), t in zip(segments, targets):
            assert torch.equal(kmesh_gpu.gather(cache, layout, t.slots).cpu().view(torch.uint8),
                               kv.view(torch.uint8))
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["object", "chunk driver", "chunk torch"])
@pytest.mark.parametrize("verify", ["device", "none"])
def test_read_objects_go_to_the_gpu_exactly_from_the_completion_thread(store, segments, monkeypatch, copies, verify):
    """A forced read's bytes are copied to the GPU from the reader's completion thread: each object in
    one driver copy once its last chunk has landed (``routes.OBJECT_COPIES``), or chunk by chunk as
    they land, one driver copy per chunk of page-locked tier memory (``routes.CHUNK_DRIVER_COPIES``)
    or through torch; a copy the driver refuses goes through torch. The objects and the placed cache
    are exact either way."""
    from kmesh_gpu import _launch
    from kmesh_host import routes

    monkeypatch.setattr(routes, "OBJECT_COPIES", copies == "object")
    monkeypatch.setattr(routes, "CHUNK_DRIVER_COPIES", copies == "chunk driver")
    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=True)
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)
    calls, real = [], _launch.copy_htod

    def counted(*a):
        calls.append((a[0], a[2]))
        return False if len(calls) == 2 else real(*a)  # the second copy is refused: torch makes it

    monkeypatch.setattr(_launch, "copy_htod", counted)
    tier = make_tier(store, "cuda", chunk_bytes=8192)  # several chunks per object
    for _ in range(2):
        tier.evict()
        calls.clear()
        cache = layout.allocate("cuda", fill=0x7F)
        result = restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                                      layout=layout, rope=ROPE, verify=verify)
        assert result.report.tier_sources == {"read": len(segments)} and result.report.placed
        assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
        for (_, kv, _), got in zip(segments, result.kv):
            assert torch.equal(got.cpu(), kv)
        total = sum(h.padded_length for h in result.headers)
        lo, hi = result.buffer.data_ptr(), result.buffer.data_ptr() + result.buffer.numel()
        calls[:] = [n for dst, n in calls if lo <= dst < hi]  # (not the gate's upload of the stored roots)
        if copies == "object":  # one per object (the refused one included: torch copied it)
            assert sorted(calls) == sorted(h.padded_length for h in result.headers)
        elif copies == "chunk driver":  # every chunk of every object, once
            assert len(calls) > len(segments) and sum(calls) == total
        else:
            assert calls == []
    tier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verify", ["device", "device-batched", "host"])
def test_corrupt_payload_is_refused_and_nothing_is_placed(store, segments, device, verify):
    key = segments[1][0]
    flip_payload_bit(store, key, 333, 0x04)
    layout, cache, targets = cache_and_targets(segments, device, shifted=False)
    before = cache.clone()
    tier = make_tier(store, device)
    with pytest.raises(IntegrityError, match=key):
        restore_host_staging(store, targets, model_fingerprint=FP, device=device, tier=tier, cache=cache,
                             layout=layout, verify=verify)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes  # leases released
    tier.close()


def test_retained_source_serves_later_children_from_ram(store, segments):
    tier = make_tier(store, "cpu")
    targets = [RestoreTarget(k) for k, _, _ in segments]
    first = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
    second = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
    assert first.report.tier_sources == {"read": 3}
    assert second.report.tier_sources == {"hit": 3} and second.report.bytes_read == 0
    assert second.report.mechanism.startswith("host tier")
    tier.evict()
    third = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
    assert third.report.tier_sources == {"read": 3}
    assert tier.stats["reads"] == 6
    tier.close()


def test_concurrent_children_share_one_read(store, segments):
    tier = make_tier(store, "cpu", singleflight=True, retain=True)
    targets = [RestoreTarget(k) for k, _, _ in segments]
    results, errors = [], []
    barrier = threading.Barrier(4)

    def child():
        try:
            barrier.wait(timeout=10)
            results.append(restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier))
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=child) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 4
    assert tier.stats["reads"] == 3  # one read per segment for all four children
    for r in results:
        for (key, kv, pos), got in zip(segments, r.kv):
            assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    tier.close()


def test_wrong_fingerprint_and_missing_segment(store, segments):
    tier = make_tier(store, "cpu")
    other = ModelFingerprint("Qwen2ForCausalLM", L, H, D, "bfloat16", {"base": 1e6})
    with pytest.raises(FingerprintMismatch):
        restore_host_staging(store, [RestoreTarget(segments[0][0])], model_fingerprint=other, device="cpu",
                             tier=tier)
    with pytest.raises(kmesh_gpu.SegmentNotFound):
        restore_host_staging(store, [RestoreTarget("ef" * 32)], model_fingerprint=FP, device="cpu", tier=tier)
    assert tier.pool.in_use_bytes == 0 and tier.stats["reads"] == 0
    tier.close()


def test_private_tier_when_none_is_given(store, segments):
    result = restore("host_staging", store, [RestoreTarget(k) for k, _, _ in segments], model_fingerprint=FP,
                     device="cpu", verify="host")
    assert all(torch.equal(g, kv) for (_, kv, _), g in zip(segments, result.kv))


def test_o_direct_refusal_is_reported(store, segments, monkeypatch):
    refuse_o_direct_at_open(monkeypatch)
    tier = make_tier(store, "cpu")
    result = restore_host_staging(store, [RestoreTarget(k) for k, _, _ in segments], model_fingerprint=FP,
                                  device="cpu", tier=tier, verify="host")
    rep = result.report
    assert rep.o_direct is False and "page-cache reads" in rep.mechanism
    assert any("O_DIRECT" in n for n in rep.notes)
    assert all(torch.equal(g, kv) for (_, kv, _), g in zip(segments, result.kv))
    tier.close()


def test_placement_arguments_are_checked(store, segments):
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=False)
    tier = make_tier(store, "cpu")
    with pytest.raises(kmesh_gpu.LayoutError, match="new_positions"):
        restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                             layout=layout, rope=ROPE)
    with pytest.raises(kmesh_gpu.LayoutError, match="slots"):
        restore_host_staging(store, [RestoreTarget(segments[0][0])], model_fingerprint=FP, device="cpu",
                             tier=tier, cache=cache, layout=layout)
    with pytest.raises(kmesh_gpu.LayoutError):
        restore_host_staging(store, [], model_fingerprint=FP, device="cpu", tier=tier)
    assert tier.stats["reads"] == 0 and tier.pool.in_use_bytes == 0  # refused before any read went out
    tier.close()


@pytest.mark.parametrize("reads_first", [True, False])
def test_reads_go_out_before_the_staging_buffer_and_early_landings_wait(store, segments, monkeypatch,
                                                                        reads_first):
    """``routes.READS_FIRST``: a forced read's chunks are queued right after its headers, before the
    staging buffer, streams and verifier are made. A load that completes before those exist (here:
    every load, ``start_loads`` returns only once they all have) is parked and landed when this
    thread arms the landings: copied, hashed once, placed exactly, its lease released. Off: the
    reads go out after those are made, as before."""
    monkeypatch.setattr(routes_mod, "READS_FIRST", reads_first)
    monkeypatch.setattr(routes_mod, "TRACE", [])
    hashed, real_digests = [], kmesh_gpu.tree_digests

    def digests(data, offsets, lengths, **k):
        hashed.extend(offsets)
        return real_digests(data, offsets, lengths, **k)

    monkeypatch.setattr(kmesh_gpu, "tree_digests", digests)
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=True)
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

    monkeypatch.setattr(tier, "start_loads", start_loads)
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    steps = [step for step, _ in routes_mod.TRACE]
    assert result.report.tier_sources == {"read": 3} and result.report.placed
    assert result.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    assert sorted(hashed) == sorted(result.offsets)
    if reads_first:
        assert steps.index("reads queued") < steps.index("staging allocated") < steps.index("landings armed")
    else:
        assert steps.index("staging allocated") < steps.index("reads queued") and "landings armed" not in steps
    expect = reference_cache(segments, targets, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


def test_a_failure_after_the_reads_went_out_releases_every_lease(store, segments, monkeypatch):
    """With ``routes.READS_FIRST`` the reads are in flight while the staging side is made: a failure
    there (the verifier refused, here) fails the restore with that error after every load has
    settled, nothing is placed, every lease is released, and the next restore is exact."""
    monkeypatch.setattr(routes_mod, "READS_FIRST", True)
    real_init = routes_mod._Verifier.__init__
    calls = []

    def refusing(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("verifier refused: injected")
        real_init(self, *a, **k)

    monkeypatch.setattr(routes_mod._Verifier, "__init__", refusing)
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=True)
    before = cache.clone()
    tier = make_tier(store, "cpu", retain=True)
    with pytest.raises(RuntimeError, match="injected"):
        restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                             layout=layout, rope=ROPE)
    assert torch.equal(cache, before)
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == tier.resident_bytes
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    assert result.report.placed
    expect = reference_cache(segments, targets, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


# ------------------------------------------------------------------ direct
def test_direct_needs_cuda(store, segments):
    with pytest.raises(BackendError):
        restore_direct(store, [RestoreTarget(segments[0][0])], model_fingerprint=FP, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("shifted", [False, True], ids=["copy", "rope-shift"])
def test_direct_route_end_to_end(store, segments, shifted):
    pytest.importorskip("kvikio", reason="the direct route needs the kvikio package")
    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=shifted)
    rope = ROPE if shifted else None
    result = restore_direct(store, targets, model_fingerprint=FP, device="cuda", cache=cache, layout=layout,
                            rope=rope)
    rep = result.report
    assert rep.placed and rep.bytes_read == sum(h.padded_length for h in result.headers)
    for (key, kv, pos), got in zip(segments, result.kv):
        assert torch.equal(got.cpu().view(torch.uint8), kv.view(torch.uint8))
    expect = reference_cache(segments, targets, layout, "cuda", rope=rope)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    # The destination is exported as a DMA-BUF where the device supports it (the guide's H200 does).
    dma = rep.facts["dma_buf"]
    assert dma["exported"] is bool(rep.facts["device_dmabuf_supported"]), dma
    if dma["exported"]:
        assert dma["bytes"] >= sum(h.padded_length for h in result.headers)
    # Never call a bounce-buffer copy direct.
    if rep.direct_dma:
        assert rep.facts["gds_available"] is True and rep.facts["kvikio_compat_preferred"] is False
        assert "GPUDirect Storage" in rep.mechanism
    else:
        assert "NOT direct" in rep.mechanism


@pytest.mark.gpu
def test_direct_route_refuses_corrupt_payload(store, segments):
    pytest.importorskip("kvikio", reason="the direct route needs the kvikio package")
    key = segments[2][0]
    off = store.read_header(key).payload_offset
    with open(store.path(key), "r+b") as f:
        f.seek(off + 4096 + 7)
        f.write(b"\x55")
    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=False)
    before = cache.clone()
    with pytest.raises(IntegrityError, match=key):
        restore_direct(store, targets, model_fingerprint=FP, device="cuda", cache=cache, layout=layout)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.gpu
def test_pinned_tier_buffers_are_page_locked(store, segments):
    tier = make_tier(store, "cuda")
    with tier.acquire(segments[0][0], model_fingerprint=FP) as lease:
        assert lease.payload.is_pinned()
        assert lease.payload.data_ptr() % 4096 == 0
    tier.close()


# ------------------------------------------------------------------ overlap: streams, trust, failures
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

    def sync(self):
        pass

    def copy_handle(self):
        return None  # no CUDA stream: the route copies with torch


@pytest.fixture
def recorded(monkeypatch):
    log = []
    monkeypatch.setattr(routes_mod, "_Streams", lambda device: RecordingStreams(device, log))
    real_prepare, real_digests, real_run = routes_mod.prepare_place_many, kmesh_gpu.tree_digests, \
        routes_mod._Placement.run

    def prepare(*a, **k):
        log.append(("prepare",))
        return real_prepare(*a, **k)

    def digests(data, offsets, lengths, **k):
        log.append(("digest", tuple(offsets)))
        return real_digests(data, offsets, lengths, **k)

    def run(self):
        log.append(("place",))
        real_run(self)

    monkeypatch.setattr(routes_mod, "prepare_place_many", prepare)
    monkeypatch.setattr(kmesh_gpu, "tree_digests", digests)
    monkeypatch.setattr(routes_mod._Placement, "run", run)
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
    preparation (with ``READS_FIRST`` they are queued before it); on the GPU machine they take
    milliseconds. Hold each object's landing (its copy and digest) until the placement is being
    prepared, as a real read would, so that the order a test checks does not depend on timing.
    ``groups=False``: the engine reports no groups of landings (``on_batch`` dropped), so the
    restoring thread takes every landing once all loads have settled."""
    preparing = threading.Event()
    recorded_prepare, real_start = routes_mod.prepare_place_many, tier.start_loads

    def prepare(*a, **k):
        preparing.set()
        return recorded_prepare(*a, **k)

    def start_loads(keys, *, on_done, **kw):
        def held(*args):
            preparing.wait(10)
            return on_done(*args)
        if not groups:
            kw["on_batch"] = None
        return real_start(keys, on_done=held, **kw)

    monkeypatch.setattr(routes_mod, "prepare_place_many", prepare)
    monkeypatch.setattr(tier, "start_loads", start_loads)


def test_forced_read_issue_order(store, segments, recorded, monkeypatch):
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=True)
    tier = make_tier(store, "cpu")
    hold_landings_until_prepared(monkeypatch, tier)
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    assert result.report.placed and result.report.tier_sources == {"read": 3}
    check_issue_order(recorded, 3, digests=True)
    expect = reference_cache(segments, targets, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


@pytest.mark.parametrize("batch,hook", [(False, True), (True, True), (True, False)],
                         ids=["each as it lands", "per group the engine reports", "all once loads settled"])
def test_landings_are_copied_fenced_and_hashed_per_group(store, segments, recorded, monkeypatch, batch, hook):
    """Objects that land together are copied, fenced and hashed together (``routes.BATCH_LANDINGS``):
    one copy event per group of landings the engine reports (``on_batch``), and what no group took
    is taken by the restoring thread once every load has settled; each object as it lands
    otherwise. Every object is copied once, every copy is fenced and waited for before its digest
    and the placement, and the cache is exact."""
    monkeypatch.setattr(routes_mod, "BATCH_LANDINGS", batch)
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=True)
    tier = make_tier(store, "cpu", io_engine="threads")
    # not hook: the engine reports no groups, the restoring thread takes every landing at the end
    hold_landings_until_prepared(monkeypatch, tier, groups=hook)
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    assert result.report.placed and result.report.tier_sources == {"read": 3}
    events = [e for e in recorded if e[0] == "event"]
    assert sum(e == ("copy",) for e in recorded) == 3  # one whole-object copy each
    if not batch:
        assert len(events) == 3
    elif not hook:
        assert len(events) == 1
    else:
        assert 1 <= len(events) <= 3
    check_issue_order(recorded, 3, digests=True)
    expect = reference_cache(segments, targets, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_a_refused_digest_launch_fails_the_restore_and_leaks_nothing(store, segments, monkeypatch, engine):
    """A failure while a group of landings is fenced and hashed (on a reading thread, in the engine's
    after-batch hook, or on the restoring thread once loads settle) fails the restore with that
    error: nothing is placed, every lease is released, and the next restore is exact."""
    if engine == "io_uring" and not uring.available()[0]:
        engine = "threads"
    real, calls = routes_mod._Verifier.landed_many, []

    def refusing(self, items, event=None):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise RuntimeError("digest launch refused: injected")
        return real(self, items, event)

    monkeypatch.setattr(routes_mod._Verifier, "landed_many", refusing)
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=True)
    before = cache.clone()
    tier = make_tier(store, "cpu", io_engine=engine, retain=True)
    with pytest.raises(RuntimeError, match="injected"):
        restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                             layout=layout, rope=ROPE)
    assert calls and torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes  # no lease left behind
    monkeypatch.undo()
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    assert result.report.placed
    expect = reference_cache(segments, targets, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


def test_resident_issue_order_copies_once_per_object(store, segments, recorded):
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=True)
    tier = make_tier(store, "cpu", retain=True)
    restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                         layout=layout, rope=ROPE)
    recorded.clear()
    cache = layout.allocate("cpu", fill=0x7F)
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    assert result.report.tier_sources == {"hit": 3}
    assert result.report.bytes_moved == sum(h.padded_length for h in result.headers)
    # one block of whole-object copies (no chunking) and one event fencing them, issued before the
    # placement is prepared so the DMA overlaps the preparation
    assert sum(e[0] == "copy" for e in recorded) == 1 and sum(e[0] == "event" for e in recorded) == 1
    assert recorded.index(("copy",)) < recorded.index(("prepare",))
    check_issue_order(recorded, 3, digests=False)  # verified on entry: trusted, not hashed again
    expect = reference_cache(segments, targets, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


def test_resident_objects_are_trusted_or_reverified(store, segments):
    tier = make_tier(store, "cpu", retain=True)
    targets = [RestoreTarget(k) for k, _, _ in segments]
    first = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
    assert first.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    trusted = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
    [(how, count)] = trusted.report.verified.items()
    assert count == 3 and how.startswith("trusted: device kmesh-tree-sha256 root of a copy of this buffer")
    again = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, trust_verified=False)
    assert again.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    # Bytes damaged in RAM after their check: trusting restores them, re-verification refuses them.
    key = segments[2][0]
    with tier.acquire(key, model_fingerprint=FP) as lease:
        lease.payload[77] ^= 0x10
    with pytest.raises(IntegrityError, match=key):
        restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, trust_verified=False)
    assert key not in tier and segments[0][0] in tier  # the failed object left the tier
    assert tier.pool.in_use_bytes == tier.resident_bytes
    fresh = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
    assert fresh.report.tier_sources == {"hit": 2, "read": 1}
    assert torch.equal(fresh.kv[2].view(torch.uint8), segments[2][1].view(torch.uint8))
    tier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verify", ["device", "device-batched", "host"])
def test_overlapped_verification_names_every_corrupt_object(store, segments, device, verify):
    for key, _, _ in segments[:2]:
        flip_payload_bit(store, key, 4100, 0x01)
    layout, cache, targets = cache_and_targets(segments, device, shifted=True)
    before = cache.clone()
    tier = make_tier(store, device, retain=True)
    with pytest.raises(IntegrityError, match="nothing was placed") as err:
        restore_host_staging(store, targets, model_fingerprint=FP, device=device, tier=tier, cache=cache,
                             layout=layout, rope=ROPE, verify=verify)
    assert segments[0][0] in str(err.value) and segments[1][0] in str(err.value)
    assert segments[2][0] not in str(err.value)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.resident() == [segments[2][0]]  # retention keeps only what checked out
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False], ids=["short digests", "tree_digests"])
@pytest.mark.parametrize("batch", [False, True], ids=["each as it lands", "grouped"])
def test_repeated_forced_reads_check_every_object_on_the_short_digest_path(store, segments, monkeypatch, fast,
                                                                           batch):
    """From the second forced read of a shape on, a digest launch the route made before (the same
    objects together, on the same stream) is one launch into device rows and one driver copy of
    their roots (``routes.FAST_DIGESTS``); objects landing together share a launch
    (``routes.BATCH_LANDINGS``). Every object is hashed exactly once per restore, the objects and
    cache stay exact, and an object corrupted on storage after the warm-up is still named, with
    nothing placed."""
    from kmesh_host import routes

    monkeypatch.setattr(routes, "FAST_DIGESTS", fast)
    monkeypatch.setattr(routes, "BATCH_LANDINGS", batch)
    monkeypatch.setattr(routes._sha256, "_VALIDATED", {})  # no digest of this shape checked before
    calls, real = [], routes._sha256._tree_launch  # (offsets, took the short path)

    def counted(data, offsets, *a):
        calls.append((offsets, real(data, offsets, *a)))
        return calls[-1][1]

    monkeypatch.setattr(routes._sha256, "_tree_launch", counted)
    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=True)
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)
    tier = make_tier(store, "cuda", retain=False)
    for child in range(3):
        calls.clear()
        cache = layout.allocate("cuda", fill=0x7F)
        result = restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                                      layout=layout, rope=ROPE, verify="device")
        assert result.report.tier_sources == {"read": len(segments)}
        assert result.report.verified == {"device kmesh-tree-sha256 root (this call)": len(segments)}
        assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
        if fast:  # each object in exactly one launch
            assert sorted(o for offsets, _ in calls for o in offsets) == sorted(result.offsets)
            if not batch:  # the first restore of this shape prepares each object's digest on its stream
                assert [short for _, short in calls] == ([False] * len(segments) if child == 0 else
                                                         [True] * len(segments))
        else:
            assert calls == []
    key = segments[1][0]
    flip_payload_bit(store, key, 100, 0x20)
    cache = layout.allocate("cuda", fill=0x7F)
    before = cache.clone()
    calls.clear()
    with pytest.raises(IntegrityError, match=key) as err:
        restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                             layout=layout, rope=ROPE, verify="device")
    assert segments[0][0] not in str(err.value) and segments[2][0] not in str(err.value)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    if fast:
        assert len(sorted(o for offsets, _ in calls for o in offsets)) == len(segments)
        if not batch:
            assert [short for _, short in calls] == [True] * len(segments)
    else:
        assert calls == []
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gated", "gate refused", "off"])
def test_placement_behind_the_device_root_check_writes_nothing_for_a_corrupt_object(store, segments, monkeypatch,
                                                                                     case):
    """With device verification a forced read's placement is launched behind a device comparison of
    the roots, before the host compares them (``routes.GATED_PLACEMENT``, ``_Launch.gate``): a good
    child is placed exactly; with an object corrupted on storage the gate empties the run table on
    the device, so the cache keeps every byte and the error names that object. A gate the driver
    refuses (or switched off) leaves the placement after the host's comparison, with the same results."""
    from kmesh_gpu.place import _Launch
    from kmesh_host import routes

    monkeypatch.setattr(routes, "GATED_PLACEMENT", case != "off")
    gates, real = [], _Launch.gate

    def gate(self, *a):
        gates.append(False if case == "gate refused" else real(self, *a))
        return gates[-1]

    monkeypatch.setattr(_Launch, "gate", gate)
    # blocks of 32 slots filled in order: runs the run kernel takes (the gate's table)
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=16, block_size=32, num_kv_heads=H, head_size=D,
                                dtype=DTYPE)
    targets, start = [], 0
    for key, kv, pos in segments:
        T = kv.shape[2]
        targets.append(RestoreTarget(key, torch.arange(start, start + T, device="cuda"),
                                     torch.arange(T, device="cuda") + 300 + start))
        start = -(-(start + T) // 32) * 32
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)
    tier = make_tier(store, "cuda", retain=False)
    routes.TRACE = trace = []
    try:
        for child in range(2):
            gates.clear()
            trace.clear()
            cache = layout.allocate("cuda", fill=0x7F)
            result = restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                                          layout=layout, rope=ROPE, verify="device")
            assert result.report.placed and torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
            steps = [step for step, _ in trace]
            if case == "gated":
                assert gates == [True]
                assert steps.index("placement launched behind the gate") < steps.index("roots compared")
            else:
                assert gates == ([False] if case == "gate refused" else [])
                assert steps.index("roots compared") < steps.index("placement launched")
        key = segments[1][0]
        flip_payload_bit(store, key, 2000, 0x08)
        gates.clear()
        cache = layout.allocate("cuda", fill=0x7F)
        before = cache.clone()
        with pytest.raises(IntegrityError, match=key) as err:
            restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                                 layout=layout, rope=ROPE, verify="device")
        assert segments[0][0] not in str(err.value) and segments[2][0] not in str(err.value)
        torch.cuda.synchronize()
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
        assert gates == ([True] if case == "gated" else [False] if case == "gate refused" else [])
        assert tier.pool.in_use_bytes == tier.resident_bytes
    finally:
        routes.TRACE = None
    tier.close()


def test_verify_none_trusts_nothing_and_marks_nothing(store, segments):
    tier = make_tier(store, "cpu", retain=True)
    targets = [RestoreTarget(k) for k, _, _ in segments]
    first = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, verify="none")
    assert first.report.verified == {"not verified": 3}
    second = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
    assert second.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    tier.close()


# ------------------------------------------------------------------ pipelined reads
@pytest.mark.parametrize("device", DEVICES)
def test_pipelined_reads_land_bit_exact_with_resident_objects_mixed_in(store, segments, device):
    """One object resident, the others read in 4 KiB chunks interleaved across objects on three
    threads: every byte equals the host copy, and the cache equals the in-memory path."""
    layout, cache, targets = cache_and_targets(segments, device, shifted=True)
    tier = make_tier(store, device, retain=True, read_threads=3, chunk_bytes=4096)
    with tier.acquire(segments[1][0], model_fingerprint=FP):
        pass  # resident from now on
    result = restore_host_staging(store, targets, model_fingerprint=FP, device=device, tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    assert result.report.tier_sources == {"hit": 1, "read": 2}
    for i, (key, kv, pos) in enumerate(segments):
        with tier.acquire(key, model_fingerprint=FP) as lease:
            host = lease.payload.numpy().tobytes()
        assert result.buffer[result.offsets[i]: result.offsets[i] + len(host)].cpu().numpy().tobytes() == host
    expect = reference_cache(segments, targets, layout, device, rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_read_error_mid_pipeline_places_nothing_and_leaks_nothing(store, segments, monkeypatch, engine):
    """One object's second chunk fails while the other objects' reads go on: the error reaches the
    caller, the cache is untouched, every lease is released and the good objects stay resident.
    io_uring: the kernel's read fails (a bad descriptor), the synchronous retry fails too."""
    if engine == "io_uring" and not uring.available()[0]:
        engine = "threads"  # the io_uring engine is refused there (test_host_staging_bytes_are_exact)
    bad_path = store.local_path(segments[2][0])
    real_read = DirectFile.pread_into

    def failing(self, view, offset):
        if self.path == bad_path and offset >= 8192:
            raise StorageError(f"read of {self.path} at {offset} failed: injected")
        return real_read(self, view, offset)

    monkeypatch.setattr(DirectFile, "pread_into", failing)
    if engine == "io_uring":
        from kmesh_host.direct_io import ReadEngine

        real_chunk = ReadEngine._read

        class BadFile:  # the kernel gets a closed descriptor; the retry reads through `failing`
            def __init__(self, f):
                self.path, self.size, self._f = f.path, f.size, f

            def fileno(self):
                return -1

            def pread_into(self, view, offset):
                return failing(self._f, view, offset)

        def chunk(self, file, buffer, base, a, b, file_offset, done, after=None):
            if file.path == bad_path and file_offset >= 8192:
                file = BadFile(file)
            return real_chunk(self, file, buffer, base, a, b, file_offset, done, after)

        monkeypatch.setattr(ReadEngine, "_read", chunk)
    layout, cache, targets = cache_and_targets(segments, "cpu", shifted=True)
    before = cache.clone()
    tier = make_tier(store, "cpu", retain=True, read_threads=2, chunk_bytes=4096, io_engine=engine)
    with pytest.raises(StorageError, match="injected"):
        restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                             layout=layout, rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.in_flight() == 0 and segments[2][0] not in tier
    assert tier.pool.in_use_bytes == tier.resident_bytes  # no lease left behind
    monkeypatch.undo()
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    assert result.report.placed and result.report.tier_sources.get("read") == 1
    tier.close()


def test_every_restore_settles_its_verifier_whatever_happened(store, segments, monkeypatch):
    """The digests' root downloads and the gate's upload are driver copies torch's pinned allocator
    does not track: before the pinned table can go, the route waits for them (``_Verifier.settle``)
    after a success and after a failure alike; settle waits for each root event and the gate's, and
    a device error there does not replace the restore's own."""
    from kmesh_host import routes

    settled = []
    real = routes._Verifier.settle
    monkeypatch.setattr(routes._Verifier, "settle", lambda self: settled.append(self.mode) or real(self))
    targets = [RestoreTarget(k) for k, _, _ in segments]
    tier = make_tier(store, "cpu", retain=False)
    restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, verify="device")
    assert settled == ["device"]
    flip_payload_bit(store, segments[0][0], 10, 0x01)
    with pytest.raises(IntegrityError, match=segments[0][0]):
        restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier, verify="device")
    assert settled == ["device", "device"]
    tier.close()

    class Event:
        def __init__(self, fail=False):
            self.fail, self.waited = fail, 0

        def synchronize(self):
            self.waited += 1
            if self.fail:
                raise RuntimeError("CUDA error: injected")

    v = routes._Verifier("device", torch.zeros(8, dtype=torch.uint8), "auto", None, trust_verified=True)
    real(v)  # nothing queued: nothing to wait for
    v._root_events = [Event(), Event(fail=True), Event()]
    v._gate_done = Event(fail=True)
    real(v)
    assert [e.waited for e in v._root_events] == [1, 1, 1] and v._gate_done.waited == 1


def test_forced_reads_reuse_the_pooled_buffers(store, segments):
    tier = make_tier(store, "cpu", retain=True)
    targets = [RestoreTarget(k) for k, _, _ in segments]
    for _child in range(4):
        tier.evict()
        result = restore_host_staging(store, targets, model_fingerprint=FP, device="cpu", tier=tier)
        assert result.report.tier_sources == {"read": 3}
    assert tier.stats["reads"] == 12 and tier.pool.allocations == 3  # never allocated (or pinned) again
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("trust", [True, False])
def test_resident_child_runs_on_the_callers_stream(store, segments, trust):
    """Every object resident: trusted, the copies and placement follow one another on the caller's
    current stream (here a side stream); re-verified, on the route's streams. The cache equals the
    in-memory path either way, and a resident payload corrupted in RAM is caught when re-verified,
    with nothing placed."""
    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=True)
    tier = make_tier(store, "cuda", retain=True)
    restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                         layout=layout, rope=ROPE)
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)
    side = torch.cuda.Stream()
    for _ in range(3):
        cache = layout.allocate("cuda", fill=0x7F)
        with torch.cuda.stream(side):
            result = restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier,
                                          cache=cache, layout=layout, rope=ROPE, trust_verified=trust)
        assert result.report.tier_sources == {"hit": 3} and result.report.placed
        assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
        counts = result.report.verified
        if trust:  # checked on the device when first read (the first restore above)
            assert len(counts) == 1 and next(iter(counts)).startswith("trusted: ") and sum(counts.values()) == 3
        else:
            assert counts == {"device kmesh-tree-sha256 root (this call)": 3}
    lease = tier.acquire_resident(segments[1][0], model_fingerprint=FP)
    lease.payload[100] ^= 0x10  # a bit flips in RAM
    lease.release()
    cache = layout.allocate("cuda", fill=0x7F)
    before = cache.clone()
    with pytest.raises(IntegrityError, match=segments[1][0]):
        restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                             layout=layout, rope=ROPE, trust_verified=False)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("verify", ["device", "none"])
def test_resident_child_starts_in_one_step_and_places_what_the_general_start_places(store, segments, monkeypatch,
                                                                                     device, verify):
    """A child whose objects are all resident, page-locked and trusted is leased and its first copy
    queued in one step (``HostTier.acquire_ready``); a child that is not (its first restore reads)
    takes the general start. Both starts, and ``routes.READY`` off, give the same cache and objects."""
    from kmesh_host import routes

    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=True)
    tier = make_tier(store, "cuda", retain=True)
    got, real = [], tier.acquire_ready

    def counted(*a, **k):
        out = real(*a, **k)
        got.append(out is not None)
        return out

    monkeypatch.setattr(tier, "acquire_ready", counted)
    restore_host_staging(store, targets, model_fingerprint=FP, device=device, tier=tier, cache=cache,
                         layout=layout, rope=ROPE, verify=verify)
    assert got == [False]  # nothing resident yet: read, then the general path
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)
    for ready in (True, False, True):
        monkeypatch.setattr(routes, "READY", ready)
        cache = layout.allocate("cuda", fill=0x7F)
        got.clear()
        result = restore_host_staging(store, targets, model_fingerprint=FP, device=device, tier=tier, cache=cache,
                                      layout=layout, rope=ROPE, verify=verify)
        assert got == ([True] if ready else [])
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
    from kmesh_gpu import _launch

    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=True)
    tier = make_tier(store, "cuda", retain=True)
    restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                         layout=layout, rope=ROPE)
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)
    calls = []
    real_one, real_many = _launch.copy_htod, _launch.copies_htod

    def one(*a):
        calls.append("one")
        return False if refused == "the first copy" else real_one(*a)

    def many(desc, count, stream):
        calls.append(("many", count))
        return 0 if refused == "the other copies" else real_many(desc, count, stream)

    monkeypatch.setattr(_launch, "copy_htod", one)
    monkeypatch.setattr(_launch, "copies_htod", many)
    cache = layout.allocate("cuda", fill=0x7F)
    result = restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                                  layout=layout, rope=ROPE)
    n = len(segments)
    assert calls == ["one", ("many", n - 1 if refused != "the first copy" else n)]
    assert result.report.tier_sources == {"hit": 3} and result.report.placed
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    for (_, kv, _), got in zip(segments, result.kv):
        assert torch.equal(got.cpu(), kv)
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["one call", "declined", "in steps"])
def test_resident_child_places_exactly_in_one_call_or_in_steps(store, segments, monkeypatch, case):
    """The trusted resident child's placement prepared and launched in one compiled call (host
    slots in increasing order, as a scheduler's block tables give them), declined by that call
    (slots in random order on the GPU: nothing queued, prepared in steps after it), or in steps
    from the start: the same cache and objects every time."""
    from kmesh_gpu import _place_driver
    from kmesh_host import routes

    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=True)
    if case != "declined":  # blocks of 64: runs long enough for the run kernel to pay
        layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=8, block_size=64, num_kv_heads=H, head_size=D,
                                    dtype=DTYPE)
        cache = layout.allocate("cuda", fill=0x7F)
        start, ordered = 0, []
        for t in targets:
            T = t.slots.numel()
            ordered.append(RestoreTarget(t.key, torch.arange(start + 3, start + 3 + T), t.new_positions.cpu()))
            start += T + 7
        targets = ordered
    tier = make_tier(store, "cuda", retain=True)
    restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                         layout=layout, rope=ROPE)
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)
    monkeypatch.setattr(routes, "LANE", case != "in steps")
    launched, real = [], _place_driver.place_now

    def counted(*a, **k):
        launched.append(real(*a, **k))
        return launched[-1]

    monkeypatch.setattr(_place_driver, "place_now", counted)
    for _ in range(3):
        cache = layout.allocate("cuda", fill=0x7F)
        result = restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                                      layout=layout, rope=ROPE)
        assert result.report.tier_sources == {"hit": 3} and result.report.placed
        assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
        for (_, kv, _), got in zip(segments, result.kv):
            assert torch.equal(got.cpu(), kv)
    assert launched == {"one call": [True] * 3, "declined": [False] * 3, "in steps": []}[case]
    tier.close()


@pytest.mark.gpu
def test_ready_child_takes_the_spare_staging_buffer_of_its_stream_and_size(store, segments, monkeypatch):
    """``routes.SPARE_STAGING``: a ready child (every object resident, pinned, trusted) leaves a fresh
    staging buffer of its size for the next one on the same device and stream, which takes it (its
    result lives in that very buffer) and leaves another. A child on another stream, or of another
    size, does not take it. Every result equals the in-memory path and the objects read; with the
    switch off nothing is kept; ``drop_staging_spares`` frees what is."""
    from kmesh_host import routes

    monkeypatch.setattr(routes, "_spares", {})
    layout, cache, targets = cache_and_targets(segments, "cuda", shifted=True)
    tier = make_tier(store, "cuda", retain=True)
    restore_host_staging(store, targets, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                         layout=layout, rope=ROPE)  # reads: the general start keeps no spare
    assert routes._spares == {}
    expect = reference_cache(segments, targets, layout, "cuda", rope=ROPE)

    def child(tgts=targets, stream=None):
        cache = layout.allocate("cuda", fill=0x7F)
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            result = restore_host_staging(store, tgts, model_fingerprint=FP, device="cuda", tier=tier, cache=cache,
                                          layout=layout, rope=ROPE)
        assert result.report.tier_sources == {"hit": len(tgts)} and result.report.placed
        for (_, kv, _), t, out in zip(segments, tgts, result.kv):
            assert torch.equal(out.cpu(), dict((k, kv) for k, kv, _ in segments)[t.key])
        return cache, result

    cache, first = child()
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    (key, spare), = routes._spares.items()
    assert key == (0, torch.cuda.current_stream().cuda_stream) and spare.numel() == first.buffer.numel()
    cache, second = child()
    assert second.buffer.data_ptr() == spare.data_ptr()  # the spare, not a new allocation
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    (again,) = routes._spares.values()
    assert again.data_ptr() not in (spare.data_ptr(), first.buffer.data_ptr())
    side = torch.cuda.Stream()
    cache, third = child(stream=side)  # another stream: its own spare, the default stream's kept
    assert third.buffer.data_ptr() != again.data_ptr() and len(routes._spares) == 2
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    fewer = targets[:2]  # another size: the spare is not used (and no longer kept), a new one is
    _, fourth = child(fewer)
    assert fourth.buffer.data_ptr() != again.data_ptr()
    assert routes._spares[(0, torch.cuda.current_stream().cuda_stream)].numel() == fourth.buffer.numel()
    assert routes.drop_staging_spares() == 2 and routes._spares == {}
    monkeypatch.setattr(routes, "SPARE_STAGING", False)
    cache, _ = child()
    assert routes._spares == {} and torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


def test_spare_staging_buffers_are_taken_once_per_stream_and_size_and_bounded(monkeypatch):
    """The spare-staging bookkeeping (``SPARE_STAGING``; the buffers are made on the GPU there, on the
    CPU here): a spare goes to the first taker of its device, stream and size and to no one else; a
    taker of another size frees it; at most ``_MAX_SPARES`` are kept; a stocked slot is not replaced."""
    from kmesh_host import routes

    monkeypatch.setattr(routes, "_spares", {})
    cpu = torch.device("cpu")
    routes._stock_spare(cpu, 0, 11, 4096)
    kept = routes._spares[(0, 11)]
    routes._stock_spare(cpu, 0, 11, 8192)  # already stocked: kept as it is
    assert routes._spares[(0, 11)] is kept and kept.numel() == 4096 and kept.dtype == torch.uint8
    assert routes._take_spare(0, 12, 4096) is None and routes._take_spare(1, 11, 4096) is None  # other stream/device
    assert routes._take_spare(0, 11, 4096) is kept
    assert routes._take_spare(0, 11, 4096) is None  # taken once
    routes._stock_spare(cpu, 0, 11, 4096)
    assert routes._take_spare(0, 11, 8192) is None and (0, 11) not in routes._spares  # another size frees it
    for s in range(routes._MAX_SPARES + 3):
        routes._stock_spare(cpu, 0, s, 4096)
    assert len(routes._spares) == routes._MAX_SPARES
    assert routes.drop_staging_spares() == routes._MAX_SPARES and routes._spares == {}
