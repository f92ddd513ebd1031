"""Host-RAM tier: segment payloads held in (pinned) host buffers, shared by the children that use them.

* **Buffer pool** — page-aligned host buffers within a byte budget, page-locked when CUDA is
  available (``HostTierConfig.pin``), kept for reuse after release because pinning is slow.
* **Retention** — a loaded segment stays after the child that loaded it is done, so later
  children restore it from RAM (``retain=True``); with ``retain=False`` it goes with its last lease.
  Unreferenced entries are dropped least-recently-used first when the budget needs room, and
  :meth:`HostTier.evict` drops them on request (benchmarks force reads that way).
* **Singleflight** — concurrent :meth:`HostTier.acquire` calls for one key do one read; its
  failure reaches every waiter, and a failed load returns its buffer to the pool.

Verification: an entry records how its bytes were checked (``HostLease.verified``): by the tier's
own host check at load (``HostTierConfig.verify``), or by a route that computed the object's tree
root on the device from a copy of this very buffer and marked the entry (``HostLease.mark_verified``).
Routes may then restore a verified resident entry without checking it again; an entry that fails a
check is evicted, so retention never keeps bad bytes.

Loads: :meth:`HostTier.start_loads` (the routes' path) queues every chunk of every missing object
on the reader at once, in key order (``HostTierConfig.io_engine``: io_uring where the kernel offers
it, else a thread pool), and reports chunks and finished objects through callbacks from the thread
that completed them (io_uring's completion thread, or a reading thread): no thread per object, and
the reader keeps ``read_threads`` reads in flight from the first chunk to the last.
:meth:`HostTier.acquire` is the blocking form for one key.

Ownership: the tier owns every buffer. A :class:`HostLease` keeps its entry's buffer alive until
:meth:`HostLease.release` (or the ``with`` block ends); an async copy that reads a lease's payload is
recorded with :meth:`HostLease.fence`, and the buffer is reused or freed only after that event.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from kmesh_gpu.errors import BudgetExceeded, FingerprintMismatch, KmeshError, SegmentNotFound, StorageError

from .direct_io import ENGINES, DirectFile, HostBuffer, ReadEngine, round_up
from .segment import ModelFingerprint, SegmentHeader, check_fingerprint, check_payload
from .singleflight import SingleFlight
from .store import SegmentStore


@dataclass(frozen=True)
class HostTierConfig:
    """Configuration of one :class:`HostTier`.

    Attributes:
        budget_bytes: most bytes of host buffers the tier holds (in use and cached for reuse).
        pin: page-lock buffers; ``None`` means "when CUDA is available".
        retain: keep segments after their last lease (retention across children).
        singleflight: join concurrent loads of one key into one read.
        verify: host check of each loaded payload: ``"sha256"``, ``"tree"`` or ``"none"`` (use
            ``"none"`` only when the consumer verifies on the device, as the routes do).
        o_direct: read with O_DIRECT where the filesystem allows it.
        read_threads, chunk_bytes: reads in flight at once (the queue depth: io_uring entries or
            reading threads) and their chunk size.
        io_engine: ``"auto"`` (io_uring where the kernel offers it, else a thread pool),
            ``"io_uring"`` or ``"threads"`` (see :class:`kmesh_host.direct_io.ReadEngine`).
        parallel_loads: threads running :meth:`HostTier.acquire_async` (objects loaded at once).
    """

    budget_bytes: int = 1 << 30
    pin: bool | None = None
    retain: bool = True
    singleflight: bool = True
    verify: str = "sha256"
    o_direct: bool = True
    read_threads: int = 4
    chunk_bytes: int = 1 << 20
    parallel_loads: int = 4
    io_engine: str = "auto"

    def __post_init__(self):
        if self.verify not in ("sha256", "tree", "none"):
            raise ValueError(f"verify: expected 'sha256', 'tree' or 'none', got {self.verify!r}")
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes: expected a positive size, got {self.budget_bytes}")
        if self.io_engine not in ENGINES:
            raise ValueError(f"io_engine: expected one of {ENGINES}, got {self.io_engine!r}")


class BufferPool:
    """Host buffers within ``budget`` bytes; released buffers are cached for reuse by size.

    ``reclaim(nbytes)`` is called (without the pool's lock) when a request does not fit; it may
    release buffers (the tier evicts unreferenced entries) and returns how many bytes it released.
    """

    def __init__(self, budget: int, *, pin: bool, reclaim: Callable[[int], int] | None = None):
        self.budget = budget
        self.pin = pin
        self._reclaim = reclaim
        self._lock = threading.Lock()
        self._free: dict[int, list[HostBuffer]] = {}
        self.held_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0

    def _trim_locked(self, need: int) -> list[HostBuffer]:
        dropped = []
        for size in sorted(self._free, reverse=True):
            while self._free[size] and self.held_bytes + need > self.budget:
                buf = self._free[size].pop()
                self.held_bytes -= buf.nbytes
                dropped.append(buf)
        self._free = {s: v for s, v in self._free.items() if v}
        return dropped

    def acquire(self, nbytes: int, *, name: str = "") -> HostBuffer:
        size = round_up(nbytes)
        if size > self.budget:
            raise BudgetExceeded(f"segment {name}: {size} bytes exceed the host tier budget of {self.budget}")
        for attempt in range(2):
            with self._lock:
                cached = self._free.get(size)
                if cached:
                    buf = cached.pop()
                    self.in_use_bytes += size
                    reuse = True
                else:
                    reuse = False
                    dropped = self._trim_locked(size)
                    fits = self.held_bytes + size <= self.budget
                    if fits:
                        self.held_bytes += size
                        self.in_use_bytes += size
            if reuse:
                buf.wait()
                return buf
            for old in dropped:
                old.close()
            if fits:
                try:
                    buf = HostBuffer(size, pin=self.pin)
                except BaseException:
                    with self._lock:
                        self.held_bytes -= size
                        self.in_use_bytes -= size
                    raise
                self.allocations += 1
                return buf
            if attempt == 0 and self._reclaim is not None:
                self._reclaim(size)
        raise BudgetExceeded(f"segment {name}: {size} bytes do not fit in the host tier budget of {self.budget} "
                             f"({self.in_use_bytes} bytes are held by live leases)")

    def release(self, buf: HostBuffer) -> None:
        with self._lock:
            self.in_use_bytes -= buf.nbytes
            self._free.setdefault(buf.nbytes, []).append(buf)

    def trim(self) -> None:
        """Free every cached (unused) buffer."""
        with self._lock:
            dropped = [b for v in self._free.values() for b in v]
            self._free.clear()
            self.held_bytes -= sum(b.nbytes for b in dropped)
        for b in dropped:
            b.close()

    def close(self) -> None:
        self.trim()


class _Entry:
    __slots__ = ("key", "header", "buffer", "lead", "refs", "in_map", "dropped", "evict_on_release", "o_direct",
                 "note", "verified", "reserved")

    def __init__(self, key: str, header: SegmentHeader, buffer: HostBuffer, lead: int, o_direct: bool, note,
                 verified: str | None = None):
        self.key, self.header, self.buffer, self.lead = key, header, buffer, lead
        self.verified = verified
        self.refs = 0
        self.in_map = False
        self.dropped = False  # its buffer went back to the pool
        self.evict_on_release = False
        self.o_direct, self.note = o_direct, note
        self.reserved = 0  # references counted in refs for joiners of the load that made it, not yet taken

    @property
    def payload(self) -> torch.Tensor:
        return self.buffer.tensor[self.lead: self.lead + self.header.padded_length]


class HostLease:
    """One holder's use of a tier entry. ``payload``: uint8[padded_length] host tensor (pinned when
    the tier pins); ``kv``: its ``(2, L, T, H, D)`` view. ``source``: ``"hit"`` (already resident),
    ``"read"`` (this call read it from storage) or ``"joined"`` (waited on another call's read).
    """

    def __init__(self, tier: "HostTier", entry: _Entry, source: str):
        self._tier, self._entry, self.source = tier, entry, source
        self.key, self.header = entry.key, entry.header
        self.o_direct, self.io_note = entry.o_direct, entry.note

    @property
    def payload(self) -> torch.Tensor:
        if self._entry is None:
            raise KmeshError(f"segment {self.key}: lease already released")
        return self._entry.payload

    @property
    def kv(self) -> torch.Tensor:
        return self.header.kv_view(self.payload)

    def payload_memory(self) -> tuple[int, bool]:
        """``(address, pinned)`` of ``payload``'s first byte: for copies issued below torch."""
        entry = self._entry
        if entry is None:
            raise KmeshError(f"segment {self.key}: lease already released")
        return entry.buffer.address + entry.lead, entry.buffer.pinned

    @property
    def verified(self) -> str | None:
        """How the payload was checked against its stored digests (``None``: not checked yet)."""
        return self._entry.verified if self._entry is not None else None

    def mark_verified(self, how: str) -> None:
        """Record that the payload bytes were checked (``how`` names the check); later leases trust it.

        Only call after a check of these bytes (or of a copy made from this buffer) succeeded.
        """
        if self._entry is not None:
            self._entry.verified = how

    def fence(self, event) -> None:
        """Record that an async copy reading ``payload`` completes when CUDA ``event`` does."""
        if self._entry is not None:
            self._entry.buffer.set_fence(event)

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._tier._release(entry)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class HostTier:
    """Segments of one :class:`SegmentStore` held in host RAM (see the module docstring).

    ``acquire`` is the one entry point children use (``acquire_resident`` its non-blocking hit-only
    form, ``acquire_async`` its form on loader threads); ``evict`` is for benchmarks and memory
    pressure; ``stats`` counts ``reads`` (loads from storage), ``bytes_read``, ``hits``, ``joins``,
    ``failures`` and ``evictions``.
    """

    def __init__(self, store: SegmentStore, config: HostTierConfig = HostTierConfig()):
        self.store = store
        self.config = config
        self.pin = torch.cuda.is_available() if config.pin is None else bool(config.pin)
        self.pool = BufferPool(config.budget_bytes, pin=self.pin, reclaim=self._reclaim)
        self._engine = ReadEngine(config.read_threads, config.chunk_bytes, engine=config.io_engine)
        # Separate from the read pool: a load waits on its chunk reads there.
        self._loader = ThreadPoolExecutor(max(1, config.parallel_loads), thread_name_prefix="kmesh-load")
        # Host checks that finish pipelined loads: never queued behind loader threads that wait
        # (as joiners) for those very loads.
        self._checker = ThreadPoolExecutor(max(1, config.parallel_loads), thread_name_prefix="kmesh-check")
        self._flight = SingleFlight()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.stats = {"reads": 0, "bytes_read": 0, "hits": 0, "joins": 0, "failures": 0, "evictions": 0}
        # Loads from storage per key (the read-once benchmark checks every key was read exactly once).
        self.reads_by_key: dict[str, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ acquire / release
    def acquire(self, key: str, *, model_fingerprint: ModelFingerprint,
                on_chunk: Callable[[torch.Tensor, int, int], None] | None = None) -> HostLease:
        """Lease segment ``key``'s payload in host RAM, reading it from the store if not resident.

        ``on_chunk(chunk, start, stop)`` is called in this thread for each chunk of the payload as
        it arrives, in order, when *this* call reads it (``chunk`` is the uint8 host tensor of
        payload bytes ``[start, stop)``); the routes start H2D copies from it.
        Raises SegmentNotFound / FingerprintMismatch / IntegrityError / BudgetExceeded.
        """
        if self._closed:
            raise KmeshError("host tier is closed")
        for _ in range(8):
            lease = self.acquire_resident(key, model_fingerprint=model_fingerprint)
            if lease is not None:
                return lease
            # The caller's own callback failing fails this call only: the load goes on for joiners.
            cb_error: list = []
            chunk = None if on_chunk is None else _guarded(on_chunk, cb_error)
            try:
                if self.config.singleflight:
                    entry, joined = self._flight.do(key, lambda: self._load(key, model_fingerprint, chunk),
                                                    on_settle=self._reserve_for_joiners)
                else:
                    entry, joined = self._load(key, model_fingerprint, chunk), False
            except FingerprintMismatch:
                # a joined load may have been led by a caller of another model: decide with ours
                check_fingerprint(self.store.read_header(key), model_fingerprint)
                continue
            if entry is None:  # it became resident while this call was starting: lease that copy
                continue
            if cb_error and not joined:
                with self._lock:
                    alive = not entry.dropped
                    if alive:
                        entry.refs += 1
                if alive:
                    self._release(entry)  # drops a private or unretained copy
                raise cb_error[0]
            with self._lock:
                # A joiner's reference was counted when the load settled (so the leader's release
                # cannot free the entry before the joiner gets here); budget pressure may have dropped
                # a fresh entry before its caller got to it; a leader whose key was already resident
                # keeps its own copy privately.
                reserved = joined and entry.reserved > 0
                if reserved:
                    entry.reserved -= 1
                usable = not entry.dropped and (entry.in_map or not joined or reserved)
                if usable and not reserved:
                    check_fingerprint(entry.header, model_fingerprint)  # raises with nothing taken
                    entry.refs += 1
            if usable:
                if reserved:
                    try:
                        check_fingerprint(entry.header, model_fingerprint)
                    except BaseException:
                        self._release(entry)
                        raise
                if joined:
                    with self._lock:
                        self.stats["joins"] += 1
                return HostLease(self, entry, "joined" if joined else "read")
            if reserved:  # not usable after all: give the reserved reference back
                self._release(entry)
        raise BudgetExceeded(f"segment {key}: evicted repeatedly before it could be leased (budget too small)")

    def acquire_resident(self, key: str, *, model_fingerprint: ModelFingerprint) -> HostLease | None:
        """A lease on ``key`` if it is resident now (``source="hit"``), else ``None``; never reads.

        Runs on the calling thread without waiting for any load, so restoring resident segments
        costs no thread hop. Raises FingerprintMismatch for a resident segment of another model.
        """
        if self._closed:
            raise KmeshError("host tier is closed")
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            check_fingerprint(entry.header, model_fingerprint)
            entry.refs += 1
            self._entries.move_to_end(key)
            self.stats["hits"] += 1
            return HostLease(self, entry, "hit")

    def acquire_resident_many(self, keys, *, model_fingerprint: ModelFingerprint) -> list:
        """:meth:`acquire_resident` of every key under one lock: a lease or ``None`` per key.

        Raises FingerprintMismatch (taking no lease) when a resident key belongs to another model."""
        if self._closed:
            raise KmeshError("host tier is closed")
        with self._lock:
            entries = self._entries
            found = [entries.get(key) for key in keys]
            for entry in found:
                if entry is not None:
                    check_fingerprint(entry.header, model_fingerprint)
            out = []
            for key, entry in zip(keys, found):
                if entry is None:
                    out.append(None)
                    continue
                entry.refs += 1
                entries.move_to_end(key)
                out.append(HostLease(self, entry, "hit"))
            self.stats["hits"] += len(out) - out.count(None)
            return out

    def acquire_ready(self, keys, *, model_fingerprint: ModelFingerprint, verified: bool):
        """Leases on every key at once when each is resident in page-locked memory (and, with
        ``verified``, was checked when it entered), with the ``(address, bytes)`` of each payload:
        ``(leases, rows)``; else ``None`` and nothing is taken. One pass under the lock, for a restore
        whose copies can start at once (:meth:`acquire_resident_many` serves the others).

        Raises FingerprintMismatch (taking no lease) when a resident key belongs to another model."""
        if self._closed:
            raise KmeshError("host tier is closed")
        with self._lock:
            entries = self._entries
            found = []
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    return None
                check_fingerprint(entry.header, model_fingerprint)
                buf = entry.buffer
                if not buf.pinned or (verified and entry.verified is None):
                    return None
                found.append(entry)
            leases, rows = [], []
            for entry in found:
                entry.refs += 1
                entries.move_to_end(entry.key)
                leases.append(HostLease(self, entry, "hit"))
                rows.append((entry.buffer.address + entry.lead, entry.header.padded_length))
            self.stats["hits"] += len(found)
            return leases, rows

    def acquire_async(self, key: str, *, model_fingerprint: ModelFingerprint,
                      on_chunk: Callable[[torch.Tensor, int, int], None] | None = None) -> "Future[HostLease]":
        """:meth:`acquire` on the tier's loader threads, so several objects load at once.

        ``on_chunk`` then runs on a loader thread. The caller must take the lease from the future
        (and release it) even when it no longer needs it.
        """
        if self._closed:
            raise KmeshError("host tier is closed")
        return self._loader.submit(self.acquire, key, model_fingerprint=model_fingerprint, on_chunk=on_chunk)

    def start_loads(self, keys, *, model_fingerprint: ModelFingerprint, on_done: Callable,
                    on_chunk: Callable | None = None, headers=None, on_batch: Callable | None = None) -> None:
        """Bring ``keys`` into the tier together; ``on_done(i, lease, error)`` reports each of them.

        Resident keys are leased at once (``source="hit"``). For the others every chunk read is
        queued on the read pool before this returns, in key order, so the reads of all objects are
        in flight together and the first objects tend to complete first. A key whose load another
        call is running (singleflight) joins it on a loader thread (``"joined"``).

        ``on_chunk(i, chunk, start, stop)`` runs on a reading thread as each chunk of a key this call
        reads lands (any order): ``chunk`` is the host tensor of payload bytes ``[start, stop)``.
        ``on_done(i, lease, error)`` runs exactly once per key, after every ``on_chunk`` of that key
        has returned, with a lease (the caller must release it) or the error (SegmentNotFound,
        FingerprintMismatch, IntegrityError, StorageError, BudgetExceeded); it runs on the thread that
        finished the load, or on this one for keys that fail or hit at once. Neither callback may
        block or raise. ``headers``: the keys' headers when the caller has read them already.
        ``on_batch()`` (optional; must not raise) runs on a reading thread after a group of those
        callbacks of this call's reads that completed together (``ReadEngine.start``'s ``after``):
        a hint for doing follow-up work once per group; it is not a promise that every ``on_done``
        is followed by one (a host check moves ``on_done`` to another thread, a failure or a hit
        reports at once).
        """
        if self._closed:
            raise KmeshError("host tier is closed")
        loads = []
        for i, key in enumerate(keys):
            try:
                lease = self.acquire_resident(key, model_fingerprint=model_fingerprint)
                if lease is None and not self.store.local:
                    self._join(i, key, model_fingerprint, on_chunk, on_done)
                    continue
                if lease is not None:
                    on_done(i, lease, None)
                    continue
                call = self._flight.lead(key) if self.config.singleflight else None
                if self.config.singleflight and call is None:  # another call is loading it: join
                    self._join(i, key, model_fingerprint, on_chunk, on_done)
                    continue
                if call is not None:  # a load that ended after the check above made it resident
                    try:
                        lease = self.acquire_resident(key, model_fingerprint=model_fingerprint)
                    except BaseException as exc:
                        self._flight.settle(key, call, error=exc)
                        raise
                    if lease is not None:
                        self._flight.settle(key, call, result=None)  # joiners lease it themselves
                        on_done(i, lease, None)
                        continue
            except BaseException as exc:
                on_done(i, None, exc)
                continue
            try:
                header = headers[i] if headers is not None else self.store.read_header(key)
                check_fingerprint(header, model_fingerprint)
                loads.append(_PipelinedLoad(self, i, key, header, call, on_chunk, on_done, on_batch))
            except BaseException as exc:
                if call is not None:
                    self._flight.settle(key, call, error=exc)
                on_done(i, None, exc)
        for load in loads:
            load.submit()  # a chunk the engine refuses to queue is reported as that chunk's error

    def _join(self, i: int, key: str, fingerprint: ModelFingerprint, on_chunk, on_done) -> None:
        """:meth:`acquire` on a loader thread, reported through ``on_done``."""
        chunk = None if on_chunk is None else (lambda c, lo, hi: on_chunk(i, c, lo, hi))
        fut = self._loader.submit(self.acquire, key, model_fingerprint=fingerprint, on_chunk=chunk)

        def done(f):
            error = f.exception()
            on_done(i, None if error is not None else f.result(), error)

        fut.add_done_callback(done)

    def _reserve_for_joiners(self, entry, joiners: int) -> None:
        """SingleFlight's ``on_settle``: count a reference for each caller that joined the load of
        ``entry`` (each takes its own in :meth:`acquire`), before the leader can release its own."""
        if entry is None or not joiners:
            return
        with self._lock:
            if entry.dropped:  # budget pressure freed it before the load settled: joiners read again
                return
            entry.refs += joiners
            entry.reserved += joiners

    def _entered(self, key: str, header: SegmentHeader, buf: HostBuffer, lead: int, o_direct: bool, note,
                 verified) -> _Entry:
        """A loaded payload enters the tier (when its key is not resident already), leased once."""
        entry = _Entry(key, header, buf, lead, o_direct, note, verified)
        with self._lock:
            if key not in self._entries:
                entry.in_map = True
                self._entries[key] = entry
            entry.refs += 1  # leased before the lock drops: budget pressure cannot take it first
        return entry

    def _count_read(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.stats["reads"] += 1
            self.stats["bytes_read"] += nbytes
            self.reads_by_key[key] = self.reads_by_key.get(key, 0) + 1

    def _host_check(self, header: SegmentHeader, view) -> str | None:
        if self.config.verify == "none":
            return None
        check_payload(header, view, sha=self.config.verify == "sha256", tree=self.config.verify == "tree")
        return f"host {'SHA-256' if self.config.verify == 'sha256' else 'kmesh-tree-sha256 root'} " \
               "when it entered the tier"

    def _load(self, key: str, fingerprint: ModelFingerprint, on_chunk) -> _Entry | None:
        store = self.store
        with self._lock:
            if key in self._entries:  # loaded by a call that ended after this one checked: no new read
                return None
        header = store.read_header(key)
        check_fingerprint(header, fingerprint)
        padded = header.padded_length
        lead = header.payload_offset % 4096
        buf = self.pool.acquire(lead + padded, name=key)
        try:
            if store.local:
                with _open_direct(store, key, self.config.o_direct) as f:
                    rr = self._engine.submit(f, header.payload_offset, padded, buf.view, name=key)
                    for lo, hi in rr.chunks():
                        if on_chunk is not None:
                            on_chunk(buf.tensor[lo:hi], lo - lead, hi - lead)
                    o_direct, note = f.o_direct, f.fallback_reason
            else:
                with store._open(key) as f:
                    if f.read_into(buf.view[lead: lead + padded], header.payload_offset) != padded:
                        raise KmeshError(f"segment {key}: short read")
                if on_chunk is not None:
                    on_chunk(buf.tensor[lead: lead + padded], 0, padded)
                o_direct, note = False, f"{store.filesystem.type_name} filesystem read through pyarrow.fs"
            self._count_read(key, padded)
            verified = self._host_check(header, buf.view[lead: lead + padded])
        except BaseException:
            with self._lock:
                self.stats["failures"] += 1
            self.pool.release(buf)
            raise
        entry = _Entry(key, header, buf, lead, o_direct, note, verified)
        with self._lock:
            if key not in self._entries:
                entry.in_map = True
                self._entries[key] = entry
        return entry

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            drop = entry.evict_on_release or not entry.in_map or not self.config.retain
            if drop:
                self._drop_locked(entry)
                entry.dropped = True
        if drop:
            self.pool.release(entry.buffer)

    def _drop_locked(self, entry: _Entry) -> None:
        if entry.in_map and self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self.stats["evictions"] += 1
        entry.in_map = False

    # ------------------------------------------------------------------ eviction
    def evict(self, key: str | None = None, *, drop_page_cache: bool = False) -> int:
        """Drop ``key`` (or every segment) from the tier; returns the bytes freed now.

        Segments still leased leave the tier now (the next acquire reads again) and free their
        buffer on their last release. ``drop_page_cache`` also drops the files' pages from the OS
        page cache (posix_fadvise DONTNEED) so the next read goes to the disk even without O_DIRECT.
        """
        freed, buffers, keys = 0, [], []
        with self._lock:
            targets = [self._entries[key]] if key is not None and key in self._entries else \
                list(self._entries.values()) if key is None else []
            for entry in targets:
                keys.append(entry.key)
                if entry.refs == 0:
                    self._drop_locked(entry)
                    entry.dropped = True
                    buffers.append(entry.buffer)
                    freed += entry.buffer.nbytes
                else:
                    self._drop_locked(entry)
                    entry.evict_on_release = True
        for buf in buffers:
            self.pool.release(buf)
        if drop_page_cache and self.store.local:
            for k in keys if key is None else [key]:
                self.drop_page_cache(k)
        return freed

    def drop_page_cache(self, key: str) -> None:
        """Drop segment ``key``'s file pages from the OS page cache (no privileges needed)."""
        try:
            fd = os.open(self.store.local_path(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def _reclaim(self, need: int) -> int:
        """Drop least-recently-used unleased entries until ``need`` bytes could be freed."""
        freed, buffers = 0, []
        with self._lock:
            for entry in list(self._entries.values()):
                if freed >= need:
                    break
                if entry.refs == 0:
                    self._drop_locked(entry)
                    entry.dropped = True
                    buffers.append(entry.buffer)
                    freed += entry.buffer.nbytes
        for buf in buffers:
            # Back to the pool, not freed: a request of the same size reuses the pinned buffer, and
            # the pool frees cached buffers of other sizes only as far as the budget needs.
            self.pool.release(buf)
        return freed

    # ------------------------------------------------------------------ introspection / lifetime
    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._entries

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    @property
    def io_engine(self) -> ReadEngine:
        """The reader (its ``engine``, ``engine_note`` and ``description`` say how reads are made)."""
        return self._engine

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(e.buffer.nbytes for e in self._entries.values())

    def in_flight(self) -> int:
        """Loads in progress now."""
        return self._flight.in_flight()

    def waiting(self, key: str) -> int:
        """Callers waiting on the load of ``key`` in progress."""
        return self._flight.waiting(key)

    def close(self) -> None:
        """Drop everything and free the buffers (waits for recorded copies). Leases must be released."""
        if self._closed:
            return
        self._closed = True
        self._loader.shutdown(wait=True)
        self._checker.shutdown(wait=True)
        self.evict()
        self.pool.close()
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _guarded(on_chunk, errors: list):
    """``on_chunk`` that records its first failure in ``errors`` (and is not called again)."""
    def chunk(c, lo, hi):
        if errors:
            return
        try:
            on_chunk(c, lo, hi)
        except BaseException as exc:  # noqa: BLE001 - re-raised to the caller that passed it
            errors.append(exc)
    return chunk


def _open_direct(store: SegmentStore, key: str, direct: bool) -> DirectFile:
    """``key``'s file opened for payload reads; a file gone or unreadable since its header was read is
    a typed error naming the segment."""
    path = store.local_path(key)
    try:
        return DirectFile(path, direct=direct)
    except FileNotFoundError as exc:
        raise SegmentNotFound(f"segment {key}: {path} disappeared while loading (deleted?)") from exc
    except OSError as exc:
        raise StorageError(f"segment {key}: cannot open {path}: {exc}") from exc


class _PipelinedLoad:
    """One key read by :meth:`HostTier.start_loads`: its buffer, its file and its chunks in flight.

    The last chunk to complete (on a reading thread) finishes the load: the entry enters the tier
    and ``on_done`` gets a lease. A host check configured on the tier runs on a loader thread, so
    the read pool only ever reads.
    """

    def __init__(self, tier: HostTier, i: int, key: str, header: SegmentHeader, call, on_chunk, on_done,
                 on_batch=None):
        self.tier, self.i, self.key, self.header, self.call = tier, i, key, header, call
        self.on_chunk, self.on_done, self.on_batch = on_chunk, on_done, on_batch
        self.lead = header.payload_offset % 4096
        self.buf = tier.pool.acquire(self.lead + header.padded_length, name=key)
        try:
            self.file = _open_direct(tier.store, key, tier.config.o_direct)
        except BaseException:
            tier.pool.release(self.buf)
            raise
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        # known before the first chunk can complete
        self._left = math.ceil(round_up(self.lead + header.padded_length) / tier._engine.chunk_bytes)

    def submit(self) -> None:
        h = self.header
        if self._left == 0:  # an empty payload: nothing to read
            self._left = 1
            self._chunk(self.lead, self.lead, None)
            return
        self.tier._engine.start(self.file, h.payload_offset, h.padded_length, self.buf.view, self._chunk,
                                name=self.key, after=self.on_batch)

    def _chunk(self, lo: int, hi: int, error: BaseException | None) -> None:
        if error is None and self.on_chunk is not None and self.error is None:
            try:
                self.on_chunk(self.i, self.buf.tensor[lo:hi], lo - self.lead, hi - self.lead)
            except BaseException as exc:  # the caller's failure fails this load
                error = exc
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            last = self._left == 0
        if last:  # no read writes the buffer any more
            self.o_direct, self.note = self.file.o_direct, self.file.fallback_reason
            self.file.close()
            if self.error is None and self.tier.config.verify != "none":
                self.tier._checker.submit(self._finish)
            else:
                self._finish()

    def _finish(self) -> None:
        tier, h = self.tier, self.header
        try:
            if self.error is not None:
                raise self.error
            tier._count_read(self.key, h.padded_length)
            verified = tier._host_check(h, self.buf.view[self.lead: self.lead + h.padded_length])
        except BaseException as exc:
            with tier._lock:
                tier.stats["failures"] += 1
            tier.pool.release(self.buf)
            if self.call is not None:
                tier._flight.settle(self.key, self.call, error=exc)
            self.on_done(self.i, None, exc)
            return
        entry = tier._entered(self.key, h, self.buf, self.lead, self.o_direct, self.note, verified)
        if self.call is not None:
            tier._flight.settle(self.key, self.call, result=entry, on_settle=tier._reserve_for_joiners)
        self.on_done(self.i, HostLease(tier, entry, "read"), None)


__all__ = ["HostTier", "HostTierConfig", "HostLease", "BufferPool"]
