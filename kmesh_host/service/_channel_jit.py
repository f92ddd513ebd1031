"""Compiled (Numba) halves of the shared-memory channel's handshake (:mod:`.channel`).

Each side polls a word of the shared page that the other side advances. Polling from Python would
hold the GIL for the whole poll (and CPython gives no ordering guarantees between the two
processes' accesses); these functions run without the GIL and use acquire loads, release stores
and a sequentially consistent fence (:mod:`kmesh_gpu._intrinsics`). Time is read from the C
library's ``clock_gettime`` by address, so that a poll is bounded in time whatever the CPU's
speed. Imported on first use by :func:`.channel.compiled`.
"""

from __future__ import annotations

import ctypes
import time

import numba
import numpy as np

from kmesh_gpu._intrinsics import ccall, cpu_relax, fence, load_acquire, store_release

_JIT = dict(nogil=True, cache=True)
CLOCK_MONOTONIC = time.CLOCK_MONOTONIC
#: loads between two looks at the clock (and at the ``busy`` word)
_LOADS_PER_CHECK = 64


def clock_address() -> int:
    """The address of the C library's ``clock_gettime``."""
    return ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value


@numba.njit(**_JIT)
def _now(clock, ts):
    """``CLOCK_MONOTONIC`` in ns through ``clock_gettime`` at ``clock``; ``ts``: int64[2] scratch."""
    ccall(clock, (np.int32(CLOCK_MONOTONIC), ts.ctypes.data))
    return ts[0] * 1_000_000_000 + ts[1]


@numba.njit(**_JIT)
def post(seq_at, len_at, sleeping_at, seq, length):
    """Publish a message: its length, then its sequence number (release: the message's bytes,
    written before this call, are visible to whoever sees the number). Returns the peer's sleeping
    word, read after a full fence: non-zero means the peer may be asleep and must be woken."""
    store_release(len_at, length)
    store_release(seq_at, seq)
    fence()
    return load_acquire(sleeping_at)


@numba.njit(**_JIT)
def poll(seq_at, last, closed_at, busy_at, spin_ns, clock, ts):
    """Poll the word at ``seq_at`` until it differs from ``last`` (returns it), or until ``spin_ns``
    have passed, the word at ``closed_at`` is non-zero, or (``busy_at`` non-zero) the word there is
    non-zero (returns ``last``)."""
    v = load_acquire(seq_at)
    if v != last or spin_ns <= 0:
        return v
    start = _now(clock, ts)
    while True:
        for _ in range(_LOADS_PER_CHECK):
            v = load_acquire(seq_at)
            if v != last:
                return v
            cpu_relax()
        if load_acquire(closed_at) != 0 or (busy_at != 0 and load_acquire(busy_at) != 0):
            return last
        if _now(clock, ts) - start >= spin_ns:
            return last


@numba.njit(**_JIT)
def arm(sleeping_at, seq_at, last):
    """About to sleep: set the sleeping word, fence, and read the sequence word again. Returns it;
    when it already differs from ``last`` the sleeping word is cleared again (do not sleep)."""
    store_release(sleeping_at, 1)
    fence()
    v = load_acquire(seq_at)
    if v != last:
        store_release(sleeping_at, 0)
    return v


@numba.njit(**_JIT)
def disarm(sleeping_at):
    store_release(sleeping_at, 0)


@numba.njit(**_JIT)
def load(at):
    return load_acquire(at)


def _compile_used_signatures() -> None:
    """Compile (or load from Numba's cache) for the argument types the channel passes."""
    i64 = np.int64
    n = i64(0)
    ts = np.zeros(2, dtype=i64)
    for fn, args in ((post, (n, n, n, n, n)), (poll, (n, n, n, n, n, n, ts)), (arm, (n, n, n)),
                     (disarm, (n,)), (load, (n,))):
        fn.compile(tuple(numba.typeof(a) for a in args))


_compile_used_signatures()
