"""The run kernel's table built on the host in one compiled pass (Numba).

``kmesh_place_runs`` (``csrc/place.cu``) reads one row per *run*: consecutive tokens of one item that
fill consecutive slots of one block (a run also ends before a slot that is a multiple of ``cap``).
:func:`build_runs` walks the slots once, checks them (range, positions, no slot twice) and writes
the rows. Slots need not be sorted and tokens may be skipped (slot ``-1``); a request whose slots
increase (the usual restore) proves them distinct on the way, any other is checked by sorting its
runs. A negative return is a code: the caller then takes the per-token kernel (which checks with
NumPy and names any error exactly), so both describe the same placement.

Plain Python here; :mod:`kmesh_gpu.compiled` compiles it (and the compiled driver sequences call it).
"""

from __future__ import annotations

import numpy as np

# codes below zero
SLOT_RANGE = -1  # a slot outside [-1, S)
DUPLICATE_SLOT = -2  # one slot written twice (checked only when asked to)
POSITION_RANGE = -3  # an old or new position of a placed token outside [0, P)
RUNS_DO_NOT_PAY = -4  # runs average under cap / 2 tokens: the per-token kernel is faster

RUN_COLS = 7  # RunCol in place.cu: first token, length, source address, source step, K/V offsets, cache
RUN_LEN_COL = 1  # a run's token count: 0 makes the run kernel skip the run (gate.cu)

# the constants of one destination cache (PARAMS order), packed once per cache: a compiled call
# checks the type of every argument it is given, so few arguments make a cheaper call
PARAMS = ("row", "N", "cap", "S", "P", "kst1", "kst3", "koff", "vst1", "vst3", "voff")


def build_runs(sl, starts, ptrs, params, check_distinct, pos, out):
    """Runs of the slots ``sl`` (int64[T]) into ``out`` (``T x RUN_COLS`` int64); returns R or a code.

    ``starts``: each item's first token (n + 1 entries, the last = T); ``ptrs``: each item's source
    address; ``params``: int64 values named by ``PARAMS`` (``row``: bytes per token row of an item,
    ``N``: block size, ``cap``: longest run, ``S``: slots, ``P``: positions, then the K and V block
    and token strides and offsets in elements); ``check_distinct``: refuse a slot written twice
    (a gather reads a slot twice harmlessly); ``pos``: old then new positions (2T entries, empty
    without RoPE), checked for placed tokens only (a skipped token's are never read)."""
    row, N, cap, S, P = params[0], params[1], params[2], params[3], params[4]
    kst1, kst3, koff, vst1, vst3, voff = params[5], params[6], params[7], params[8], params[9], params[10]
    T = sl.shape[0]
    if T == 0:  # no tokens (and perhaps no items: starts may be [0] alone)
        return 0
    rope = pos.shape[0] != 0
    R = 0
    item = 0
    nxt = starts[1]
    prev = -2  # slot of the last placed token
    last = -2  # index of the last placed token
    increasing = True
    placed = 0
    split = cap < N
    off = 0  # the token's slot within its block, s % N, followed along a run (no division per token)
    sub = 0  # s % cap (split only)
    for t in range(T):
        new_item = False
        while t == nxt:  # an item begins here (empty items are passed over)
            item += 1
            nxt = starts[item + 1]
            new_item = True
        s = sl[t]
        if s == -1:
            continue
        if s < -1 or s >= S:
            return SLOT_RANGE
        if rope:
            p, q = pos[t], pos[T + t]
            if p < 0 or p >= P or q < 0 or q >= P:
                return POSITION_RANGE
        placed += 1
        if s <= prev:
            increasing = False
        if last == t - 1 and not new_item and s == prev + 1:
            off += 1
            if split:
                sub += 1
                if sub == cap:
                    sub = 0
            if off != N and not (split and sub == 0):  # neither a block nor a cap boundary: extend
                out[R - 1, 1] += 1
                prev = s
                last = t
                continue
        blk = s // N
        off = s - blk * N
        if split:
            sub = s % cap
        out[R, 0] = t
        out[R, 1] = 1
        out[R, 2] = ptrs[item] + (t - starts[item]) * row
        out[R, 3] = (starts[item + 1] - starts[item]) * row
        out[R, 4] = blk * kst1 + off * kst3 + koff
        out[R, 5] = blk * vst1 + off * vst3 + voff
        out[R, 6] = 0
        R += 1
        prev = s
        last = t
    if check_distinct and not increasing and R > 1:
        first = np.empty(R, dtype=np.int64)
        for r in range(R):
            first[r] = sl[out[r, 0]]
        order = np.argsort(first)
        for i in range(R - 1):
            a, b = order[i], order[i + 1]
            if first[a] + out[a, 1] > first[b]:
                return DUPLICATE_SLOT
    if 2 * placed < cap * R:
        return RUNS_DO_NOT_PAY
    return R
