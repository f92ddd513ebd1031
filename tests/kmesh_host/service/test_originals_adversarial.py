"""Adversarial checks of the shared originals the cache service owns (CPU shared memory, seeded).

Scope: the service's segment store and the host tier over it (``ServiceConfig.store_root``, its
byte budget), and the handlers that use them: ``put``, ``get``, ``evict``, ``save`` (published on
its drain), ``restore`` and the registry's source holds. Keys are the store's (content-derived):
an original never changes under its key.

What is checked: ``get`` returns exactly what was put or saved; the host tier never holds more than
its budget, and an original it let go is read from the store again; a key held by a pending restore
cannot be evicted; a save is published only after its drain and only when it succeeded; store
faults (corrupt, truncated, missing, not a file, another model, a file replaced between two
restores) are typed errors naming the key that write nothing; and seeded threads over separate
connections restoring, putting, evicting, saving and reading the same keys always see each key's
own bytes, leave nothing held and cause no internal error.

Copies on CPU are synchronous; a copy is kept *pending* (its holds alive) with the service's fault
injection ``{"refuse_waits": n}``, never with sleeps.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
from types import SimpleNamespace

import pytest
import torch

from kmesh_gpu import gather, place_many
from kmesh_gpu.errors import (
    BudgetExceeded,
    DrainError,
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    OwnershipError,
    SegmentNotFound,
)
from kmesh_host import SegmentStore
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache
from tests.kmesh_host.service.helpers import fingerprint, registration_of, small_layout, small_rope, socket_dir

POISON = 0x5A
T = 4
KV_BYTES = 2 * 2 * T * 2 * 8 * 2  # one (2, L=2, T=4, H=2, D=8) bfloat16 original: 512 bytes
ENTRY = 4096  # what one such original takes in the host tier (its payload padded to the store's chunk size)
BUDGET = 10 * ENTRY
FP = fingerprint()
FP_OTHER = fingerprint(architecture="LlamaForCausalLM")


def _kv(seed: int, t: int = T, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, t, 2, 8, generator=g)
    if dtype == torch.uint8:
        return (x * 40).to(torch.int16).remainder(256).to(torch.uint8)
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _read(cache: SharedCache, layout, slots) -> torch.Tensor:
    return gather(cache.tensor, layout, torch.tensor(slots, dtype=torch.int64))


def _originals(c: CacheClient) -> dict:
    return c.status()["originals"]


def _put(c: CacheClient, seed: int, t: int = T, dtype=torch.bfloat16, pos0: int = 0, fp=FP):
    """``(key, kv, positions, token ids)`` of a new original of seed ``seed``."""
    kv = _kv(seed, t, dtype)
    pos = torch.arange(pos0, pos0 + t, dtype=torch.int64)
    tok = torch.arange(t, dtype=torch.int64) + 1000 * seed
    return c.put(kv, tok, pos, model_fingerprint=fp), kv, pos, tok


def _store_keys(c: CacheClient) -> list:
    return SegmentStore(_originals(c)["store_root"]).keys()


def _guarded(problems: list, fn):
    """``fn`` for a thread: whatever escapes it (a failed assertion included) becomes a problem."""
    def run(*args):
        try:
            fn(*args)
        except BaseException as exc:  # reported by the test's assertion on ``problems``
            problems.append(f"thread {fn.__name__}{args}: {type(exc).__name__}: {exc}")
    return run


def _settled(c: CacheClient, base: dict) -> None:
    """Nothing held or pending anywhere, no internal error since ``base``, the host tier within its
    budget."""
    st = c.status()
    assert st["healthy"] is True
    assert st["pending_ops"] == [] and st["held_sources"] == {}, (st["pending_ops"], st["held_sources"])
    assert st["counters"]["internal_errors"] == base["counters"]["internal_errors"]
    assert st["originals"]["host_bytes"] <= st["originals"]["host_budget_bytes"]


# ---------------------------------------------------------------------------------- services
@pytest.fixture(scope="module")
def host_svc():
    """A service with its private store and a small host tier."""
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), allow_fault_injection=True,
                            host_budget_bytes=BUDGET, reap_interval_s=0.02, receive_spin_s=0.0, max_connections=64)
        with CacheService(cfg) as svc:
            yield svc


@pytest.fixture
def hc(host_svc):
    """A client of the private-store service, its status before the test, and a fresh registration."""
    layout, rope = small_layout(), small_rope()
    with CacheClient(host_svc.socket_path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
        base = c.status()
        reg = c.register(cache, layout, model_fingerprint=FP, rope=rope)
        yield SimpleNamespace(c=c, cache=cache, reg=reg, layout=layout, rope=rope, base=base, svc=host_svc)
        try:
            c.drain(reg, timeout=60)
        except KmeshError:
            pass
        assert c.close_registration(reg, timeout=60) is True


@pytest.fixture(scope="module")
def store_svc():
    """A service over a store this process writes too (``store_root``)."""
    root = tempfile.mkdtemp(prefix="kmesh-srcadv-")
    try:
        with socket_dir() as d:
            cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), store_root=root,
                                allow_fault_injection=True, reap_interval_s=0.02, receive_spin_s=0.0)
            with CacheService(cfg) as svc:
                yield SimpleNamespace(svc=svc, root=root, store=SegmentStore(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sc(store_svc):
    layout, rope = small_layout(), small_rope()
    with CacheClient(store_svc.svc.socket_path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
        base = c.status()
        reg = c.register(cache, layout, model_fingerprint=FP, rope=rope)
        yield SimpleNamespace(c=c, cache=cache, reg=reg, layout=layout, rope=rope, base=base, store=store_svc.store)
        assert c.close_registration(reg, timeout=60) is True


def _stored(store: SegmentStore, seed: int, pos0: int = 0, fp=FP):
    kv = _kv(seed)
    pos = torch.arange(pos0, pos0 + T, dtype=torch.int64)
    tok = torch.arange(T, dtype=torch.int64) + 1000 * seed
    return store.put(kv, tok, pos, model_fingerprint=fp), kv, pos, tok


# ---------------------------------------------------------------------------------- put, get, evict
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_get_returns_exactly_what_was_put_and_evict_lets_it_go_from_ram_only(hc, dtype):
    c = hc.c
    fp = fingerprint(dtype=str(dtype).removeprefix("torch."))
    cases = []
    for i, t in enumerate([T, 1, 17]):
        kv = _kv(100 + i, t, dtype)
        pos = torch.arange(t, dtype=torch.int64) * 3 + 7  # not 0..T-1: positions travel as they are
        tok = torch.arange(t, dtype=torch.int64) - 5
        key = c.put(kv, tok, pos, model_fingerprint=fp)
        assert c.put(kv, tok, pos, model_fingerprint=fp) == key  # the same segment: the same key
        cases.append((key, kv, pos, tok))
    for key, kv, pos, tok in cases:
        seg = c.get(key, model_fingerprint=fp)
        assert _same(seg.kv, kv) and _same(seg.positions, pos) and _same(seg.token_ids, tok)
    reads = _originals(c)["tier"]["reads"]
    for key, kv, *_ in cases:
        assert c.evict(key) is True
        assert c.evict(key) is False  # a second evict finds nothing
        assert key in _store_keys(c)  # the store's file stays
        assert _same(c.get(key, model_fingerprint=fp).kv, kv)  # read from the store again
    assert _originals(c)["tier"]["reads"] == reads + len(cases)
    with pytest.raises(KmeshError):  # an empty segment is refused, typed
        c.put(_kv(1, 0, dtype), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
              model_fingerprint=fp)
    with pytest.raises(KmeshError):  # a segment of another geometry than its fingerprint's
        c.put(_kv(1, T, dtype), torch.arange(T), torch.arange(T), model_fingerprint=fingerprint(num_layers=3))
    for key, *_ in cases:
        c.evict(key)
    _settled(c, hc.base)


def test_put_and_get_refuse_other_models(hc):
    c = hc.c
    key, kv, *_ = _put(c, 5)
    with pytest.raises(FingerprintMismatch, match=key):
        c.get(key, model_fingerprint=FP_OTHER)
    with SharedCache(hc.layout, fill=POISON) as other_cache:
        other = c.register(other_cache, hc.layout, model_fingerprint=FP_OTHER)
        before = _bits(other_cache.tensor)
        with pytest.raises(FingerprintMismatch, match=key):
            c.restore(other, [(key, [0, 1, 2, 3])])
        assert torch.equal(_bits(other_cache.tensor), before)
        assert c.close_registration(other) is True
    with pytest.raises(SegmentNotFound):
        c.get("0" * 64, model_fingerprint=FP)
    assert c.evict(key) is True
    _settled(c, hc.base)


def test_the_host_tier_never_exceeds_its_budget_and_reads_again_what_it_let_go(hc):
    c, layout = hc.c, hc.layout
    assert _originals(c)["host_budget_bytes"] == BUDGET
    made = [_put(c, 200 + i) for i in range(2 * BUDGET // ENTRY)]  # twice what the tier holds
    for _ in range(2):
        for i, (key, kv, *_) in enumerate(made):
            slots = [4 * (i % layout.num_blocks) + j for j in range(T)]
            c.restore(hc.reg, [(key, slots)])
            assert _same(_read(hc.cache, layout, slots), kv), i
            assert _originals(c)["host_bytes"] <= BUDGET
    tier = _originals(c)["tier"]
    assert tier["reads"] >= len(made) and tier["evictions"] > 0
    # a segment larger than the whole tier: published (in the store), restored never: typed, nothing written
    big = _kv(9, 1024)  # 128 KiB
    key = c.put(big, torch.arange(1024), torch.arange(1024), model_fingerprint=FP)
    assert key in _store_keys(c)
    before = _bits(hc.cache.tensor)
    with pytest.raises(BudgetExceeded, match=key):
        c.restore(hc.reg, [(key, list(range(1024)))])
    assert torch.equal(_bits(hc.cache.tensor), before)
    r = registration_of(c.status(), hc.reg.reg_id)
    assert r["held_blocks"] == [] and r["pending_ops"] == []
    for key, *_ in made:
        c.evict(key)
    _settled(c, hc.base)


def test_a_held_key_is_not_evicted_and_the_restore_delivers_it_whole(hc):
    c, layout = hc.c, hc.layout
    key, v1, *_ = _put(c, 1)
    op = c.restore(hc.reg, [(key, [0, 1, 2, 3]), (key, [8, 9, 10, 11])], wait=False, inject={"refuse_waits": 2})
    st = c.status()
    assert st["held_sources"] == {key: 1}
    for _ in range(2):  # the first two drains are refused: still pending, still held
        with pytest.raises(OwnershipError, match="held by a pending operation"):
            c.evict(key)
        assert _same(c.get(key, model_fingerprint=FP).kv, v1)
        with pytest.raises(DrainError, match="refused"):
            c.drain(hc.reg, [op])
    with pytest.raises(OwnershipError, match="held by a pending operation"):
        c.evict(key)
    assert c.drain(hc.reg, [op]) == [op]
    assert _same(_read(hc.cache, layout, [0, 1, 2, 3]), v1) and _same(_read(hc.cache, layout, [8, 9, 10, 11]), v1)
    # released: evicted, then restored again from the store
    assert c.evict(key) is True
    c.restore(hc.reg, [(key, [4, 5, 6, 7])])
    assert _same(_read(hc.cache, layout, [4, 5, 6, 7]), v1)
    assert c.evict(key) is True
    _settled(c, hc.base)


def test_a_pending_save_is_published_only_by_its_drain(hc):
    c, layout = hc.c, hc.layout
    hc.cache.tensor.copy_(torch.randn(hc.cache.tensor.shape, generator=torch.Generator().manual_seed(5))
                          .to(hc.cache.tensor.dtype))
    expected = _read(hc.cache, layout, [4, 5, 6, 7])
    published = _store_keys(c)
    with pytest.raises(DrainError, match="refused") as info:
        c.save(hc.reg, [4, 5, 6, 7], [1, 2, 3, 4], [40, 41, 42, 43], inject={"refuse_waits": 1})
    op = info.value.op_id
    assert op is not None and _store_keys(c) == published  # not before its drain
    r = registration_of(c.status(), hc.reg.reg_id)
    assert r["held_blocks"] == [1] and r["pending_ops"] == [op]
    with pytest.raises(OwnershipError, match="held by operation"):
        c.restore(hc.reg, [(_put(c, 6)[0], [4, 5, 6, 7])])  # nothing may overwrite the blocks being read
    assert c.drain(hc.reg, [op]) == [op]
    (key,) = set(_store_keys(c)) - set(published) - {_put(c, 6)[0]}
    seg = c.get(key, model_fingerprint=FP)
    assert _same(seg.kv, expected) and seg.positions.tolist() == [40, 41, 42, 43]
    assert seg.token_ids.tolist() == [1, 2, 3, 4]
    assert c.save(hc.reg, [4, 5, 6, 7], [1, 2, 3, 4], [40, 41, 42, 43]) == key  # the same content: the same key
    assert c.evict(key) is True
    _settled(c, hc.base)


@pytest.mark.parametrize("mode", ["fail_after_submit", "cancel", "fail_and_refused_wait"])
def test_a_failed_or_cancelled_save_is_never_published(hc, mode):
    c, layout = hc.c, hc.layout
    published = _store_keys(c)
    if mode == "cancel":
        with pytest.raises(DrainError) as info:
            c.save(hc.reg, [0, 1, 2, 3], list(range(T)), list(range(T)), inject={"refuse_waits": 1})
        op = info.value.op_id
        assert c.cancel(hc.reg, op)["outcome"] == "cancelled"
    else:
        inject = {"fail_after_submit": True}
        if mode == "fail_and_refused_wait":
            inject["refuse_waits"] = 1
        with pytest.raises(KmeshError, match="injected failure") as info:
            c.save(hc.reg, [0, 1, 2, 3], list(range(T)), list(range(T)), inject=inject)
        op = info.value.op_id
        assert op is not None
        if mode == "fail_and_refused_wait":
            with pytest.raises(DrainError):
                c.drain(hc.reg, [op])
    assert c.drain(hc.reg, [op]) == [op]
    assert _store_keys(c) == published
    # the registration saves on: a successful save of the same slots is published
    key = c.save(hc.reg, [0, 1, 2, 3], list(range(T)), list(range(T)))
    assert _same(c.get(key, model_fingerprint=FP).kv, _read(hc.cache, layout, [0, 1, 2, 3]))
    assert c.evict(key) is True
    _settled(c, hc.base)


def test_the_same_items_over_other_originals_restore_each_ones_bytes(hc):
    """The same item list shape (remembered checks on the registration) over originals with other
    contents and other stored positions, plain and shifted; and an original of another token count."""
    c, layout, rope = hc.c, hc.layout, hc.rope
    slots = [12, 13, 14, 15]
    new = [100, 101, 102, 103]
    for round_ in range(6):
        key, kv, pos, _ = _put(c, 50 + round_, pos0=10 * round_)
        c.restore(hc.reg, [(key, slots)])
        assert _same(_read(hc.cache, layout, slots), kv), round_
        ref = hc.cache.tensor.clone()
        place_many([kv], ref, layout, [torch.tensor(slots)], rope=rope, old_positions=[pos],
                   new_positions=[torch.tensor(new)])
        c.restore(hc.reg, [(key, slots, new)])
        assert torch.equal(_bits(hc.cache.tensor), _bits(ref)), round_
        assert c.evict(key) is True
    key, kv, *_ = _put(c, 77, t=2)
    with pytest.raises(KmeshError, match="expected 2 slots"):
        c.restore(hc.reg, [(key, slots)])
    c.restore(hc.reg, [(key, slots[:2])])
    assert _same(_read(hc.cache, layout, slots[:2]), kv)
    assert c.evict(key) is True
    _settled(c, hc.base)


# ---------------------------------------------------------------------------------- concurrency
def test_concurrent_restores_puts_evicts_saves_and_gets(hc):
    """Seeded threads, each over its own connection: restorers (own registrations; waiting, not
    waiting, and with a refused first wait that keeps the hold alive) and writers putting,
    evicting, saving and reading. Every successful restore's destination and every get equals its
    key's own bytes; refusals are the typed ones the contract names; afterwards nothing is held."""
    layout = hc.layout
    path = hc.svc.socket_path
    known: dict[str, torch.Tensor] = {}  # key -> its bytes
    klock = threading.Lock()
    problems: list[str] = []
    stats = {"restored": 0, "got": 0, "put": 0, "saved": 0, "evicted": 0, "evict_refused": 0}
    slock = threading.Lock()

    def count(name):
        with slock:
            stats[name] += 1

    def keys():
        with klock:
            return list(known)

    def restorer(seed):
        rng = random.Random(seed)
        with CacheClient(path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
            reg = c.register(cache, layout, model_fingerprint=FP)
            i = 0
            while not writers_done.is_set() and i < 400:
                i += 1
                ks = rng.sample(keys(), rng.choice([1, 1, 2]))
                blocks = rng.sample(range(layout.num_blocks), len(ks))
                items = [(k, [4 * b + j for j in range(T)]) for k, b in zip(ks, blocks)]
                mode = rng.choice(["wait", "wait", "nowait", "refused"])
                try:
                    if mode == "wait":
                        c.restore(reg, items)
                    elif mode == "nowait":
                        op = c.restore(reg, items, wait=False)
                        assert c.drain(reg, [op]) == [op]
                    else:
                        try:
                            c.restore(reg, items, inject={"refuse_waits": 1})
                            problems.append("a refused wait was not reported")
                        except DrainError as exc:
                            assert c.drain(reg, [exc.op_id]) == [exc.op_id]
                except Exception as exc:
                    problems.append(f"restore {items}: {type(exc).__name__}: {exc}")
                    continue
                for k, s in items:
                    if not _same(_read(cache, layout, s), known[k]):
                        problems.append(f"restore of {k} into {s} ({mode}): not its bytes")
                count("restored")
            assert c.close_registration(reg, timeout=60) is True

    def step(c, reg, cache, rng, seed, action):
        key = rng.choice(keys())
        try:
            if action == "put":
                k, kv, *_ = _put(c, seed)
                with klock:
                    known[k] = kv
                count("put")
            elif action == "evict":
                if c.evict(key):
                    count("evicted")
            elif action == "save":
                b = rng.randrange(layout.num_blocks)
                slots = [4 * b + j for j in range(T)]
                want = _read(cache, layout, slots)
                k = c.save(reg, slots, list(range(T)), list(range(T)))
                with klock:
                    known[k] = want
                count("saved")
            else:
                if not _same(c.get(key, model_fingerprint=FP).kv, known[key]):
                    problems.append(f"get {key}: not its bytes")
                count("got")
        except OwnershipError as exc:
            if action == "evict" and "held by a pending operation" in str(exc):
                count("evict_refused")
            else:
                problems.append(f"{action} {key}: {type(exc).__name__}: {exc}")
        except KmeshError as exc:
            problems.append(f"{action} {key}: {type(exc).__name__}: {exc}")

    def writer(seed):
        rng = random.Random(seed)
        with CacheClient(path, timeout=60) as c, SharedCache(layout, fill=0) as cache:
            g = torch.Generator().manual_seed(seed)
            cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g).to(cache.tensor.dtype))
            reg = c.register(cache, layout, model_fingerprint=FP)
            for i in range(60):
                plan = rng.choice([["put"], ["evict", "put"], ["evict", "save"], ["save"], ["evict"], ["get"]])
                for action in plan:
                    step(c, reg, cache, rng, seed * 1000 + i, action)
            assert c.close_registration(reg, timeout=60) is True

    for i in range(5):  # every thread starts with five originals
        k, kv, *_ = _put(hc.c, 5000 + i)
        known[k] = kv
    writers_done = threading.Event()
    readers = [threading.Thread(target=_guarded(problems, restorer), args=(s,)) for s in (11, 12, 13)]
    writers = [threading.Thread(target=_guarded(problems, writer), args=(s,)) for s in (21, 22)]
    threads = readers + writers
    for t in threads:
        t.start()
    for t in writers:
        t.join(120)
    writers_done.set()
    for t in readers:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not problems, problems[:10]
    assert stats["restored"] > 20 and stats["put"] > 3 and stats["saved"] > 3 and stats["evicted"] > 5, stats
    for k in known:
        hc.c.evict(k)
    _settled(hc.c, hc.base)


def test_many_clients_restore_one_key_while_it_is_evicted_again_and_again(hc):
    """A key evicted as fast as the holds allow while four clients restore it (each restore then
    reads it back through the tier, joined): every restore is its bytes, evictions are refused
    only while held."""
    layout = hc.layout
    path = hc.svc.socket_path
    key, kv, *_ = _put(hc.c, 1001)
    stop = threading.Event()
    problems: list[str] = []
    counts = {"ok": 0}
    lock = threading.Lock()

    def restorer(seed):
        rng = random.Random(seed)
        with CacheClient(path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
            reg = c.register(cache, layout, model_fingerprint=FP)
            n = 0
            while not stop.is_set() and n < 200:
                n += 1
                blk = rng.randrange(layout.num_blocks)
                slots = [4 * blk + j for j in range(T)]
                try:
                    c.restore(reg, [(key, slots)], inject={"refuse_waits": 1} if n % 5 == 0 else None)
                except DrainError as exc:
                    c.drain(reg, [exc.op_id])
                except Exception as exc:
                    problems.append(f"{type(exc).__name__}: {exc}")
                    continue
                if not _same(_read(cache, layout, slots), kv):
                    problems.append("a restore delivered other bytes")
                with lock:
                    counts["ok"] += 1
            assert c.close_registration(reg, timeout=60) is True

    threads = [threading.Thread(target=_guarded(problems, restorer), args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    evicted = refused = 0
    c = hc.c
    i = 0
    while i < 60 or (counts["ok"] < 20 and i < 3000):  # at least 60 attempts and 20 restores alongside
        i += 1
        try:
            evicted += c.evict(key)
        except OwnershipError as exc:
            assert "held by a pending operation" in str(exc)
            refused += 1
    stop.set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not problems, problems[:10]
    assert counts["ok"] > 10 and evicted > 0, (counts, evicted, refused)
    c.restore(hc.reg, [(key, [0, 1, 2, 3])])
    assert _same(_read(hc.cache, layout, [0, 1, 2, 3]), kv)
    c.evict(key)
    _settled(c, hc.base)


# ---------------------------------------------------------------------------------- segment store
def test_store_original_is_restored_exactly_and_retained_once(sc):
    c, layout, rope = sc.c, sc.layout, sc.rope
    key, kv, pos, tok = _stored(sc.store, 1, pos0=20)
    ref = layout.allocate(fill=POISON)
    place_many([kv], ref, layout, [torch.tensor([0, 1, 2, 3])], rope=rope, old_positions=[pos],
               new_positions=[torch.tensor([5, 6, 7, 8])])
    with SharedCache(layout, fill=POISON) as other_cache:
        other = c.register(other_cache, layout, model_fingerprint=FP_OTHER, rope=rope)
        with pytest.raises(FingerprintMismatch, match=key):
            c.restore(other, [(key, [0, 1, 2, 3], [5, 6, 7, 8])])
        assert torch.equal(_bits(other_cache.tensor), _bits(layout.allocate(fill=POISON)))
        assert c.close_registration(other) is True
    c.restore(sc.reg, [(key, [0, 1, 2, 3], [5, 6, 7, 8])])
    assert torch.equal(_bits(sc.cache.tensor), _bits(ref))
    src = _originals(c)
    assert src["host_keys"] == sc.base["originals"]["host_keys"] + 1
    assert src["host_bytes"] == sc.base["originals"]["host_bytes"] + ENTRY
    seg = c.get(key, model_fingerprint=FP)
    assert _same(seg.kv, kv) and torch.equal(seg.positions, pos) and torch.equal(seg.token_ids, tok)
    assert c.evict(key) is True
    assert c.evict(key) is False
    assert key in sc.store  # the store's file is not the host tier's to delete
    _settled(c, sc.base)


def _flip_payload_byte(path):
    with open(path, "r+b") as f:
        f.seek(4096 + 3)
        b = f.read(1)
        f.seek(4096 + 3)
        f.write(bytes([b[0] ^ 0x40]))


def _truncate(n):
    def f(path):
        with open(path, "r+b") as fh:
            fh.truncate(n if n >= 0 else os.path.getsize(path) + n)
    return f


def _replace_with(what):
    def f(path):
        os.unlink(path)
        what(path)
    return f


FAULTS = [
    ("payload-bit-flip", _flip_payload_byte, IntegrityError),
    ("truncated-in-header", _truncate(100), IntegrityError),
    ("truncated-footer", _truncate(-5), IntegrityError),
    ("empty", _truncate(0), IntegrityError),
    ("random-bytes", lambda p: open(p, "wb").write(random.Random(3).randbytes(9000)), IntegrityError),
    ("missing", os.unlink, SegmentNotFound),
    ("directory", _replace_with(os.mkdir), IntegrityError),
    ("fifo", _replace_with(os.mkfifo), IntegrityError),
    ("symlink-loop", _replace_with(lambda p: os.symlink(p, p)), KmeshError),
]


@pytest.mark.parametrize("n, fault, exc", [(i, *f[1:]) for i, f in enumerate(FAULTS)], ids=[f[0] for f in FAULTS])
def test_store_faults_are_typed_errors_naming_the_key_and_write_nothing(sc, n, fault, exc):
    c, layout = sc.c, sc.layout
    good_key, good_kv, _, _ = _stored(sc.store, 7)
    key, _, _, _ = _stored(sc.store, 300 + n)
    fault(sc.store.path(key))
    before = _bits(sc.cache.tensor)
    for items in ([(key, [0, 1, 2, 3])], [(good_key, [4, 5, 6, 7]), (key, [0, 1, 2, 3])]):
        for wait in (True, False):
            with pytest.raises(exc, match=key) as info:
                c.restore(sc.reg, items, wait=wait)
            assert "internal error" not in str(info.value)
    with pytest.raises(exc, match=key):
        c.get(key, model_fingerprint=FP)
    assert torch.equal(_bits(sc.cache.tensor), before)  # nothing written, not even the good item
    r = registration_of(c.status(), sc.reg.reg_id)
    assert r["held_blocks"] == [] and r["pending_ops"] == []
    # the service is healthy: the good original restores exactly
    c.restore(sc.reg, [(good_key, [4, 5, 6, 7])])
    assert _same(_read(sc.cache, layout, [4, 5, 6, 7]), good_kv)
    assert c.evict(good_key) is True
    _settled(c, sc.base)


def test_store_file_replaced_between_two_restores(sc):
    """A retained original keeps serving the bytes it was verified with; once evicted from the host
    tier the file is read again, and a file that now holds another segment is refused, typed and
    naming the key, without writing; putting the right file back makes it restorable again."""
    c, layout = sc.c, sc.layout
    key, kv, _, _ = _stored(sc.store, 41)
    other, _, _, _ = _stored(sc.store, 42)
    path = sc.store.path(key)
    saved = open(path, "rb").read()
    c.restore(sc.reg, [(key, [0, 1, 2, 3])])
    assert _same(_read(sc.cache, layout, [0, 1, 2, 3]), kv)
    tmp = path + ".swap"
    shutil.copyfile(sc.store.path(other), tmp)
    os.replace(tmp, path)  # another valid segment's file under this key's name
    c.restore(sc.reg, [(key, [4, 5, 6, 7])])  # retained copy
    assert _same(_read(sc.cache, layout, [4, 5, 6, 7]), kv)
    assert c.evict(key) is True
    before = _bits(sc.cache.tensor)
    with pytest.raises(IntegrityError, match=key):
        c.restore(sc.reg, [(key, [8, 9, 10, 11])])
    assert torch.equal(_bits(sc.cache.tensor), before)
    with open(tmp, "wb") as f:
        f.write(saved)
    os.replace(tmp, path)
    c.restore(sc.reg, [(key, [8, 9, 10, 11])])
    assert _same(_read(sc.cache, layout, [8, 9, 10, 11]), kv)
    assert c.evict(key) is True
    _settled(c, sc.base)


def test_store_key_restored_by_many_clients_at_once(sc, store_svc):
    """Concurrent first uses of one store key: every restore is exact, the key is read and retained
    once (the tier joins concurrent loads) and its bytes are charged once."""
    layout = sc.layout
    key, kv, _, _ = _stored(sc.store, 61)
    keys2 = [_stored(sc.store, 62 + i) for i in range(3)]
    problems: list[str] = []
    barrier = threading.Barrier(4)
    reads = _originals(sc.c)["tier"]["reads"]

    def run(seed):
        rng = random.Random(seed)
        with CacheClient(store_svc.svc.socket_path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
            reg = c.register(cache, layout, model_fingerprint=FP)
            barrier.wait(30)
            for _ in range(15):
                k2, kv2, _, _ = rng.choice(keys2)
                try:
                    c.restore(reg, [(key, [0, 1, 2, 3]), (k2, [4, 5, 6, 7])])
                except Exception as exc:
                    problems.append(f"{type(exc).__name__}: {exc}")
                    continue
                first, second = _read(cache, layout, [0, 1, 2, 3]), _read(cache, layout, [4, 5, 6, 7])
                if not (_same(first, kv) and _same(second, kv2)):
                    problems.append("restore not exact")
            assert c.close_registration(reg, timeout=60) is True

    threads = [threading.Thread(target=_guarded(problems, run), args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not problems, problems[:5]
    src = _originals(sc.c)
    assert src["host_keys"] == sc.base["originals"]["host_keys"] + 4
    assert src["host_bytes"] == sc.base["originals"]["host_bytes"] + 4 * ENTRY
    assert src["tier"]["reads"] == reads + 4  # one read per key, whoever asked first
    for k in [key] + [k for k, *_ in keys2]:
        assert sc.c.evict(k) is True
    _settled(sc.c, sc.base)
