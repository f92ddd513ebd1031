"""Adversarial checks of the host tier, singleflight and read engines.

Seeded and bounded: every wait has a timeout, so a deadlock fails a test rather than hanging it.
What this file adds to test_tier.py / test_read_engine.py (the route over the tier:
restore/test_host_staging_adversarial.py):

* stress: many threads acquiring / evicting / releasing the same and different keys under a small
  budget, with corrupt files, over-budget objects and injected read errors; afterwards the budget
  accounting, descriptors and threads are back where they started and every lease was bit-exact
  for as long as it was held;
* budget edges (object larger than the budget, budget exactly one object, zero budget, every byte
  leased): typed, immediate refusals, never a wait;
* singleflight with a leader failing by a non-Exception BaseException, late joiners, retries;
* both read engines at 0, 1, 4095, 4096, 4097, chunk-1, chunk, chunk+1 ... bytes, past the end
  of the file, and on files truncated between open and read.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time

import pytest
import torch

from kmesh_gpu.errors import StorageError
from kmesh_host import (
    BudgetExceeded,
    FingerprintMismatch,
    HostTierConfig,
    IntegrityError,
    KmeshError,
    ModelFingerprint,
    SegmentStore,
    SingleFlight,
    uring,
)
from kmesh_host.direct_io import ALIGN, DirectFile, HostBuffer, ReadEngine, round_up
from tests.helpers.waiting import settle
from tests.helpers.tier import FP, OBJ, OTHER_FP, kv_for, tier_for, wait_until

HAVE_URING = uring.available()[0]
ENGINES = ["threads", "io_uring"] if HAVE_URING else ["threads"]

def put(store: SegmentStore, seed: int, T: int = 64, fp: ModelFingerprint = FP) -> str:
    return store.put(kv_for(seed, T), torch.arange(T), torch.arange(T), model_fingerprint=fp)


def flip_payload_byte(store: SegmentStore, key: str, at: int) -> None:
    path, off = store.path(key), store.read_header(key).payload_offset
    with open(path, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ 0x20]))


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def kmesh_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kmesh-")]


def join_all(threads, timeout=30.0):
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running (deadlock?): {alive}"


class Done:
    """start_loads callbacks: one on_done per key, waited for with a timeout."""

    def __init__(self, n):
        self.n, self.lock, self.sem = n, threading.Lock(), threading.Semaphore(0)
        self.done = [None] * n
        self.calls = [0] * n

    def on_done(self, i, lease, error):
        with self.lock:
            self.calls[i] += 1
            self.done[i] = (lease, error)
        self.sem.release()

    def wait(self, timeout=30.0):
        end = time.monotonic() + timeout
        for _ in range(self.n):
            assert self.sem.acquire(timeout=max(0.0, end - time.monotonic())), "on_done not called in time"
        assert self.calls == [1] * self.n
        return self.done


@pytest.fixture
def baseline():
    """Descriptors and kmesh threads before the test; the test asserts they come back."""
    return open_fds(), kmesh_threads()


def assert_back_to(baseline):
    fds, threads = baseline
    wait_until(lambda: kmesh_threads() == threads)
    # A closed io_uring reader keeps two descriptors (its mmaps' dups of the ring fd) until the Ring
    # object is collected, and a HostTier sits in a reference cycle: collect before counting.
    gc.collect()
    leaked = open_fds() - fds
    assert not leaked, f"descriptors left open: {[os.readlink(f'/proc/self/fd/{fd}') for fd in leaked if os.path.exists(f'/proc/self/fd/{fd}')]}"


# ====================================================================================== stress
def _stress_store(tmp_path):
    """Segments of several sizes, most not multiples of 4096 (store chunk 512): good ones, one
    corrupt, one larger than the stress budget."""
    store = SegmentStore(tmp_path / "stress", chunk_size=512)
    good = {}
    for seed, T in [(0, 64), (1, 17), (2, 65), (3, 100), (4, 3), (5, 130)]:
        good[put(store, seed, T)] = kv_for(seed, T).view(torch.uint8).reshape(-1)
    corrupt = put(store, 6, 64)
    flip_payload_byte(store, corrupt, 1234)
    huge = put(store, 7, 400)  # 51200 bytes: larger than the budget below
    return store, good, corrupt, huge


OPS = 150
BUDGET = 40_000  # not a multiple of 4096: room for about four of the objects above


class Injector:
    """Fails a seeded fraction of chunk reads with a StorageError (both engines read through _read)."""

    def __init__(self, tier, seed, rate):
        self.rng, self.rate, self.lock, self.failed = random.Random(seed), rate, threading.Lock(), 0
        self.real = tier._engine._read

    def __call__(self, file, buffer, base, a, b, file_offset, done, after=None):
        with self.lock:
            fail = self.rng.random() < self.rate
            self.failed += fail
        if fail:
            done(0, StorageError(f"read of {file.path} at {file_offset} failed: injected"))
            if after is not None:
                after()
            return
        self.real(file, buffer, base, a, b, file_offset, done, after)


def _check_lease(lease, good, key):
    want = good[key]
    got = lease.payload[: want.numel()]
    return torch.equal(got, want)


@pytest.mark.parametrize("engine", ENGINES)
def test_stress_acquire_evict_release_with_failures(tmp_path, monkeypatch, engine, baseline):
    """8 threads x 60 seeded operations (acquire, acquire_async, acquire_resident, evict, evict-all)
    on 6 good keys, a corrupt key and an over-budget key, 4% of chunk reads failing, host check
    sha256. Every lease is bit-exact when taken AND when released (eviction and budget reclaim
    never reuse a leased buffer); errors are typed and name the key; the budget is never exceeded;
    afterwards nothing is leased, in flight, open or running."""
    store, good, corrupt, huge = _stress_store(tmp_path)
    keys = list(good) + [corrupt, huge]
    tier = tier_for(store, budget_bytes=BUDGET, verify="sha256", io_engine=engine, parallel_loads=3,
                    read_threads=3)
    inject = Injector(tier, seed=1234, rate=0.04)
    monkeypatch.setattr(tier._engine, "_read", inject)
    problems, outcomes, lock = [], {"ok": 0, "budget": 0, "integrity": 0, "storage": 0}, threading.Lock()
    stop = threading.Event()
    max_held = [0]

    def monitor():
        while not stop.is_set():
            held, used = tier.pool.held_bytes, tier.pool.in_use_bytes
            max_held[0] = max(max_held[0], held)
            if held > BUDGET or used > held:
                problems.append(f"accounting: held {held} used {used} budget {BUDGET}")
            time.sleep(0.0005)

    def classify(key, exc):
        if isinstance(exc, BudgetExceeded):
            return "budget"
        if isinstance(exc, IntegrityError) and key == corrupt and key in str(exc):
            return "integrity"
        if isinstance(exc, StorageError) and "injected" in str(exc) and key in str(exc):
            return "storage"
        problems.append(f"unexpected error for {key[:8]}: {type(exc).__name__}: {exc}")
        return None

    def worker(w):
        rng = random.Random(100 + w)
        held = []
        for _ in range(OPS):
            op = rng.random()
            key = rng.choice(keys)
            try:
                if op < 0.45:
                    lease = tier.acquire(key, model_fingerprint=FP)
                elif op < 0.6:
                    lease = tier.acquire_async(key, model_fingerprint=FP).result(timeout=60)
                elif op < 0.75:
                    lease = tier.acquire_resident(key, model_fingerprint=FP)
                elif op < 0.9:
                    tier.evict(key)
                    lease = None
                else:
                    tier.evict()
                    lease = None
            except KmeshError as exc:
                kind = classify(key, exc)
                if kind:
                    with lock:
                        outcomes[kind] += 1
                lease = None
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                problems.append(f"non-Kmesh error for {key[:8]}: {type(exc).__name__}: {exc}")
                lease = None
            if lease is not None:
                if key not in good:
                    problems.append(f"{key[:8]} (corrupt or over budget) was leased")
                elif not _check_lease(lease, good, key):
                    problems.append(f"{key[:8]}: wrong bytes when leased ({lease.source})")
                with lock:
                    outcomes["ok"] += 1
                held.append((key, lease))
            while len(held) > (rng.random() < 0.3):
                k, old = held.pop(rng.randrange(len(held)))
                time.sleep(rng.random() * 0.001)
                if not _check_lease(old, good, k):
                    problems.append(f"{k[:8]}: bytes changed while leased ({old.source})")
                old.release()
        for k, old in held:
            if not _check_lease(old, good, k):
                problems.append(f"{k[:8]}: bytes changed while leased ({old.source})")
            old.release()

    mon = threading.Thread(target=monitor, name="monitor")
    mon.start()
    threads = [threading.Thread(target=worker, args=(w,), name=f"w{w}") for w in range(8)]
    for t in threads:
        t.start()
    join_all(threads, timeout=120)
    stop.set()
    mon.join(5)
    assert not problems, problems[:10]
    assert outcomes["ok"] > 50 and outcomes["integrity"] > 0 and outcomes["budget"] > 0, outcomes
    assert inject.failed > 0
    assert max_held[0] <= BUDGET
    # Everything released: nothing in flight, only resident entries hold bytes; evict frees them all.
    assert tier.in_flight() == 0
    assert tier.pool.in_use_bytes == tier.resident_bytes
    assert corrupt not in tier and huge not in tier
    assert tier.stats["reads"] == sum(tier.reads_by_key.values())
    tier.evict()
    assert tier.pool.in_use_bytes == 0 and tier.resident() == []
    tier.close()
    assert tier.pool.held_bytes == 0
    monkeypatch.undo()  # it holds the engine (and so its ring) for the undo
    del tier, inject
    assert_back_to(baseline)


@pytest.mark.parametrize("engine", ENGINES)
def test_stress_pipelined_loads_joins_and_evictions(tmp_path, monkeypatch, engine, baseline):
    """start_loads (the routes' path) from 6 threads on overlapping key lists, mixed with acquire
    and evictions, 4% of chunk reads failing, host check off (as the routes configure it: they
    check on the device). Every key gets exactly one
    on_done; streamed chunks and leased payloads are bit-exact; a failed key never leaves a lease,
    a buffer in use or a claim behind."""
    store, good, corrupt, huge = _stress_store(tmp_path)
    keys = list(good) + [huge]
    tier = tier_for(store, budget_bytes=BUDGET, verify="none", io_engine=engine, parallel_loads=4,
                    read_threads=3)
    inject = Injector(tier, seed=99, rate=0.04)
    monkeypatch.setattr(tier._engine, "_read", inject)
    problems = []
    counts = {"ok": 0, "failed": 0}
    lock = threading.Lock()

    def worker(w):
        rng = random.Random(500 + w)
        for _ in range(40):
            r = rng.random()
            if r < 0.15:
                tier.evict(rng.choice(keys) if rng.random() < 0.7 else None)
                continue
            if r < 0.3:
                key = rng.choice(keys)
                try:
                    with tier.acquire(key, model_fingerprint=FP) as lease:
                        if key not in good or not _check_lease(lease, good, key):
                            problems.append(f"acquire {key[:8]}: wrong bytes / should have failed")
                except (BudgetExceeded, StorageError):
                    pass
                except BaseException as exc:  # noqa: BLE001
                    problems.append(f"acquire {key[:8]}: {type(exc).__name__}: {exc}")
                continue
            batch = rng.sample(keys, rng.randint(1, 3))
            col = Done(len(batch))
            streamed = [dict() for _ in batch]

            def on_chunk(i, chunk, lo, hi, batch=batch, streamed=streamed):
                want = good.get(batch[i])
                if want is not None and hi <= want.numel() and not torch.equal(chunk, want[lo:hi]):
                    problems.append(f"chunk [{lo},{hi}) of {batch[i][:8]} wrong")
                streamed[i][lo] = hi

            try:
                tier.start_loads(batch, model_fingerprint=FP, on_done=col.on_done, on_chunk=on_chunk)
                done = col.wait()
            except BaseException as exc:  # noqa: BLE001
                problems.append(f"start_loads: {type(exc).__name__}: {exc}")
                continue
            for key, (lease, error) in zip(batch, done):
                if error is not None:
                    if lease is not None or not isinstance(error, (BudgetExceeded, StorageError)):
                        problems.append(f"{key[:8]}: {type(error).__name__}: {error} (lease {lease})")
                    with lock:
                        counts["failed"] += 1
                    continue
                if key not in good or not _check_lease(lease, good, key):
                    problems.append(f"{key[:8]}: wrong bytes ({lease.source})")
                with lock:
                    counts["ok"] += 1
                time.sleep(rng.random() * 0.001)
                if not _check_lease(lease, good, key):
                    problems.append(f"{key[:8]}: bytes changed while leased")
                lease.release()

    threads = [threading.Thread(target=worker, args=(w,), name=f"p{w}") for w in range(6)]
    for t in threads:
        t.start()
    join_all(threads, timeout=120)
    assert not problems, problems[:10]
    assert counts["ok"] > 30 and counts["failed"] > 0, counts
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == tier.resident_bytes
    assert tier.pool.held_bytes <= BUDGET and huge not in tier
    tier.evict()
    assert tier.pool.in_use_bytes == 0
    tier.close()
    monkeypatch.undo()
    del tier, inject
    assert_back_to(baseline)


def test_eviction_under_budget_pressure_never_reuses_a_leased_buffer(tmp_path):
    """Budget of two objects: lease A, then load and evict B, C, D through the other slot many times.
    A's bytes never change and A's buffer is never handed to another load while leased."""
    store = SegmentStore(tmp_path / "s")
    keys = [put(store, i) for i in range(4)]
    tier = tier_for(store, budget_bytes=2 * OBJ)
    a = tier.acquire(keys[0], model_fingerprint=FP)
    tier.evict(keys[0])  # leased: leaves the map, memory kept
    a_addr = a.payload_memory()[0]
    for rnd in range(12):
        k = keys[1 + rnd % 3]
        with tier.acquire(k, model_fingerprint=FP) as other:
            assert other.payload_memory()[0] != a_addr
            assert torch.equal(other.kv, kv_for(1 + rnd % 3))
        if rnd % 2:
            tier.evict()
        assert torch.equal(a.kv, kv_for(0))
    with pytest.raises(BudgetExceeded):  # A + a resident-but-leased B fill the budget
        with tier.acquire(keys[1], model_fingerprint=FP):
            tier.acquire(keys[2], model_fingerprint=FP)
    a.release()
    assert tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()


# ====================================================================================== budget
def test_object_larger_than_the_budget_is_refused_at_once_on_every_path(tmp_path, baseline):
    store = SegmentStore(tmp_path / "s")
    small, big = put(store, 0, 64), put(store, 1, 256)  # 8192 and 32768 bytes
    tier = tier_for(store, budget_bytes=4 * OBJ - 1)
    with pytest.raises(BudgetExceeded, match=big):
        tier.acquire(big, model_fingerprint=FP)
    with pytest.raises(BudgetExceeded, match=big):
        tier.acquire_async(big, model_fingerprint=FP).result(timeout=60)
    col = Done(2)
    tier.start_loads([big, small], model_fingerprint=FP, on_done=col.on_done)
    (l0, e0), (l1, e1) = col.wait()
    assert l0 is None and isinstance(e0, BudgetExceeded) and big in str(e0)
    assert e1 is None and torch.equal(l1.kv, kv_for(0))  # the other key is unaffected
    l1.release()
    assert tier.stats["reads"] == 1 and tier.in_flight() == 0 and tier.resident() == [small]
    assert tier.pool.in_use_bytes == OBJ
    tier.close()
    del tier, col, l0, e0, l1, e1  # the errors' tracebacks hold the tier's frames
    assert_back_to(baseline)


def test_budget_of_exactly_one_object(tmp_path):
    store = SegmentStore(tmp_path / "s")
    keys = [put(store, i) for i in range(3)]
    tier = tier_for(store, budget_bytes=OBJ)
    for rnd in range(6):  # each load reclaims the previous one's buffer: one allocation in all
        with tier.acquire(keys[rnd % 3], model_fingerprint=FP) as lease:
            assert lease.source == "read" and torch.equal(lease.kv, kv_for(rnd % 3))
            with pytest.raises(BudgetExceeded, match=keys[(rnd + 1) % 3]):
                tier.acquire(keys[(rnd + 1) % 3], model_fingerprint=FP)
            with tier.acquire(keys[rnd % 3], model_fingerprint=FP) as again:  # same key: a hit
                assert again.source == "hit"
    assert tier.pool.allocations == 1 and tier.pool.held_bytes == OBJ and tier.resident() == [keys[2]]
    tier.close()
    one_short = tier_for(store, budget_bytes=OBJ - 1)
    with pytest.raises(BudgetExceeded, match=keys[0]):
        one_short.acquire(keys[0], model_fingerprint=FP)
    assert one_short.pool.held_bytes == 0
    one_short.close()


@pytest.mark.parametrize("budget", [0, -1, -OBJ])
def test_zero_or_negative_budget_is_refused_by_the_config(budget):
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTierConfig(budget_bytes=budget)


def test_every_byte_leased_new_loads_fail_typed_and_fast_never_wait(tmp_path, baseline):
    """The API does not wait for room: with the whole budget leased, acquire / acquire_async /
    start_loads (and a joiner of such a load) get BudgetExceeded at once; after the releases the
    same loads succeed."""
    store = SegmentStore(tmp_path / "s")
    keys = [put(store, i) for i in range(6)]
    tier = tier_for(store, budget_bytes=3 * OBJ, parallel_loads=2)
    held = [tier.acquire(k, model_fingerprint=FP) for k in keys[:3]]
    results = []

    def try_load(k):
        try:
            results.append(tier.acquire(k, model_fingerprint=FP))
        except BaseException as exc:  # noqa: BLE001
            results.append(exc)

    threads = [threading.Thread(target=try_load, args=(keys[3 + i % 3],)) for i in range(6)]
    for t in threads:
        t.start()
    join_all(threads)
    assert all(isinstance(r, BudgetExceeded) for r in results), results
    futs = [tier.acquire_async(k, model_fingerprint=FP) for k in keys[3:]]
    for f in futs:
        with pytest.raises(BudgetExceeded):
            f.result(timeout=60)
    col = Done(3)
    tier.start_loads(keys[3:], model_fingerprint=FP, on_done=col.on_done)
    assert all(lease is None and isinstance(e, BudgetExceeded) for lease, e in col.wait())
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == 3 * OBJ and tier.stats["reads"] == 3
    for lease in held:
        lease.release()
    col = Done(3)
    tier.start_loads(keys[3:], model_fingerprint=FP, on_done=col.on_done)
    for i, (lease, error) in enumerate(col.wait()):
        assert error is None and torch.equal(lease.kv, kv_for(3 + i))
        lease.release()
    assert tier.pool.held_bytes <= 3 * OBJ and tier.pool.in_use_bytes == tier.resident_bytes
    tier.close()
    del tier, col, results, futs, held, lease  # the errors' tracebacks hold the tier's frames
    assert_back_to(baseline)


# ====================================================================================== singleflight
class Cancelled(BaseException):
    """A cancellation-style failure: not an Exception (KeyboardInterrupt is too dangerous to use)."""


def test_singleflight_leader_base_exception_reaches_every_joiner_then_runs_again():
    sf = SingleFlight()
    gate, calls = threading.Event(), []

    def leader_work():
        calls.append("leader")
        assert gate.wait(30)
        raise Cancelled("leader cancelled")

    errors = []

    def call():
        try:
            sf.do("k", leader_work)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(6)]
    threads[0].start()
    wait_until(lambda: sf.in_flight() == 1)
    for t in threads[1:]:
        t.start()
    wait_until(lambda: sf.waiting("k") == 5)
    gate.set()
    join_all(threads)
    assert len(errors) == 6 and len({id(e) for e in errors}) == 1 and isinstance(errors[0], Cancelled)
    assert calls == ["leader"] and sf.in_flight() == 0 and sf.waiting("k") == 0
    # a caller arriving after the failure starts a new execution (no cached failure)
    assert sf.do("k", lambda: "fresh") == ("fresh", False)
    # lead/settle with an error: the same for joiners of a claimed key
    call_ = sf.lead("k")
    assert call_ is not None and sf.lead("k") is None
    got = []
    t = threading.Thread(target=lambda: got.append(pytest.raises(Cancelled, sf.do, "k", lambda: "never")))
    t.start()
    wait_until(lambda: sf.waiting("k") == 1)
    sf.settle("k", call_, error=Cancelled("settled"))
    join_all([t])
    assert got and sf.in_flight() == 0 and sf.do("k", lambda: 7) == (7, False)


def test_singleflight_different_keys_do_not_block_each_other():
    sf = SingleFlight()
    gate = threading.Event()
    t = threading.Thread(target=lambda: sf.do("slow", lambda: gate.wait(30)))
    t.start()
    wait_until(lambda: sf.in_flight() == 1)
    assert sf.do("other", lambda: 1) == (1, False)  # not serialised behind "slow"
    gate.set()
    join_all([t])


def _gate_header(monkeypatch, tier, waiters, *, fail=None):
    real = tier.store.read_header
    state = {"n": 0}

    def gated(k):
        state["n"] += 1
        if state["n"] == 1:
            wait_until(lambda: tier.waiting(k) >= waiters)
            if fail is not None:
                raise fail
        return real(k)

    monkeypatch.setattr(tier.store, "read_header", gated)


def acquire_from_threads(tier, key: str, n: int) -> list:
    """``n`` threads each acquire ``key`` and release it; returns what they raised."""
    errors = []

    def call():
        try:
            tier.acquire(key, model_fingerprint=FP).release()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    join_all(threads)
    return errors


def test_tier_leader_base_exception_fails_joiners_and_leaks_nothing(tmp_path, monkeypatch):
    store = SegmentStore(tmp_path / "s")
    key = put(store, 0)
    tier = tier_for(store)
    _gate_header(monkeypatch, tier, 4, fail=Cancelled("load cancelled"))
    errors = acquire_from_threads(tier, key, 5)
    assert len(errors) == 5 and all(isinstance(e, Cancelled) for e in errors)
    assert tier.in_flight() == 0 and tier.pool.in_use_bytes == 0 and key not in tier
    with tier.acquire(key, model_fingerprint=FP) as lease:  # a retry reads afresh
        assert lease.source == "read" and torch.equal(lease.kv, kv_for(0))
    tier.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_retry_after_a_failed_read_does_a_new_read(tmp_path, monkeypatch, engine):
    store = SegmentStore(tmp_path / "s")
    key = put(store, 0)
    tier = tier_for(store, io_engine=engine)
    real = tier._engine._read
    fail = {"on": True}

    def failing(file, buffer, base, a, b, file_offset, done, after=None):
        if fail["on"] and a == 4096:
            done(0, StorageError(f"read of {file.path} at {file_offset} failed: injected"))
            return
        real(file, buffer, base, a, b, file_offset, done, after)

    monkeypatch.setattr(tier._engine, "_read", failing)
    _gate_header(monkeypatch, tier, 3)
    errors = acquire_from_threads(tier, key, 4)
    assert len(errors) == 4 and all(isinstance(e, StorageError) and key in str(e) for e in errors)
    assert tier.stats["failures"] == 1 and tier.in_flight() == 0 and tier.pool.in_use_bytes == 0
    fail["on"] = False
    col = Done(1)
    tier.start_loads([key], model_fingerprint=FP, on_done=col.on_done)
    (lease, error), = col.wait()
    assert error is None and lease.source == "read" and torch.equal(lease.kv, kv_for(0))
    lease.release()
    assert tier.reads_by_key == {key: 1}  # the failed read is not counted; the retry is one read
    tier.close()


def test_joiner_with_the_wrong_fingerprint_is_refused_alone(tmp_path, monkeypatch):
    store = SegmentStore(tmp_path / "s")
    key = put(store, 0)
    tier = tier_for(store)
    _gate_header(monkeypatch, tier, 1)
    out = {}

    def right():
        out["right"] = tier.acquire(key, model_fingerprint=FP)

    def wrong():
        wait_until(lambda: tier.in_flight() == 1)
        try:
            tier.acquire(key, model_fingerprint=OTHER_FP)
        except BaseException as exc:  # noqa: BLE001
            out["wrong"] = exc

    threads = [threading.Thread(target=right), threading.Thread(target=wrong)]
    for t in threads:
        t.start()
    join_all(threads)
    assert isinstance(out["wrong"], FingerprintMismatch) and key in str(out["wrong"])
    assert torch.equal(out["right"].kv, kv_for(0))
    out["right"].release()
    assert tier.pool.in_use_bytes == OBJ and tier.in_flight() == 0
    tier.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_failing_on_chunk_returns_the_buffer_only_after_every_read_into_it(tmp_path, monkeypatch, engine):
    """acquire's on_chunk raising on chunk 0 while chunk 1 is still being read: the buffer goes back
    to the pool (and may be handed to another load) only after chunk 1's read has finished."""
    store = SegmentStore(tmp_path / "s")
    key = put(store, 0)
    tier = tier_for(store, io_engine=engine, read_threads=2)
    log = []
    real_read = tier._engine._read

    def slow_second(file, buffer, base, a, b, file_offset, done, after=None):
        if a == 0:
            return real_read(file, buffer, base, a, b, file_offset, done, after)

        def later():
            time.sleep(0.2)
            real_read(file, buffer, base, a, b, file_offset,
                      lambda n, e: (log.append(("chunk 1 landed", e)), done(n, e)), after)

        threading.Thread(target=later).start()

    monkeypatch.setattr(tier._engine, "_read", slow_second)
    real_release = tier.pool.release
    monkeypatch.setattr(tier.pool, "release", lambda buf: (log.append(("released", None)), real_release(buf)))

    def on_chunk(chunk, lo, hi):
        raise ValueError("copy failed")

    with pytest.raises(ValueError):
        tier.acquire(key, model_fingerprint=FP, on_chunk=on_chunk)
    settle(lambda: log and tier.in_flight() == 0 and tier.pool.in_use_bytes == tier.resident_bytes)
    assert log[0] == ("chunk 1 landed", None)  # never released before the read into it ended
    assert log[1:] in ([("released", None)], [])  # (or kept: a finished load may stay resident)
    assert tier.pool.in_use_bytes == tier.resident_bytes and tier.in_flight() == 0
    tier.close()


# ====================================================================================== read engines
CH = 8192


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, CH - 1, CH, CH + 1, 2 * CH - 1, 2 * CH + 1, 3 * CH])
def test_engine_whole_file_and_past_eof(direct_dir, engine, size):
    path = str(direct_dir / "f.bin")
    data = random.Random(size).randbytes(size)
    with open(path, "wb") as f:
        f.write(data)
    with DirectFile(path) as f, ReadEngine(2, CH, engine=engine) as reader, \
            HostBuffer(round_up(size + 1) + ALIGN) as buf:
        assert f.o_direct and f.size == size
        assert bytes(reader.read(f, 0, size, buf.view, name="seg")) == data
        # callback form: the promised number of chunks, each once, inside the range, bytes exact
        buf.view[:] = b"\xEE" * len(buf.view)
        seen, ev = [], threading.Event()
        expect = len(range(0, round_up(size), CH))

        def on_chunk(lo, hi, error):
            seen.append((lo, hi, error))
            if len(seen) == expect:
                ev.set()

        assert reader.start(f, 0, size, buf.view, on_chunk, name="seg") == expect
        assert expect == 0 or ev.wait(30)
        time.sleep(0.01)
        assert len(seen) == expect and all(e is None and 0 <= lo <= hi <= size for lo, hi, e in seen)
        assert sorted(lo for lo, _, _ in seen) == list(range(0, round_up(size), CH))
        assert bytes(buf.view[:size]) == data
        # one byte more than the file, or bytes wholly past its end: typed, naming the range's owner
        for off, n in [(0, size + 1), (size, 1), (size + 5000, 3), (max(0, size - 1), 2)]:
            with pytest.raises(IntegrityError, match="seg.*truncated"):
                reader.read(f, off, n, buf.view, name="seg")
        # a range ending exactly at the end of the file, from every kind of start
        for off in {0, 1, size // 2, max(0, size - 1), max(0, size - 4096), max(0, size - CH - 1)}:
            if off < size:
                assert bytes(reader.read(f, off, size - off, buf.view)) == data[off:]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("size,keep", [(4097, 100), (CH + 1, CH), (3 * CH, CH + 5), (3 * CH, 0), (5000, 4096)])
def test_engine_file_truncated_between_open_and_read(tmp_path, engine, size, keep):
    path = str(tmp_path / "t.bin")
    data = random.Random(size + keep).randbytes(size)
    with open(path, "wb") as f:
        f.write(data)
    with DirectFile(path) as f, ReadEngine(2, CH, engine=engine) as reader, HostBuffer(round_up(size)) as buf:
        os.truncate(path, keep)  # after open: f.size still says `size`
        with pytest.raises((IntegrityError, StorageError)) as err:
            reader.read(f, 0, size, buf.view, name="seg-t")
        assert "seg-t" in str(err.value) or path in str(err.value)
        n_chunks = len(range(0, round_up(size), CH))
        seen, ev = [], threading.Event()

        def on_chunk(lo, hi, error):
            seen.append((lo, hi, error))
            if len(seen) == n_chunks:
                ev.set()

        assert reader.start(f, 0, size, buf.view, on_chunk, name="seg-t") == n_chunks
        assert ev.wait(30)
        time.sleep(0.01)
        assert len(seen) == n_chunks  # each chunk reported once, errors included
        errors = [e for _, _, e in seen if e is not None]
        assert errors and all(isinstance(e, KmeshError) for e in errors)
        for lo, hi, e in seen:  # a chunk reported good holds the file's bytes
            if e is None:
                assert hi <= keep and bytes(buf.view[lo:hi]) == data[lo:hi]


@pytest.mark.parametrize("engine", ENGINES)
def test_tier_segment_truncated_after_its_header_was_read(tmp_path, monkeypatch, engine):
    """The header passes, then the file shrinks before the payload is read (acquire and start_loads):
    IntegrityError naming the key, nothing leased, resident or held."""
    store = SegmentStore(tmp_path / "s")
    keys = [put(store, i) for i in range(2)]
    tier = tier_for(store, io_engine=engine)
    real = store.read_header

    def then_truncate(k):
        h = real(k)
        os.truncate(store.path(k), h.payload_offset + 4096 + 10)
        return h

    monkeypatch.setattr(store, "read_header", then_truncate)
    with pytest.raises(IntegrityError, match=keys[0]):
        tier.acquire(keys[0], model_fingerprint=FP)
    monkeypatch.setattr(store, "read_header", real)
    h = store.read_header(keys[1])
    os.truncate(store.path(keys[1]), h.payload_offset + 100)
    col = Done(1)
    tier.start_loads([keys[1]], model_fingerprint=FP, on_done=col.on_done, headers=[h])
    (lease, error), = col.wait()
    assert lease is None and isinstance(error, IntegrityError) and keys[1] in str(error)
    assert tier.resident() == [] and tier.pool.in_use_bytes == 0 and tier.in_flight() == 0
    tier.close()


# ====================================================================================== lifetime
def test_many_tiers_opened_used_and_closed_leak_nothing(tmp_path, baseline):
    store = SegmentStore(tmp_path / "s")
    keys = [put(store, i) for i in range(3)]
    for rnd in range(16):
        engine = ENGINES[rnd % len(ENGINES)]
        with tier_for(store, io_engine=engine, budget_bytes=2 * OBJ) as tier:
            col = Done(3)
            tier.start_loads(keys, model_fingerprint=FP, on_done=col.on_done)
            for lease, error in col.wait():
                if lease is not None:
                    lease.release()
            tier.acquire_async(keys[rnd % 3], model_fingerprint=FP).result(timeout=60).release()
            tier.evict(drop_page_cache=True)
    with pytest.raises(KmeshError, match="closed"):
        tier.acquire(keys[0], model_fingerprint=FP)
    del tier, col, lease, error
    assert_back_to(baseline)
