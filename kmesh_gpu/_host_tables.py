"""Compiled host builder of the run kernel's table (Numba), for the usual placement.

``place._fast_prepare`` builds the run table of ``kmesh_place_runs`` on the host. With NumPy that is
some forty whole-array operations on arrays of a few thousand entries, each costing more in dispatch
than in work; here one compiled pass over the slots checks them and writes the runs. It covers the
usual case only: every token placed (no slot -1), slots strictly increasing (which proves them
distinct) unless the caller has already checked them, and positions in range. Anything else returns
a negative code and the NumPy path decides (and describes any error), so both build the same table.

Numba is imported on first use; where it is missing or fails, :func:`builder` returns ``None``.
"""

from __future__ import annotations

import functools

# codes below zero: the NumPy path takes over
SLOT_RANGE = -1  # a slot outside [0, S) (a skipped token's -1 included)
NOT_INCREASING = -2  # slots not strictly increasing, and the caller has not proved them distinct
POSITION_RANGE = -3  # an old or new position outside [0, P)


# the constants of one destination cache (PARAMS order), packed once per cache: a compiled call
# checks the type of every argument it is given, so few arguments make a cheaper call
PARAMS = ("row", "N", "cap", "S", "P", "kst1", "kst3", "koff", "vst1", "vst3", "voff")


def _build(sl, starts, ptrs, params, need_increasing, pos, out):
    """Runs of ``sl`` into ``out`` (R x 7 int64, RunCol in place.cu); returns R or a negative code.

    ``starts``: each item's first token (n + 1 entries, the last = T); ``ptrs``: each item's
    address; ``params``: int64 values named by ``PARAMS`` (``row``: bytes per token row of an item,
    ``N``: block size, ``cap``: longest run, ``S``: slots, ``P``: positions, then the K and V block
    and token strides and offsets in elements); ``pos``: old then new positions (2T entries, empty
    without RoPE). A run is consecutive tokens of one item in consecutive slots that neither starts
    a block nor crosses a multiple of ``cap`` (as ``place._runs``)."""
    row, N, cap, S, P = params[0], params[1], params[2], params[3], params[4]
    kst1, kst3, koff, vst1, vst3, voff = params[5], params[6], params[7], params[8], params[9], params[10]
    T = sl.shape[0]
    for i in range(pos.shape[0]):
        p = pos[i]
        if p < 0 or p >= P:
            return POSITION_RANGE
    R = 0
    item = 0
    nxt = starts[1]
    prev = -2
    split = cap < N
    off = 0  # the token's slot within its block, s % N, followed along a run (no division per token)
    sub = 0  # s % cap (split only)
    for t in range(T):
        s = sl[t]
        if s < 0 or s >= S:
            return SLOT_RANGE
        new_item = False
        while t == nxt:  # an item begins here (empty items are passed over)
            item += 1
            nxt = starts[item + 1]
            new_item = True
        if need_increasing and t > 0 and s <= prev:
            return NOT_INCREASING
        if t > 0 and not new_item and s == prev + 1:
            off += 1
            if split:
                sub += 1
                if sub == cap:
                    sub = 0
            if off != N and not (split and sub == 0):  # neither a block nor a cap boundary: extend
                out[R - 1, 1] += 1
                prev = s
                continue
        blk = s // N
        off = s - blk * N
        if split:
            sub = s % cap
        dst = blk * kst1 + off * kst3
        out[R, 0] = t
        out[R, 1] = 1
        out[R, 2] = ptrs[item] + (t - starts[item]) * row
        out[R, 3] = (starts[item + 1] - starts[item]) * row
        out[R, 4] = dst + koff
        out[R, 5] = blk * vst1 + off * vst3 + voff
        out[R, 6] = 0
        R += 1
        prev = s
    return R


@functools.lru_cache(maxsize=1)
def builder():
    """The compiled :func:`_build`, or ``None`` where Numba is not usable (the NumPy path serves)."""
    try:
        import numba
        import numpy as np

        fn = numba.njit(nogil=True, cache=True)(_build)
        # compile once, on a tiny input, and check it against the reference semantics
        out = np.zeros((4, 7), dtype=np.int64)
        params = np.array([10, 8, 8, 64, 1, 100, 1, 0, 100, 1, 50], dtype=np.int64)
        got = fn(np.array([3, 4, 8], dtype=np.int64), np.array([0, 3], dtype=np.int64),
                 np.array([1000], dtype=np.int64), params, True, np.zeros(0, dtype=np.int64), out)
        if got != 2 or out[0, 1] != 2 or out[1, 0] != 2 or out[1, 4] != 100:
            return None
        return fn
    except Exception:  # no Numba, or it cannot compile here: the NumPy path serves
        return None
