"""Singleflight: concurrent calls for one key share a single execution.

The first caller of :meth:`SingleFlight.do` for a key runs the function; callers arriving while it
runs wait and receive its result, or its exception (each joiner re-raises the same exception
object, so typed errors such as IntegrityError reach everyone). When the call ends the key is
forgotten, so the next call runs again: this joins loads in flight, it is not a cache.

A leader that finishes its work on other threads (the host tier's pipelined loads) claims the key
with :meth:`SingleFlight.lead` and ends the call with :meth:`SingleFlight.settle`; callers of
:meth:`SingleFlight.do` join such a call exactly as they join one run by ``do``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable


class _Call:
    __slots__ = ("done", "result", "error", "joiners")

    def __init__(self):
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.joiners = 0


class SingleFlight:
    """Joins concurrent executions per key (thread-safe; one instance per resource family)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[Hashable, _Call] = {}

    def do(self, key: Hashable, fn: Callable[[], Any], *, on_settle=None) -> tuple[Any, bool]:
        """Run ``fn()`` once for all concurrent callers of ``key``; returns ``(result, joined)``.

        ``joined`` is False for the caller that ran ``fn`` and True for those that waited on it.
        ``on_settle(result, joiners)``: called once ``fn`` has returned, while no caller can join any
        more and none has been woken, with the final count of joiners (see :meth:`settle`).
        """
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if leader:
                call = self._calls[key] = _Call()
            else:
                call.joiners += 1
        if not leader:
            call.done.wait()
            if call.error is not None:
                raise call.error
            return call.result, True
        try:
            call.result = fn()
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            with self._lock:
                if call.error is None and on_settle is not None:
                    on_settle(call.result, call.joiners)
                del self._calls[key]
            call.done.set()
        return call.result, False

    def lead(self, key: Hashable) -> _Call | None:
        """Claim ``key`` without running anything: the claim (pass it to :meth:`settle`), or ``None``
        when another execution for ``key`` is in flight (join it with :meth:`do`)."""
        with self._lock:
            if key in self._calls:
                return None
            call = self._calls[key] = _Call()
            return call

    def settle(self, key: Hashable, call: _Call, result: Any = None, error: BaseException | None = None, *,
               on_settle=None) -> None:
        """End a call claimed with :meth:`lead`: its joiners get ``result`` or ``error``. Call exactly once.

        ``on_settle(result, joiners)`` (with a result): called under this object's lock, when the
        number of joiners is final and none has been woken: a leader can set something aside for
        each of them (the host tier reserves a lease per joiner, so that the leader's own release
        cannot free what they are about to take)."""
        call.result, call.error = result, error
        with self._lock:
            if error is None and on_settle is not None:
                on_settle(result, call.joiners)
            if self._calls.get(key) is call:
                del self._calls[key]
        call.done.set()

    def waiting(self, key: Hashable) -> int:
        """How many callers are waiting on the execution in flight for ``key`` (0 if none)."""
        with self._lock:
            call = self._calls.get(key)
            return call.joiners if call is not None else 0

    def in_flight(self) -> int:
        """How many keys are being executed now (tests use it to check nothing is left behind)."""
        with self._lock:
            return len(self._calls)


__all__ = ["SingleFlight"]
