"""A NumPy reference of the run kernel's table (the semantics of ``kmesh_gpu.compiled.build_runs``).

Written with whole-array operations (as the NumPy run builder that the compiled one replaced), so
it shares no code and no control flow with the compiled token-by-token pass it checks. A *run* is
consecutive tokens of one item, every one placed (slot >= 0), in consecutive slots of one block
that cross no multiple of ``cap``; the table has one row per run (``RunCol`` in csrc/place.cu).
"""

from __future__ import annotations

import numpy as np

from kmesh_gpu.compiled import (DUPLICATE_SLOT, PARAMS, POSITION_RANGE, RUN_COLS, RUNS_DO_NOT_PAY,
                                SLOT_RANGE)

__all__ = ["run_split", "run_table", "token_loop_split"]


def run_split(slots: np.ndarray, item: np.ndarray, N: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(first token, length) of each run of the placed tokens; ``item``: each token's item."""
    slots = np.asarray(slots, dtype=np.int64)
    n = slots.size
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z
    valid = slots >= 0
    brk = np.ones(n, dtype=bool)  # a token that starts a run
    brk[1:] = (slots[1:] != slots[:-1] + 1) | (item[1:] != item[:-1]) | ~valid[:-1]
    brk |= slots % N == 0  # a block's first slot
    if cap < N:
        brk |= slots % cap == 0  # a long run is split at every multiple of cap
    brk &= valid
    first = np.flatnonzero(brk)
    # a run ends where the next one starts or at the first skipped token after it
    end = np.append(first[1:], n)
    stop = np.flatnonzero(~valid)
    if stop.size and first.size:
        end = np.minimum(end, np.append(stop, n)[np.searchsorted(stop, first)])
    return first, end - first


def token_loop_split(slots, item, N: int, cap: int) -> list[list[int]]:
    """The same split, token by token (a second, obvious reference for :func:`run_split`)."""
    out: list[list[int]] = []
    for t in range(len(slots)):
        s = int(slots[t])
        if s < 0:
            continue
        if (t > 0 and slots[t - 1] >= 0 and item[t] == item[t - 1] and s == slots[t - 1] + 1 and s % N
                and (cap >= N or s % cap)):
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return out


def run_table(sl, starts, ptrs, params, check_distinct: bool, pos) -> tuple[int, np.ndarray]:
    """``(R, table[R, RUN_COLS])`` for the same arguments as ``build_runs``, or ``(code, None)``.

    Codes in the compiled builder's order: the first token (in token order) whose slot is outside
    ``[-1, S)`` or, placed, has a position outside ``[0, P)`` decides between ``SLOT_RANGE`` and
    ``POSITION_RANGE``; then ``DUPLICATE_SLOT`` (``check_distinct`` only); then
    ``RUNS_DO_NOT_PAY`` (runs average under ``cap / 2`` placed tokens)."""
    p = dict(zip(PARAMS, (int(v) for v in params)))
    sl = np.asarray(sl, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    ptrs = np.asarray(ptrs, dtype=np.int64)
    pos = np.asarray(pos, dtype=np.int64)
    T = sl.size
    counts = np.diff(starts)
    item = np.repeat(np.arange(counts.size), counts)
    bad_slot = (sl < -1) | (sl >= p["S"])
    placed = (sl >= 0) & ~bad_slot
    bad_pos = np.zeros(T, dtype=bool)
    if pos.size:
        old, new = pos[:T], pos[T:]
        bad_pos = placed & ((old < 0) | (old >= p["P"]) | (new < 0) | (new >= p["P"]))
    bad = np.flatnonzero(bad_slot | bad_pos)
    if bad.size:
        return (SLOT_RANGE if bad_slot[bad[0]] else POSITION_RANGE), None
    if check_distinct:
        kept = sl[placed]
        if np.unique(kept).size != kept.size:
            return DUPLICATE_SLOT, None
    first, length = run_split(sl, item, p["N"], p["cap"])
    R = first.size
    if 2 * int(placed.sum()) < p["cap"] * R:
        return RUNS_DO_NOT_PAY, None
    s = sl[first]
    blk, off = s // p["N"], s % p["N"]
    it = item[first]
    table = np.zeros((R, RUN_COLS), dtype=np.int64)
    table[:, 0], table[:, 1] = first, length
    table[:, 2] = ptrs[it] + (first - starts[it]) * p["row"]
    table[:, 3] = counts[it] * p["row"]
    table[:, 4] = blk * p["kst1"] + off * p["kst3"] + p["koff"]
    table[:, 5] = blk * p["vst1"] + off * p["vst3"] + p["voff"]
    return R, table
