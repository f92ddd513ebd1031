"""The restore hot path's host passes in plain Python: the check of a restore's slots and positions
that yields the blocks it writes, and the reservation and release of a registration's block holders.

Nothing here imports Numba: :mod:`._compiled` compiles these functions (explicit int64 signatures)
and :mod:`._atomics` compiles the reservation and release under a registration's spin lock. Every
index a function follows is bounds-checked by it (compiled code does not check), so wrong arguments
give a code, never a stray access.
"""

from __future__ import annotations

import numpy as np

#: :func:`restore_blocks` found something the NumPy path must decide (an error or an unusual request)
UNUSUAL = -1
#: :func:`reserve`: a block id outside the holders array
OUT_OF_RANGE = -2
#: :func:`reserve`: every block was free and is now held
RESERVED = -1


def restore_blocks(values, starts, params, out):
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


def reserve(holders, blocks, op_id):
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


def release(holders, blocks, op_id):
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
