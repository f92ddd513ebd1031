"""The host-staging route end to end through :class:`~kmesh_host.InProcessRestorer`: read, verify
where the bytes landed, place; reports say what ran. (Which internal path ran: test_host_staging_paths.py.)

The same bodies run on CPU (host side: the "H2D" is a memcpy) and, with ``-m gpu``, on CUDA.
"""

from __future__ import annotations

import threading

import pytest
import torch

import kmesh_gpu
from kmesh_gpu import KVLayout
from kmesh_gpu.errors import StorageError
from kmesh_host import (
    FingerprintMismatch,
    HostTier,
    HostTierConfig,
    InProcessRestorer,
    IntegrityError,
    LayoutError,
    ModelFingerprint,
    RestoreItem,
    RouteConfig,
    SegmentStore,
    uring,
)
from kmesh_host.direct_io import DirectFile
from kmesh_host.restore import verifier as verifier_mod
from tests.helpers.devices import DEVICES
from tests.helpers.io import refuse_o_direct_at_open
from tests.helpers.restore import cache_for, fetch, restore_once
from tests.helpers.route_model import DTYPE, FP, ROPE, D, H, L

TOKENS = [37, 64, 100]  # three segments, none a multiple of a 4 KiB page


def kv_for(i, T):
    return torch.randn((2, L, T, H, D), generator=torch.Generator().manual_seed(i)).to(DTYPE)


@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "store")


def _put_segments(store):
    out = []
    for i, T in enumerate(TOKENS):
        kv = kv_for(i, T)
        pos = torch.arange(T) + 5 * i
        out.append((store.put(kv, torch.arange(T), pos, model_fingerprint=FP), kv, pos))
    return out


@pytest.fixture
def segments(store):
    return _put_segments(store)


@pytest.fixture
def direct_store(direct_dir):
    """``store`` and its ``segments`` where the filesystem takes O_DIRECT reads (the tests that say they bypass
    the page cache)."""
    store = SegmentStore(direct_dir / "store")
    return store, _put_segments(store)


def make_tier(store, device, **kw):
    kw.setdefault("verify", "none")  # the routes verify where the data landed
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("read_threads", 2)
    return HostTier(store, HostTierConfig(pin=torch.device(device).type == "cuda", **kw))


def cache_and_items(segments, device, *, shifted):
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=32, block_size=16, num_kv_heads=H, head_size=D,
                                dtype=DTYPE)
    cache = layout.allocate(device, fill=0x7F)
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(1))
    items, start = [], 0
    for key, kv, pos in segments:
        T = kv.shape[2]
        slots = perm[start: start + T].to(device)
        start += T
        new = (torch.arange(T) + 200 + start).to(device) if shifted else None
        items.append(RestoreItem(key, slots, new))
    return layout, cache, items


def reference_cache(segments, items, layout, device, *, rope):
    """The in-memory path: the same placement from the segments held in RAM."""
    cache = layout.allocate(device, fill=0x7F)
    for (key, kv, pos), t in zip(segments, items):
        if rope is None or t.new_positions is None:
            kmesh_gpu.place(kv.to(device), cache, layout, t.slots)
        else:
            kmesh_gpu.place(kv.to(device), cache, layout, t.slots, rope=rope, old_positions=pos.to(device),
                            new_positions=t.new_positions)
    return cache


def restore(store, items, *, cache, layout, rope=None, tier=None, **config):
    return restore_once(store, items, cache=cache, layout=layout, model_fingerprint=FP, rope=rope, tier=tier, **config)


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
def test_host_staging_bytes_are_exact(direct_store, device, verify, engine):
    store, segments = direct_store
    if engine == "io_uring" and not uring.available()[0]:  # required but absent: a typed refusal
        with pytest.raises(StorageError, match="io_uring"):
            make_tier(store, device, io_engine=engine)
        engine = "auto"  # ... and "auto" reads on threads instead
    tier = make_tier(store, device, io_engine=engine)
    layout, cache, items = cache_for(store, [k for k, _, _ in segments], device)
    result = restore(store, items, cache=cache, layout=layout, tier=tier, verify=verify)
    rep = result.report
    assert rep.path == "in_process" and rep.route == "host_staging" and rep.objects == 3 and rep.placed
    assert rep.tier_sources == {"read": 3} and rep.bytes_read == rep.bytes_moved > 0
    assert rep.o_direct is True and "O_DIRECT reads" in rep.mechanism
    want = "io_uring" if engine != "threads" and uring.available()[0] else "threads"
    assert rep.io_engine == tier.io_engine.engine == want
    assert rep.timings["restore_s"] >= rep.timings["read_s"] >= 0
    for (key, kv, pos), got, seg, it in zip(segments, result.kv, result.segments(), items):
        assert got.device.type == torch.device(device).type
        assert torch.equal(got.cpu().view(torch.uint8), kv.view(torch.uint8))
        assert torch.equal(seg.positions, pos) and seg.key == key
        assert torch.equal(kmesh_gpu.gather(cache, layout, it.slots).cpu().view(torch.uint8), kv.view(torch.uint8))
    if torch.device(device).type == "cuda":
        assert rep.pinned is True and "pinned host RAM" in rep.mechanism and "cudaMemcpyAsync" in rep.mechanism
    tier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shifted", [False, True], ids=["copy", "rope-shift"])
def test_host_staging_places_like_the_in_memory_path(store, segments, device, shifted):
    layout, cache, items = cache_and_items(segments, device, shifted=shifted)
    rope = ROPE if shifted else None
    tier = make_tier(store, device)
    result = restore(store, items, cache=cache, layout=layout, rope=rope, tier=tier)
    assert result.report.placed
    expect = reference_cache(segments, items, layout, device, rope=rope)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    if not shifted:
        for (key, kv, pos), t in zip(segments, items):
            assert torch.equal(kmesh_gpu.gather(cache, layout, t.slots).cpu().view(torch.uint8),
                               kv.view(torch.uint8))
    tier.close()


@pytest.mark.parametrize("device", DEVICES)
def test_items_with_and_without_new_positions_mix_in_one_restore(store, segments, device):
    """With a RoPE spec, an item with ``new_positions`` has K shifted and one without is placed as
    stored, in the same restore (two launches); a slot named by both kinds is refused with nothing
    placed."""
    layout, cache, items = cache_and_items(segments, device, shifted=True)
    items[1] = RestoreItem(items[1].key, items[1].slots)
    tier = make_tier(store, device, retain=True)
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, rope=ROPE, tier=tier) as restorer:
        for _ in range(2):  # read, then resident
            cache.fill_(0x7F)
            result = restorer.restore(items)
            assert result.report.placed
            assert torch.equal(cache.view(torch.uint8),
                               reference_cache(segments, items, layout, device, rope=ROPE).view(torch.uint8))
        clash = RestoreItem(items[1].key, torch.cat([items[0].slots[:1], items[1].slots[1:]]))
        before = cache.clone()
        with pytest.raises(LayoutError, match="same destination slot"):
            restorer.restore([items[0], clash, items[2]])
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verify", ["device", "device-batched", "host"])
def test_corrupt_payload_is_refused_and_nothing_is_placed(store, segments, device, verify):
    key = segments[1][0]
    flip_payload_bit(store, key, 333, 0x04)
    layout, cache, items = cache_and_items(segments, device, shifted=False)
    before = cache.clone()
    tier = make_tier(store, device)
    with pytest.raises(IntegrityError, match=key):
        restore(store, items, cache=cache, layout=layout, tier=tier, verify=verify)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes  # leases released
    tier.close()


def test_retained_source_serves_later_children_from_ram(store, segments):
    tier = make_tier(store, "cpu")
    layout, cache, items = cache_for(store, [k for k, _, _ in segments])
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, tier=tier) as restorer:
        first = restorer.restore(items)
        second = restorer.restore(items)
        assert first.report.tier_sources == {"read": 3}
        assert second.report.tier_sources == {"hit": 3} and second.report.bytes_read == 0
        assert second.report.mechanism.startswith("host tier")
        tier.evict()
        third = restorer.restore(items)
    assert third.report.tier_sources == {"read": 3}
    assert tier.stats["reads"] == 6
    tier.close()


def test_concurrent_children_share_one_read(store, segments):
    tier = make_tier(store, "cpu", singleflight=True, retain=True)
    keys = [k for k, _, _ in segments]
    results, errors = [], []
    barrier = threading.Barrier(4)

    def child():
        try:
            layout, cache, items = cache_for(store, keys)
            barrier.wait(timeout=60)
            results.append(restore(store, items, cache=cache, layout=layout, tier=tier))
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
    layout, cache, items = cache_for(store, [segments[0][0]])
    with pytest.raises(FingerprintMismatch):
        restore_once(store, items, cache=cache, layout=layout, model_fingerprint=other, tier=tier)
    with pytest.raises(kmesh_gpu.SegmentNotFound):
        restore(store, [RestoreItem("ef" * 32, items[0].slots)], cache=cache, layout=layout, tier=tier)
    assert tier.pool.in_use_bytes == 0 and tier.stats["reads"] == 0
    tier.close()


def test_private_tier_when_none_is_given(store, segments):
    result = fetch(store, [k for k, _, _ in segments], model_fingerprint=FP, verify="host")
    assert all(torch.equal(g, kv) for (_, kv, _), g in zip(segments, result.kv))


def test_o_direct_refusal_is_reported(store, segments, monkeypatch):
    refuse_o_direct_at_open(monkeypatch)
    tier = make_tier(store, "cpu")
    result = fetch(store, [k for k, _, _ in segments], model_fingerprint=FP, tier=tier, verify="host")
    rep = result.report
    assert rep.o_direct is False and "page-cache reads" in rep.mechanism
    assert any("O_DIRECT" in n for n in rep.notes)
    assert all(torch.equal(g, kv) for (_, kv, _), g in zip(segments, result.kv))
    tier.close()


def test_placement_arguments_are_checked_before_any_read(store, segments):
    """Slots that do not fit their segment are refused before any read goes out (a placement that
    cannot work costs no read); so are an empty item list and an item that is not one."""
    layout, cache, items = cache_and_items(segments, "cpu", shifted=False)
    tier = make_tier(store, "cpu")
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, rope=ROPE, tier=tier) as restorer:
        short = RestoreItem(items[1].key, items[1].slots[:-1])
        with pytest.raises(LayoutError, match=r"slots\[1\]"):
            restorer.restore([items[0], short, items[2]])
        with pytest.raises(LayoutError, match="slots"):
            RestoreItem(segments[0][0], None)
        with pytest.raises(LayoutError):
            restorer.restore([])
        with pytest.raises(LayoutError, match=r"items\[1\]"):
            restorer.restore([items[0], segments[1][0]])
    assert tier.stats["reads"] == 0 and tier.pool.in_use_bytes == 0  # refused before any read went out
    tier.close()


def test_a_failure_after_the_reads_went_out_releases_every_lease(store, segments, monkeypatch):
    """The reads are in flight while the staging side is made: a failure there (the verifier
    refused, here) fails the restore with that error after every load has settled, nothing is
    placed, every lease is released, and the next restore is exact."""
    real_init = verifier_mod.Verifier.__init__
    calls = []

    def refusing(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("verifier refused: injected")
        real_init(self, *a, **k)

    monkeypatch.setattr(verifier_mod.Verifier, "__init__", refusing)
    layout, cache, items = cache_and_items(segments, "cpu", shifted=True)
    before = cache.clone()
    tier = make_tier(store, "cpu", retain=True)
    with pytest.raises(RuntimeError, match="injected"):
        restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    assert torch.equal(cache, before)
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == tier.resident_bytes
    result = restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    assert result.report.placed
    expect = reference_cache(segments, items, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


@pytest.mark.gpu
def test_pinned_tier_buffers_are_page_locked(store, segments):
    tier = make_tier(store, "cuda")
    with tier.acquire(segments[0][0], model_fingerprint=FP) as lease:
        assert lease.payload.is_pinned()
        assert lease.payload.data_ptr() % 4096 == 0
    tier.close()


# ------------------------------------------------------------------ trust, failures
@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_a_refused_digest_launch_fails_the_restore_and_leaks_nothing(store, segments, monkeypatch, engine):
    """A failure while a group of landings is fenced and hashed (on a reading thread, in the engine's
    after-batch hook, or on the restoring thread once loads settle) fails the restore with that
    error: nothing is placed, every lease is released, and the next restore is exact."""
    if engine == "io_uring" and not uring.available()[0]:
        engine = "threads"
    real, calls = verifier_mod.Verifier.landed_many, []

    def refusing(self, items, event=None):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise RuntimeError("digest launch refused: injected")
        return real(self, items, event)

    monkeypatch.setattr(verifier_mod.Verifier, "landed_many", refusing)
    layout, cache, items = cache_and_items(segments, "cpu", shifted=True)
    before = cache.clone()
    tier = make_tier(store, "cpu", io_engine=engine, retain=True)
    with pytest.raises(RuntimeError, match="injected"):
        restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    assert calls and torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.pool.in_use_bytes == tier.resident_bytes  # no lease left behind
    monkeypatch.undo()
    result = restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    assert result.report.placed
    expect = reference_cache(segments, items, layout, "cpu", rope=ROPE)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    tier.close()


def test_resident_objects_are_trusted_or_reverified(store, segments):
    tier = make_tier(store, "cpu", retain=True)
    layout, cache, items = cache_for(store, [k for k, _, _ in segments])
    first = restore(store, items, cache=cache, layout=layout, tier=tier)
    assert first.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    trusted = restore(store, items, cache=cache, layout=layout, tier=tier)
    [(how, count)] = trusted.report.verified.items()
    assert count == 3 and how.startswith("trusted: device kmesh-tree-sha256 root of a copy of this buffer")
    again = restore(store, items, cache=cache, layout=layout, tier=tier, trust_verified=False)
    assert again.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    # Bytes damaged in RAM after their check: trusting restores them, re-verification refuses them.
    key = segments[2][0]
    with tier.acquire(key, model_fingerprint=FP) as lease:
        lease.payload[77] ^= 0x10
    with pytest.raises(IntegrityError, match=key):
        restore(store, items, cache=cache, layout=layout, tier=tier, trust_verified=False)
    assert key not in tier and segments[0][0] in tier  # the failed object left the tier
    assert tier.pool.in_use_bytes == tier.resident_bytes
    fresh = restore(store, items, cache=cache, layout=layout, tier=tier)
    assert fresh.report.tier_sources == {"hit": 2, "read": 1}
    assert torch.equal(fresh.kv[2].view(torch.uint8), segments[2][1].view(torch.uint8))
    tier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verify", ["device", "device-batched", "host"])
def test_overlapped_verification_names_every_corrupt_object(store, segments, device, verify):
    for key, _, _ in segments[:2]:
        flip_payload_bit(store, key, 4100, 0x01)
    layout, cache, items = cache_and_items(segments, device, shifted=True)
    before = cache.clone()
    tier = make_tier(store, device, retain=True)
    with pytest.raises(IntegrityError, match="nothing was placed") as err:
        restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier, verify=verify)
    assert segments[0][0] in str(err.value) and segments[1][0] in str(err.value)
    assert segments[2][0] not in str(err.value)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.resident() == [segments[2][0]]  # retention keeps only what checked out
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


def test_verify_none_trusts_nothing_and_marks_nothing(store, segments):
    tier = make_tier(store, "cpu", retain=True)
    layout, cache, items = cache_for(store, [k for k, _, _ in segments])
    first = restore(store, items, cache=cache, layout=layout, tier=tier, verify="none")
    assert first.report.verified == {"not verified": 3}
    second = restore(store, items, cache=cache, layout=layout, tier=tier)
    assert second.report.verified == {"device kmesh-tree-sha256 root (this call)": 3}
    tier.close()


# ------------------------------------------------------------------ pipelined reads
@pytest.mark.parametrize("device", DEVICES)
def test_pipelined_reads_land_bit_exact_with_resident_objects_mixed_in(store, segments, device):
    """One object resident, the others read in 4 KiB chunks interleaved across objects on three
    threads: every byte equals the host copy, and the cache equals the in-memory path."""
    layout, cache, items = cache_and_items(segments, device, shifted=True)
    tier = make_tier(store, device, retain=True, read_threads=3, chunk_bytes=4096)
    with tier.acquire(segments[1][0], model_fingerprint=FP):
        pass  # resident from now on
    result = restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    assert result.report.tier_sources == {"hit": 1, "read": 2}
    for i, (key, kv, pos) in enumerate(segments):
        with tier.acquire(key, model_fingerprint=FP) as lease:
            host = lease.payload.numpy().tobytes()
        assert result.buffer[result.offsets[i]: result.offsets[i] + len(host)].cpu().numpy().tobytes() == host
    expect = reference_cache(segments, items, layout, device, rope=ROPE)
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
    layout, cache, items = cache_and_items(segments, "cpu", shifted=True)
    before = cache.clone()
    tier = make_tier(store, "cpu", retain=True, read_threads=2, chunk_bytes=4096, io_engine=engine)
    with pytest.raises(StorageError, match="injected"):
        restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert tier.in_flight() == 0 and segments[2][0] not in tier
    assert tier.pool.in_use_bytes == tier.resident_bytes  # no lease left behind
    monkeypatch.undo()
    result = restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    assert result.report.placed and result.report.tier_sources.get("read") == 1
    tier.close()


def test_every_restore_settles_its_verifier_whatever_happened(store, segments, monkeypatch):
    """The digests' root downloads and the gate's upload are driver copies torch's pinned allocator
    does not track: before the pinned table can go, the route waits for them (``Verifier.settle``)
    after a success and after a failure alike (the settle itself: test_verifier.py)."""
    settled = []
    real = verifier_mod.Verifier.settle
    monkeypatch.setattr(verifier_mod.Verifier, "settle", lambda self: settled.append(self.mode) or real(self))
    layout, cache, items = cache_for(store, [k for k, _, _ in segments])
    tier = make_tier(store, "cpu", retain=False)
    restore(store, items, cache=cache, layout=layout, tier=tier, verify="device")
    assert settled == ["device"]
    flip_payload_bit(store, segments[0][0], 10, 0x01)
    with pytest.raises(IntegrityError, match=segments[0][0]):
        restore(store, items, cache=cache, layout=layout, tier=tier, verify="device")
    assert settled == ["device", "device"]
    tier.close()


def test_forced_reads_reuse_the_pooled_buffers(store, segments):
    tier = make_tier(store, "cpu", retain=True)
    layout, cache, items = cache_for(store, [k for k, _, _ in segments])
    with InProcessRestorer(store, cache, layout, model_fingerprint=FP, tier=tier) as restorer:
        for _child in range(4):
            tier.evict()
            result = restorer.restore(items)
            assert result.report.tier_sources == {"read": 3}
    assert tier.stats["reads"] == 12 and tier.pool.allocations == 3  # never allocated (or pinned) again
    tier.close()


def test_a_private_tier_pools_its_buffers_across_restores_and_closes_with_the_restorer(store, segments):
    """``tier=None``: the restorer's own tier (no retention) reads every object each time into
    buffers it pools, and goes with the restorer."""
    layout, cache, items = cache_for(store, [k for k, _, _ in segments])
    restorer = InProcessRestorer(store, cache, layout, model_fingerprint=FP, config=RouteConfig(verify="host"))
    for _ in range(3):
        assert restorer.restore(items).report.tier_sources == {"read": 3}
    tier = restorer.tier
    assert tier.stats["reads"] == 9 and tier.pool.allocations == 3 and tier.resident() == []
    restorer.close()
    restorer.close()  # idempotent
    with pytest.raises(LayoutError, match="closed"):
        restorer.restore(items)


@pytest.mark.gpu
@pytest.mark.parametrize("trust", [True, False])
def test_resident_child_runs_on_the_callers_stream(store, segments, trust):
    """Every object resident: trusted, the copies and placement follow one another on the caller's
    current stream (here a side stream); re-verified, on the route's streams. The cache equals the
    in-memory path either way, and a resident payload corrupted in RAM is caught when re-verified,
    with nothing placed."""
    layout, cache, items = cache_and_items(segments, "cuda", shifted=True)
    tier = make_tier(store, "cuda", retain=True)
    restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier)
    expect = reference_cache(segments, items, layout, "cuda", rope=ROPE)
    side = torch.cuda.Stream()
    for _ in range(3):
        cache = layout.allocate("cuda", fill=0x7F)
        with torch.cuda.stream(side):
            result = restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier, trust_verified=trust)
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
        restore(store, items, cache=cache, layout=layout, rope=ROPE, tier=tier, trust_verified=False)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    tier.close()
