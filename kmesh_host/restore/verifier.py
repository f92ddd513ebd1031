"""The tree-root check of restored objects where they landed (:class:`Verifier`).

Every object that is not already verified is checked against the kmesh-tree-sha256/v1 root stored
with it: on the device (``kmesh_gpu.tree_digests``, one launch per group of objects as soon as their
bytes are in place, the roots downloaded into a page-locked table right behind their digest), or on
the host. All roots are compared on the host once every download's event has completed; with
device verification on CUDA the placement can go ahead of that comparison behind a device-side
comparison of the roots with the stored ones (:meth:`Verifier.gate`, ``kmesh_gpu.Launch.gate``),
which writes nothing unless all of them match.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import kmesh_gpu
from kmesh_gpu import cuda
from kmesh_gpu.errors import IntegrityError, LayoutError

from ..segment import SegmentHeader, check_payload

VERIFY_MODES = ("device", "device-batched", "host", "none")


class Verifier:
    """Tree-root checks of objects where they landed: launched as objects land, compared once.

    ``landed(...)`` / ``landed_many(...)`` are called as objects' bytes arrive (in any order; the
    objects of one call together); objects whose tier entry is already verified are trusted when
    ``trust_verified``. :meth:`finish` compares every root with one synchronisation and returns the
    keys that failed; :meth:`gate` lets the placement go ahead of that comparison on the device.

    Args:
        mode: one of :data:`VERIFY_MODES`.
        buffer: the staging buffer (uint8) the objects land in.
        backend: ``kmesh_gpu.tree_digests``' backend.
        streams: the restore's :class:`~kmesh_host.restore.streams.Streams` (or ``CallerStream``).
        trust_verified: objects whose tier lease says they were verified are not checked again.
        objects: how many objects may land (sizes the root tables on CUDA; 0: no tables).
    """

    _HOW = {"device": "device kmesh-tree-sha256 root", "device-batched": "device kmesh-tree-sha256 root",
            "host": "host kmesh-tree-sha256 root"}

    def __init__(self, mode: str, buffer: torch.Tensor, backend: str, streams, *, trust_verified: bool,
                 objects: int = 0):
        if mode not in VERIFY_MODES:
            raise LayoutError(f"verify: expected one of {VERIFY_MODES}, got {mode!r}")
        self.mode, self.buffer, self.backend, self.streams = mode, buffer, backend, streams
        self.trust = trust_verified
        self.started: float | None = None
        self.counts: dict[str, int] = {}
        self._checked: list[tuple[int, SegmentHeader, object]] = []  # (offset, header, lease or None)
        self._roots: list[torch.Tensor] = []
        self._host_bad: list[str] = []
        # ``device`` mode on CUDA: the objects landed together get one digest launch, whose roots
        # go into rows of a device table and are downloaded right after it, on its stream, into a
        # pinned table, so that once the last digest is done the comparison is one wait and a host
        # compare of 32-byte rows. Both tables have 2 x ``objects`` rows (made before the reads):
        # rows [0, objects) the computed roots, in the order of ``_checked``; rows [objects, 2 x
        # objects) the stored ones, which the gate uploads and compares on the device.
        self._objects = objects
        self._rows = 0  # table rows filled (checked objects, in the order of ``_checked``)
        self._host_roots = self._dev_roots = None
        self._root_events: list = []  # per digest launch (tables only): an event after its roots' download
        self.gated = False  # the placement was queued behind a device comparison of the roots (gate())
        self._gate_done = None  # an event after the gate
        if mode == "device" and objects > 0 and buffer.is_cuda:
            self._host_roots = torch.empty((2 * objects, 32), dtype=torch.uint8, pin_memory=True)
            self._dev_roots = torch.empty((2 * objects, 32), dtype=torch.uint8, device=buffer.device)

    def _mark(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def landed(self, offset: int, header: SegmentHeader, *, lease=None, event=None) -> None:
        """Object bytes are in ``buffer[offset:]`` once ``event`` (its copy; ``None``: already) completes."""
        self.landed_many([(offset, header, lease)], event)

    def landed_many(self, items, event=None) -> None:
        """Objects ``(offset, header, lease or None)`` whose bytes are all in ``buffer`` once ``event``
        completes (``None``: already). In ``device`` mode with the tables, those to check are hashed
        by one launch (one per set of tree parameters among them)."""
        group = []
        for offset, header, lease in items:
            if lease is not None and self.trust and lease.verified:
                self._count(f"trusted: {lease.verified}")
                continue
            if self.mode == "none":
                self._count("not verified")
                continue
            self._count(f"{self._HOW[self.mode]} (this call)")
            if self.mode == "device":
                self._mark()
                if self._host_roots is not None:
                    if self._rows + len(group) >= self._objects:
                        raise RuntimeError(f"Verifier: more objects landed than the {self._objects} it was made for")
                    group.append((offset, header, lease))
                    continue
                self._checked.append((offset, header, lease))
                with self.streams.on_digest(event):
                    root = kmesh_gpu.tree_digests(self.buffer, [offset], [header.padded_length],
                                                  leaf_size=header.tree_leaf_size, fanout=header.tree_fanout,
                                                  backend=self.backend)
                    self._roots.append(root)
                continue
            self._checked.append((offset, header, lease))
            if self.mode == "host" and lease is not None:
                self._mark()
                if not host_root_ok(header, lease.payload.numpy()):
                    self._host_bad.append(header.key)
        if group:
            by_params: dict = {}
            for item in group:
                by_params.setdefault((item[1].tree_leaf_size, item[1].tree_fanout), []).append(item)
            for (leaf, fanout), items_ in by_params.items():
                self._digest_to_table(items_, leaf, fanout, event)

    def _digest_to_table(self, items: list, leaf: int, fanout: int, event) -> None:
        """One digest launch for ``items`` (same tree parameters) on the next side stream after
        ``event``, their roots into the next rows of the device table, downloaded into the same
        rows of the pinned table there, and an event recorded after that (the comparison waits for
        those events alone, not for a join of every stream). Often runs on the reader's completion
        thread, between chunk landings, so it is kept short: a digest this restore's shape has had
        on that stream before is one launch (``tree_digests`` with ``out`` and ``stream``) and one
        driver copy of the roots."""
        k, m = self._rows, len(items)
        stored = self._host_roots.numpy()
        for j, (_, header, _) in enumerate(items):  # the stored roots, for the gate's upload
            stored[self._objects + k + j] = np.frombuffer(header.tree_root, dtype=np.uint8)
        side = self.streams.digest_side(event)
        out = self._dev_roots[k:k + m]
        kmesh_gpu.tree_digests(self.buffer, tuple(o for o, _, _ in items), tuple(h.padded_length for _, h, _ in items),
                               leaf_size=leaf, fanout=fanout, backend=self.backend, out=out, stream=side.cuda_stream)
        if not cuda.copy_dtoh(self._host_roots.data_ptr() + 32 * k, out.data_ptr(), 32 * m, side.cuda_stream):
            with self.streams.on_side(side):
                self._host_roots[k:k + m].copy_(out, non_blocking=True)
        event = cuda.DriverEvent.recorded(side.cuda_stream)
        if event is None:
            event = torch.cuda.Event()
            event.record(side)
        self._root_events.append(event)
        self._checked.extend(items)
        self._rows += m

    def _in_tables(self) -> bool:
        """Every checked object's root is (on its way) in the tables."""
        return self._host_roots is not None and self._rows == len(self._checked) and not self._roots

    def gate(self, launches) -> bool:
        """Queue on the work stream, behind every checked object's root (each digest launch's
        event), the device comparison of those roots with the stored ones, made so that each of
        ``launches`` (the placement's ``kmesh_gpu.Launch``es, run next on the work stream) writes
        nothing unless all of them match (``Launch.gate``): the placement can then be launched
        before :meth:`finish` compares on the host, with no host round trip between the last
        digest and the placement. ``True`` when queued for every launch; ``False`` in other
        verification modes, for a placement without a run table on the device, or on a refusal:
        compare first, then place."""
        n = self._rows
        if self.mode != "device" or not n or not self._in_tables() or self.streams.work is None:
            return False
        work = self.streams.work.cuda_stream
        want = self._dev_roots.data_ptr() + 32 * self._objects
        if not cuda.copy_htod(want, self._host_roots.data_ptr() + 32 * self._objects, 32 * n, work):
            return False
        # (a failed gate below leaves that upload queued: harmless, and settle() waits for it)
        self._gate_done = cuda.DriverEvent.recorded(work)
        for event in self._root_events:
            self.streams.work_after(event)
        gated = True
        for launch in launches:
            gated = gated and launch.gate(self._dev_roots.data_ptr(), want, 32 * n, work)
        self.gated = gated
        if gated:
            self._gate_done = cuda.DriverEvent.recorded(work) or self._gate_done
        return gated

    def settle(self) -> None:
        """Wait for every digest, root download and gate still pending where this class queued them
        below torch: driver copies into and out of the pinned table (which torch's pinned allocator
        does not track), reading device rows made on another thread's stream. Called before the
        tables can go, also when a restore fails before :meth:`finish` (after it, the events have
        completed and this only queries them)."""
        for event in (*self._root_events, self._gate_done):
            if event is None:
                continue
            try:
                event.synchronize()
            except RuntimeError:  # a device error: the restore's own error (or finish's) reports it
                pass

    def finish(self) -> tuple[float, list[str]]:
        """``(seconds since the first check started, keys whose root does not match)``."""
        if not self._checked:
            return 0.0, []
        self._mark()
        headers = [h for _, h, _ in self._checked]
        if self.mode == "host":
            bad = list(self._host_bad)
            for offset, h, lease in self._checked:
                if lease is None:  # objects that only exist on the device (direct route): download
                    with self.streams.on_work():
                        host = self.buffer[offset: offset + h.padded_length].cpu().numpy()
                    if not host_root_ok(h, host):
                        bad.append(h.key)
            return time.perf_counter() - self.started, bad
        n = len(headers)
        if self.mode == "device" and self._in_tables():
            # every root is on its way to the pinned table: wait for each download's event (no
            # stream waits for the digests here: the placement reads the buffer, not the roots, and
            # the caller's stream joins the digest streams before the buffer can go, in join())
            for event in self._root_events:
                event.synchronize()
            got = self._host_roots.numpy()[:n]
        else:
            self.streams.digests_done()
            with self.streams.on_work():
                if self.mode == "device-batched":
                    params = {(h.tree_leaf_size, h.tree_fanout) for h in headers}
                    if len(params) != 1:
                        raise IntegrityError(f"segments {[h.key for h in headers]}: mixed tree parameters "
                                             f"{params}; use verify='device'")
                    leaf, fanout = params.pop()
                    roots = kmesh_gpu.tree_digests(self.buffer, [o for o, _, _ in self._checked],
                                                   [h.padded_length for h in headers], leaf_size=leaf,
                                                   fanout=fanout, backend=self.backend)
                else:
                    roots = torch.cat([r.reshape(-1, 32) for r in self._roots])
                # The one synchronisation: the roots come back (32 bytes per object).
                got = roots.cpu().numpy()
        bad = [h.key for h, row in zip(headers, got) if row.tobytes() != h.tree_root]
        return time.perf_counter() - self.started, bad

    def mark_verified(self, route: str) -> None:
        """After a successful :meth:`finish`: tier entries checked here are trusted from now on."""
        if self.mode == "none":
            return
        how = f"{self._HOW[self.mode]} of a copy of this buffer (route {route})" if self.mode != "host" else \
            f"{self._HOW[self.mode]} (route {route})"
        for _, _, lease in self._checked:
            if lease is not None:
                lease.mark_verified(how)

    @property
    def description(self) -> str:
        return {"device": "device tree-root (objects as they land, compared once)",
                "device-batched": "device tree-root (one batched launch)", "host": "host tree-root",
                "none": "none"}[self.mode]


def host_root_ok(header: SegmentHeader, payload) -> bool:
    """``payload`` (host bytes) has the tree root ``header`` stores."""
    try:
        check_payload(header, payload, sha=False, tree=True)
    except IntegrityError:
        return False
    return True


def integrity_failure(bad: list[str]) -> IntegrityError:
    """The error of a restore whose objects ``bad`` failed their root check (nothing was placed)."""
    return IntegrityError(f"segment(s) {', '.join(bad)}: kmesh-tree-sha256 root mismatch where the data landed "
                          "(corrupt read or storage); nothing was placed")


__all__ = ["VERIFY_MODES", "Verifier", "host_root_ok", "integrity_failure"]
