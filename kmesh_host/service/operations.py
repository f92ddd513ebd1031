"""Operations on a registration's memory: submitting a copy on its stream with the completion that
releases it (:meth:`Operations.submit`), waiting for it (:meth:`Operations.finish`), and the save
(the registration's slots gathered and published as an original once drained).

Each submission ends with a CUDA event (CPU copies are finished when they return); the operation's
source and destination stay held until a wait on that event succeeds (``drain``, ``acquire``, a
synchronous request, ``close`` or the reaper for clients that went away). Whatever a submission
managed to queue is covered by that event, also when it failed part-way: a failed request is
drained, never resubmitted.

Fault injection (``ServiceConfig.allow_fault_injection=True`` only; tests): a request may carry
``inject``: ``{"spin_cycles": int}`` queues a spin kernel ahead of its copy, ``{"fail_after_submit":
true}`` fails the request after its copy was submitted, ``{"refuse_waits": n}`` refuses the first
``n`` waits on its completion.
"""

from __future__ import annotations

import threading

import torch

from kmesh_gpu import cuda
from kmesh_gpu.errors import DrainError, KmeshError, ProtocolError, ServiceError

from .completions import CudaEventCompletion, RefusingCompletion
from .originals import Originals
from .registry import Completion, Finished, Op, Registration, Registry

_FINISHED = Finished()  # stateless: one for every synchronous (host memory) copy
_NO_FAULTS: dict = {}  # never modified
_FAULTS = ("spin_cycles", "fail_after_submit", "refuse_waits")

# torch's current stream as (stream_id, device_index, device_type) and its setter, without building
# Stream objects (torch.cuda.stream's context does that and more on every entry); None where absent
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)


class InjectedFault(KmeshError):
    """A failure requested by a test through ``inject``."""


class Activity:
    """Requests in flight in the whole service, and its counters (under one lock). The completion
    poll and the request poll look at ``inflight`` without the lock (a hint, never authority)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inflight = 0
        self.counters = {"requests": 0, "errors": 0, "internal_errors": 0, "refused_peers": 0,
                         "placements_one_prepare": 0, "placements_two_prepares": 0}

    def count(self, name: str) -> None:
        with self.lock:
            self.counters[name] += 1

    def nothing_in_flight(self) -> bool:
        return self.inflight == 0

    def alone(self) -> bool:
        """No other request is being handled (the completion poll's condition to go on polling)."""
        return self.inflight <= 1


def check_inject(inject: dict | None, allowed: bool) -> dict:
    """A request's ``inject`` field, checked (:class:`ProtocolError` unless ``allowed`` and well formed)."""
    if not inject:
        return _NO_FAULTS
    if not allowed:
        raise ProtocolError("inject: fault injection is disabled in this service")
    for k, v in inject.items():
        if k not in _FAULTS:
            raise ProtocolError(f"inject: unknown fault {k!r}")
        if k == "fail_after_submit" and type(v) is not bool:
            raise ProtocolError("inject.fail_after_submit: expected a bool")
        if k != "fail_after_submit" and (type(v) is not int or not 0 <= v < 1 << 62):
            raise ProtocolError(f"inject.{k}: expected an int in 0..2^62")
    return inject


class _OnStream:
    """``with``: the registration's stream (its ``stream_ids``) is torch's current stream, and its
    device the current device: what ``with torch.cuda.device(i), torch.cuda.stream(s)`` does, for a
    fraction of its Python cost (those resolve the current device several times and build Stream
    objects). Afterwards the device's previous stream and the thread's previous device are back."""

    __slots__ = ("ids", "prev", "prev_device")

    def __init__(self, ids: tuple):
        self.ids = ids

    def __enter__(self):
        self.prev_device = torch.cuda.current_device()
        self.prev = _GET_STREAM(self.ids[1])
        _SET_STREAM(stream_id=self.ids[0], device_index=self.ids[1], device_type=self.ids[2])

    def __exit__(self, *exc):
        p = self.prev
        _SET_STREAM(stream_id=p[0], device_index=p[1], device_type=p[2])
        if self.prev_device != self.ids[1]:
            torch.cuda.set_device(self.prev_device)


class _TorchStream:
    """:class:`_OnStream` through torch's context managers, where torch has no raw setters."""

    __slots__ = ("stream", "ctx")

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.ctx = (torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream))
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(None, None, None)


def on_stream(dest):
    """``with``: ``dest.stream`` current (see :class:`_OnStream`)."""
    if _GET_STREAM is None or _SET_STREAM is None:
        return _TorchStream(dest.stream)
    return _OnStream(dest.stream_ids)


class Operations:
    """Submission and completion of a registration's copies, and the save."""

    def __init__(self, registry: Registry, originals: Originals, activity: Activity, *, completion_spin_s: float):
        self.registry, self.originals, self.activity = registry, originals, activity
        self.completion_spin_s = completion_spin_s

    def submit(self, reg: Registration, op: Op, inject: dict, enqueue, *, client_event=None,
               on_drained=None) -> None:
        """Run ``enqueue(keepalive)`` on the registration's stream and record what was submitted.

        Whatever ``enqueue`` managed to queue is covered by the completion recorded afterwards, also
        when it raised part-way: a failed request is still drained, never resubmitted.
        """
        keepalive: list = []
        error: BaseException | None = None
        completion: Completion
        dest = reg.destination
        if dest.on_cuda:
            stream = dest.stream
            switch = on_stream(dest)
            switch.__enter__()
            try:
                try:
                    if client_event is not None:
                        # The client's earlier writes/reads of these blocks come first. Where they
                        # have already finished (the event's last record, made for this request, has
                        # completed) the stream does not wait: a device-side wait on an
                        # interprocess event delays the copy by tens of microseconds even then.
                        if not cuda.event_query(client_event.cuda_event):
                            if not cuda.wait_event(stream.cuda_stream, client_event.cuda_event):
                                stream.wait_event(client_event)
                        keepalive.append(client_event)
                    if inject and inject.get("spin_cycles"):
                        torch.cuda._sleep(int(inject["spin_cycles"]))
                    enqueue(keepalive)
                    if inject and inject.get("fail_after_submit"):
                        raise InjectedFault("injected failure after the copy was submitted")
                except BaseException as exc:
                    error = exc
                finally:
                    try:  # an event of an earlier copy that has drained (see restores), else a new one
                        done = dest.free_events.pop()
                    except IndexError:
                        done = torch.cuda.Event(blocking=True)
                    if not cuda.record_event(done.cuda_event, stream.cuda_stream):  # a new one: torch creates it
                        done.record(stream)
            finally:
                switch.__exit__(None, None, None)
            activity = self.activity
            completion = CudaEventCompletion(done, spin_s=self.completion_spin_s if activity.inflight <= 1 else 0.0,
                                             spin_while=activity.alone)
        else:
            try:
                enqueue(keepalive)
                if inject and inject.get("fail_after_submit"):
                    raise InjectedFault("injected failure after the copy was submitted")
            except BaseException as exc:
                error = exc
            completion = _FINISHED
        if inject and inject.get("refuse_waits"):
            completion = RefusingCompletion(completion, int(inject["refuse_waits"]))
        if error is None:
            self.registry.submitted(op, completion, outcome="ok", keepalive=keepalive, on_drained=on_drained)
            return
        self.registry.submitted(op, completion, outcome="failed", error=str(error), keepalive=keepalive,
                                on_drained=on_drained)
        if not isinstance(error, KmeshError):
            error = ServiceError(f"copy failed after submission: {type(error).__name__}: {error}")
        error.op_id = op.op_id
        raise error

    def finish(self, op: Op, wait: bool, timeout: float | None) -> Op:
        """Drain ``op`` when the request waits for its copy; returns it."""
        if wait:
            try:
                self.registry.drain_one(op, timeout)
            except DrainError as exc:
                exc.op_id = op.op_id
                raise
        return op

    def save(self, reg: Registration, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, *,
             inject: dict, timeout: float | None, client_event=None) -> tuple[Op, str]:
        """Gather the registration's ``slots`` and publish them (``token_ids``, ``positions``, the
        registration's fingerprint) once the copy has drained; returns the operation and the key.

        A save whose wait fails or is refused raises (``DrainError`` with ``op_id``) and stays pending;
        whoever drains it later publishes it then (its key is what a save of the same content
        returns). A failed or cancelled save is only freed."""
        dest = reg.destination
        blocks = self.registry.block_ids_of_slots(reg, slots)
        op = self.registry.begin(reg, "save", blocks)
        host_box: list = []
        published: list = []
        errors: list = []

        def enqueue(keepalive):
            kv = dest.plain.gather(slots)
            if dest.on_cuda:
                host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                host.copy_(kv, non_blocking=True)
                keepalive.extend((kv, host))
            else:
                host = kv
            host_box.append(host)

        def publish(drained_op):
            # Runs once the copy has physically finished; a failed or cancelled save is only freed.
            try:
                if drained_op.outcome == "ok" and host_box:
                    published.append(self.originals.put(host_box[0], token_ids, positions,
                                                        model_fingerprint=dest.model_fingerprint))
            except KmeshError as exc:  # told to the save's requester (if it waits), not to whoever drained
                drained_op.error = f"not published: {exc}"
                errors.append(exc)
            finally:
                host_box.clear()

        self.submit(reg, op, inject, enqueue, client_event=client_event, on_drained=publish)
        self.finish(op, True, timeout)
        if errors:
            errors[0].op_id = op.op_id
            raise errors[0]
        if not published:
            raise ServiceError(f"save {op.op_id}: {op.outcome}, nothing published")
        return op, published[0]
