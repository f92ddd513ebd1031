"""Compiled (Numba) passes of the restore hot path: the check of a restore's slots and positions
that yields its blocks, and the reservation and release of a registration's block holders.

In NumPy each of these is a handful of whole-array operations on a few hundred entries (a sort,
comparisons, reductions, fancy indexing), each costing more in dispatch than in work; here one
compiled call does it. The slot check covers the usual request only: no slot -1, each item's slots
increasing, the items' slot ranges apart (which together prove every slot distinct), every position
in range. Anything else returns :data:`UNUSUAL` and the NumPy path
(:meth:`.Registry.block_ids_of_slots` and the service's position check) decides and names any
error, so both paths accept exactly the same requests.

Numba is imported on first use; where it is missing or fails, :func:`compiled` returns ``None`` and
the NumPy paths serve. Every index a compiled function follows is bounds-checked by it (Numba does
not check), so wrong arguments give a code, never a stray access.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

#: :func:`restore_blocks` found something the NumPy path must decide (an error or an unusual request)
UNUSUAL = -1
#: :func:`reserve`: a block id outside the holders array
OUT_OF_RANGE = -2
#: :func:`reserve`: every block was free and is now held
RESERVED = -1


def _restore_blocks(values, starts, params, out):
    """Blocks addressed by a restore's slots, sorted and unique, into ``out``; returns their count,
    or :data:`UNUSUAL`.

    ``values``: the request's body, every item's slots end to end, then the new positions;
    ``starts``: n + 1 offsets, item ``i``'s slots being ``values[starts[i]:starts[i + 1]]``;
    ``params``: the registration's slot count and block size, and the bound of the positions (0:
    there are none). The items are visited in order of their first slot, so one running comparison
    proves every slot in ``[0, slot count)`` and distinct; the blocks then come out in order.
    """
    n_slots, block_size, num_positions = params[0], params[1], params[2]
    n = starts.shape[0] - 1
    if n < 0 or starts[0] != 0:
        return UNUSUAL
    total = starts[n]
    if total > values.shape[0] or total > out.shape[0] or block_size <= 0:
        return UNUSUAL
    for i in range(total, values.shape[0]):
        p = values[i]
        if p < 0 or p >= num_positions:
            return UNUSUAL
    # the non-empty items by first slot (insertion sort: a restore has a handful of items)
    order = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        a, b = starts[i], starts[i + 1]
        if b < a or b > total:
            return UNUSUAL
        if b > a:
            first = values[a]
            j = m
            while j > 0 and values[starts[order[j - 1]]] > first:
                order[j] = order[j - 1]
                j -= 1
            order[j] = i
            m += 1
    count = 0
    prev = -1
    for k in range(m):
        i = order[k]
        for t in range(starts[i], starts[i + 1]):
            s = values[t]
            if s <= prev or s >= n_slots:  # a -1, a repeated or unordered slot, or one out of range
                return UNUSUAL
            blk = s // block_size
            if count == 0 or out[count - 1] != blk:
                out[count] = blk
                count += 1
            prev = s
    return count


def _reserve(holders, blocks, op_id):
    """Hold ``blocks`` for ``op_id`` if every one is free: :data:`RESERVED`, else the index in
    ``blocks`` of the first held one (nothing changed), or :data:`OUT_OF_RANGE`."""
    n = holders.shape[0]
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if b < 0 or b >= n:
            return OUT_OF_RANGE
        if holders[b] != 0:
            return i
    for i in range(blocks.shape[0]):
        holders[blocks[i]] = op_id
    return RESERVED


def _release(holders, blocks, op_id):
    """Free those of ``blocks`` that ``op_id`` holds; returns how many it did not hold."""
    n = holders.shape[0]
    foreign = 0
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if 0 <= b < n and holders[b] == op_id:
            holders[b] = 0
        else:
            foreign += 1
    return foreign


class Compiled(NamedTuple):
    restore_blocks: object
    reserve: object
    release: object
    #: ``reserve`` and ``release`` under a registration's spin lock (``_atomics``), which a fast
    #: lane's loop holds while it changes the holders without the GIL; ``None`` where those do
    #: not compile (no lane can then exist)
    reserve_locked: object = None
    release_locked: object = None
    #: the registration lock itself (``_atomics.take`` / ``give``)
    take: object = None
    give: object = None


@functools.lru_cache(maxsize=1)
def compiled() -> Compiled | None:
    """The compiled functions (explicit int64 signatures: C-contiguous int64 arrays only), or
    ``None`` where Numba is not usable. Compiles, or loads Numba's on-disk cache, on first call."""
    try:
        import numba

        def jit(fn, sig):
            return numba.njit(sig, cache=True)(fn)

        out = Compiled(jit(_restore_blocks, "int64(int64[::1], int64[::1], int64[::1], int64[::1])"),
                       jit(_reserve, "int64(int64[::1], int64[::1], int64)"),
                       jit(_release, "int64(int64[::1], int64[::1], int64)"))
        # checked once against the semantics the NumPy paths have
        blocks = np.empty(6, dtype=np.int64)
        params = np.array([32, 4, 100], dtype=np.int64)
        values = np.array([9, 10, 11, 0, 1, 7, 99, 5], dtype=np.int64)  # items [9, 10, 11], [0, 1, 7]
        if out.restore_blocks(values, np.array([0, 3, 6], dtype=np.int64), params, blocks) != 3 \
                or blocks[:3].tolist() != [0, 1, 2]:
            return None
        if out.restore_blocks(values, np.array([0, 1, 6], dtype=np.int64), params, blocks) != UNUSUAL:
            return None  # [9], [10, 11, 0, 1, 7]: not increasing
        holders = np.zeros(4, dtype=np.int64)
        held = np.array([1, 3], dtype=np.int64)
        if out.reserve(holders, held, 7) != RESERVED or out.reserve(holders, held[1:], 8) != 0 \
                or out.release(holders, held, 7) != 0 or holders.any():
            return None
        try:
            from . import _atomics

            lock = np.zeros(1, dtype=np.int64)
            if _atomics.reserve_locked(lock, holders, held, 7) == RESERVED \
                    and _atomics.reserve_locked(lock, holders, held[1:], 8) == 0 \
                    and _atomics.release_locked(lock, holders, held, 7) == 0 and not holders.any() and not lock[0]:
                out = out._replace(reserve_locked=_atomics.reserve_locked, release_locked=_atomics.release_locked,
                                   take=_atomics.take, give=_atomics.give)
        except Exception:  # the atomics do not compile here: no lanes, the plain passes serve
            pass
        return out
    except Exception:  # no Numba, or it cannot compile here: the NumPy paths serve
        return None
