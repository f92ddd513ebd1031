"""Adversarial checks of the shared originals the cache service owns (CPU shared memory, seeded).

Scope: the host tier (:class:`~kmesh_host.service.sources.HostOriginals`, its byte budget), the
segment store behind it (``ServiceConfig.store_root``), and the handlers that use them: ``put``,
``get``, ``evict``, ``save`` (published on its drain), ``restore`` and the registry's source holds.

What is checked: ``get`` returns exactly what was put or saved; the host budget is never exceeded
and returns to its baseline; a key held by a pending restore or save cannot be evicted or replaced,
and the restore delivers the version it resolved; a key evicted and published again is never served
stale; a save is published only after its drain and only when it succeeded; store faults (corrupt,
truncated, missing, not a file, wrong model, a file replaced between two restores) are typed
errors naming the key that write nothing; and seeded threads over separate connections restoring,
putting, evicting, saving and reading the same keys always see one whole version of each original,
leave nothing held and cause no internal error.

Copies on CPU are synchronous; a copy is kept *pending* (its holds alive) with the service's fault
injection ``{"refuse_waits": n}``, never with sleeps.

Checks that currently fail (bugs) live in /tmp/audit3/sources/failing_tests.py, not here.
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
    DrainError,
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    OwnershipError,
    SegmentNotFound,
)
from kmesh_host import ModelFingerprint, SegmentStore
from kmesh_host.service import CacheClient, CacheService, RestoreItem, ServiceConfig, SharedCache, protocol
from tests.helpers.service import registration_of, small_layout, small_rope, socket_dir

POISON = 0x5A
T = 4
KV_BYTES = 2 * 2 * T * 2 * 8 * 2  # one (2, L=2, T=4, H=2, D=8) bfloat16 original: 512 bytes
BUDGET = 40 * KV_BYTES


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


def _sources(c: CacheClient) -> dict:
    return c.status()["sources"]


def _guarded(problems: list, fn):
    """``fn`` for a thread: whatever escapes it (a failed assertion included) becomes a problem."""
    def run(*args):
        try:
            fn(*args)
        except BaseException as exc:  # reported by the test's assertion on ``problems``
            problems.append(f"thread {fn.__name__}{args}: {type(exc).__name__}: {exc}")
    return run


def _settled(c: CacheClient, base: dict) -> None:
    """Nothing held or pending anywhere, no internal error since ``base``, the host tier at ``base``'s
    size (every test evicts what it published)."""
    st = c.status()
    assert st["healthy"] is True
    assert st["pending_ops"] == [] and st["held_sources"] == {}, (st["pending_ops"], st["held_sources"])
    assert st["counters"]["internal_errors"] == base["counters"]["internal_errors"]
    for k in ("host_keys", "host_bytes"):
        assert st["sources"][k] == base["sources"][k], (k, st["sources"], base["sources"])
    assert st["sources"]["host_bytes"] <= st["sources"]["host_budget_bytes"]


# ---------------------------------------------------------------------------------- services
@pytest.fixture(scope="module")
def host_svc():
    with socket_dir() as d:
        cfg = ServiceConfig(socket_path=os.path.join(d, "svc", "kmesh.sock"), allow_fault_injection=True,
                            host_budget_bytes=BUDGET, reap_interval_s=0.02, receive_spin_s=0.0, max_connections=64)
        with CacheService(cfg) as svc:
            yield svc


@pytest.fixture
def hc(host_svc):
    """A client of the host-only service, its status before the test, and a fresh registration."""
    layout, rope = small_layout(), small_rope()
    with CacheClient(host_svc.socket_path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
        base = c.status()
        reg = c.register(cache, layout, rope=rope)
        yield SimpleNamespace(c=c, cache=cache, reg=reg, layout=layout, rope=rope, base=base, svc=host_svc)
        try:
            c.drain(reg, timeout=10)
        except KmeshError:
            pass
        assert c.close_registration(reg, timeout=10) is True


FP = ModelFingerprint("Qwen2ForCausalLM", 2, 2, 8, "bfloat16", small_rope().to_dict())
FP_OTHER = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "bfloat16", small_rope().to_dict())


@pytest.fixture(scope="module")
def store_svc():
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
        reg = c.register(cache, layout, rope=rope)
        yield SimpleNamespace(c=c, cache=cache, reg=reg, layout=layout, rope=rope, base=base, store=store_svc.store)
        assert c.close_registration(reg, timeout=10) is True


def _stored(store: SegmentStore, seed: int, pos0: int = 0):
    kv = _kv(seed)
    pos = torch.arange(pos0, pos0 + T, dtype=torch.int64)
    tok = torch.arange(T, dtype=torch.int64) + 1000 * seed
    return store.put(kv, tok, pos, model_fingerprint=FP), kv, pos, tok


# ---------------------------------------------------------------------------------- host tier
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_get_returns_exactly_what_was_put_and_evict_returns_its_bytes(hc, dtype):
    c = hc.c
    cases = []
    for i, (t, with_tokens) in enumerate([(T, True), (1, False), (17, True), (0, False)]):
        key = f"rt-{dtype}-{i}"
        kv = _kv(100 + i, t, dtype)
        pos = torch.arange(t, dtype=torch.int64) * 3 + 7  # not 0..T-1: positions travel as they are
        tok = torch.arange(t, dtype=torch.int64) - 5 if with_tokens else None
        before = _sources(c)["host_bytes"]
        c.put(key, kv, pos, tok)
        assert _sources(c)["host_bytes"] == before + kv.numel() * kv.element_size()
        cases.append((key, kv, pos, tok))
    for key, kv, pos, tok in cases:
        got_kv, got_pos, got_tok = c.get(key)
        assert _same(got_kv, kv) and _same(got_pos, pos)
        assert (got_tok is None) if tok is None else _same(got_tok, tok)
    for key, *_ in cases:
        assert c.evict(key) is True
        assert c.evict(key) is False  # a second evict finds nothing
        with pytest.raises(SegmentNotFound, match=key):
            c.get(key)
    _settled(c, hc.base)


def test_host_budget_is_never_exceeded_and_returns_to_baseline(hc):
    c, layout = hc.c, hc.layout
    src = _sources(c)
    assert src["host_budget_bytes"] == BUDGET
    room = (BUDGET - src["host_bytes"]) // KV_BYTES
    keys = []
    for i in range(room):
        c.put(f"budget-{i}", _kv(i), torch.arange(T))
        keys.append(f"budget-{i}")
        assert _sources(c)["host_bytes"] <= BUDGET
    with pytest.raises(KmeshError, match="exceed the host budget"):
        c.put("budget-over", _kv(999), torch.arange(T))
    with pytest.raises(SegmentNotFound):
        c.get("budget-over")
    full = _sources(c)
    assert full["host_bytes"] <= BUDGET and BUDGET - full["host_bytes"] < KV_BYTES
    # a save whose publication would exceed the budget: typed, not published, nothing left held
    hc.cache.tensor.view(torch.uint8).fill_(7)
    with pytest.raises(KmeshError, match="exceed the host budget") as info:
        c.save(hc.reg, "budget-save", [0, 1, 2, 3], list(range(T)))
    assert info.value.op_id is not None
    assert _sources(c) == full
    r = registration_of(c.status(), hc.reg.reg_id)
    assert r["held_blocks"] == [] and r["pending_ops"] == []
    with pytest.raises(SegmentNotFound):
        c.get("budget-save")
    # one eviction makes room for exactly one more, then the same save goes through
    assert c.evict(keys.pop()) is True
    c.save(hc.reg, "budget-save", [0, 1, 2, 3], list(range(T)))
    kv, pos, _ = c.get("budget-save")
    assert _same(kv, _read(hc.cache, layout, [0, 1, 2, 3])) and pos.tolist() == list(range(T))
    assert _sources(c)["host_bytes"] <= BUDGET
    for k in keys + ["budget-save"]:
        assert c.evict(k) is True
    _settled(c, hc.base)


def test_a_held_key_is_neither_evicted_nor_replaced_and_the_restore_delivers_what_it_resolved(hc):
    c, layout = hc.c, hc.layout
    key = "held-k"
    v1, v2 = _kv(1), _kv(2)
    c.put(key, v1, torch.arange(T))
    op = c.restore(hc.reg, [(key, [0, 1, 2, 3]), (key, [8, 9, 10, 11])], wait=False,
                   inject={"refuse_waits": 2})
    st = c.status()
    assert st["held_sources"].get(key, 0) >= 1
    for _ in range(2):  # the first two drains are refused: still pending, still held
        with pytest.raises(OwnershipError, match="held by a pending operation"):
            c.evict(key)
        with pytest.raises(KmeshError, match="already present"):
            c.put(key, v2, torch.arange(T))
        assert _same(c.get(key)[0], v1)
        with pytest.raises(DrainError, match="refused"):
            c.drain(hc.reg, [op])
    with pytest.raises(OwnershipError, match="held by a pending operation"):
        c.evict(key)
    assert c.drain(hc.reg, [op]) == [op]
    # the restore delivered the version it resolved, whole
    assert _same(_read(hc.cache, layout, [0, 1, 2, 3]), v1) and _same(_read(hc.cache, layout, [8, 9, 10, 11]), v1)
    # released: evict, publish another version, and it is what is served from now on
    assert c.evict(key) is True
    c.put(key, v2, torch.arange(T))
    c.restore(hc.reg, [(key, [0, 1, 2, 3])])
    assert _same(_read(hc.cache, layout, [0, 1, 2, 3]), v2)
    assert _same(_read(hc.cache, layout, [8, 9, 10, 11]), v1)  # untouched
    assert _same(c.get(key)[0], v2)
    assert c.evict(key) is True
    _settled(c, hc.base)


def test_a_pending_save_holds_its_key_against_every_writer(hc):
    c, layout = hc.c, hc.layout
    key = "held-save"
    hc.cache.tensor.copy_(torch.randn(hc.cache.tensor.shape, generator=torch.Generator().manual_seed(5))
                          .to(hc.cache.tensor.dtype))
    expected = _read(hc.cache, layout, [4, 5, 6, 7])
    op = c.save(hc.reg, key, [4, 5, 6, 7], [40, 41, 42, 43], [1, 2, 3, 4], wait=False, inject={"refuse_waits": 1})
    assert c.status()["held_sources"] == {key: 1}
    with pytest.raises(SegmentNotFound):
        c.get(key)  # not before its drain
    with pytest.raises(OwnershipError, match="being saved|pending"):
        c.put(key, _kv(3), torch.arange(T))
    with pytest.raises(OwnershipError, match="held by a pending operation"):
        c.evict(key)
    with SharedCache(layout, fill=0) as other_cache:  # a second save of the key, from another registration
        other = c.register(other_cache, layout)
        with pytest.raises(OwnershipError, match="being saved"):
            c.save(other, key, [0, 1, 2, 3], [0, 1, 2, 3])
        assert c.close_registration(other) is True
    with pytest.raises(DrainError, match="refused"):
        c.drain(hc.reg, [op])
    with pytest.raises(SegmentNotFound):
        c.get(key)  # a refused wait is no drain: still unpublished
    assert c.drain(hc.reg, [op]) == [op]
    kv, pos, tok = c.get(key)
    assert _same(kv, expected) and pos.tolist() == [40, 41, 42, 43] and tok.tolist() == [1, 2, 3, 4]
    assert c.evict(key) is True
    _settled(c, hc.base)


@pytest.mark.parametrize("mode", ["fail_after_submit", "cancel", "fail_and_refused_wait"])
def test_a_failed_or_cancelled_save_is_never_published(hc, mode):
    c, layout = hc.c, hc.layout
    key = f"unpublished-{mode}"
    if mode == "cancel":
        op = c.save(hc.reg, key, [0, 1, 2, 3], list(range(T)), wait=False, inject={"refuse_waits": 1})
        assert c.cancel(hc.reg, op)["outcome"] == "cancelled"
        with pytest.raises(DrainError):
            c.drain(hc.reg, [op])
    else:
        inject = {"fail_after_submit": True}
        if mode == "fail_and_refused_wait":
            inject["refuse_waits"] = 1
        with pytest.raises(KmeshError, match="injected failure") as info:
            c.save(hc.reg, key, [0, 1, 2, 3], list(range(T)), wait=False, inject=inject)
        op = info.value.op_id
        assert op is not None
        if mode == "fail_and_refused_wait":
            with pytest.raises(DrainError):
                c.drain(hc.reg, [op])
    with pytest.raises(OwnershipError):
        c.put(key, _kv(4), torch.arange(T))  # still being saved until its drain
    assert c.drain(hc.reg, [op]) == [op]
    with pytest.raises(SegmentNotFound):
        c.get(key)
    # the key is free again: a put and a successful save of another key both work
    c.put(key, _kv(4), torch.arange(T))
    assert _same(c.get(key)[0], _kv(4))
    assert c.evict(key) is True
    c.save(hc.reg, key + "-ok", [0, 1, 2, 3], list(range(T)))
    assert _same(c.get(key + "-ok")[0], _read(hc.cache, layout, [0, 1, 2, 3]))
    assert c.evict(key + "-ok") is True
    _settled(c, hc.base)


def test_an_evicted_and_republished_key_is_never_served_stale(hc):
    """The same item list (remembered checks on the registration) over versions of one key with
    other contents and other stored positions, plain and shifted; and a version with another token
    count under the same key."""
    c, layout, rope = hc.c, hc.layout, hc.rope
    key = "stale-k"
    slots = [12, 13, 14, 15]
    new = [100, 101, 102, 103]
    for round_ in range(6):
        kv = _kv(50 + round_)
        pos = torch.arange(T, dtype=torch.int64) + 10 * round_
        c.put(key, kv, pos)
        c.restore(hc.reg, [(key, slots)])
        assert _same(_read(hc.cache, layout, slots), kv), round_
        ref = hc.cache.tensor.clone()
        place_many([kv], ref, layout, [torch.tensor(slots)], rope=rope, old_positions=[pos],
                   new_positions=[torch.tensor(new)])
        c.restore(hc.reg, [RestoreItem(key, slots, new)])
        assert torch.equal(_bits(hc.cache.tensor), _bits(ref)), round_
        got, got_pos, _ = c.get(key)
        assert _same(got, kv) and torch.equal(got_pos, pos)
        assert c.evict(key) is True
    c.put(key, _kv(77, t=2), torch.arange(2))
    with pytest.raises(KmeshError, match="expected 2 slots"):
        c.restore(hc.reg, [(key, slots)])
    c.restore(hc.reg, [(key, slots[:2])])
    assert _same(_read(hc.cache, layout, slots[:2]), _kv(77, t=2))
    assert c.evict(key) is True
    with pytest.raises(SegmentNotFound, match=key):
        c.restore(hc.reg, [(key, slots)])
    _settled(c, hc.base)


# ---------------------------------------------------------------------------------- concurrency
KEYS = [f"cc-{i}" for i in range(5)]


def test_concurrent_restores_puts_evicts_saves_and_gets(hc):
    """Seeded threads, each over its own connection: restorers (own registrations; waiting,
    not waiting, and with a refused first wait that keeps the hold alive) and writers putting,
    evicting, saving and reading the same keys. Every successful restore's destination and every
    get equals one whole published version of its key; refusals are the typed ones the contract
    names; afterwards nothing is held and the host tier is back to its baseline."""
    layout = hc.layout
    path = hc.svc.socket_path
    versions: dict[str, list[torch.Tensor]] = {k: [] for k in KEYS}
    vlock = threading.Lock()
    problems: list[str] = []
    stats = {"restored": 0, "got": 0, "put": 0, "saved": 0, "evicted": 0, "evict_refused": 0}
    slock = threading.Lock()

    def count(name):
        with slock:
            stats[name] += 1

    def candidates(key):
        with vlock:
            return list(versions[key])

    def matches(key, got):
        return any(_same(got, v) for v in candidates(key))

    def restorer(seed):
        rng = random.Random(seed)
        with CacheClient(path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
            reg = c.register(cache, layout)
            i = 0
            while not writers_done.is_set() and i < 400:
                i += 1
                ks = rng.sample(KEYS, rng.choice([1, 1, 2]))
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
                except SegmentNotFound:
                    continue
                except Exception as exc:
                    problems.append(f"restore {items}: {type(exc).__name__}: {exc}")
                    continue
                for k, s in items:
                    if not matches(k, _read(cache, layout, s)):
                        problems.append(f"restore of {k} into {s} ({mode}): not one published version")
                count("restored")
            assert c.close_registration(reg, timeout=10) is True

    def step(c, reg, cache, rng, seed, key, action):
        try:
            if action == "put":
                kv = _kv(seed)
                with vlock:
                    versions[key].append(kv)  # a candidate before anyone can see it
                c.put(key, kv, torch.arange(T))
                count("put")
            elif action == "evict":
                if c.evict(key):
                    count("evicted")
            elif action == "save":
                b = rng.randrange(layout.num_blocks)
                slots = [4 * b + j for j in range(T)]
                with vlock:
                    versions[key].append(_read(cache, layout, slots))
                c.save(reg, key, slots, list(range(T)))
                count("saved")
            else:
                kv, pos, _ = c.get(key)
                if not matches(key, kv) or pos.tolist() != list(range(T)):
                    problems.append(f"get {key}: not one published version")
                count("got")
        except SegmentNotFound:
            if action != "get":
                problems.append(f"{action} {key}: SegmentNotFound")
        except OwnershipError as exc:
            msg = str(exc)
            if action == "evict" and "held by a pending operation" in msg:
                count("evict_refused")
            elif not (action in ("put", "save") and ("being saved" in msg or "save into it" in msg)):
                problems.append(f"{action} {key}: {type(exc).__name__}: {exc}")
        except KmeshError as exc:
            if not (action in ("put", "save") and "already present" in str(exc)):
                problems.append(f"{action} {key}: {type(exc).__name__}: {exc}")

    def writer(seed):
        rng = random.Random(seed)
        with CacheClient(path, timeout=60) as c, SharedCache(layout, fill=0) as cache:
            g = torch.Generator().manual_seed(seed)
            cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g).to(cache.tensor.dtype))
            reg = c.register(cache, layout)
            for i in range(60):
                key = rng.choice(KEYS)
                plan = rng.choice([["put"], ["evict", "put"], ["evict", "put"], ["evict", "save"],
                                   ["evict", "save"], ["save"], ["evict"], ["get"]])
                for action in plan:
                    step(c, reg, cache, rng, seed * 1000 + i, key, action)
            assert c.close_registration(reg, timeout=10) is True

    for k in KEYS:  # every key starts published
        kv = _kv(5000 + KEYS.index(k))
        versions[k].append(kv)
        hc.c.put(k, kv, torch.arange(T))
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
    for k in KEYS:
        hc.c.evict(k)
    _settled(hc.c, hc.base)


def test_many_clients_restore_one_key_while_it_is_evicted_and_republished(hc):
    """A key that is evicted and republished with alternating contents as fast as the holds allow,
    while four clients restore it: every restore is one whole version, evictions are refused only
    while held, and the final restore after the last publication sees that publication."""
    layout = hc.layout
    path = hc.svc.socket_path
    key = "cc-hot"
    a, b = _kv(1001), _kv(1002)
    hc.c.put(key, a, torch.arange(T))
    stop = threading.Event()
    problems: list[str] = []
    counts = {"ok": 0, "missing": 0}
    lock = threading.Lock()

    def restorer(seed):
        rng = random.Random(seed)
        with CacheClient(path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
            reg = c.register(cache, layout)
            n = 0
            while not stop.is_set() and n < 200:
                n += 1
                blk = rng.randrange(layout.num_blocks)
                slots = [4 * blk + j for j in range(T)]
                try:
                    c.restore(reg, [(key, slots)], inject={"refuse_waits": 1} if n % 5 == 0 else None)
                except DrainError as exc:
                    c.drain(reg, [exc.op_id])
                except SegmentNotFound:
                    with lock:
                        counts["missing"] += 1
                    continue
                except Exception as exc:
                    problems.append(f"{type(exc).__name__}: {exc}")
                    continue
                got = _read(cache, layout, slots)
                if not (_same(got, a) or _same(got, b)):
                    problems.append("a restore delivered neither version")
                with lock:
                    counts["ok"] += 1
            assert c.close_registration(reg, timeout=10) is True

    threads = [threading.Thread(target=_guarded(problems, restorer), args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    flips = refused = 0
    c = hc.c
    i = 0
    while i < 60 or (counts["ok"] < 20 and i < 3000):  # at least 60 attempts and 20 restores alongside
        i += 1
        try:
            if c.evict(key):
                c.put(key, b if flips % 2 == 0 else a, torch.arange(T))
                flips += 1
        except OwnershipError as exc:
            assert "held by a pending operation" in str(exc)
            refused += 1
    stop.set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not problems, problems[:10]
    assert counts["ok"] > 10 and flips > 0, (counts, flips, refused)
    last = b if flips % 2 == 1 else a
    c.restore(hc.reg, [(key, [0, 1, 2, 3])])
    assert _same(_read(hc.cache, layout, [0, 1, 2, 3]), last)
    assert c.evict(key) is True
    _settled(c, hc.base)


# ---------------------------------------------------------------------------------- segment store
def test_store_original_is_restored_exactly_and_retained_once(sc):
    c, layout, rope = sc.c, sc.layout, sc.rope
    key, kv, pos, tok = _stored(sc.store, 1, pos0=20)
    ref = layout.allocate(fill=POISON)
    place_many([kv], ref, layout, [torch.tensor([0, 1, 2, 3])], rope=rope, old_positions=[pos],
               new_positions=[torch.tensor([5, 6, 7, 8])])
    with pytest.raises(FingerprintMismatch, match=key):
        c.restore(sc.reg, [(key, [0, 1, 2, 3], [5, 6, 7, 8])], model_fingerprint=FP_OTHER.to_dict())
    assert _sources(c)["host_keys"] == sc.base["sources"]["host_keys"]  # nothing retained by a refusal
    assert torch.equal(_bits(sc.cache.tensor), _bits(layout.allocate(fill=POISON)))
    c.restore(sc.reg, [(key, [0, 1, 2, 3], [5, 6, 7, 8])], model_fingerprint=FP.to_dict())
    assert torch.equal(_bits(sc.cache.tensor), _bits(ref))
    src = _sources(c)
    assert src["host_keys"] == sc.base["sources"]["host_keys"] + 1
    assert src["host_bytes"] == sc.base["sources"]["host_bytes"] + KV_BYTES
    reply = c.call({"op": "get", "key": key, "model_fingerprint": FP.to_dict()})
    got = protocol.unpack_tensor(reply.header["tensors"], reply.body, "kv")
    got_pos = protocol.unpack_tensor(reply.header["tensors"], reply.body, "positions")
    got_tok = protocol.unpack_tensor(reply.header["tensors"], reply.body, "token_ids")
    assert _same(got, kv) and torch.equal(got_pos, pos) and torch.equal(got_tok, tok)
    assert c.evict(key) is True
    assert c.evict(key) is False  # the store's file is not the host tier's to delete
    assert key in sc.store
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
                c.restore(sc.reg, items, wait=wait, model_fingerprint=FP.to_dict())
            assert "internal error" not in str(info.value)
    with pytest.raises(exc, match=key):
        c.call({"op": "get", "key": key, "model_fingerprint": FP.to_dict()})
    assert torch.equal(_bits(sc.cache.tensor), before)  # nothing written, not even the good item
    r = registration_of(c.status(), sc.reg.reg_id)
    assert r["held_blocks"] == [] and r["pending_ops"] == []
    # the service is healthy: the good original restores exactly
    c.restore(sc.reg, [(good_key, [4, 5, 6, 7])], model_fingerprint=FP.to_dict())
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
    c.restore(sc.reg, [(key, [0, 1, 2, 3])], model_fingerprint=FP.to_dict())
    assert _same(_read(sc.cache, layout, [0, 1, 2, 3]), kv)
    tmp = path + ".swap"
    shutil.copyfile(sc.store.path(other), tmp)
    os.replace(tmp, path)  # another valid segment's file under this key's name
    c.restore(sc.reg, [(key, [4, 5, 6, 7])], model_fingerprint=FP.to_dict())  # retained copy
    assert _same(_read(sc.cache, layout, [4, 5, 6, 7]), kv)
    assert c.evict(key) is True
    before = _bits(sc.cache.tensor)
    with pytest.raises(IntegrityError, match=key):
        c.restore(sc.reg, [(key, [8, 9, 10, 11])], model_fingerprint=FP.to_dict())
    assert torch.equal(_bits(sc.cache.tensor), before)
    with open(tmp, "wb") as f:
        f.write(saved)
    os.replace(tmp, path)
    c.restore(sc.reg, [(key, [8, 9, 10, 11])], model_fingerprint=FP.to_dict())
    assert _same(_read(sc.cache, layout, [8, 9, 10, 11]), kv)
    assert c.evict(key) is True
    _settled(c, sc.base)


def test_store_key_restored_by_many_clients_at_once(sc, store_svc):
    """Concurrent first uses of one store key: every restore is exact, the key is retained once and
    its bytes are charged once."""
    layout = sc.layout
    key, kv, _, _ = _stored(sc.store, 61)
    keys2 = [_stored(sc.store, 62 + i) for i in range(3)]
    problems: list[str] = []
    barrier = threading.Barrier(4)

    def run(seed):
        rng = random.Random(seed)
        with CacheClient(store_svc.svc.socket_path, timeout=60) as c, SharedCache(layout, fill=POISON) as cache:
            reg = c.register(cache, layout)
            barrier.wait(30)
            for _ in range(15):
                k2, kv2, _, _ = rng.choice(keys2)
                try:
                    c.restore(reg, [(key, [0, 1, 2, 3]), (k2, [4, 5, 6, 7])], model_fingerprint=FP.to_dict())
                except Exception as exc:
                    problems.append(f"{type(exc).__name__}: {exc}")
                    continue
                first, second = _read(cache, layout, [0, 1, 2, 3]), _read(cache, layout, [4, 5, 6, 7])
                if not (_same(first, kv) and _same(second, kv2)):
                    problems.append("restore not exact")
            assert c.close_registration(reg, timeout=10) is True

    threads = [threading.Thread(target=_guarded(problems, run), args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not problems, problems[:5]
    src = _sources(sc.c)
    assert src["host_keys"] == sc.base["sources"]["host_keys"] + 4
    assert src["host_bytes"] == sc.base["sources"]["host_bytes"] + 4 * KV_BYTES
    for k in [key] + [k for k, *_ in keys2]:
        assert sc.c.evict(k) is True
    _settled(sc.c, sc.base)
