"""Where a restore's device work runs: the copy, work and digest streams of a route, or the caller's.

:class:`Streams`: H2D copies on a copy stream, digests on a few side streams, the root comparison
and placement on a work stream; all start after the caller's current stream's earlier work and are
joined back into it. :class:`CallerStream` has the same interface with every step on the caller's
stream, for a child with nothing to read or hash. Events, waits and joins go through the driver
(:mod:`kmesh_gpu.cuda`: a quarter of the host cost of torch's event objects), torch's where the
driver declines. Stream switches use torch's raw setters where it has them (its context manager
builds objects and looks up the device on every entry); the streams are taken from torch's pool
once per thread and device.

:func:`on_stream` and :func:`stream_ids` are the cheap stream switch on their own (the cache
service uses it too).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from kmesh_gpu import cuda

# torch's current stream as (stream_id, device_index, device_type) and its setter, without building
# Stream objects (torch.cuda.stream's context does that and more on every entry); None where absent
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)


class _On:
    """``with``: ``stream`` (on the current device) is torch's current stream inside the block."""

    __slots__ = ("ids", "prev")

    def __init__(self, ids: tuple):
        self.ids = ids

    def __enter__(self):
        self.prev = _GET_STREAM(self.ids[1])
        _SET_STREAM(stream_id=self.ids[0], device_index=self.ids[1], device_type=self.ids[2])

    def __exit__(self, *exc):
        p = self.prev
        _SET_STREAM(stream_id=p[0], device_index=p[1], device_type=p[2])


def stream_ids(stream) -> tuple:
    """``(stream_id, device_index, device_type)`` of a torch CUDA stream: what :func:`on_stream` takes."""
    return stream.stream_id, stream.device_index, stream.device_type


def on_stream(stream, ids: tuple):
    """``with``: ``stream`` (``ids``: its :func:`stream_ids`) is torch's current stream, and its
    device the current device, inside the block; torch's raw setter where it has one, its context
    otherwise."""
    if _GET_STREAM is None or _SET_STREAM is None:
        return torch.cuda.stream(stream)
    return _On(ids)


raw_stream = cuda.current_stream  # torch's current stream as a raw handle (no Stream object)
#: per thread and device: the copy and work streams and the digest side streams a restore on that
#: thread uses (taken from torch's pool once; each restore ends synchronised, so the next reuses them)
_THREAD = threading.local()


class Streams:
    """Where one restore's device work runs (see the module docstring).

    ``copy`` takes the H2D copies, ``work`` the root comparison and placement; each object's digest
    runs on one of a few side streams (:meth:`on_digest`), so digests of objects that land together
    run at once rather than one after another (a tree digest is latency-bound: a few hundred
    threads per object leave the GPU mostly idle). All first wait for the caller's current stream
    (one event); :meth:`join` makes the caller's stream wait for all of them. On the CPU there are
    no streams: every step runs inline, in the order it is issued.
    """

    SIDE_STREAMS = 4

    def __init__(self, device: torch.device):
        self.caller = self.copy = self.work = self.start = None
        self.device = device
        self._sides: list = []
        self._next_side = 0
        self._joined = False
        self._lean, self._pool = False, []
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.caller = torch.cuda.current_stream(index)
            cache = getattr(_THREAD, "streams", None)
            if cache is None:
                cache = _THREAD.streams = {}
            own = cache.get(index)
            if own is None:  # From torch's per-device stream pool, once per thread.
                own = cache[index] = (torch.cuda.Stream(device=index), torch.cuda.Stream(device=index), [])
            self.copy, self.work, self._pool = own
            # one event after the caller's earlier work, which every stream of the restore waits for:
            # a driver event and waits where the driver takes them (torch's build objects and may
            # release the GIL, which the reader's completion thread then waits to get back)
            self.start = _driver_event(self.caller)
            self._wait(self.copy, self.start)
            self._wait(self.work, self.start)
            # the lean stream switch where torch offers it and the restore runs on the current device
            self._lean = _GET_STREAM is not None and _SET_STREAM is not None \
                and index == torch.cuda.current_device()
            self._copy_ids, self._work_ids = stream_ids(self.copy), stream_ids(self.work)

    def _on(self, stream, ids=None):
        if not self._lean:
            return torch.cuda.stream(stream)
        return _On(ids or stream_ids(stream))

    def on_copy(self):
        return self._on(self.copy, self._copy_ids) if self.copy is not None else contextlib.nullcontext()

    def on_work(self):
        return self._on(self.work, self._work_ids) if self.work is not None else contextlib.nullcontext()

    def copied(self):
        """An event completing after every copy issued so far (``None`` on the CPU)."""
        if self.copy is None:
            return None
        return _driver_event(self.copy)

    @staticmethod
    def _wait(stream, event) -> None:
        """``stream`` waits (on the device) for ``event``, a torch or a driver event."""
        if type(event) is cuda.DriverEvent:
            if not cuda.wait_event(stream.cuda_stream, event.cuda_event):
                event.synchronize()  # the driver refused the wait: the host waits instead
        else:
            stream.wait_event(event)

    def work_after(self, event) -> None:
        """Work issued from now on runs after ``event`` (a device-side wait; the host goes on)."""
        if event is not None:
            self._wait(self.work, event)

    def on_digest(self, event):
        """A context for one object's digest: the next side stream, after ``event`` (its copy)."""
        side = self.digest_side(event)
        return contextlib.nullcontext() if side is None else self._on(side)

    def on_side(self, side):
        """A context in which ``side`` (from :meth:`digest_side`) is torch's current stream."""
        return self._on(side)

    def digest_side(self, event):
        """The next side stream for one object's digest, made to wait for ``event`` (its copy);
        ``None`` on the CPU."""
        if self.work is None:
            return None
        if len(self._sides) < self.SIDE_STREAMS:
            k = len(self._sides)
            if k == len(self._pool):  # the thread's side streams, taken from torch's pool once
                self._pool.append(torch.cuda.Stream(device=self.caller.device_index))
            side = self._pool[k]
            self._wait(side, self.start)
            self._sides.append(side)
        else:
            side = self._sides[self._next_side % self.SIDE_STREAMS]
        self._next_side += 1
        if event is not None:
            self._wait(side, event)
        return side

    def digests_done(self) -> None:
        """Work issued from now on runs after every digest."""
        for side in self._sides:
            self.work.wait_stream(side)

    def join(self) -> None:
        """The caller's stream waits for every stream of this restore (once; later calls do nothing)."""
        if self.caller is not None and not self._joined:
            self._joined = True
            caller = self.caller.cuda_stream
            for stream in (self.copy, self.work, *self._sides):
                # a driver event and wait (two ctypes calls) where the driver takes them; torch's
                # wait_stream (a new event object each) otherwise
                event = cuda.DriverEvent.recorded(stream.cuda_stream)
                if event is None or not cuda.wait_event(caller, event.cuda_event):
                    self.caller.wait_stream(stream)

    def after_late_copies(self) -> None:
        """The caller's stream waits for the copy stream again: copies a reading thread issued after
        :meth:`join` (before it saw the restore give up) are then done before the buffer can go."""
        if self.caller is not None:
            self.caller.wait_stream(self.copy)

    def sync(self) -> None:
        """Wait on the host for the caller's stream (everything joined into it)."""
        if self.caller is not None:
            self.caller.synchronize()

    def copy_handle(self) -> int | None:
        """The raw handle of the copy stream (``None`` on the CPU)."""
        return self.copy.cuda_stream if self.copy is not None else None


class CallerStream:
    """:class:`Streams`' interface with every step on the caller's current stream, for a restore
    with nothing to read or hash (every object resident in the host tier and trusted): there is
    nothing to overlap, so the copies and the placement simply follow one another on one stream,
    and no event, cross-stream wait or stream switch is spent on arranging an overlap."""

    copy = work = caller = None
    _NULL = contextlib.nullcontext()

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()

    def on_copy(self):
        return self._NULL

    on_work = on_copy

    def copied(self):
        """An event after everything queued on the caller's stream so far (a driver event where the
        driver takes it: a quarter of the host cost of torch's)."""
        event = cuda.DriverEvent.recorded(raw_stream(self.index))
        if event is None:
            event = torch.cuda.Event()
            event.record()
        return event

    def work_after(self, event) -> None:
        pass

    def on_digest(self, event):
        return self._NULL

    def digests_done(self) -> None:
        pass

    def join(self) -> None:
        pass

    def after_late_copies(self) -> None:
        pass

    def sync(self) -> None:
        if not cuda.stream_synchronize(raw_stream(self.index)):
            torch.cuda.current_stream(self.device).synchronize()  # raises what the driver reported

    def copy_handle(self) -> int:
        """The raw handle of the stream copies go on (the caller's)."""
        return raw_stream(self.index)


def _driver_event(stream):
    """An event recorded on torch stream ``stream``: the driver's where it takes it, else torch's."""
    event = cuda.DriverEvent.recorded(stream.cuda_stream)
    if event is None:
        event = torch.cuda.Event()
        event.record(stream)
    return event


__all__ = ["Streams", "CallerStream", "on_stream", "stream_ids", "raw_stream"]
