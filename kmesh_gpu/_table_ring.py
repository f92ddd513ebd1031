"""Page-locked host memory for launch tables uploaded with raw driver copies (:class:`TableRing`).

torch's pinned-memory allocator keeps a block from reuse until the copies *torch* queued from it
have run; a copy queued straight through the driver (:mod:`._driver_jit`) is invisible to it, so
a table uploaded that way needs memory whose reuse waits for that copy. A ring hands out regions in
order; each region is fenced by an event recorded after its upload and is handed out again only
once that event has completed. A ring never waits: when the region it would hand out next is still
being read, :meth:`TableRing.reserve` returns ``None`` and the caller takes its other path.
"""

from __future__ import annotations

import collections
import threading

import torch

_ALIGN = 256


class _Region:
    __slots__ = ("start", "end", "event", "done")

    def __init__(self, start: int, end: int, event):
        self.start, self.end, self.event, self.done = start, end, event, False

    def finished(self) -> bool:
        if not self.done:
            self.done = bool(self.event.query())
        return self.done


class TableRing:
    """``nbytes`` of host memory (page-locked when ``pin``) lent out in regions, each until the
    event its borrower recorded after reading it has completed.

    ``new_event()``: makes an event for a region (``None``: none can be made; :meth:`reserve` then
    declines); events are reused once their region is free again. Thread-safe.
    """

    def __init__(self, nbytes: int, *, pin: bool, new_event):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.base = self.tensor.data_ptr()
        self.size = nbytes
        #: the same memory as int64 (offsets from :meth:`reserve` are multiples of 256 bytes)
        self.t64 = self.tensor.view(torch.int64)
        self.a64 = self.t64.numpy()
        self._new_event = new_event
        self._head = 0
        self._regions: collections.deque[_Region] = collections.deque()  # in the order they were lent
        self._spare: list = []  # events of regions that are free again
        self._lock = threading.Lock()
        #: device memory of the ring's size, for borrowers whose fence follows every reader of their
        #: region there too (``PlacementPlan.place``); made on first use (:meth:`device_mirror`)
        self.mirror = None

    def device_mirror(self, device) -> int:
        """Address of the ring's device mirror on ``device`` (made once; 0 where it cannot be)."""
        if self.mirror is None:
            with self._lock:
                if self.mirror is None:
                    try:
                        self.mirror = torch.empty(self.size, dtype=torch.uint8, device=device)
                    except RuntimeError:  # out of device memory: the borrower's other path
                        self.mirror = False
        return self.mirror.data_ptr() if self.mirror is not False else 0

    def reserve(self, nbytes: int):
        """``(offset, event)`` of a free region of ``nbytes`` (the caller records ``event`` after
        the copy that reads it, or calls :meth:`cancel`), or ``None``.

        Regions are lent at increasing offsets, wrapping to 0, so the ones a new region would
        overwrite are always the oldest, at the front of the list: a reservation looks at those
        only (and, when it wraps, first at the abandoned tail's), never at the whole list."""
        n = -(-nbytes // _ALIGN) * _ALIGN
        if n > self.size // 4:  # a table this large is rare: it takes the caller's other path
            return None
        with self._lock:
            head = self._head
            start = head if head + n <= self.size else 0
            end = start + n
            regions, spare = self._regions, self._spare
            while regions:
                r = regions[0]
                # overwritten by the new region, or in the tail a wrap leaves behind (older than
                # the regions at the start it is about to reach)
                if not (r.start < end and start < r.end) and not (start == 0 and r.start >= head and head):
                    break
                if not r.finished():
                    return None
                spare.append(regions.popleft().event)
            event = spare.pop() if spare else self._new_event()
            if event is None:
                return None
            regions.append(_Region(start, end, event))
            self._head = end
            return start, event

    def cancel(self, offset: int) -> None:
        """The region at ``offset`` was not read after all (nothing was queued from it)."""
        with self._lock:
            for r in reversed(self._regions):  # the newest, as a rule
                if r.start == offset and not r.done:
                    r.done = True
                    return

    def pending(self) -> int:
        """Regions still lent (their events not yet seen complete)."""
        with self._lock:
            return sum(1 for r in self._regions if not r.finished())


_RINGS: dict = {}  # device index -> TableRing (or None: this device's ring cannot be made)
_RINGS_LOCK = threading.Lock()
RING_BYTES = 4 << 20  # tables of up to ~13k tokens each; ~50 of a 1k-token restore in flight


def ring_for(device_index: int, new_event) -> TableRing | None:
    """The table ring of the CUDA device ``device_index`` (events must belong to its context)."""
    ring = _RINGS.get(device_index, False)
    if ring is not False:
        return ring
    with _RINGS_LOCK:
        ring = _RINGS.get(device_index, False)
        if ring is False:
            try:
                ring = TableRing(RING_BYTES, pin=True, new_event=new_event)
            except RuntimeError:  # pinned memory refused
                ring = None
            _RINGS[device_index] = ring
    return ring
