"""Host-RAM tier (retention, eviction, budget, singleflight) and the O_DIRECT reader beneath it."""

from __future__ import annotations

import errno
import fcntl
import os
import threading

import pytest
import torch

import kmesh_host.store as store_mod
from kmesh_host import (
    BudgetExceeded,
    KmeshError,
    FingerprintMismatch,
    IntegrityError,
    ModelFingerprint,
    SegmentNotFound,
    SegmentStore,
    SingleFlight,
)
from kmesh_host.direct_io import ALIGN, DirectFile, HostBuffer, ReadEngine
from kmesh_host.tier import BufferPool
from kmesh_gpu.errors import StorageError
from tests.helpers.io import refuse_o_direct_at_open
from tests.helpers.tier import FP, OBJ, kv_for, put_segments, tier_for, wait_until



@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "store")


@pytest.fixture
def keys(store):
    return put_segments(store, 4)


# ------------------------------------------------------------------ singleflight
def run_threads(n, fn):
    results, errors = [None] * n, [None] * n

    def body(i):
        try:
            results[i] = fn(i)
        except BaseException as exc:  # collected and asserted by the caller
            errors[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_singleflight_joins_and_propagates_failure():
    sf = SingleFlight()
    gate = threading.Event()
    calls = []

    def work():
        calls.append(1)
        gate.wait(30)
        return "value"

    def opener():
        wait_until(lambda: sf.waiting("k") == 5)
        gate.set()

    threading.Thread(target=opener).start()
    results, errors = run_threads(6, lambda i: sf.do("k", work))
    assert errors == [None] * 6 and len(calls) == 1
    assert sorted(r[1] for r in results) == [False] + [True] * 5 and {r[0] for r in results} == {"value"}
    assert sf.in_flight() == 0

    gate.clear()

    def failing():
        gate.wait(30)
        raise IntegrityError("segment k: boom")

    threading.Thread(target=opener).start()
    results, errors = run_threads(6, lambda i: sf.do("k", failing))
    assert all(isinstance(e, IntegrityError) for e in errors)
    assert sf.in_flight() == 0
    assert sf.do("k", lambda: 3) == (3, False)  # not a cache: the next call runs again


def _gate_reads(monkeypatch, tier, key, waiters, *, fail=None):
    """Block the tier's header read for ``key`` until ``waiters`` callers have joined."""
    real = tier.store.read_header

    def gated(k):
        wait_until(lambda: tier.waiting(k) >= waiters)
        if fail is not None:
            raise fail
        return real(k)

    monkeypatch.setattr(tier.store, "read_header", gated)


def test_concurrent_loads_of_one_key_do_one_read(store, keys, monkeypatch):
    tier = tier_for(store)
    _gate_reads(monkeypatch, tier, keys[0], 7)
    results, errors = run_threads(8, lambda i: tier.acquire(keys[0], model_fingerprint=FP))
    assert errors == [None] * 8
    assert tier.stats["reads"] == 1 and tier.stats["bytes_read"] == OBJ and tier.stats["joins"] == 7
    assert sorted(r.source for r in results) == ["joined"] * 7 + ["read"]
    expect = kv_for(0)
    assert all(torch.equal(r.kv, expect) for r in results)
    for r in results:
        r.release()
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == OBJ  # retained, not leaked
    tier.close()


def test_failed_load_reaches_every_joiner_and_leaks_nothing(store, keys, monkeypatch):
    tier = tier_for(store)
    _gate_reads(monkeypatch, tier, keys[1], 5, fail=IntegrityError(f"segment {keys[1]}: injected"))
    results, errors = run_threads(6, lambda i: tier.acquire(keys[1], model_fingerprint=FP))
    assert all(isinstance(e, IntegrityError) and keys[1] in str(e) for e in errors)
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == 0 and keys[1] not in tier
    monkeypatch.undo()
    with tier.acquire(keys[1], model_fingerprint=FP) as lease:
        assert torch.equal(lease.kv, kv_for(1))
    tier.close()


def test_corrupt_payload_fails_every_joiner(store, keys, monkeypatch):
    path = store.path(keys[2])
    off = store.read_header(keys[2]).payload_offset
    with open(path, "r+b") as f:
        f.seek(off + 100)
        f.write(b"\x00\x01")
    tier = tier_for(store, verify="sha256")
    _gate_reads(monkeypatch, tier, keys[2], 3)
    results, errors = run_threads(4, lambda i: tier.acquire(keys[2], model_fingerprint=FP))
    assert all(isinstance(e, IntegrityError) and keys[2] in str(e) for e in errors)
    assert tier.stats["failures"] == 1 and tier.pool.in_use_bytes == 0 and tier.in_flight() == 0
    tier.close()


def test_missing_segment_and_wrong_fingerprint(store, keys):
    tier = tier_for(store)
    with pytest.raises(SegmentNotFound):
        tier.acquire("cd" * 32, model_fingerprint=FP)
    other = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", {"base": 1e4})
    with pytest.raises(FingerprintMismatch):
        tier.acquire(keys[0], model_fingerprint=other)
    assert tier.stats["reads"] == 0  # refused before reading the payload
    tier.acquire(keys[0], model_fingerprint=FP).release()
    with pytest.raises(FingerprintMismatch):
        tier.acquire(keys[0], model_fingerprint=other)  # resident: checked on the hit too
    assert tier.evict() == OBJ and tier.pool.in_use_bytes == 0
    tier.close()


# ------------------------------------------------------------------ retention, eviction, budget
@pytest.mark.parametrize("retain", [True, False], ids=["retain", "no-retain"])
def test_retention_across_children(store, keys, retain):
    tier = tier_for(store, retain=retain)
    sources = []
    for _child in range(3):
        with tier.acquire(keys[0], model_fingerprint=FP) as lease:
            sources.append(lease.source)
            assert torch.equal(lease.kv, kv_for(0))
    assert sources == (["read", "hit", "hit"] if retain else ["read"] * 3)
    assert tier.stats["reads"] == (1 if retain else 3)
    assert tier.pool.allocations == 1  # released buffers are reused, not re-pinned
    tier.close()


def test_explicit_evict_forces_a_fresh_read(store, keys):
    tier = tier_for(store)
    for _child in range(4):
        tier.evict(drop_page_cache=True)
        with tier.acquire(keys[0], model_fingerprint=FP) as lease:
            assert lease.source == "read"
    assert tier.stats["reads"] == 4
    tier.close()


def test_evict_while_leased_keeps_the_lease_valid(store, keys):
    tier = tier_for(store)
    lease = tier.acquire(keys[0], model_fingerprint=FP)
    assert tier.evict(keys[0]) == 0  # still leased: nothing freed yet
    assert keys[0] not in tier
    assert torch.equal(lease.kv, kv_for(0))
    with tier.acquire(keys[0], model_fingerprint=FP) as again:
        assert again.source == "read"
    lease.release()
    lease.release()  # idempotent
    assert tier.pool.in_use_bytes == OBJ  # only the new resident copy
    tier.close()


def test_budget_evicts_least_recently_used(store, keys):
    tier = tier_for(store, budget_bytes=2 * OBJ)
    for k in keys[:3]:
        tier.acquire(k, model_fingerprint=FP).release()
    assert tier.resident() == keys[1:3] and tier.pool.held_bytes <= 2 * OBJ
    tier.acquire(keys[1], model_fingerprint=FP).release()  # touch: keys[2] is now the oldest
    tier.acquire(keys[3], model_fingerprint=FP).release()
    assert tier.resident() == [keys[1], keys[3]]
    tier.close()


def test_budget_exceeded_by_live_leases(store, keys):
    tier = tier_for(store, budget_bytes=2 * OBJ)
    a = tier.acquire(keys[0], model_fingerprint=FP)
    b = tier.acquire(keys[1], model_fingerprint=FP)
    with pytest.raises(BudgetExceeded, match=keys[2]):
        tier.acquire(keys[2], model_fingerprint=FP)
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == 2 * OBJ
    a.release()
    b.release()
    with tier.acquire(keys[2], model_fingerprint=FP) as c:
        assert torch.equal(c.kv, kv_for(2))
    tier.close()
    small = tier_for(store, budget_bytes=OBJ // 2)
    with pytest.raises(BudgetExceeded):
        small.acquire(keys[0], model_fingerprint=FP)
    small.close()


class FakeFence:
    """A CUDA event stand-in: ``done`` says whether the copy it marks has finished."""

    def __init__(self, done=False):
        self.done, self.waited = done, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_pooled_buffer_is_reused_only_after_every_copy_reading_it():
    pool = BufferPool(4 * OBJ, pin=False)
    buf = pool.acquire(OBJ)
    first, second = FakeFence(), FakeFence()
    buf.set_fence(first)   # child A copies from the buffer on one stream
    buf.set_fence(second)  # child B on another: both must be waited for, not just the last
    pool.release(buf)
    again = pool.acquire(OBJ)
    assert again is buf and pool.allocations == 1  # pooled: not allocated (or pinned) again
    assert first.waited == 1 and second.waited == 1
    again.set_fence(FakeFence(done=True))
    later = FakeFence()
    again.set_fence(later)  # completed fences are dropped, pending ones kept
    pool.release(again)
    pool.close()  # closing waits for the pending copy before unmapping
    assert later.waited == 1
    assert again.closed


def test_fences_of_a_retained_entry_are_waited_before_its_buffer_is_reused(store, keys):
    tier = tier_for(store, budget_bytes=OBJ)
    fences = []
    for _child in range(2):
        with tier.acquire(keys[0], model_fingerprint=FP) as lease:
            fences.append(FakeFence())
            lease.fence(fences[-1])
    assert [f.waited for f in fences] == [0, 0]
    with tier.acquire(keys[1], model_fingerprint=FP) as lease:  # reclaims keys[0]'s buffer
        assert torch.equal(lease.kv, kv_for(1))
    assert [f.waited for f in fences] == [1, 1] and tier.pool.allocations == 1
    tier.close()


def test_acquire_resident_never_reads(store, keys):
    tier = tier_for(store)
    assert tier.acquire_resident(keys[0], model_fingerprint=FP) is None
    assert tier.stats["reads"] == 0 and tier.pool.in_use_bytes == 0
    tier.acquire(keys[0], model_fingerprint=FP).release()
    with tier.acquire_resident(keys[0], model_fingerprint=FP) as lease:
        assert lease.source == "hit" and torch.equal(lease.kv, kv_for(0))
    other = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", {"base": 1e4})
    with pytest.raises(FingerprintMismatch):
        tier.acquire_resident(keys[0], model_fingerprint=other)
    assert tier.stats["reads"] == 1 and tier.reads_by_key == {keys[0]: 1}
    tier.close()


def test_acquire_resident_many_leases_the_resident_keys_only(store, keys):
    tier = tier_for(store)
    tier.acquire(keys[1], model_fingerprint=FP).release()
    tier.acquire(keys[2], model_fingerprint=FP).release()
    hits = tier.stats["hits"]
    leases = tier.acquire_resident_many([keys[0], keys[1], keys[2], keys[1]], model_fingerprint=FP)
    assert leases[0] is None and [lease.source for lease in leases[1:]] == ["hit"] * 3
    assert torch.equal(leases[1].kv, kv_for(1)) and torch.equal(leases[2].kv, kv_for(2))
    assert tier.stats["hits"] == hits + 3 and tier.stats["reads"] == 2
    tier.evict(keys[1])  # leased: leaves the tier now, its buffer goes on the last release
    for lease in leases[1:]:
        lease.release()
    assert tier.acquire_resident_many([keys[1]], model_fingerprint=FP) == [None]
    # another model's fingerprint: an error, and no lease taken on any key
    other = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", {"base": 1e4})
    with pytest.raises(FingerprintMismatch):
        tier.acquire_resident_many([keys[2], keys[0]], model_fingerprint=other)
    tier.evict()  # frees every buffer now only if no lease is left anywhere
    assert tier.pool.in_use_bytes == 0
    tier.close()


def _as_pinned(tier, keys, pinned: bool = True):
    """Mark the entries' buffers page-locked, or back (a CPU tier's are not; acquire_ready reads the
    flag only; a release of a page-locked buffer's lease would reach for CUDA)."""
    for k in keys:
        tier._entries[k].buffer.pinned = pinned


@pytest.mark.parametrize("verified", [True, False])
def test_acquire_ready_leases_every_key_at_once_or_takes_nothing(store, keys, verified):
    """Every key resident, page-locked and (when asked) verified: a lease on each, in order, and the
    address and length of each payload; any key missing, unpinned or unverified: ``None`` with no
    reference taken; another model's resident key: FingerprintMismatch with none taken."""
    tier = tier_for(store, verify="sha256" if verified else "none")
    for k in keys[:3]:
        tier.acquire(k, model_fingerprint=FP).release()

    def refs():
        out = []
        for k in keys[:3]:
            lease = tier.acquire_resident(k, model_fingerprint=FP)
            out.append(lease._entry.refs)
            lease.release()
        return out

    before = refs()
    assert tier.acquire_ready(keys[:3], model_fingerprint=FP, verified=verified) is None  # not page-locked
    _as_pinned(tier, keys[:3])
    assert tier.acquire_ready([keys[0], keys[3]], model_fingerprint=FP, verified=verified) is None  # one missing
    assert refs() == before
    hits = tier.stats["hits"]
    order = [keys[2], keys[0], keys[1], keys[0]]
    leases, rows = tier.acquire_ready(order, model_fingerprint=FP, verified=verified)
    assert [lease.key for lease in leases] == order and [lease.source for lease in leases] == ["hit"] * 4
    assert rows == [(lease.payload_memory()[0], lease.header.padded_length) for lease in leases]
    assert torch.equal(leases[0].kv, kv_for(2)) and torch.equal(leases[2].kv, kv_for(1))
    assert tier.stats["hits"] == hits + 4 and tier.stats["reads"] == 3
    assert refs() == [before[0] + 2, before[1] + 1, before[2] + 1]
    _as_pinned(tier, keys[:3], False)
    for lease in leases:
        lease.release()
    assert refs() == before
    _as_pinned(tier, keys[:3])
    other = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", {"base": 1e4})
    with pytest.raises(FingerprintMismatch):
        tier.acquire_ready([keys[0], keys[1]], model_fingerprint=other, verified=verified)
    assert refs() == before
    _as_pinned(tier, keys[:3], False)
    tier.close()
    with pytest.raises(KmeshError, match="closed"):
        tier.acquire_ready(keys[:1], model_fingerprint=FP, verified=verified)


def test_acquire_ready_asked_for_verified_entries_refuses_unchecked_ones(store, keys):
    tier = tier_for(store, verify="none")  # entries enter unchecked
    for k in keys[:2]:
        tier.acquire(k, model_fingerprint=FP).release()
    _as_pinned(tier, keys[:2])
    assert tier.acquire_ready(keys[:2], model_fingerprint=FP, verified=True) is None
    leases, _ = tier.acquire_ready(keys[:2], model_fingerprint=FP, verified=False)
    _as_pinned(tier, keys[:2], False)
    for lease in leases:
        lease.release()
    tier.close()


@pytest.mark.parametrize("verify", ["sha256", "tree", "none"])
def test_entries_record_how_they_were_verified(store, keys, verify):
    tier = tier_for(store, verify=verify)
    with tier.acquire(keys[0], model_fingerprint=FP) as lease:
        if verify == "none":
            assert lease.verified is None
            lease.mark_verified("device root (test)")
        else:
            assert lease.verified.startswith("host ") and "entered the tier" in lease.verified
    with tier.acquire(keys[0], model_fingerprint=FP) as lease:
        assert lease.verified is not None and lease.source == "hit"
    tier.evict()
    with tier.acquire(keys[0], model_fingerprint=FP) as lease:  # a fresh read starts unverified again
        assert (lease.verified is None) == (verify == "none")
    assert tier.reads_by_key == {keys[0]: 2}
    tier.close()


def test_on_chunk_streams_the_payload_in_order(direct_dir):
    store = SegmentStore(direct_dir / "store")
    keys = put_segments(store, 1)
    tier = tier_for(store, chunk_bytes=4096)
    seen = bytearray()
    ranges = []

    def on_chunk(chunk, lo, hi):
        ranges.append((lo, hi))
        assert lo == len(seen)
        seen.extend(chunk.numpy().tobytes())

    with tier.acquire(keys[0], model_fingerprint=FP, on_chunk=on_chunk) as lease:
        assert lease.source == "read" and lease.o_direct is True
        assert bytes(seen) == lease.payload.numpy().tobytes()
    assert ranges == [(0, 4096), (4096, 8192)]
    tier.close()


def test_pyarrow_filesystem_tier():
    store = SegmentStore("mock:///tier")
    key = store.put(kv_for(5), torch.arange(64), torch.arange(64), model_fingerprint=FP)
    tier = tier_for(store)
    with tier.acquire(key, model_fingerprint=FP) as lease:
        assert torch.equal(lease.kv, kv_for(5)) and lease.o_direct is False
    tier.close()


# ------------------------------------------------------------------ O_DIRECT reader
@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 10000, 3 * 4096 + 5])
def test_direct_reads_of_unaligned_sizes(direct_dir, size):
    path = str(direct_dir / "f.bin")
    data = os.urandom(size)
    open(path, "wb").write(data)
    with DirectFile(path) as f, ReadEngine(2, 4096) as engine, HostBuffer(size + 2 * ALIGN) as buf:
        assert buf.address % ALIGN == 0 and f.o_direct
        assert bytes(engine.read(f, 0, size, buf.view)) == data
        for off, n in [(size // 2, size - size // 2), (size - 1, 1), (min(4096, size - 1), size - min(4096, size - 1))]:
            assert bytes(engine.read(f, off, n, buf.view)) == data[off: off + n]
        with pytest.raises(IntegrityError):
            engine.read(f, 0, size + 1, buf.view)
        with pytest.raises(ValueError):
            engine.read(f, 0, size, buf.view[:ALIGN // 2])


def test_o_direct_refused_at_open_falls_back(tmp_path, monkeypatch):
    path = str(tmp_path / "f.bin")
    data = os.urandom(5000)
    open(path, "wb").write(data)
    refuse_o_direct_at_open(monkeypatch)
    with DirectFile(path) as f, ReadEngine(1, 4096) as engine, HostBuffer(8192) as buf:
        assert not f.o_direct and "refused O_DIRECT" in f.fallback_reason
        assert bytes(engine.read(f, 0, 5000, buf.view)) == data


def test_o_direct_refused_at_read_falls_back(direct_dir, monkeypatch):
    path = str(direct_dir / "f.bin")  # (the open must take O_DIRECT for its read to be refused)
    data = os.urandom(9000)
    open(path, "wb").write(data)
    real = os.preadv
    state = {"refused": 0}

    def refusing(fd, bufs, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and state["refused"] == 0:
            state["refused"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", refusing)
    with DirectFile(path) as f, ReadEngine(1, 16384, engine="threads") as engine, HostBuffer(16384) as buf:
        assert bytes(engine.read(f, 0, 9000, buf.view)) == data
        assert state["refused"] == 1 and not f.o_direct and "read" in f.fallback_reason


def test_tier_reports_the_fallback(store, keys, monkeypatch):
    refuse_o_direct_at_open(monkeypatch)
    tier = tier_for(store)
    with tier.acquire(keys[0], model_fingerprint=FP) as lease:
        assert lease.o_direct is False and "O_DIRECT" in lease.io_note
        assert torch.equal(lease.kv, kv_for(0))
    tier.close()


def test_store_module_does_not_read_payload_for_headers(store, keys, monkeypatch):
    """read_header touches only the head and footer (the payload is left to the routes)."""
    reads = []
    real = store_mod._LocalRandomAccess.read_into

    def spy(self, view, offset):
        reads.append((offset, len(view)))
        return real(self, view, offset)

    monkeypatch.setattr(store_mod._LocalRandomAccess, "read_into", spy)
    h = store.read_header(keys[0])
    lo, hi = h.payload_offset, h.payload_offset + h.padded_length
    assert all(off + n <= lo or off >= hi for off, n in reads)


# ------------------------------------------------------------------ pipelined loads (start_loads)
class Collector:
    """Callbacks of one start_loads call: chunks per key and one done per key, checked for order."""

    def __init__(self, n):
        self.lock = threading.Lock()
        self.chunks = [[] for _ in range(n)]
        self.done = [None] * n
        self.finished = threading.Semaphore(0)

    def on_chunk(self, i, chunk, lo, hi):
        with self.lock:
            assert self.done[i] is None  # never a chunk after its key's done
            self.chunks[i].append((lo, hi, chunk.numpy().tobytes()))

    def on_done(self, i, lease, error):
        with self.lock:
            assert self.done[i] is None
            self.done[i] = (lease, error)
        self.finished.release()

    def wait(self):
        for _ in self.done:
            assert self.finished.acquire(timeout=30)
        return self.done


def test_start_loads_streams_every_object_and_leases_it(store, keys):
    tier = tier_for(store, read_threads=3, chunk_bytes=4096)
    col = Collector(len(keys))
    tier.start_loads(keys, model_fingerprint=FP, on_chunk=col.on_chunk, on_done=col.on_done,
                     headers=[store.read_header(k) for k in keys])
    for i, (lease, error) in enumerate(col.wait()):
        assert error is None and lease.source == "read" and torch.equal(lease.kv, kv_for(i))
        got = bytearray(OBJ)
        for lo, hi, data in col.chunks[i]:
            got[lo:hi] = data
        assert sorted((lo, hi) for lo, hi, _ in col.chunks[i]) == [(0, 4096), (4096, 8192)]
        assert bytes(got) == lease.payload.numpy().tobytes()
        lease.release()
    assert tier.stats["reads"] == 4 and tier.in_flight() == 0 and sorted(tier.resident()) == sorted(keys)
    # resident now: hits reported at once, on this thread, without chunks
    col = Collector(2)
    tier.start_loads(keys[:2], model_fingerprint=FP, on_chunk=col.on_chunk, on_done=col.on_done)
    assert [lease.source for lease, _ in col.wait()] == ["hit", "hit"] and col.chunks == [[], []]
    for lease, _ in col.done:
        lease.release()
    tier.close()


def test_start_loads_reuses_pooled_buffers(store, keys):
    tier = tier_for(store)
    for _child in range(3):
        tier.evict()
        col = Collector(len(keys))
        tier.start_loads(keys, model_fingerprint=FP, on_done=col.on_done)
        for lease, error in col.wait():
            assert error is None
            lease.release()
    assert tier.stats["reads"] == 12 and tier.pool.allocations == 4  # pinned once, reused after
    tier.close()


def test_start_loads_failure_of_one_object_spares_the_others(store, keys, monkeypatch):
    """A read error in the middle of one object: that key fails, the rest load, nothing leaks."""
    real = DirectFile.pread_into
    bad_path = store.local_path(keys[1])

    def failing(self, view, offset):
        if self.path == bad_path and offset > 4096:
            raise StorageError(f"read of {self.path} at {offset} failed: injected")
        return real(self, view, offset)

    monkeypatch.setattr(DirectFile, "pread_into", failing)
    tier = tier_for(store, singleflight=True, io_engine="threads")  # io_uring: tests/kmesh_host/test_read_engine.py
    col = Collector(len(keys))
    tier.start_loads(keys, model_fingerprint=FP, on_chunk=col.on_chunk, on_done=col.on_done)
    done = col.wait()
    assert isinstance(done[1][1], StorageError) and done[1][0] is None
    for i in (0, 2, 3):
        lease, error = done[i]
        assert error is None and torch.equal(lease.kv, kv_for(i))
        lease.release()
    assert keys[1] not in tier and tier.stats["failures"] == 1 and tier.in_flight() == 0
    assert tier.pool.in_use_bytes == tier.resident_bytes  # the failed buffer went back to the pool
    tier.close()


def test_start_loads_joins_a_load_in_flight(store, keys, monkeypatch):
    tier = tier_for(store, singleflight=True, io_engine="threads")  # the gate holds a reading thread
    gate, entered = threading.Event(), threading.Event()
    real = DirectFile.pread_into

    def gated(self, view, offset):
        entered.set()
        assert gate.wait(30)
        return real(self, view, offset)

    monkeypatch.setattr(DirectFile, "pread_into", gated)
    first, second = Collector(1), Collector(1)
    tier.start_loads(keys[:1], model_fingerprint=FP, on_done=first.on_done)
    assert entered.wait(30)
    tier.start_loads(keys[:1], model_fingerprint=FP, on_done=second.on_done)
    wait_until(lambda: tier.waiting(keys[0]) == 1)
    gate.set()
    (a, ea), = first.wait()
    (b, eb), = second.wait()
    assert ea is None and eb is None and a.source == "read" and b.source == "joined"
    assert tier.stats["reads"] == 1
    a.release()
    b.release()
    tier.close()
