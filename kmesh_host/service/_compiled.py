"""The restore hot path's host passes (:mod:`._passes`) compiled with Numba: the check of a
restore's slots and positions that yields its blocks, and the reservation and release of a
registration's block holders.

In NumPy each of these is a handful of whole-array operations on a few hundred entries (a sort,
comparisons, reductions, fancy indexing), each costing more in dispatch than in work; here one
compiled call does it. The slot check covers the usual request only: no slot -1, each item's slots
increasing, the items' slot ranges apart (which together prove every slot distinct), every position
in range. Anything else returns :data:`UNUSUAL` and the NumPy path
(:meth:`.Registry.block_ids_of_slots` and the service's position check) decides and names any
error, so both paths accept exactly the same requests.

Numba is imported on first use; where it is missing or fails, :func:`compiled` returns ``None`` and
the NumPy paths serve.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ._passes import OUT_OF_RANGE, RESERVED, UNUSUAL, release, reserve, restore_blocks

__all__ = ["Compiled", "compiled", "OUT_OF_RANGE", "RESERVED", "UNUSUAL"]


class Compiled(NamedTuple):
    restore_blocks: object
    reserve: object
    release: object
    #: ``reserve`` and ``release`` under a registration's spin lock (:mod:`._atomics`), which a
    #: channel's loop holds while it changes the holders without the GIL; ``None`` where those do
    #: not compile (no channel can then exist)
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

        out = Compiled(jit(restore_blocks, "int64(int64[::1], int64[::1], int64[::1], int64[::1])"),
                       jit(reserve, "int64(int64[::1], int64[::1], int64)"),
                       jit(release, "int64(int64[::1], int64[::1], int64)"))
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
        except Exception:  # the atomics do not compile here: no channels, the plain passes serve
            pass
        return out
    except Exception:  # no Numba, or it cannot compile here: the NumPy paths serve
        return None
