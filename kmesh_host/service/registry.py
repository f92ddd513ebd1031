"""Ownership and drain state machine of the cache service (no sockets, no GPU: testable alone).

Who owns what:

* A **registration** is one client allocation the service may write into. Its identity is the
  allocation's handle bytes plus a generation that grows with every registration, so a later
  allocation at the same address (even one with equal handle bytes, once the first is freed) is a
  different registration. It is bound to the registering peer (pid/uid/gid from ``SO_PEERCRED``)
  and a per-registration secret; the client's ``instance`` number is a label only, so a
  replacement client that claims the same instance gets a new registration and can never reach the
  old one.
* An **operation** (a restore: host original -> client blocks; a save: client blocks -> host
  buffer) holds its source and its destination from :meth:`Registry.begin` until a wait on its
  :class:`Completion` has returned ``True``. A failed request, a cancel, a failed or refused wait, a
  closed registration or a dead client never releases anything: only physical completion does.
  Draining waits for already submitted work; nothing is ever submitted again.
* **Close** stops new work at once; the registration's memory is released (``release_memory``
  callback) only when its last operation has drained. A client whose connections all closed is
  *orphaned*: the same, driven by :meth:`Registry.reap`.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from kmesh_gpu.errors import DrainError, LayoutError, OwnershipError

from . import _compiled

_I8 = np.dtype(np.int64)  # block arrays of this dtype (and C-contiguous) take the compiled paths


def _compiled_for(blocks: np.ndarray):
    """The compiled passes where ``blocks`` fits their signature (int64, C-contiguous, writable:
    Numba types a read-only array apart and its int64[::1] signature refuses it), else ``None``."""
    flags = blocks.flags
    return _compiled.compiled() if blocks.dtype is _I8 and flags.c_contiguous and flags.writeable else None


class Completion(ABC):
    """Physical completion of work that was already submitted.

    Implementations: a CUDA event recorded after the copy (server), an already finished CPU copy,
    and test doubles that refuse or fail waits. Called by :class:`Registry` only.

    ``wait(timeout)``: block up to ``timeout`` seconds (``None``: no limit; ``0``: just look).
    Return ``True`` once the work has physically finished, ``False`` if it is still running at the
    deadline. Raise :class:`DrainError` when the wait itself failed or was refused; that says
    nothing about the work, which therefore stays held.
    """

    @abstractmethod
    def wait(self, timeout: float | None) -> bool: ...


class Finished(Completion):
    """Work that completed before it was handed over (synchronous CPU copies)."""

    def wait(self, timeout: float | None) -> bool:
        return True


@dataclass(frozen=True)
class PeerIdentity:
    """The kernel's word on who is at the other end of a Unix socket (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


REG_OPEN, REG_CLOSING, REG_ORPHANED, REG_FREED = "open", "closing", "orphaned", "freed"
OP_SUBMITTING, OP_PENDING, OP_DRAINED = "submitting", "pending", "drained"


@dataclass(eq=False)
class Registration:
    generation: int
    handle_key: bytes
    identity: PeerIdentity
    instance: int
    secret: bytes
    layout: object  # kmesh_gpu.KVLayout
    memory: object  # opaque to the registry; handed to release_memory once drained
    #: what the service writes into and how (its typed record, see ``registrations.Destination``);
    #: opaque to the registry
    destination: object = None
    state: str = REG_OPEN
    connections: set = field(default_factory=set)
    ops: dict = field(default_factory=dict)  # op id -> Op, not yet drained
    #: int64[num_blocks]: the id of the operation holding each block, 0 when free (under the
    #: registry's lock); an array, so that a request's blocks are checked and reserved at once
    holders: np.ndarray = field(init=False, repr=False)
    #: the registration's spin lock (``lock[0]``, see ``_atomics``): the holders change under it
    #: (and under the registry's lock) once a channel may change them without the GIL
    lock: np.ndarray = field(init=False, repr=False)
    #: the layout's slot count and block size, looked up once (every request is checked against them)
    num_slots: int = field(init=False, repr=False)
    block_size: int = field(init=False, repr=False)

    def __post_init__(self):
        self.holders = np.zeros(self.layout.num_blocks, dtype=np.int64)
        self.lock = np.zeros(1, dtype=np.int64)
        self.num_slots, self.block_size = int(self.layout.num_slots), int(self.layout.block_size)

    @property
    def reg_id(self) -> int:
        return self.generation

    @property
    def held_blocks(self) -> dict[int, int]:
        """Block id -> id of the operation holding it (a snapshot)."""
        held = np.flatnonzero(self.holders)
        return dict(zip(held.tolist(), self.holders[held].tolist()))

    def describe(self) -> dict:
        return {"reg": self.reg_id, "generation": self.generation, "instance": self.instance, "pid": self.identity.pid,
                "state": self.state, "memory": self.handle_key.split(b"|", 1)[0].decode("ascii", "replace"),
                "handle": self.handle_key.hex()[:32], "num_blocks": self.layout.num_blocks,
                "held_blocks": np.flatnonzero(self.holders).tolist(),
                "pending_ops": sorted(i for i, op in self.ops.items() if not op.idle_channel),
                "channels": sorted(i for i, op in self.ops.items() if op.kind == "channel")}


def _closed_gate() -> threading.Lock:
    gate = threading.Lock()
    gate.acquire()
    return gate


@dataclass(eq=False)
class Op:
    op_id: int
    reg: Registration
    kind: str
    blocks: np.ndarray  # int64, sorted, unique
    sources: tuple
    state: str = OP_SUBMITTING
    outcome: str | None = None  # "ok" / "failed" / "cancelled"
    completion: Completion | None = None
    wait_failures: int = 0
    error: str | None = None
    on_drained: Callable[["Op"], None] | None = None
    keepalive: list = field(default_factory=list)
    #: held from creation until :meth:`Registry.submitted` opens it (a lock: far cheaper to make
    #: than an Event, and an operation is created for every request)
    gate: threading.Lock = field(default_factory=_closed_gate, repr=False)
    #: held until :meth:`Registry._release` has finished with the operation (its callback run, its
    #: registration freed where it was the last): a drain that finds it drained by another thread
    #: waits for that, so its caller sees what the release did (a close's reply says "freed")
    released: threading.Lock = field(default_factory=_closed_gate, repr=False)

    def wait_released(self, timeout: float | None) -> bool:
        if not self.released.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            return False
        self.released.release()
        return True

    @property
    def idle_channel(self) -> bool:
        """A channel holding nothing between requests (it is pending until stopped, but no copy is:
        status lists it under ``channels``); a stuck channel holds its last request's blocks and is
        listed."""
        return self.kind == "channel" and not self.blocks.size

    def wait_submitted(self, timeout: float | None) -> bool:
        """Block until the operation has been submitted (``timeout`` seconds at most; ``None``: no
        limit). ``True`` once it has."""
        if self.state != OP_SUBMITTING:
            return True
        if not self.gate.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            return False
        self.gate.release()
        return True

    def describe(self) -> dict:
        return {"op": self.op_id, "reg": self.reg.reg_id, "kind": self.kind, "state": self.state,
                "outcome": self.outcome, "blocks": self.blocks.tolist(), "sources": list(self.sources),
                "wait_failures": self.wait_failures, "error": self.error}


class Registry:
    """Registrations, operations and holds. Thread-safe; waits happen outside the lock.

    ``release_memory(registration)`` is called exactly once per registration, after its last
    operation drained and it was closed or orphaned. ``now`` is injectable for tests.
    """

    def __init__(self, release_memory: Callable[[Registration], None], *, now: Callable[[], float] = time.monotonic):
        self._lock = threading.RLock()
        self._release_memory = release_memory
        self._now = now
        self._next_generation = 1
        self._next_op = 1
        self._regs: dict[int, Registration] = {}
        self._live_handles: dict[bytes, int] = {}
        self._retired: dict[int, str] = {}

    # ------------------------------------------------------------------ registrations
    def register(self, identity: PeerIdentity, *, instance: int, handle_key: bytes, layout, memory,
                 destination=None) -> Registration:
        """A new registration with a fresh generation and secret (both returned to the client)."""
        with self._lock:
            other = self._live_handles.get(handle_key)
            if other is not None:
                raise OwnershipError(f"handle: this allocation is already registration {other} "
                                     f"({self._regs[other].state}); close it and wait for its drain first")
            gen = self._next_generation
            self._next_generation += 1
            reg = Registration(gen, handle_key, identity, int(instance), secrets.token_bytes(32), layout, memory,
                               destination)
            self._regs[gen] = reg
            self._live_handles[handle_key] = gen
            return reg

    def authorize(self, reg_id: int, secret: bytes, identity: PeerIdentity, *, for_new_work: bool = True) -> Registration:
        """The registration ``reg_id`` if ``identity`` owns it and ``secret`` matches.

        ``for_new_work``: also require it to be open (close stops new work; drains and status of a
        closing registration stay allowed to its owner).
        """
        with self._lock:
            reg = self._regs.get(reg_id)
            if reg is None:
                why = self._retired.get(reg_id)
                raise OwnershipError(f"registration {reg_id}: {why or 'unknown'}")
            # Compare the secret first and in constant time; then the peer.
            if not hmac.compare_digest(reg.secret, secret):
                raise OwnershipError(f"registration {reg_id}: wrong secret")
            if identity.pid != reg.identity.pid or identity.uid != reg.identity.uid:
                raise OwnershipError(f"registration {reg_id}: belongs to another client "
                                     f"(registered by pid {reg.identity.pid}, request from pid {identity.pid})")
            if for_new_work and reg.state != REG_OPEN:
                raise OwnershipError(f"registration {reg_id}: {reg.state}; no new work is accepted")
            return reg

    def attach(self, reg: Registration, conn_id: int) -> None:
        with self._lock:
            if reg.state == REG_OPEN:
                reg.connections.add(conn_id)

    def connection_closed(self, conn_id: int) -> list[Registration]:
        """Registrations left without any live connection become orphaned (reaped after their drains)."""
        orphaned = []
        with self._lock:
            for reg in list(self._regs.values()):
                if conn_id in reg.connections:
                    reg.connections.discard(conn_id)
                    if not reg.connections and reg.state == REG_OPEN:
                        reg.state = REG_ORPHANED
                        orphaned.append(reg)
            freed = [r for r in orphaned if not r.ops]
        self._free(freed)
        return orphaned

    def close(self, reg: Registration) -> bool:
        """Stop new work on ``reg``. Returns ``True`` when its memory was released now (nothing pending)."""
        with self._lock:
            if reg.state == REG_OPEN:
                reg.state = REG_CLOSING
            ready = reg.state in (REG_CLOSING, REG_ORPHANED) and not reg.ops
        if ready:
            self._free([reg])
        return ready

    def _free(self, regs: Iterable[Registration]) -> None:
        with self._lock:
            to_release = self._retire(regs)
        self._release_memories(to_release)

    def _retire(self, regs: Iterable[Registration]) -> list[Registration]:
        """Mark the registrations of ``regs`` with nothing pending freed (``_lock`` held); returns
        them, for :meth:`_release_memories` once the lock is released."""
        to_release = []
        for reg in regs:
            if reg.state == REG_FREED or reg.ops:
                continue
            reason = "closed" if reg.state == REG_CLOSING else "reaped after its client went away"
            reg.state = REG_FREED
            self._regs.pop(reg.reg_id, None)
            if self._live_handles.get(reg.handle_key) == reg.reg_id:
                del self._live_handles[reg.handle_key]
            self._retired[reg.reg_id] = reason
            to_release.append(reg)
        return to_release

    def _release_memories(self, to_release: list[Registration]) -> None:
        errors = []
        for reg in to_release:  # each one, whatever the others' releases did
            try:
                self._release_memory(reg)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ bounds
    @staticmethod
    def blocks_of_slots(reg: Registration, slots, *, name: str = "slots") -> frozenset:
        """Blocks addressed by ``slots`` (see :meth:`block_ids_of_slots`) as a set."""
        return frozenset(Registry.block_ids_of_slots(reg, slots, name=name).tolist())

    @staticmethod
    def block_ids_of_slots(reg: Registration, slots, *, name: str = "slots") -> np.ndarray:
        """Blocks addressed by ``slots`` (a list, int64 array or CPU tensor), sorted and unique,
        after bounds and duplicate checks (``-1`` is skipped). Vectorised: a request carries
        hundreds of slots; one sort serves the bounds, the duplicates and the blocks."""
        n_slots, block_size = reg.num_slots, reg.block_size
        s = slots if type(slots) is np.ndarray else np.asarray(slots)  # a CPU tensor is viewed, not copied
        if s.ndim != 1 or (s.size and s.dtype.kind not in "iu"):
            raise LayoutError(f"{name}: expected integers [N], got {s.dtype}{list(s.shape)}")
        if not s.size:
            return np.empty(0, dtype=np.int64)
        ordered = np.array(s, dtype=np.int64)  # a copy to sort in place
        ordered.sort()
        lo, hi = int(ordered[0]), int(ordered[-1])
        if lo < -1 or hi >= n_slots:
            i = int(np.flatnonzero((s < -1) | (s >= n_slots))[0])
            raise LayoutError(f"{name}[{i}]: slot {int(s[i])} outside 0..{n_slots - 1} of registration {reg.reg_id}")
        valid = ordered[int(ordered.searchsorted(0)):] if lo < 0 else ordered  # -1 skips a token
        if valid.size < 2:
            return valid // block_size
        same = valid[1:] == valid[:-1]
        if np.count_nonzero(same):
            value = int(valid[int(same.argmax())])
            i = int(np.flatnonzero(s == value)[1])
            raise LayoutError(f"{name}[{i}]: slot {value} addressed twice in one request")
        blocks = valid // block_size
        if int(blocks[0]) == int(blocks[-1]):
            return blocks[:1]
        first = np.empty(blocks.size, dtype=bool)
        first[0] = True
        np.not_equal(blocks[1:], blocks[:-1], out=first[1:])
        return blocks[first]

    @staticmethod
    def check_blocks(reg: Registration, blocks: list[int], *, name: str = "blocks") -> frozenset:
        n = reg.layout.num_blocks
        for i, b in enumerate(blocks):
            if not 0 <= b < n:
                raise LayoutError(f"{name}[{i}]: block {b} outside 0..{n - 1} of registration {reg.reg_id}")
        return frozenset(blocks)

    # ------------------------------------------------------------------ operations
    def begin(self, reg: Registration, kind: str, blocks, sources: Iterable[str] = ()) -> Op:
        """Reserve ``blocks`` of ``reg`` (block ids in range: a set, or a sorted unique int64 array
        from :meth:`block_ids_of_slots`) and the named sources for one operation (before any
        submission). The sources are held by the pending operation itself (see :meth:`source_held`)."""
        if type(sources) is not tuple:
            sources = tuple(sources)
        if not isinstance(blocks, np.ndarray):
            blocks = np.array(sorted(blocks), dtype=np.int64)
        elif _compiled_for(blocks) is None and _compiled.compiled() is not None:
            blocks = np.array(blocks, dtype=np.int64)  # the compiled (locked) passes take it: see Registration.lock
        holders = reg.holders
        if blocks.size and (blocks[0] < 0 or blocks[-1] >= holders.shape[0]):
            raise LayoutError(f"blocks: outside 0..{holders.shape[0] - 1} of registration {reg.reg_id}")
        compiled = _compiled_for(blocks)
        if compiled is not None and compiled.reserve_locked is not None:
            return self._begin_locked(reg, kind, blocks, sources, compiled)
        with self._lock:
            if reg.state != REG_OPEN:
                raise OwnershipError(f"registration {reg.reg_id}: {reg.state}; no new work is accepted")
            op_id = self._next_op
            if compiled is not None:
                # checks that every block is free and holds them, in one call
                code = compiled.reserve_locked(reg.lock, holders, blocks, op_id) \
                    if compiled.reserve_locked is not None else compiled.reserve(holders, blocks, op_id)
                if code == _compiled.OUT_OF_RANGE:
                    raise LayoutError(f"blocks: outside 0..{holders.shape[0] - 1} of registration {reg.reg_id}")
                if code != _compiled.RESERVED:
                    self._refuse_held(reg, blocks)
            elif blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= holders.shape[0]):
                # as the compiled reserve: every id checked (an unsorted -1 would wrap to the last block)
                raise LayoutError(f"blocks: outside 0..{holders.shape[0] - 1} of registration {reg.reg_id}")
            elif np.count_nonzero(holders[blocks]):
                self._refuse_held(reg, blocks)
            else:
                holders[blocks] = op_id
            self._next_op = op_id + 1
            op = Op(op_id, reg, kind, blocks, sources)
            reg.ops[op_id] = op
            return op

    def _begin_locked(self, reg: Registration, kind: str, blocks: np.ndarray, sources: tuple, compiled) -> Op:
        """:meth:`begin` where the holders change under the registration's lock, taken before the
        registry's own: a channel request in flight holds the registration's lock until its
        copy has completed (which may wait for the client's own work), and only this registration's
        requests wait for that, never the whole registry (nothing takes the two the other way round)."""
        holders = reg.holders
        compiled.take(reg.lock)
        try:
            with self._lock:
                if reg.state != REG_OPEN:
                    raise OwnershipError(f"registration {reg.reg_id}: {reg.state}; no new work is accepted")
                op_id = self._next_op
                code = compiled.reserve(holders, blocks, op_id)  # every block free: held now
                if code == _compiled.OUT_OF_RANGE:
                    raise LayoutError(f"blocks: outside 0..{holders.shape[0] - 1} of registration {reg.reg_id}")
                if code != _compiled.RESERVED:
                    self._refuse_held(reg, blocks)
                self._next_op = op_id + 1
                op = Op(op_id, reg, kind, blocks, sources)
                reg.ops[op_id] = op
                return op
        finally:
            compiled.give(reg.lock)

    @staticmethod
    def _refuse_held(reg: Registration, blocks: np.ndarray) -> None:
        busy = blocks[reg.holders[blocks] != 0]
        raise OwnershipError(f"blocks {busy[:8].tolist()} of registration {reg.reg_id} are held by operation "
                             f"{int(reg.holders[busy[0]])} until its copy has physically finished; drain it first")

    def submitted(self, op: Op, completion: Completion | None, *, outcome: str, error: str | None = None,
                  on_drained: Callable[[Op], None] | None = None, keepalive: Iterable = ()) -> None:
        """Record what was handed to the device. ``completion=None``: nothing was submitted at all,
        so the operation releases at once. Otherwise it stays held until a wait succeeds."""
        with self._lock:
            op.completion = completion
            op.outcome = outcome if op.outcome != "cancelled" else "cancelled"
            op.error = error
            op.on_drained = on_drained
            op.keepalive.extend(keepalive)
            if op.state == OP_SUBMITTING:
                op.state = OP_PENDING
                op.gate.release()
        if completion is None:
            self._release(op)

    def op(self, reg: Registration, op_id: int) -> Op:
        with self._lock:
            op = reg.ops.get(op_id)
            if op is None:
                raise OwnershipError(f"operation {op_id}: not pending on registration {reg.reg_id} "
                                     "(unknown, or already drained)")
            return op

    def cancel(self, reg: Registration, op_id: int) -> Op:
        """Discard the operation's result. Its holds stay until its drain: a cancel proves nothing."""
        with self._lock:
            op = self.op(reg, op_id)
            op.outcome = "cancelled"
            return op

    def pending_ops(self, reg: Registration, blocks: Iterable[int] | None = None) -> list[Op]:
        with self._lock:
            if blocks is None:
                return list(reg.ops.values())
            held = reg.holders[np.fromiter(blocks, dtype=np.int64)]
            return [reg.ops[i] for i in np.unique(held[held != 0]).tolist() if i in reg.ops]

    def drain(self, ops: Iterable[Op], timeout: float | None) -> None:
        """Wait for the physical completion of ``ops`` and release their holds.

        Each operation that is still running at the deadline, or whose wait failed or was refused,
        keeps its holds and raises :class:`DrainError` (after every operation has been tried).
        """
        deadline = None if timeout is None else self._now() + timeout
        failures = []
        for op in ops:
            left = None if deadline is None else max(0.0, deadline - self._now())
            try:
                self.drain_one(op, left)
            except DrainError as exc:
                failures.append(str(exc))
        if failures:
            raise DrainError("; ".join(failures))

    def drain_one(self, op: Op, timeout: float | None) -> None:
        """:meth:`drain` of a single operation (a synchronous request's own), without the list."""
        if op.state == OP_DRAINED:
            self._released_by_other(op, timeout)
            return
        deadline = None if timeout is None else self._now() + timeout
        if not op.wait_submitted(timeout):
            with self._lock:
                op.wait_failures += 1
            raise DrainError(f"operation {op.op_id}: still being submitted; its buffers stay held")
        if op.state == OP_DRAINED:
            self._released_by_other(op, None if deadline is None else deadline - self._now())
            return
        completion = op.completion
        if completion is None:  # nothing was submitted: submitted() releases it (idempotent)
            self._release(op)
            return
        left = None if deadline is None else max(0.0, deadline - self._now())  # one timeout for both waits
        try:
            finished = completion.wait(left)
        except Exception as exc:  # any failure of the wait itself: nothing is known about the work
            with self._lock:
                op.wait_failures += 1
            raise DrainError(f"operation {op.op_id}: wait failed ({exc}); source and destination stay held") from exc
        if not finished:
            with self._lock:
                op.wait_failures += 1
            raise DrainError(f"operation {op.op_id}: copy still running after {timeout} s; "
                             "source and destination stay held")
        self._release(op)

    @staticmethod
    def _released_by_other(op: Op, timeout: float | None) -> None:
        """``op`` was drained by another thread: wait until that thread's release has finished."""
        if not op.wait_released(timeout):
            raise DrainError(f"operation {op.op_id}: drained, its release still running")

    def _release(self, op: Op) -> None:
        with self._lock:
            if op.state == OP_DRAINED:
                return
            op.state = OP_DRAINED
            reg = op.reg
            holders, blocks = reg.holders, op.blocks
            # only the blocks this operation holds: all of them, while begin() is the only one to reserve
            compiled = _compiled_for(blocks)
            locked = compiled is not None and compiled.release_locked is not None  # (then below, outside
            if not locked:                                                          # this lock: _begin_locked)
                if compiled is not None:
                    compiled.release(holders, blocks, op.op_id)
                else:
                    held = holders[blocks]
                    if np.count_nonzero(held != op.op_id):
                        holders[blocks[held == op.op_id]] = 0
                    else:
                        holders[blocks] = 0
            callback, op.on_drained = op.on_drained, None
        try:
            if locked:
                compiled.release_locked(reg.lock, holders, blocks, op.op_id)
            if callback is not None:
                callback(op)
        finally:  # the operation is released whatever its callback did
            try:
                # It stays among the registration's operations until its callback has run, so that a
                # close or drain looking meanwhile finds it (drained: it waits for this release); the
                # registration is marked freed in the same step as its last operation leaves it, so
                # whoever finds no operation pending finds it freed too.
                with self._lock:
                    reg.ops.pop(op.op_id, None)
                    to_release = self._retire([reg]) if reg.state in (REG_CLOSING, REG_ORPHANED) else []
                op.keepalive.clear()
                self._release_memories(to_release)
            finally:
                op.released.release()

    def _source_holds(self) -> dict[str, int]:
        """Key -> number of pending operations that read or write it. Counted when asked (evict,
        status) rather than kept up to date by every request. Called with ``_lock`` held."""
        holds: dict[str, int] = {}
        for reg in self._regs.values():
            for op in reg.ops.values():
                for key in set(op.sources):  # an operation naming a key twice holds it once
                    holds[key] = holds.get(key, 0) + 1
        return holds

    def source_held(self, key: str) -> bool:
        with self._lock:
            return any(key in op.sources for reg in self._regs.values() for op in reg.ops.values())

    # ------------------------------------------------------------------ reaping and state
    def reap(self, timeout: float = 0.0) -> list[Registration]:
        """One pass over closing and orphaned registrations: look at their operations, free the done.

        Returns the registrations still waiting. Failed or refused waits are counted, never fatal.
        """
        with self._lock:
            waiting = [r for r in self._regs.values() if r.state in (REG_CLOSING, REG_ORPHANED)]
            ops = [op for r in waiting for op in r.ops.values()]
            idle = [r for r in waiting if not r.ops]
        failures = []
        try:
            self._free(idle)
        except Exception as exc:
            failures.append(exc)
        for op in ops:
            try:
                self.drain_one(op, timeout)
            except DrainError:
                pass
            except Exception as exc:  # a callback or release failed: the op is released all the same
                failures.append(exc)
        if failures:  # after the whole pass
            raise failures[0]
        with self._lock:
            return [r for r in self._regs.values() if r.state in (REG_CLOSING, REG_ORPHANED)]

    def registrations(self) -> list[Registration]:
        with self._lock:
            return list(self._regs.values())

    def snapshot(self) -> dict:
        with self._lock:
            regs = [r.describe() for r in self._regs.values()]
            ops = [op.describe() for r in self._regs.values() for op in r.ops.values() if not op.idle_channel]
            return {"registrations": regs, "pending_ops": ops, "held_sources": self._source_holds(),
                    "retired": len(self._retired), "next_generation": self._next_generation}
