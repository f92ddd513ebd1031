"""Completions the service waits on before a copy's blocks and sources are released (see
:class:`.registry.Completion`): a copy's CUDA event, and the fault-injection wrapper that refuses
waits (tests of the drain rules: a refused first wait keeps everything held).
"""

from __future__ import annotations

import threading
import time

import torch

from kmesh_gpu import cuda
from kmesh_gpu.errors import DrainError

from .registry import Completion


class CudaEventCompletion(Completion):
    """The copy's CUDA event, created with blocking synchronisation (a waiting thread sleeps).

    A wait first polls the event for up to ``spin_s`` while ``spin_while()`` holds: a lone request's
    copy finishes within microseconds, sooner than a blocking wait wakes up; with other requests in
    flight, polling would take the CPU from them. Then an untimed wait blocks on the event and a
    timed one polls ``query`` at growing intervals (CUDA events have no timed wait).

    ``event`` may be recorded again for a later copy once a wait has returned ``True`` (the service
    reuses a synchronous request's event, see :mod:`.restores`): a wait that starts after
    that waits for the later copy too, which finishes after this one.
    """

    def __init__(self, event: torch.cuda.Event, *, spin_s: float = 0.0, spin_while=None):
        self.event = event
        self._spin_s = spin_s
        self._spin_while = spin_while

    def _query(self) -> bool:
        """Whether the event's last record has completed: the driver's query (it keeps the GIL,
        see :mod:`kmesh_gpu.cuda`), torch's where that is not available (which
        raises a device error properly)."""
        done = cuda.event_query(self.event.cuda_event)
        return self.event.query() if done is None else done

    def wait(self, timeout: float | None) -> bool:
        event, query = self.event, self._query
        if query():  # a short copy has often finished by the time its request looks
            return True
        start = time.monotonic()
        spin = self._spin_s if timeout is None else min(self._spin_s, timeout)
        if spin > 0:
            spin_while = self._spin_while
            while time.monotonic() - start < spin and (spin_while is None or spin_while()):
                if query():
                    return True
        if timeout is None:
            event.synchronize()
            return True
        deadline = start + timeout
        pause = 2e-5
        while not query():
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 1e-3)
        return True


class RefusingCompletion(Completion):
    """Fault injection: refuses the first ``refusals`` waits, then defers to ``inner``."""

    def __init__(self, inner: Completion, refusals: int):
        self._inner, self._left = inner, int(refusals)
        self._lock = threading.Lock()

    def wait(self, timeout: float | None) -> bool:
        with self._lock:
            if self._left > 0:
                self._left -= 1
                raise DrainError("wait refused (injected fault)")
        return self._inner.wait(timeout)
