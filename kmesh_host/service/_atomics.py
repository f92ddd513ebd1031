"""Atomics for compiled code shared between processes and threads (Numba intrinsics over int64
arrays), and the registration's spin lock built on them.

The shared-memory channel's loop (:mod:`._channel_jit`) runs without the GIL and changes a
registration's block holders while the service's Python changes them too (other requests'
reservations and releases): both sides do so only under the registration's lock, ``lock[0]`` of an
int64 array, taken with a compare-and-swap. :func:`reserve_locked` and :func:`release_locked` are
the registry's compiled reservation and release (:mod:`._passes`) under that lock. Imported on
first use (Numba at its top).
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import _passes


def _item_ptr(context, builder, arrty, arr, idx, idxty):
    ary = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [i], wraparound=False)


def _int64_vector(t) -> bool:
    return isinstance(t, types.Array) and t.dtype == types.int64 and t.ndim == 1


@intrinsic
def load(typingctx, arr, idx):
    """Sequentially consistent load of ``arr[idx]`` (int64; no bounds check)."""
    if not _int64_vector(arr) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_item_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]),
                                   "seq_cst", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def store(typingctx, arr, idx, value):
    """Sequentially consistent store of ``value`` into ``arr[idx]`` (int64; no bounds check)."""
    if not _int64_vector(arr) or not isinstance(idx, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), ptr, "seq_cst", 8)
        return context.get_dummy_value()

    return types.none(arr, idx, value), codegen


@intrinsic
def cas(typingctx, arr, idx, expected, value):
    """``arr[idx]``: ``expected`` -> ``value`` atomically; 1 when swapped, else 0."""
    if not _int64_vector(arr) or not all(isinstance(t, types.Integer) for t in (idx, expected, value)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        old = context.cast(builder, args[2], sig.args[2], types.int64)
        new = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(ptr, old, new, "seq_cst", "seq_cst")
        return builder.zext(builder.extract_value(pair, 1), ir.IntType(64))

    return types.int64(arr, idx, expected, value), codegen


@intrinsic
def fence(typingctx):
    """A sequentially consistent fence."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


_JIT = dict(nogil=True, cache=True)


@numba.njit(**_JIT)
def take(lock):
    """Spin until ``lock[0]`` is ours (0 -> 1). Held only around short steps (a channel request,
    from its checks to its copy's completion, is the longest)."""
    while cas(lock, 0, 0, 1) == 0:
        pass


@numba.njit(**_JIT)
def give(lock):
    store(lock, 0, 0)


@numba.njit(**_JIT)
def put(words, i, value):
    """``words[i] = value``, sequentially consistent (for Python's writes into a channel's page)."""
    store(words, i, value)


@numba.njit(**_JIT)
def get(words, i):
    return load(words, i)


@numba.njit(**_JIT)
def set_word(lock, words, i, value):
    """``words[i] = value`` under ``lock`` (after a channel request in flight has finished)."""
    take(lock)
    words[i] = value
    give(lock)


_reserve = numba.njit(**_JIT)(_passes.reserve)
_release = numba.njit(**_JIT)(_passes.release)


@numba.njit(**_JIT)
def reserve_locked(lock, holders, blocks, op_id):
    """:func:`._passes.reserve` under ``lock``: -1 (every block was free and is held now), else the
    index in ``blocks`` of the first one already held (nothing changed), or -2 for a block id
    outside ``holders``."""
    take(lock)
    code = _reserve(holders, blocks, op_id)
    give(lock)
    return code


@numba.njit(**_JIT)
def release_locked(lock, holders, blocks, op_id):
    """:func:`._passes.release` under ``lock``: frees those of ``blocks`` that ``op_id`` holds; returns
    how many it did not hold."""
    take(lock)
    foreign = _release(holders, blocks, op_id)
    give(lock)
    return foreign
