"""Model-based randomized checks of the ownership and drain state machine (CPU only, seeded).

The :class:`~kmesh_host.service.registry.Registry` is driven directly with fake completions the
test controls (finished now or later, the next k waits refused or raising, ``False`` at the
deadline), interleaving registrations, operations over overlapping and disjoint block sets,
submissions, drains with and without timeouts, cancels, acquires, closes, dead connections, reaps,
replacement clients and re-registrations of a freed handle. A reference model says what must be
held; after every step:

* an operation is released (its blocks free for a new operation or an acquire, its sources no
  longer held) exactly when a wait on its completion has returned ``True`` (or nothing was
  submitted); refused, failed and timed-out waits release nothing and are each counted;
* a registration is freed (``release_memory``) exactly once, exactly when it is closed or orphaned
  and its last operation has drained; other registrations are never affected;
* identities: a generation per registration, a new secret, no reuse by a replacement client.

A threaded variant runs the same registry from several threads against completions finished by a
fake device thread, checking the same rules as they can be observed concurrently, that every wait
stays bounded (no deadlock), and that everything returns to zero at the end. A few checks drive the
service's own handlers in-process (CPU shared memory, no sockets) for the server's use of the
registry: ``_submit``/``_finish``, save/restore/drain/acquire/cancel/close, ``_reap_loop``.

Checks that currently fail (bugs) live in /tmp/audit2/registry/failing_tests.py, not here.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import random
import socket
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

from kmesh_gpu import KVLayout
from kmesh_gpu.errors import DrainError, OwnershipError
from kmesh_host.service import SharedCache, protocol, restore_wire
from kmesh_host.service.completions import RefusingCompletion
from kmesh_host.service.registry import Completion, Finished, PeerIdentity, Registry
from tests.kmesh_host.service.helpers import settle

NUM_BLOCKS, BLOCK_SIZE = 8, 4
HANDLES = [b"h0", b"h1", b"h2"]
PEERS = [PeerIdentity(100, 1000, 1000), PeerIdentity(200, 1000, 1000), PeerIdentity(300, 1001, 1001)]
CONNS = [1, 2, 3, 4, 5]
SOURCES = ["k0", "k1", "k2", "k3"]

_seq = itertools.count(1)
_seq_lock = threading.Lock()


def _next_seq() -> int:
    with _seq_lock:
        return next(_seq)


def _layout() -> KVLayout:
    return KVLayout.from_vllm("NHD", num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=1,
                              head_size=4, dtype=torch.float32)


class FakeCompletion(Completion):
    """A copy's completion under the test's control.

    ``refuse``/``fail``: the next waits raise :class:`DrainError` / ``RuntimeError`` (before
    anything else, finished or not). Otherwise a wait returns whether the copy has physically
    finished. ``blocking=False`` (sequential model): an unlimited wait is a wait during which the
    copy finishes; a limited one returns at once, the copy finishing during the ``finish_on_wait``-th
    wait if set. ``blocking=True`` (threads): waits on the fake device finishing it.
    """

    def __init__(self, *, finished=False, refuse=0, fail=0, finish_on_wait=None, blocking=False):
        self._lock = threading.Lock()
        self._done = threading.Event()
        if finished:
            self._done.set()
        self.refuse, self.fail = refuse, fail
        self.finish_on_wait, self.blocking = finish_on_wait, blocking
        self.waits = self.true_returns = self.failed_waits = 0
        self.first_true_seq = None  # taken before the True is returned (so before any release)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def finish(self) -> None:
        self._done.set()

    def wait(self, timeout):
        with self._lock:
            self.waits += 1
            if self.refuse:
                self.refuse -= 1
                self.failed_waits += 1
                raise DrainError("wait refused (fake)")
            if self.fail:
                self.fail -= 1
                self.failed_waits += 1
                raise RuntimeError("wait failed (fake device error)")
            if not self.blocking:
                if timeout is None or self.finish_on_wait == self.waits:
                    self._done.set()
        ok = self._done.wait(timeout) if self.blocking else self._done.is_set()
        with self._lock:
            if ok:
                self.true_returns += 1
                if self.first_true_seq is None:
                    self.first_true_seq = _next_seq()
            else:
                self.failed_waits += 1
        return ok


class Memory:
    def __init__(self, name):
        self.name = name


# ---------------------------------------------------------------------------------- the model
class MReg:
    def __init__(self, reg, peer, instance, handle):
        self.reg, self.peer, self.instance, self.handle = reg, peer, instance, handle
        self.state = "open"  # open / closing / orphaned (freed is derived)
        self.conns: set[int] = set()
        self.ops: list[MOp] = []


class MOp:
    def __init__(self, op, mreg, blocks, sources):
        self.op, self.mreg, self.blocks, self.sources = op, mreg, frozenset(blocks), tuple(sources)
        self.submitted = False
        self.completion = None  # FakeCompletion, a Finished, or None (nothing submitted)
        self.outcome = None
        self.cancelled = False
        self.gate_failures = 0  # drain attempts while still being submitted
        self.has_callback = False

    _finished_waited = False


class Harness:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.layout = _layout()
        self.released: list[int] = []
        self.callbacks: collections.Counter = collections.Counter()
        self.registry = Registry(self._release_memory)
        self.regs: dict[int, MReg] = {}
        self.ops: dict[int, MOp] = {}
        self.max_gen = 0
        self.secrets: set[bytes] = set()
        self.log: list[str] = []

    # callbacks from the registry ------------------------------------------------------------
    def _release_memory(self, reg):
        # at release time: nothing pending, nothing held, every op observed finished
        assert not reg.ops and not reg.holders.any(), f"reg {reg.reg_id} released with work pending"
        m = self.regs[reg.reg_id]
        assert m.state in ("closing", "orphaned"), f"reg {reg.reg_id} released while {m.state}"
        for mop in m.ops:
            assert self.op_drained(mop), f"op {mop.op.op_id} not drained at release"
        self.released.append(reg.reg_id)

    def _on_drained(self, op):
        mop = self.ops[op.op_id]
        # drained, its blocks free; still listed among the registration's operations until this
        # callback has returned (a close meanwhile finds it and waits for the release to finish)
        assert op.state == "drained" and op.reg.ops.get(op.op_id) is op
        assert not np.any(op.reg.holders == op.op_id), "on_drained ran before the blocks were released"
        c = mop.completion
        assert c is None or isinstance(c, Finished) or c.true_returns > 0, "on_drained before a successful wait"
        self.callbacks[op.op_id] += 1

    # helpers -------------------------------------------------------------------------------------
    def live(self) -> list[MReg]:
        return [m for m in self.regs.values() if not self.freed(m)]

    def freed(self, m: MReg) -> bool:
        return m.state in ("closing", "orphaned") and all(self.op_drained(o) for o in m.ops)

    def op_drained(self, mop: MOp) -> bool:
        if not mop.submitted:
            return False
        c = mop.completion
        if c is None:
            return True
        if isinstance(c, FakeCompletion):
            return c.true_returns > 0
        return mop._finished_waited  # Finished: released by the first wait

    def undrained(self, m: MReg) -> list[MOp]:
        return [o for o in m.ops if not self.op_drained(o)]

    def pick_blocks(self, m: MReg) -> frozenset:
        r = self.rng.random()
        if r < 0.3 and m.ops:  # exactly, or overlapping, an existing op's blocks
            base = set(self.rng.choice(m.ops).blocks)
            if self.rng.random() < 0.5:
                base.add(self.rng.randrange(NUM_BLOCKS))
            return frozenset(base)
        return frozenset(self.rng.sample(range(NUM_BLOCKS), self.rng.randint(0, 3)))

    def blocks_arg(self, m: MReg, blocks: frozenset):
        """The same blocks as begin() accepts them: a set, a list, or slots -> int64 array (compiled path)."""
        r = self.rng.random()
        if r < 0.35:
            return blocks
        if r < 0.5:
            return sorted(blocks)
        slots = [b * BLOCK_SIZE + self.rng.randrange(BLOCK_SIZE) for b in blocks]
        self.rng.shuffle(slots)
        arr = Registry.block_ids_of_slots(m.reg, np.array(slots, dtype=np.int64))
        assert frozenset(arr.tolist()) == blocks
        return arr

    def note_drain_attempt(self, mop: MOp) -> None:
        """Before a drain attempt (always with a limited timeout on an op still being submitted):
        that one fails at the submission gate; a ``Finished`` completion's first wait releases."""
        if not mop.submitted:
            mop.gate_failures += 1
        elif isinstance(mop.completion, Finished) and mop.op.state != "drained":
            mop._finished_waited = True

    # actions -------------------------------------------------------------------------------------
    def act_register(self):
        rng = self.rng
        handle, peer, instance = rng.choice(HANDLES), rng.choice(PEERS), rng.randrange(2)
        live_handle = any(m.handle == handle for m in self.live())
        try:
            reg = self.registry.register(peer, instance=instance, handle_key=handle, layout=self.layout,
                                         memory=Memory(handle))
        except OwnershipError:
            assert live_handle, "a freed handle could not be registered again"
            return
        assert not live_handle, "the same live allocation was registered twice"
        assert reg.generation > self.max_gen and reg.reg_id == reg.generation, "generation did not grow"
        assert reg.secret not in self.secrets and len(reg.secret) == 32
        assert reg.state == "open" and not reg.holders.any() and not reg.ops
        self.max_gen = reg.generation
        self.secrets.add(reg.secret)
        new = MReg(reg, peer, instance, handle)
        # a replacement (same peer/instance or same handle) can never reach an older registration
        for old in self.regs.values():
            with pytest.raises(OwnershipError):
                self.registry.authorize(old.reg.reg_id, reg.secret, peer, for_new_work=False)
            with pytest.raises(OwnershipError):
                self.registry.authorize(reg.reg_id, old.reg.secret, old.peer, for_new_work=False)
        self.regs[reg.reg_id] = new
        if rng.random() < 0.8:
            conn = rng.choice(CONNS)
            self.registry.attach(reg, conn)
            new.conns.add(conn)

    def act_attach(self):
        if not self.regs:
            return
        m = self.rng.choice(list(self.regs.values()))
        conn = self.rng.choice(CONNS)
        self.registry.attach(m.reg, conn)
        if m.state == "open" and not self.freed(m):
            m.conns.add(conn)

    def act_begin(self):
        if not self.regs:
            return
        open_ = [m for m in self.live() if m.state == "open"]
        m = self.rng.choice(open_ if open_ and self.rng.random() < 0.85 else list(self.regs.values()))
        blocks = self.pick_blocks(m)
        sources = tuple(self.rng.sample(SOURCES, self.rng.randint(0, 2)))
        held = {b for o in self.undrained(m) for b in o.blocks}
        can = m.state == "open" and not self.freed(m) and not (blocks & held)
        before = m.reg.holders.copy()
        try:
            op = self.registry.begin(m.reg, self.rng.choice(["restore", "save"]), self.blocks_arg(m, blocks), sources)
        except OwnershipError:
            assert not can, f"begin refused on free blocks {sorted(blocks)} of an open registration"
            assert np.array_equal(before, m.reg.holders), "a refused begin changed the holders"
            return
        assert can, f"begin granted blocks {sorted(blocks & held)} still held / registration {m.state}"
        assert op.op_id not in self.ops and op.state == "submitting"
        mop = MOp(op, m, blocks, sources)
        m.ops.append(mop)
        self.ops[op.op_id] = mop

    def act_submit(self):
        pending = [o for o in self.ops.values() if not o.submitted]
        if not pending:
            return
        mop = self.rng.choice(pending)
        r = self.rng.random()
        if r < 0.08:
            completion = None
        elif r < 0.2:
            completion = Finished()
        else:
            completion = FakeCompletion(finished=self.rng.random() < 0.3, refuse=self.rng.choice([0, 0, 1, 2]),
                                        fail=self.rng.choice([0, 0, 0, 1]),
                                        finish_on_wait=self.rng.choice([None, None, 1, 2, 3]))
        outcome = self.rng.choice(["ok", "failed"])
        cb = self._on_drained if self.rng.random() < 0.7 else None
        mop.submitted, mop.completion, mop.has_callback = True, completion, cb is not None
        mop.outcome = outcome
        self.registry.submitted(mop.op, completion, outcome=outcome, error=None if outcome == "ok" else "x",
                                on_drained=cb, keepalive=[object()])
        assert mop.op.completion is completion

    def _timeout_for(self, mops):
        if any(not o.submitted for o in mops):
            return 0.0  # an unlimited wait for a submission nobody makes would hang
        return self.rng.choice([None, 0.0, 0.0, 1e-3])

    def act_drain(self):
        live = self.live()
        if not live:
            return
        m = self.rng.choice(live)
        if self.rng.random() < 0.5:
            ops = self.registry.pending_ops(m.reg)
            assert {o.op_id for o in ops} == {o.op.op_id for o in self.undrained(m)}
        else:
            chosen = [o for o in m.ops if self.rng.random() < 0.5]
            ops = [o.op for o in chosen]
        mops = [self.ops[o.op_id] for o in ops]
        timeout = self._timeout_for(mops)
        for mop in mops:
            if not self.op_drained(mop):
                self.note_drain_attempt(mop)
        try:
            if len(ops) == 1 and self.rng.random() < 0.5:
                self.registry.drain_one(ops[0], timeout)
            else:
                self.registry.drain(ops, timeout)
            raised = False
        except DrainError:
            raised = True
        assert raised == any(not self.op_drained(o) for o in mops), "drain's error does not match what drained"

    def act_acquire(self):
        """The service's acquire: authorize (open only), then drain whatever holds the blocks."""
        if not self.regs:
            return
        m = self.rng.choice(list(self.regs.values()))
        try:
            self.registry.authorize(m.reg.reg_id, m.reg.secret, m.peer)
        except OwnershipError:
            assert m.state != "open" or self.freed(m)
            return
        assert m.state == "open"
        blocks = self.registry.check_blocks(m.reg, sorted(self.pick_blocks(m)))
        holding = [o for o in self.undrained(m) if o.blocks & blocks]
        ops = self.registry.pending_ops(m.reg, blocks)
        assert {o.op_id for o in ops} == {o.op.op_id for o in holding}, "pending_ops(blocks) disagrees with the model"
        timeout = self._timeout_for(holding)
        for mop in holding:
            self.note_drain_attempt(mop)
        try:
            self.registry.drain(ops, timeout)
        except DrainError:
            assert any(not self.op_drained(o) for o in holding)
            assert any(m.reg.holders[b] for b in blocks), "a failed acquire released every block anyway"
            return
        # acquired: nothing can still write these blocks, each holder's wait returned True
        assert not any(m.reg.holders[b] for b in blocks), "acquire returned with blocks still held"
        for mop in holding:
            c = mop.completion
            assert c is None or isinstance(c, Finished) or (c.finished and c.true_returns > 0)

    def act_cancel(self):
        if not self.ops or not self.regs:
            return
        mop = self.rng.choice(list(self.ops.values()))
        m = mop.mreg if self.rng.random() < 0.8 else self.rng.choice(list(self.regs.values()))
        before = m.reg.holders.copy()
        pending = m is mop.mreg and not self.op_drained(mop)
        try:
            op = self.registry.cancel(m.reg, mop.op.op_id)
        except OwnershipError:
            assert not pending, "cancel of a pending op refused"
            return
        assert pending, "cancel reached a drained op or another registration's op"
        assert op is mop.op and op.outcome == "cancelled"
        assert np.array_equal(before, m.reg.holders), "a cancel released something"
        mop.cancelled = True

    def act_complete(self):
        """The copy physically finishes; nobody has observed it yet: nothing may be released."""
        fakes = [o for o in self.ops.values() if isinstance(o.completion, FakeCompletion) and not o.completion.finished]
        if fakes:
            self.rng.choice(fakes).completion.finish()

    def act_refuse(self):
        fakes = [o for o in self.ops.values() if isinstance(o.completion, FakeCompletion) and not self.op_drained(o)]
        if fakes:
            c = self.rng.choice(fakes).completion
            if self.rng.random() < 0.5:
                c.refuse += self.rng.randint(1, 2)
            else:
                c.fail += 1

    def act_close(self):
        if not self.regs:
            return
        m = self.rng.choice(list(self.regs.values()))
        was_freed = self.freed(m)
        if m.state == "open" and not was_freed:
            m.state = "closing"
        freed_now = self.registry.close(m.reg)
        assert freed_now == (not was_freed and self.freed(m)), "close's answer does not match the model"

    def act_connection_closed(self):
        conn = self.rng.choice(CONNS)
        expected = []
        for m in self.live():
            if conn in m.conns:
                m.conns.discard(conn)
                if not m.conns and m.state == "open":
                    m.state = "orphaned"
                    expected.append(m.reg)
        got = self.registry.connection_closed(conn)
        assert sorted(r.reg_id for r in got) == sorted(r.reg_id for r in expected)

    def act_reap(self):
        for m in self.live():
            if m.state in ("closing", "orphaned"):
                for mop in self.undrained(m):
                    self.note_drain_attempt(mop)
        waiting = self.registry.reap(timeout=0.0)
        assert sorted(r.reg_id for r in waiting) == sorted(
            m.reg.reg_id for m in self.live() if m.state in ("closing", "orphaned"))

    def act_authorize(self):
        if not self.regs:
            return
        m = self.rng.choice(list(self.regs.values()))
        freed = self.freed(m)
        for new_work in (True, False):
            ok = not freed and (m.state == "open" or not new_work)
            if ok:
                assert self.registry.authorize(m.reg.reg_id, m.reg.secret, m.peer, for_new_work=new_work) is m.reg
            else:
                with pytest.raises(OwnershipError):
                    self.registry.authorize(m.reg.reg_id, m.reg.secret, m.peer, for_new_work=new_work)
        for peer in PEERS:  # a leaked secret is not enough
            if peer.pid != m.peer.pid:
                with pytest.raises(OwnershipError):
                    self.registry.authorize(m.reg.reg_id, m.reg.secret, peer, for_new_work=False)
        with pytest.raises(OwnershipError):
            self.registry.authorize(m.reg.reg_id, bytes(32), m.peer, for_new_work=False)

    ACTIONS = [("register", 6), ("attach", 3), ("begin", 18), ("submit", 14), ("drain", 10), ("acquire", 6),
               ("cancel", 5), ("complete", 10), ("refuse", 4), ("close", 4), ("connection_closed", 4),
               ("reap", 6), ("authorize", 3)]

    def step(self):
        names, weights = zip(*self.ACTIONS)
        name = self.rng.choices(names, weights)[0]
        if not any(m.state == "open" for m in self.live()) and self.rng.random() < 0.5:
            name = "register"  # keep some registration open to work on
        self.log.append(name)
        getattr(self, "act_" + name)()
        self.check()

    # invariants ------------------------------------------------------------------------------
    def check(self):
        reg_counts = collections.Counter(self.released)
        assert all(v == 1 for v in reg_counts.values()), f"a registration released twice: {reg_counts}"
        live_ids = set()
        for gen, m in self.regs.items():
            reg = m.reg
            if self.freed(m):
                assert reg.state == "freed" and reg_counts[gen] == 1, f"reg {gen} should be freed ({m.state})"
                assert not reg.ops and not reg.holders.any()
                continue
            live_ids.add(gen)
            assert reg.state == m.state and reg_counts[gen] == 0, f"reg {gen}: {reg.state} vs model {m.state}"
            expect = np.zeros(NUM_BLOCKS, dtype=np.int64)
            for mop in self.undrained(m):
                assert not expect[list(mop.blocks)].any() if mop.blocks else True, "model: overlapping holds"
                expect[list(mop.blocks)] = mop.op.op_id
            assert np.array_equal(reg.holders, expect), f"reg {gen} holders {reg.holders} expected {expect}"
            assert set(reg.ops) == {o.op.op_id for o in self.undrained(m)}
        assert {r.reg_id for r in self.registry.registrations()} == live_ids
        for op_id, mop in self.ops.items():
            op, drained = mop.op, self.op_drained(mop)
            want = "drained" if drained else ("pending" if mop.submitted else "submitting")
            assert op.state == want, f"op {op_id}: {op.state}, model {want}"
            c = mop.completion
            failed = c.failed_waits if isinstance(c, FakeCompletion) else 0
            assert op.wait_failures == failed + mop.gate_failures, \
                f"op {op_id}: wait_failures {op.wait_failures} != {failed} + {mop.gate_failures}"
            assert self.callbacks[op_id] == (1 if drained and mop.has_callback else 0)
            if mop.cancelled:
                assert op.outcome == "cancelled"
            elif mop.submitted:
                assert op.outcome == mop.outcome
            if drained:
                assert not op.keepalive
        holds = collections.Counter(k for m in self.live() for o in self.undrained(m) for k in o.sources)
        snap = self.registry.snapshot()
        assert snap["held_sources"] == dict(holds)
        for key in SOURCES:
            assert self.registry.source_held(key) == (holds[key] > 0)
        assert snap["retired"] == len(self.regs) - len(live_ids)

    def finish_everything(self):
        """Submit, complete, close and reap until nothing is left; then everything is back to zero."""
        for mop in self.ops.values():
            if not mop.submitted:
                mop.submitted, mop.completion, mop.outcome = True, FakeCompletion(finished=True), "ok"
                self.registry.submitted(mop.op, mop.completion, outcome="ok")
            if isinstance(mop.completion, FakeCompletion):
                mop.completion.finish()
        for m in self.live():
            if m.state == "open":
                m.state = "closing"
            self.registry.close(m.reg)
        for _ in range(20):
            for m in self.live():
                for mop in self.undrained(m):
                    self.note_drain_attempt(mop)
            if not self.registry.reap(timeout=0.0):
                break
            self.check()
        self.check()
        assert self.registry.registrations() == [] and not self.live()
        assert sorted(self.released) == sorted(self.regs), "each registration released exactly once"
        for m in self.regs.values():
            assert m.reg.state == "freed" and not m.reg.holders.any() and not m.reg.ops
        snap = self.registry.snapshot()
        assert snap["pending_ops"] == [] and snap["held_sources"] == {} and snap["registrations"] == []
        for op_id, mop in self.ops.items():
            assert mop.op.state == "drained" and self.callbacks[op_id] == (1 if mop.has_callback else 0)
            c = mop.completion
            if isinstance(c, FakeCompletion):
                assert c.finished and c.true_returns >= 1


@pytest.mark.parametrize("seed", range(24))
def test_registry_against_model(seed):
    h = Harness(seed)
    for _ in range(250):
        h.step()
    counts = collections.Counter(h.log)
    assert counts["begin"] and counts["drain"] and counts["reap"]
    assert len(h.ops) >= 10 and len(h.regs) >= 2  # the run did something
    h.finish_everything()


def test_model_reaches_the_interesting_states():
    """Across the seeds the model covers refused/failed waits, gate timeouts, overlapping refusals,
    orphaned and closed registrations freed only after their drains, and re-registered handles."""
    seen = collections.Counter()
    for seed in range(24):
        h = Harness(seed)
        for _ in range(250):
            h.step()
            for mop in h.ops.values():
                if mop.gate_failures:
                    seen["gate"] += 1
                c = mop.completion
                if isinstance(c, FakeCompletion) and c.failed_waits and not h.op_drained(mop):
                    seen["held after failed wait"] += 1
                if mop.cancelled and not h.op_drained(mop):
                    seen["cancelled but held"] += 1
            for m in h.regs.values():
                if m.state == "orphaned" and not h.freed(m):
                    seen["orphaned with work"] += 1
                if m.state == "closing" and not h.freed(m):
                    seen["closing with work"] += 1
        handles = collections.Counter(m.handle for m in h.regs.values())
        if any(v > 1 for v in handles.values()):
            seen["handle registered again"] += 1
        h.finish_everything()
    for what in ("gate", "held after failed wait", "cancelled but held", "orphaned with work", "closing with work",
                 "handle registered again"):
        assert seen[what] > 0, f"the model never reached: {what}"


# ---------------------------------------------------------------------------------- threads
class FakeDevice:
    """Finishes submitted completions after a short random delay, on one thread."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self._heap: list = []
        self._cv = threading.Condition()
        self._stop = False
        self._n = itertools.count()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, c: FakeCompletion) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + self.rng.uniform(0, 0.01), next(self._n), c))
            self._cv.notify()

    def _run(self):
        with self._cv:
            while not self._stop:
                if not self._heap:
                    self._cv.wait(0.05)
                    continue
                when, _, c = self._heap[0]
                delay = when - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                heapq.heappop(self._heap)
                c.finish()

    def stop(self):
        with self._cv:
            self._stop = True
            self._cv.notify()
        self.thread.join(5)
        for _, _, c in self._heap:
            c.finish()


def test_registry_threads_no_early_release_no_deadlock():
    layout = _layout()
    released = collections.Counter()
    release_lock = threading.Lock()

    def release(reg):
        assert not reg.ops and not reg.holders.any()
        with release_lock:
            released[reg.reg_id] += 1

    registry = Registry(release)
    device = FakeDevice(1234)
    lock = threading.Lock()
    regs: list = []  # (reg, peer)
    all_ops: list = []  # (op, completion or None, blocks)
    callbacks = collections.Counter()
    errors: list = []
    conn_ids = itertools.count(100)

    def on_drained(op):
        with lock:
            callbacks[op.op_id] += 1

    def register(rng, peer):
        reg = registry.register(peer, instance=rng.randrange(2), handle_key=b"t%d" % rng.randrange(1 << 30),
                                layout=layout, memory=Memory("t"))
        conn = next(conn_ids)
        registry.attach(reg, conn)
        with lock:
            regs.append((reg, peer, conn))

    def check_begin(op, blocks):
        """Every earlier op that held one of these blocks was released after a True wait."""
        with lock:
            earlier = [(o, c, b) for (o, c, b) in all_ops if o.reg is op.reg and b & blocks and o.op_id < op.op_id]
        for o, c, _ in earlier:
            assert o.state == "drained", f"op {op.op_id} got blocks still held by op {o.op_id}"
            assert c is None or c.first_true_seq is not None, f"op {o.op_id} released without a successful wait"

    def worker(seed):
        rng = random.Random(seed)
        peer = PeerIdentity(1000 + seed, 1000, 1000)
        try:
            register(rng, peer)
            for _ in range(250):  # a fixed amount of work (about a second here), however loaded the machine
                with lock:
                    mine = [r for r in regs if r[1] == peer]
                    everyone = list(regs)
                reg, _, conn = rng.choice(mine) if mine and rng.random() < 0.85 else rng.choice(everyone)
                r = rng.random()
                if r < 0.45:  # a request: begin, submit (maybe late), maybe wait
                    blocks = frozenset(rng.sample(range(NUM_BLOCKS), rng.randint(1, 3)))
                    try:
                        op = registry.begin(reg, "restore", blocks, [rng.choice(SOURCES)])
                    except OwnershipError:
                        continue
                    check_begin(op, blocks)
                    kind = rng.random()
                    c = None if kind < 0.05 else FakeCompletion(refuse=rng.choice([0, 0, 0, 1]),
                                                                fail=rng.choice([0, 0, 0, 0, 1]), blocking=True)
                    with lock:
                        all_ops.append((op, c, blocks))
                    if rng.random() < 0.3:
                        time.sleep(0.001)  # others see it while still being submitted
                    if c is not None:
                        device.submit(c)
                    registry.submitted(op, c, outcome="ok", on_drained=on_drained if rng.random() < 0.5 else None)
                    if rng.random() < 0.5:
                        try:
                            registry.drain_one(op, rng.choice([None, 0.0, 0.005]))
                        except DrainError:
                            pass
                elif r < 0.6:  # drain everything pending on the registration
                    ops = registry.pending_ops(reg)
                    try:
                        registry.drain(ops, rng.choice([None, 0.0, 0.01]))
                    except DrainError:
                        pass
                elif r < 0.72:  # acquire
                    blocks = frozenset(rng.sample(range(NUM_BLOCKS), rng.randint(1, 4)))
                    ops = registry.pending_ops(reg, blocks)
                    try:
                        registry.drain(ops, rng.choice([None, 0.01]))
                    except DrainError:
                        continue
                    for o in ops:
                        assert o.state == "drained"
                        c = next((c for (x, c, _) in list(all_ops) if x is o), None)
                        assert c is None or c.first_true_seq is not None, "acquire without a successful wait"
                elif r < 0.78:
                    with lock:
                        ids = [o.op_id for (o, _, _) in all_ops if o.reg is reg]
                    if ids:
                        try:
                            op = registry.cancel(reg, rng.choice(ids))
                            assert op.outcome == "cancelled"
                        except OwnershipError:
                            pass
                elif r < 0.84:
                    registry.reap(timeout=rng.choice([0.0, 0.002]))
                elif r < 0.9:  # the client closes, or goes away, and comes back with a new registration
                    if rng.random() < 0.5:
                        registry.close(reg)
                    else:
                        registry.connection_closed(conn)
                    register(rng, peer)
                elif r < 0.95:
                    try:
                        registry.authorize(reg.reg_id, reg.secret, peer, for_new_work=False)
                    except OwnershipError:
                        pass
                else:
                    registry.snapshot()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker is stuck (deadlock or unbounded wait)"
    device.stop()
    if errors:
        raise errors[0]
    for _, c, _ in all_ops:
        if c is not None:
            c.finish()
    for reg, _, _ in list(regs):
        registry.close(reg)
    for _ in range(10):
        if not registry.reap(timeout=0.0):
            break
    assert registry.registrations() == []
    assert sorted(released) == sorted(r.reg_id for r, _, _ in regs) and set(released.values()) == {1}
    for op, c, _ in all_ops:
        assert op.state == "drained" and not op.keepalive
        assert c is None or c.true_returns >= 1
        assert op.wait_failures >= (c.failed_waits if c is not None else 0)
        assert callbacks[op.op_id] <= 1
    assert all(v == 1 for v in callbacks.values())
    for reg, _, _ in regs:
        assert not reg.holders.any() and not reg.ops and reg.state == "freed"
    snap = registry.snapshot()
    assert snap["pending_ops"] == [] and snap["held_sources"] == {}
    assert len(all_ops) > 50  # the threads did work


# ---------------------------------------------------------------------------------- the service
@pytest.fixture
def service():
    from kmesh_host.service.server import _Service, ServiceConfig

    d = tempfile.mkdtemp(prefix="kmr-")
    svc = _Service(ServiceConfig(socket_path=os.path.join(d, "s.sock"), allow_fault_injection=True,
                                 reap_interval_s=0.01))
    caches = []
    yield svc, caches
    svc._stop.set()
    for reg in svc.registry.registrations():
        svc.registry.close(reg)
    svc.registry.reap()
    for c in caches:
        c.close()
    svc.originals.close()  # (its private store lies in d)
    os.rmdir(d)


def _me(pid=None):
    return PeerIdentity(os.getpid() if pid is None else pid, os.getuid(), os.getgid())


def _conn(conn_id, peer):
    from kmesh_host.service.handlers import Connection

    return Connection(conn_id, None, peer)


def _register(svc, caches, conn_id, peer, *, cache=None):
    from tests.kmesh_host.service.helpers import fingerprint, small_layout

    layout = small_layout()
    if cache is None:
        cache = SharedCache(layout, fill=0)
        caches.append(cache)
    out, _ = svc.handlers.register({"op": "register", "memory": cache.handle.to_dict(), "layout": layout.to_dict(),
                                    "model_fingerprint": fingerprint().to_dict()}, b"", _conn(conn_id, peer))
    reg = svc.registry.authorize(out["reg"], bytes.fromhex(out["secret"]), peer)
    return reg, {"reg": out["reg"], "secret": out["secret"]}, cache


class _CountingMemory:
    def __init__(self, inner):
        self.inner, self.closes = inner, 0

    def close(self):
        self.closes += 1
        self.inner.close()


_TOKENS = itertools.count(100)  # each save's token ids its own: one key per save


def _save(svc, auth, peer, conn_id, slots, *, inject=None, timeout=None):
    """A save; with waits refused, the ``DrainError`` its own wait raised, carrying the op id."""
    n = len(slots)
    tensors, body = protocol.pack_int64({"slots": np.array(slots), "positions": np.arange(n),
                                         "token_ids": np.arange(n) + next(_TOKENS)})
    h = {"op": "save", **auth, "tensors": tensors, "timeout": timeout}
    if inject:
        h["inject"] = inject
    try:
        return svc.handlers.save(h, body, _conn(conn_id, peer))[0]["op"]
    except DrainError as exc:
        return exc.op_id


def _published(svc) -> int:
    return len(svc.originals.store.keys())


def test_service_refused_waits_keep_everything_until_a_later_wait(service, monkeypatch):
    """A save whose first waits are refused (its own, then drain's and acquire's) keeps its blocks
    held and stays unpublished; no copy is ever submitted again; a later wait succeeds, releases
    and publishes. Another registration is unaffected throughout."""
    from kmesh_gpu import PlacementPlan

    svc, caches = service
    gathers = []
    real_gather = PlacementPlan.gather
    monkeypatch.setattr(PlacementPlan, "gather", lambda *a, **k: gathers.append(1) or real_gather(*a, **k))
    me, other = _me(), _me(os.getpid() + 1)
    reg, auth, _ = _register(svc, caches, 1, me)
    reg2, auth2, _ = _register(svc, caches, 2, other)
    published = _published(svc)
    op_id = _save(svc, auth, me, 1, [0, 1, 5], inject={"refuse_waits": 4})
    assert reg.held_blocks == {0: op_id, 1: op_id}
    h = svc.handlers
    for handler, req in ((h.drain, {"op": "drain", **auth, "timeout": 1.0}),
                         (h.acquire, {"op": "acquire", **auth, "blocks": [1], "timeout": None}),
                         (h.drain, {"op": "drain", **auth, "ops": [op_id]})):
        with pytest.raises(DrainError):
            handler(req, b"", _conn(1, me))
        assert reg.held_blocks == {0: op_id, 1: op_id} and _published(svc) == published
    assert reg2.held_blocks == {}
    op2 = _save(svc, auth2, other, 2, [0, 1])  # the other registration works meanwhile
    assert svc.registry.op(reg, op_id).wait_failures == 4
    out, _ = h.acquire({"op": "acquire", **auth, "blocks": [0, 1]}, b"", _conn(1, me))
    assert out["drained"] == [op_id] and reg.held_blocks == {} and _published(svc) == published + 2
    assert len(gathers) == 2 and op2 != op_id  # one submission per save, none by a drain
    assert reg2.held_blocks == {} and reg2.state == "open"


def test_service_close_and_dead_client_freed_only_after_their_drains(service):
    """close with a refused wait stays closing and refuses new work; a dead client's registration
    is orphaned; the reaper frees each exactly once after a later wait succeeds; others unaffected."""
    svc, caches = service
    me, other, third = _me(), _me(os.getpid() + 1), _me(os.getpid() + 2)
    a, auth_a, _ = _register(svc, caches, 1, me)
    b, auth_b, _ = _register(svc, caches, 2, other)
    c, auth_c, _ = _register(svc, caches, 3, third)
    for reg in (a, b, c):
        reg.memory = _CountingMemory(reg.memory)
    published = _published(svc)
    op_a = _save(svc, auth_a, me, 1, [4], inject={"refuse_waits": 3})  # (its own wait: the first refusal)
    op_b = _save(svc, auth_b, other, 2, [4], inject={"refuse_waits": 3})
    out, _ = svc.handlers.close({"op": "close", **auth_a, "timeout": 0.5}, b"", _conn(1, me))
    assert out == {"reg": a.reg_id, "freed": False, "pending_ops": [op_a]} and a.state == "closing"
    with pytest.raises(OwnershipError, match="closing"):
        _save(svc, auth_a, me, 1, [0])
    svc.registry.connection_closed(2)  # client b went away
    assert b.state == "orphaned" and b.held_blocks == {1: op_b}
    assert a.memory.closes == 0 and b.memory.closes == 0
    svc.registry.reap()  # a: third refusal; b: second
    assert a.state == "closing" and b.state == "orphaned" and a.memory.closes == 0 and b.memory.closes == 0
    reaper = threading.Thread(target=svc._reap_loop, daemon=True)
    reaper.start()
    try:
        settle(lambda: a.state == b.state == "freed")
    finally:
        svc._stop.set()
        reaper.join(30)
    assert a.state == b.state == "freed" and a.memory.closes == 1 and b.memory.closes == 1
    assert _published(svc) == published + 2  # both published once drained
    assert c.state == "open" and c.memory.closes == 0 and c.held_blocks == {}
    _save(svc, auth_c, third, 3, [0, 31])
    for auth, peer in ((auth_a, me), (auth_b, other)):
        with pytest.raises(OwnershipError):
            svc.handlers.drain({"op": "drain", **auth}, b"", _conn(9, peer))


def test_service_replacement_and_reregistration_are_new_registrations(service):
    """The same allocation cannot be registered again while its registration is closing; once
    freed, it can, under a new generation and secret; neither secret reaches the other."""
    svc, caches = service
    me = _me()
    old, auth_old, cache = _register(svc, caches, 1, me)
    _save(svc, auth_old, me, 1, [0], inject={"refuse_waits": 2})  # its own wait and the close's refused
    svc.handlers.close({"op": "close", **auth_old, "timeout": 0}, b"", _conn(1, me))
    with pytest.raises(OwnershipError, match="already registration"):
        _register(svc, caches, 2, me, cache=cache)
    svc.registry.reap()
    assert old.state == "freed"
    new, auth_new, _ = _register(svc, caches, 2, me, cache=cache)
    assert new.generation > old.generation and new.secret != old.secret and new.handle_key == old.handle_key
    with pytest.raises(OwnershipError):
        svc.registry.authorize(old.reg_id, new.secret, me, for_new_work=False)
    with pytest.raises(OwnershipError):
        svc.registry.authorize(new.reg_id, old.secret, me, for_new_work=False)
    assert new.held_blocks == {} and new.state == "open"


def _restore_frame(reg_id, secret_hex, key, slots, *, wait, inject=None, timeout=None):
    items = restore_wire.restore_items([key], [len(slots)], [None])
    parts = restore_wire.restore_frame(items, 7, reg_id, bytes.fromhex(secret_hex), [np.array(slots, dtype=np.int64)],
                                       wait=wait, timeout=timeout, inject=inject)
    a, b = socket.socketpair()
    try:
        protocol.send_parts(a, parts)
        flags, raw, body = protocol.read_frame(b, max_body_bytes=1 << 20)
    finally:
        a.close()
        b.close()
    return memoryview(raw)[:len(raw) - len(body)], body


def test_service_restore_failed_or_refused_stays_held_and_is_never_resubmitted(service, monkeypatch):
    """A restore that fails after submission, and one whose wait is refused, keep their blocks
    until a drain's wait succeeds; neither is submitted again; a cancel releases nothing."""
    from kmesh_host.service import operations
    from tests.kmesh_host.service.helpers import fingerprint

    svc, caches = service
    me = _me()
    conn = _conn(1, me)
    reg, auth, _ = _register(svc, caches, 1, me)
    kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
    descr, body = protocol.pack_tensors({"kv": kv, "positions": torch.arange(4), "token_ids": torch.arange(4)})
    key = svc.handlers.put({"op": "put", "tensors": descr, "model_fingerprint": fingerprint().to_dict()}, body,
                           conn)[0]["key"]
    submits = []
    real_submit = operations.Operations.submit
    monkeypatch.setattr(operations.Operations, "submit",
                        lambda self, *a, **k: submits.append(1) or real_submit(self, *a, **k))
    raw, body = _restore_frame(auth["reg"], auth["secret"], key, [0, 1, 2, 3], wait=True,
                               inject={"refuse_waits": 1})
    reply = protocol.decode_header(memoryview(svc._serve_binary(raw, body, conn, 0))[protocol.PREFIX.size:])
    with pytest.raises(DrainError):
        protocol.raise_for_reply(reply)
    op_id = reply["error"]["op"]
    assert reg.held_blocks == {0: op_id} and svc.registry.source_held(key)
    raw, body = _restore_frame(auth["reg"], auth["secret"], key, [4, 5, 6, 7], wait=False,
                               inject={"fail_after_submit": True})
    reply = protocol.decode_header(memoryview(svc._serve_binary(raw, body, conn, 0))[protocol.PREFIX.size:])
    failed_id = reply["error"]["op"]
    assert reply["ok"] is False and "injected failure" in reply["error"]["message"]
    assert reg.held_blocks == {0: op_id, 1: failed_id}
    out, _ = svc.handlers.cancel({"op": "cancel", **auth, "op_id": failed_id}, b"", conn)
    assert out["outcome"] == "cancelled" and reg.held_blocks == {0: op_id, 1: failed_id}
    # the same blocks again: refused while held
    raw, body = _restore_frame(auth["reg"], auth["secret"], key, [3, 8, 9, 10], wait=True)
    reply = protocol.decode_header(memoryview(svc._serve_binary(raw, body, conn, 0))[protocol.PREFIX.size:])
    with pytest.raises(OwnershipError, match="held by operation"):
        protocol.raise_for_reply(reply)
    out, _ = svc.handlers.drain({"op": "drain", **auth, "timeout": 1.0}, b"", conn)
    assert sorted(out["drained"]) == sorted([op_id, failed_id]) and reg.held_blocks == {}
    assert not svc.registry.source_held(key)
    assert len(submits) == 2  # the refused and the failed restore, once each; the refused third never began


def test_refusing_completion_refuses_exactly_n_then_defers():
    inner = FakeCompletion()
    c = RefusingCompletion(inner, 3)
    results = []

    def waiter():
        try:
            results.append(c.wait(0))
        except DrainError:
            results.append("refused")

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results.count("refused") == 3 and results.count(False) == 5
    inner.finish()
    assert c.wait(0) is True and inner.waits == 6
