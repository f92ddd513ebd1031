"""Whole-object SHA-256 and the kmesh-tree-sha256/v1 digest, computed on the host.

kmesh-tree-sha256/v1 (parameters ``leaf_size`` and ``fanout``; defaults 4096 and 64)
------------------------------------------------------------------------------------
1. Split the payload into ``leaf_size``-byte pieces; the last may be shorter; an empty payload is a
   single empty piece. Level 0 is the SHA-256 of each piece, in order.
2. While a level holds more than one digest, the next level is the SHA-256 of each run of ``fanout``
   consecutive 32-byte digests concatenated (the last run may be shorter).
3. root = SHA-256( b"kmesh-tree-sha256/v1\\x00" || u64le(payload length) || u32le(leaf_size)
                   || u32le(fanout) || top digest )

The root commits to the payload length and to both parameters, so two payloads with different tree
shapes can never share a root, and a leaf digest cannot be presented as an inner node. Every level is
a batch of independent SHA-256 messages, which is what makes the format parallel on a GPU
(``kmesh_gpu.tree_digests``) and across host cores (here). See docs/tree-sha256.md.
"""

from __future__ import annotations

import hashlib
import os
import struct
from concurrent.futures import ThreadPoolExecutor

from kmesh_gpu.errors import IntegrityError

TREE_FORMAT = "kmesh-tree-sha256/v1"
TREE_DOMAIN = b"kmesh-tree-sha256/v1\x00"
DEFAULT_LEAF_SIZE = 4096
DEFAULT_FANOUT = 64
# Below this many leaves a thread pool costs more than it saves.
_PARALLEL_MIN_LEAVES = 256


def sha256(payload) -> bytes:
    """Whole-object SHA-256 of a bytes-like payload (hashlib; uses SHA-NI where the CPU has it)."""
    return hashlib.sha256(memoryview(payload).cast("B")).digest()


def check_tree_params(leaf_size: int, fanout: int) -> None:
    if not isinstance(leaf_size, int) or leaf_size < 64 or leaf_size % 64:
        raise IntegrityError(f"leaf_size: expected a positive multiple of 64, got {leaf_size!r}")
    if not isinstance(fanout, int) or fanout < 2:
        raise IntegrityError(f"fanout: expected an integer >= 2, got {fanout!r}")


def tree_root(top: bytes, length: int, leaf_size: int, fanout: int) -> bytes:
    """The root record of step 3, from the single digest left at the top of the tree."""
    header = TREE_DOMAIN + struct.pack("<QII", length, leaf_size, fanout)
    return hashlib.sha256(header + top).digest()


def _hash_pieces(view: memoryview, size: int, start: int, stop: int) -> bytes:
    h = hashlib.sha256
    return b"".join(h(view[i * size:(i + 1) * size]).digest() for i in range(start, stop))


def _level(view: memoryview, piece: int, count: int, pool) -> bytes:
    if pool is None or count < _PARALLEL_MIN_LEAVES:
        return _hash_pieces(view, piece, 0, count)
    step = max(64, -(-count // (4 * pool._max_workers)))
    futures = [pool.submit(_hash_pieces, view, piece, s, min(count, s + step))
               for s in range(0, count, step)]
    return b"".join(f.result() for f in futures)


def tree_digest(payload, *, leaf_size: int = DEFAULT_LEAF_SIZE, fanout: int = DEFAULT_FANOUT,
                threads: int | None = None) -> bytes:
    """kmesh-tree-sha256/v1 root (32 bytes) of ``payload`` (any bytes-like object).

    Leaves and inner levels are hashed in parallel on ``threads`` host threads (default: all
    cores); hashlib releases the GIL on large inputs so threads scale.
    """
    check_tree_params(leaf_size, fanout)
    view = memoryview(payload).cast("B")
    length = view.nbytes
    n_leaves = max(1, -(-length // leaf_size))
    workers = threads if threads is not None else (os.cpu_count() or 1)
    pool = ThreadPoolExecutor(workers) if workers > 1 and n_leaves >= _PARALLEL_MIN_LEAVES else None
    try:
        level = _level(view, leaf_size, n_leaves, pool)
        while len(level) > 32:
            count = -(-len(level) // (32 * fanout))
            level = _level(memoryview(level), 32 * fanout, count, pool)
    finally:
        if pool is not None:
            pool.shutdown()
    return tree_root(level, length, leaf_size, fanout)
