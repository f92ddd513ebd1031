"""The ``host_staging`` route: segment file --O_DIRECT reads--> the host tier's pinned buffers
--async H2D--> the staging buffer on the device --verified, placed--> the paged cache.

Reads: every chunk of every missing object is queued on the tier's reader at once, in object order
(``HostTier.start_loads``: io_uring, or a thread pool; no thread per object), right after the
headers are read and before the staging buffer, streams and verifier are made (a landing that
comes before those exist is parked until the restoring thread arms the landings). The reader's
completion thread that lands an object's last chunk queues that object's copy at once (one driver
call from the tier's page-locked buffer); objects that land together (the reader reports the
completions of one wake-up as a group, ``on_batch``) are then fenced by one event and hashed by one
tree-digest launch on a side stream that waits for that event, while the reads of later objects go
on. All of that runs on the completion thread between landings, so it is kept short: a late
landing is a late restore.

Resident segments (the tier's retention) skip the read: they are copied from RAM in one H2D per
object, issued before anything else so the DMA overlaps the placement's preparation. They were
verified when they entered the tier (the tier's host check, or an earlier restore's device check
of a copy of that very buffer), so by default they are not hashed again
(``RouteConfig.trust_verified``).

Placement: prepared while the bytes move; with device verification on CUDA queued on the work
stream behind a device comparison of the roots (:meth:`~.verifier.Verifier.gate`), so it follows
the last digest on the device with no host round trip; else launched after the host's comparison.
A mismatch raises IntegrityError naming every bad segment, nothing is placed, and the bad segments
leave the host tier.

A child whose objects are all resident in page-locked memory and trusted (the *ready* child) has
nothing to overlap: :func:`restore_host_staging` leases it, takes a staging buffer (the restorer's
spare of that size where it keeps one) and queues its first copy in one short step, then the other
copies, the placement (``PlacementPlan.place``: one compiled call on CUDA) and the bookkeeping
follow on the caller's stream while the DMA runs (:func:`_resident_child`).

Streams: see :mod:`.streams`. Before the call returns, also on failure, the caller's current stream
waits for every stream the restore used, so later work on it sees the placed cache and buffers it
frees are no longer in use.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from kmesh_gpu import cuda
from kmesh_gpu.errors import IntegrityError

from ..segment import check_fingerprint
from .contract import RestoreReport, RestoreResult
from .staging import layout_offsets, offsets_of
from .streams import CallerStream, Streams, raw_stream
from .verifier import Verifier, integrity_failure


def restore_host_staging(ctx, items) -> RestoreResult:
    """Restore ``items`` (checked :class:`RestoreItem`\\ s) for the restorer ``ctx`` (its store, tier,
    device, config, placer and spares) through pinned host RAM (see the module docstring)."""
    t0 = time.perf_counter()
    cfg = ctx.config
    # Every object resident in page-locked memory and trusted (or not to be checked): the DMA
    # starts with the first object's copy, before anything else is arranged.
    ready = ctx.tier.acquire_ready([it.key for it in items], model_fingerprint=ctx.model_fingerprint,
                                   verified=cfg.verify != "none") if ctx.ready_start else None
    if ready is None:
        return _HostStagingRestore(ctx, items, t0).run()
    leases, rows = ready
    try:
        offsets, total = offsets_of([nbytes for _, nbytes in rows])
        index = ctx.device_index
        stream = raw_stream(index)
        buffer = ctx.spares.take(index, stream, total)
        if buffer is None:
            buffer = torch.empty(total, dtype=torch.uint8, device=ctx.device)
        early = int(cuda.copy_htod(buffer.data_ptr(), rows[0][0], rows[0][1], stream))
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return _resident_child(ctx, items, leases, [lease.header for lease in leases], buffer, offsets, early,
                           CallerStream(ctx.device), t0, spare=(index, stream, total))


def _resident_child(ctx, items, leases: list, headers: list, buffer: torch.Tensor, offsets: list, early: int,
                    streams: CallerStream, t0: float, spare=None) -> RestoreResult:
    """Every object resident and trusted (or not to be checked), ``early`` of them already copied:
    the other copies, the placement and the bookkeeping, in order on the caller's stream, then one
    wait. ``spare``: ``(device index, raw stream, bytes)`` of a staging buffer to leave for the next
    such child while the device works."""
    verifier = None
    cfg = ctx.config
    try:
        n = len(items)
        resident_event = _copy_resident(buffer, offsets, headers, leases, range(n), early, streams)
        ctx.placer.check(items, headers)
        tp = time.perf_counter()
        ctx.placer.place(buffer, offsets, items, headers)
        prepare_s = time.perf_counter() - tp
        report = _new_report(ctx)
        report.placed = True
        # every object trusted (or not to be checked): no digest, so no root tables (objects=0)
        verifier = Verifier(cfg.verify, buffer, cfg.hash_backend, streams, trust_verified=cfg.trust_verified)
        moved = 0
        for i in range(n):
            moved += headers[i].padded_length
            verifier.landed(offsets[i], headers[i], lease=leases[i], event=resident_event)
            # every copy from the tier's buffers is queued and fenced (resident_event): the leases
            # can go before the wait (a buffer is reused only after its fence)
            leases[i].release()
            leases[i] = None
        report.bytes_moved = moved
        result = RestoreResult(report, buffer, offsets, headers)
        if spare is not None:  # the host waits for the device below anyway
            ctx.spares.stock(ctx.device, *spare)
        streams.sync()
    finally:
        if verifier is not None:
            verifier.settle()
        for lease in leases:
            if lease is not None:
                lease.release()
    return _finish_report(result, ctx.tier, {"hit": n}, set(), set(), verifier, [None] * n, None, None, 0.0,
                          prepare_s, t0)


def _copy_resident(buffer: torch.Tensor, offsets: list, headers: list, leases: list, resident, early: int,
                   streams):
    """Copies of the resident objects ``resident`` (the first ``early`` already queued) into the
    staging buffer on the copy stream; returns the one event that fences every resident buffer.
    Page-locked payloads go by the driver, all in one compiled call where it serves (torch's
    ``copy_`` costs several times more); the others (and any the driver refused) through torch, in
    order after them."""
    handle = streams.copy_handle()
    base = buffer.data_ptr()
    with streams.on_copy():
        rows = []
        if handle is not None:
            for i in resident[early:]:
                addr, pinned = leases[i].payload_memory()
                if not pinned:
                    break
                rows.append((base + offsets[i], addr, headers[i].padded_length))
        queued = early + (cuda.copies_htod(np.array(rows, dtype=np.int64), len(rows), handle) if rows else 0)
        for i in resident[queued:]:
            off, nbytes = offsets[i], headers[i].padded_length
            buffer[off: off + nbytes].copy_(leases[i].payload, non_blocking=True)
    event = streams.copied()
    for i in resident:
        leases[i].fence(event)
    return event


class _HostStagingRestore:
    """One host-staging restore of a child with something to read or to hash: the state its
    restoring thread (:meth:`run`) and the reader's completion thread (:meth:`on_done`,
    :meth:`on_batch`) share. Every field the completion thread touches is read and written under
    ``lock``; landings reported before the staging side exists are parked until :meth:`_arm`."""

    __slots__ = ("ctx", "items", "t0", "tier", "n", "leases", "headers", "offsets", "buffer", "missing",
                 "lock", "settled", "all_settled", "pending", "stopped", "failures", "arrived", "armed",
                 "parked", "reads_started", "streams", "verifier", "report", "copy_handle", "read_start",
                 "read_end", "sources", "o_direct_flags", "io_notes", "landed")

    def __init__(self, ctx, items, t0: float):
        self.ctx, self.items, self.t0, self.tier = ctx, items, t0, ctx.tier
        n = self.n = len(items)
        self.leases: list = [None] * n
        self.headers = self.offsets = self.buffer = None
        self.missing: list = []  # indices of the objects read (not resident)
        self.lock = threading.Lock()  # verifier, streams and report bookkeeping: one landing at a time
        # Each load's outcome (i, lease, error), in the order they settle; ``all_settled`` is set by
        # the last one (one wake-up of this thread, not one per object: each would take the GIL from
        # the completion thread while it lands the next object)
        self.settled: list = []
        self.all_settled = None  # (a threading.Event, made only when something is read)
        self.pending = 0  # loads started whose outcomes have not been taken yet
        self.stopped = False  # this call gave up: landings copy nothing further
        self.failures: list = []
        self.arrived: list = []  # (i, lease) of objects landed whose fences and digests are not queued yet
        self.armed = False  # landings can be copied, hashed and reported
        self.parked: list = []  # (i, lease, when) of landings before that
        self.reads_started = False
        self.streams = self.verifier = self.report = self.copy_handle = None
        self.read_start = self.read_end = None
        self.sources: dict = {}
        self.o_direct_flags: set = set()
        self.io_notes: set = set()
        self.landed: list = [None] * n  # seconds from the call's start to each read object's load completing

    # ------------------------------------------------------------------ the restoring thread
    def run(self) -> RestoreResult:
        ctx, items, n, tier = self.ctx, self.items, self.n, self.tier
        cfg = ctx.config
        try:
            # Resident objects are leased here, on this thread: no read and no thread hop.
            leases = self.leases
            leases[:] = tier.acquire_resident_many([it.key for it in items], model_fingerprint=ctx.model_fingerprint)
            headers = self.headers = [lease.header if lease is not None else ctx.store.read_header(it.key)
                                      for lease, it in zip(leases, items)]
            for lease, h in zip(leases, headers):
                if lease is None:  # resident ones were checked when leased
                    check_fingerprint(h, ctx.model_fingerprint)
            offsets, total = layout_offsets(headers)
            self.offsets = offsets
            self.missing = [i for i in range(n) if leases[i] is None]
            if self.missing:
                # the reads go out now, before the staging buffer, streams and checks below are made
                # (landings until then are parked); a placement that cannot work costs no read
                ctx.placer.check(items, headers)
                self._start_reads()
            buffer = self.buffer = torch.empty(total, dtype=torch.uint8, device=ctx.device)
            if ctx.device.type == "cuda" and all(
                    lease is not None and (cfg.verify == "none" or (cfg.trust_verified and lease.verified))
                    for lease in leases):
                # nothing to read and nothing to hash: nothing to overlap, one stream serves; the DMA
                # starts with the first object's copy, before the others' are arranged
                streams = CallerStream(ctx.device)
                addr, pinned = leases[0].payload_memory()
                early = int(pinned and cuda.copy_htod(buffer.data_ptr(), addr, headers[0].padded_length,
                                                      streams.copy_handle()))
                return _resident_child(ctx, items, leases, headers, buffer, offsets, early, streams, self.t0)
            # digests of several objects run side by side on separate streams
            streams = self.streams = Streams(ctx.device)
            # 1. Resident objects: their copies go first, so the DMA runs while everything below is done.
            resident = [i for i in range(n) if leases[i] is not None]
            resident_event = _copy_resident(buffer, offsets, headers, leases, resident, 0, streams) if resident \
                else None
            # (checks that need no data come after the copies: the DMA is running meanwhile)
            if not self.reads_started:
                ctx.placer.check(items, headers)
            report = self.report = _new_report(ctx)
            # 2. Missing objects: their reads went out after the headers; the thread that finishes an
            # object queues its copy at once (`_land`), and after each group of landings the reader
            # reports together it fences them and queues their digest (`_flush`), while the other
            # reads go on: no hop to this thread sits between an object's last byte and its digest.
            verifier = self.verifier = Verifier(cfg.verify, buffer, cfg.hash_backend, streams,
                                                trust_verified=cfg.trust_verified, objects=n)
            # a read object's bytes go to the GPU in one driver copy from the completion thread
            self.copy_handle = streams.copy_handle() if tier.pool.pin else None
            if self.reads_started:
                self._arm()
            # 3. While the bytes move: the placement (validation and launch tables).
            placement = ctx.placer.prepare(buffer, offsets, items, headers, streams)
            if resident:
                with self.lock:
                    # Digests and placement read the resident objects only after their copies.
                    streams.work_after(resident_event)
                    self.sources["hit"] = self.sources.get("hit", 0) + len(resident)
                    report.bytes_moved += sum(headers[i].padded_length for i in resident)
                    verifier.landed_many([(offsets[i], headers[i], leases[i]) for i in resident], resident_event)
            if self.pending:  # every load's lease, so that each is released whatever happened
                self._take_loads()
            if self.failures:
                raise self.failures[0]
            # The placement behind a device comparison of the roots where it can be (it writes
            # nothing unless all match), so that it follows the last digest on the device, not the
            # host's comparison; otherwise it is launched once the host has compared.
            gated = verifier.gate(placement.launches)
            if gated:
                placement.run()
            verify_s, bad = verifier.finish()
            if bad:
                for key in bad:
                    tier.evict(key)  # retention must not keep bytes that failed their check
                raise integrity_failure(bad)
            verifier.mark_verified("host_staging")
            if not gated:
                placement.run()
            report.placed = True
            result = RestoreResult(report, buffer, offsets, headers)
            streams.join()
            streams.sync()
        finally:
            self._wind_up()
        return _finish_report(result, tier, self.sources, self.o_direct_flags, self.io_notes, verifier, self.landed,
                              self.read_start, self.read_end, verify_s, placement.seconds, self.t0)

    def _start_reads(self) -> None:
        """Every chunk of every missing object queued on the tier's reader, in order."""
        self.read_start = time.perf_counter()
        self.all_settled = threading.Event()
        self.pending = len(self.missing)
        self.reads_started = True
        items, headers = self.items, self.headers
        self.tier.start_loads([items[i].key for i in self.missing], model_fingerprint=self.ctx.model_fingerprint,
                              headers=[headers[i] for i in self.missing], on_done=self.on_done,
                              on_batch=self.on_batch)

    def _arm(self) -> None:
        """Landings can be copied, hashed and reported from now on: take those parked so far."""
        with self.lock:
            self.armed = True
            try:
                if not (self.stopped or self.failures):
                    for i, lease, when in self.parked:
                        self._land(i, lease, when)
                    self._flush()
                self.parked.clear()  # (their leases are in `settled`: released with the others)
            except BaseException as exc:
                self.failures.append(exc)

    def _take_loads(self) -> None:
        """Wait for every load to settle, take their leases, and flush what no group took."""
        self.all_settled.wait()
        self.pending = _take_leases(self.settled, self.leases)
        with self.lock:  # landings no reading thread has queued yet (none when it kept up)
            try:
                self._flush()
            except BaseException as exc:
                self.failures.append(exc)

    def _wind_up(self) -> None:
        """Whatever happened: no landing runs past this point, the caller's stream waits for every
        stream used, the verifier's driver copies are done, every load's lease is released."""
        with self.lock:  # later landings see `stopped`
            self.stopped = True
        streams = self.streams
        if streams is not None:
            streams.join()
        if self.verifier is not None:
            self.verifier.settle()
        # Loads still in flight after an early error: take their leases so every one is released.
        drained = bool(self.pending)
        if drained:
            self.all_settled.wait()
            self.pending = _take_leases(self.settled, self.leases)
            if streams is not None:
                # copies issued by reading threads before they saw `stopped`: the caller's stream
                # (which frees the staging buffer) waits for them too
                streams.after_late_copies()
        for lease in self.leases:
            if lease is not None:
                lease.release()

    # ------------------------------------------------------------------ the reader's completion thread
    def on_done(self, j: int, lease, error) -> None:
        """``HostTier.start_loads``' report of load ``j`` (the ``j``-th missing object)."""
        when = time.perf_counter()
        i = self.missing[j]
        with self.lock:
            if error is not None:
                self.failures.append(error)
                self.stopped = True
            elif not self.stopped and not self.failures:
                if not self.armed:
                    self.parked.append((i, lease, when))
                else:
                    try:
                        self._land(i, lease, when)
                    except BaseException as exc:
                        self.failures.append(exc)
            self.settled.append((i, lease, error))
            last = len(self.settled) == len(self.missing)
        if last:
            self.all_settled.set()

    def on_batch(self) -> None:
        """After a group of landings the reader reported together: fence and hash them at once."""
        with self.lock:
            if not self.armed:
                return
            try:
                self._flush()
            except BaseException as exc:
                self.failures.append(exc)

    def _land(self, i: int, lease, when: float) -> None:
        """(lock held, armed) Object ``i``'s load finished: its checks, bookkeeping and copy;
        :meth:`_flush` queues its fence and digest."""
        header = self.headers[i]
        if lease.header.sha256 != header.sha256:
            raise IntegrityError(f"segment {self.items[i].key}: changed on storage during the restore")
        source = lease.source
        self.sources[source] = self.sources.get(source, 0) + 1
        self.landed[i] = when - self.t0
        if source == "read":
            self.read_end = when if self.read_end is None else max(self.read_end, when)
            self.report.bytes_read += header.padded_length
            self.o_direct_flags.add(lease.o_direct)
            if lease.io_note:
                self.io_notes.add(lease.io_note)
        _copy_into(self.buffer, self.offsets[i], lease, self.streams, self.copy_handle)  # the DMA starts at once
        self.arrived.append((i, lease))

    def _flush(self) -> None:
        """(lock held) The objects landed and copied since the last flush: one event after their
        copies, fencing their buffers and awaited by the work stream, and their digests, one
        launch for all of them (``Verifier.landed_many``)."""
        arrived = self.arrived
        if not arrived:
            return
        group = arrived[:]
        arrived.clear()
        streams = self.streams
        event = streams.copied()  # after every copy issued so far
        for _, lease in group:  # fenced also when the restore gives up
            lease.fence(event)
        if self.stopped or self.failures:
            return
        headers, offsets = self.headers, self.offsets
        self.report.bytes_moved += sum(headers[i].padded_length for i, _ in group)
        streams.work_after(event)
        self.verifier.landed_many([(offsets[i], headers[i], lease) for i, lease in group], event)


def _take_leases(settled: list, leases: list) -> int:
    """Every settled load's lease into ``leases`` (its release is the caller's); returns 0 (none pending)."""
    for i, lease, error in settled:
        if error is None:
            leases[i] = lease
    return 0


def _copy_into(buffer: torch.Tensor, offset: int, lease, streams, handle: int | None) -> None:
    """One async copy of a leased payload into ``buffer[offset:]`` on the copy stream (the caller
    records the event that fences it). ``handle``: the copy stream's raw handle, for one driver call
    where the payload is page-locked (torch's copy otherwise, or where the driver refuses)."""
    addr, pinned = lease.payload_memory() if handle is not None else (0, False)
    if not (pinned and cuda.copy_htod(buffer.data_ptr() + offset, addr, lease.header.padded_length, handle)):
        payload = lease.payload
        with streams.on_copy():
            buffer[offset: offset + payload.numel()].copy_(payload, non_blocking=True)


def _new_report(ctx) -> RestoreReport:
    engine = ctx.tier.io_engine
    return RestoreReport(path="in_process", route="host_staging", mechanism="", device=str(ctx.device),
                         io_engine=engine.engine, notes=[f"reads: {engine.description}"])


def _finish_report(result: RestoreResult, tier, sources: dict, o_direct_flags: set, io_notes: set, verifier: Verifier,
                   landed: list, read_start, read_end, verify_s: float, prepare_s: float, t0: float) -> RestoreResult:
    """The report's facts, filled in after the restore's wait (``restore_s`` ends here).

    ``timings`` holds nested wall intervals in seconds (never add them): ``read_s`` (first read
    submitted to last read complete), ``verify_s`` (first digest launched to the roots checked),
    ``prepare_s`` (placement preparation, overlapped with the reads and copies) and ``tail_s`` (last
    object landed to the end) all lie inside ``restore_s`` (call start to data verified, placed and
    the caller's stream synchronised)."""
    end = time.perf_counter()
    report = result.report
    engine = tier.io_engine
    report.objects = len(result.headers)
    report.tier_sources = sources
    report.pinned = tier.pin
    report.o_direct = (o_direct_flags == {True}) if o_direct_flags else None
    report.notes += sorted(io_notes)
    report.verification = verifier.description
    report.verified = dict(verifier.counts)
    cfg = tier.config
    # With reads queued in object order, objects land one after another and each digest overlaps
    # the later reads; ~equal times mean the disk served all objects' chunks together.
    report.facts["loads_done_s"] = landed
    report.facts["io"] = {"engine": engine.engine, "engine_note": engine.engine_note, "chunk_bytes": cfg.chunk_bytes,
                          "queue_depth": cfg.read_threads, "submission": "every chunk of every object at once, "
                          "in object order (no thread per object)"}
    dst = "cudaMemcpyAsync H2D on a copy stream" if result.buffer.is_cuda else "host memcpy (no GPU)"
    staging = "pinned host RAM" if tier.pin else "pageable host RAM"
    if sources.get("read") and not tier.store.local:
        report.facts["io"] = {"engine": "pyarrow.fs", "filesystem": tier.store.filesystem.type_name,
                              "submission": "one read per object on the tier's loader threads"}
        report.mechanism = (f"reads through pyarrow.fs ({tier.store.filesystem.type_name}), one per object "
                            f"-> {staging} -> {dst}, one copy per object")
    elif sources.get("read"):
        how = "O_DIRECT reads" if report.o_direct else "page-cache reads (O_DIRECT unavailable)"
        report.mechanism = (f"{how} through {engine.description}, {cfg.chunk_bytes >> 10} KiB chunks "
                            f"-> {staging} -> {dst}, one copy per object as its last chunk lands")
    else:
        report.mechanism = f"host tier ({staging}, retained) -> {dst}, one copy per object"
    report.timings = {"read_s": (read_end - read_start) if read_end is not None else 0.0, "verify_s": verify_s,
                      "prepare_s": prepare_s, "tail_s": (end - read_end) if read_end is not None else 0.0,
                      "restore_s": end - t0}
    return result


__all__ = ["restore_host_staging"]
