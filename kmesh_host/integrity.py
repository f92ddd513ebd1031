"""Whole-object SHA-256 and the kmesh-tree-sha256/v1 digest on the host, and their verification.

Every stored object carries two digests (DESIGN §3): the whole-object SHA-256 of the exact stored
payload (padding included; the compatible default, hashlib/OpenSSL with SHA-NI) and the
kmesh-tree-sha256/v1 root, which the GPU can check where a restored object lands
(``kmesh_gpu.verify_tree_roots``) without copying the payload back. :func:`object_digests`
computes both on write; :func:`verify_object` checks host-tier data against them.

kmesh-tree-sha256/v1 (parameters ``leaf_size`` and ``fanout``; defaults 4096 and 64)
------------------------------------------------------------------------------------
1. Split the payload into ``leaf_size``-byte pieces; the last may be shorter; an empty payload is a
   single empty piece. Level 0 is the SHA-256 of each piece, in order.
2. While a level holds more than one digest, the next level is the SHA-256 of each run of ``fanout``
   consecutive 32-byte digests concatenated (the last run may be shorter).
3. root = SHA-256( b"kmesh-tree-sha256/v1\\x00" || u64le(payload length) || u32le(leaf_size)
                   || u32le(fanout) || top digest )

``leaf_size`` is a multiple of 64 in [64, 2**30]; ``fanout`` is in [2, 2**24]. The root commits to the
payload length and to both parameters, so two payloads with different tree shapes can never share a
root, and a leaf digest cannot be presented as an inner node. Every level is a batch of independent
SHA-256 messages: parallel on a GPU (``kmesh_gpu.tree_digests``) and across host cores (here, one
thread pool over the pieces of each level). The full specification with test vectors is
docs/tree-sha256.md.

Numba is used for one thing only, where it measurably wins: the loop over the pieces of a level,
calling OpenSSL's own SHA-256 (SHA-NI, the code hashlib runs) without the GIL, so threads scale; see
:func:`_native_piece_hasher`. Without libcrypto or Numba, hashlib computes the same digests (its
threads release the GIL only while hashing each piece, so they scale poorly).
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kmesh_gpu.errors import IntegrityError, LayoutError
from kmesh_gpu.sha256 import (
    DEFAULT_FANOUT,
    DEFAULT_LEAF_SIZE,
    TREE_DOMAIN,
    TREE_FORMAT,
    check_tree_params,
    root_header,
)

__all__ = [
    "DEFAULT_FANOUT", "DEFAULT_LEAF_SIZE", "TREE_DOMAIN", "TREE_FORMAT", "ObjectDigests",
    "check_tree_format", "check_tree_params", "object_digests", "sha256", "tree_digest", "tree_root",
    "verify_object", "verify_sha256", "verify_tree_digest",
]

# Below this many pieces in a level a thread pool costs more than it saves.
_PARALLEL_MIN_PIECES = 256
# Pieces per task: large enough that the per-task cost vanishes, small enough to balance cores.
_MIN_PIECES_PER_TASK = 64
# From this many pieces in a level on, the Numba/OpenSSL loop (below) hashes it; fewer go to hashlib,
# which needs no compilation on first use.
_NATIVE_MIN_PIECES = 64


def _byte_view(payload) -> memoryview:
    """A flat byte view of ``payload`` (bytes-like, numpy array, or contiguous CPU torch tensor)."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu":
            raise LayoutError(f"payload: expected a CPU tensor, got one on {payload.device} "
                              f"(kmesh_gpu.tree_digests hashes device tensors in place)")
        if not payload.is_contiguous():
            raise LayoutError("payload: expected a contiguous tensor (its bytes are hashed in memory order)")
        if payload.is_conj() or payload.is_neg():
            # the memory holds the unconjugated / unnegated values: hashing it would not be the tensor
            raise LayoutError("payload: a conjugate or negative view (call resolve_conj()/resolve_neg() first)")
        payload = payload.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise LayoutError("payload: expected a contiguous array (its bytes are hashed in memory order)")
        if payload.dtype.hasobject:
            raise LayoutError("payload: an object array holds pointers, not values; it has no bytes to hash")
        payload = payload.reshape(-1).view(np.uint8)     # any shape (empty ones too), any fixed-size dtype
    try:
        view = memoryview(payload)
        flat = view.cast("B") if view.nbytes else memoryview(b"")
    except (TypeError, ValueError):
        raise LayoutError(f"payload: expected a bytes-like object, numpy array or CPU tensor, "
                          f"got {type(payload).__name__}") from None
    if "O" in view.format and _holds_objects(view):
        raise LayoutError("payload: a buffer of Python object pointers has no bytes to hash")
    return flat


def _holds_objects(view: memoryview) -> bool:
    """Whether a buffer's items are PyObject pointers (a memoryview of a numpy object array)."""
    try:
        return np.asarray(view).dtype.hasobject
    except (TypeError, ValueError, NotImplementedError):
        return False


def sha256(payload) -> bytes:
    """Whole-object SHA-256 of ``payload`` (hashlib; uses SHA-NI where the CPU has it)."""
    return hashlib.sha256(_byte_view(payload)).digest()


def check_tree_format(tree_format: str) -> None:
    """Raise :class:`IntegrityError` unless ``tree_format`` names a format this code implements."""
    if tree_format != TREE_FORMAT:
        raise IntegrityError(f"unknown tree digest format {tree_format!r}; this version implements "
                             f"{TREE_FORMAT!r} only")


def tree_root(top: bytes, length: int, leaf_size: int, fanout: int) -> bytes:
    """The root of step 3, from the single digest left at the top of the tree."""
    return hashlib.sha256(root_header(length, leaf_size, fanout) + top).digest()


def _hash_pieces(view: memoryview, size: int, start: int, stop: int) -> bytes:
    h = hashlib.sha256
    return b"".join([h(view[i * size:(i + 1) * size]).digest() for i in range(start, stop)])


@functools.cache
def _native_piece_hasher():
    """A Numba loop over pieces calling OpenSSL's SHA256_Init/Update/Final (the SHA-NI code hashlib
    uses), compiled once per process; None where libcrypto or Numba is unavailable.

    Why: hashlib costs about a microsecond of Python per 4 KiB leaf and takes the GIL back after every
    leaf, so threads convoy on the GIL (measured on 2 cores: 12 MiB in 10.8 ms on one thread, 12.2 ms
    on two). This loop holds no GIL for a whole run of pieces: 7.8 ms on one thread, 4.6 ms on two.
    """
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("crypto")
        if name is None:
            return None
        lib = ctypes.CDLL(name)
        init, update, final = lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final
        for fn, nargs in ((init, 1), (update, 3), (final, 2)):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_size_t] * nargs          # addresses and sizes as machine words
        import numba

        @numba.njit(nogil=True)
        def hash_pieces(src, nbytes, piece, start, stop, out):
            ctx = np.empty(256, np.uint8)                     # SHA256_CTX is 112 bytes
            c = ctx.ctypes.data
            for i in range(start, stop):
                begin = i * piece
                init(c)
                update(c, src + begin, min(piece, nbytes - begin))
                final(out + 32 * i, c)
            return 0

        probe = np.frombuffer(bytes(range(256)) * 20, dtype=np.uint8)
        got = np.empty(32 * 3, dtype=np.uint8)
        hash_pieces(probe.ctypes.data, probe.size, 2048, 0, 3, got.ctypes.data)
        raw = probe.tobytes()
        if got.tobytes() != b"".join(hashlib.sha256(raw[i:i + 2048]).digest() for i in (0, 2048, 4096)):
            return None
        return hash_pieces
    except Exception:  # no usable libcrypto symbols or Numba: hashlib serves
        return None


def _level(view: memoryview, piece: int, count: int, pool, workers: int) -> bytes:
    """Concatenated digests of the ``count`` consecutive ``piece``-byte pieces of ``view``."""
    native = _native_piece_hasher() if count >= _NATIVE_MIN_PIECES else None
    if native is not None:
        src = np.frombuffer(view, dtype=np.uint8)
        out = np.empty(32 * count, dtype=np.uint8)
        args = (src.ctypes.data, src.size, piece)
        if pool is None or count < _PARALLEL_MIN_PIECES:
            native(*args, 0, count, out.ctypes.data)
        else:
            step = max(_MIN_PIECES_PER_TASK, -(-count // (4 * workers)))
            futures = [pool.submit(native, *args, s, min(count, s + step), out.ctypes.data)
                       for s in range(0, count, step)]
            for f in futures:
                f.result()
        return out.tobytes()
    if pool is None or count < _PARALLEL_MIN_PIECES:
        return _hash_pieces(view, piece, 0, count)
    step = max(_MIN_PIECES_PER_TASK, -(-count // (4 * workers)))
    futures = [pool.submit(_hash_pieces, view, piece, s, min(count, s + step))
               for s in range(0, count, step)]
    return b"".join(f.result() for f in futures)


def tree_digest(payload, *, leaf_size: int = DEFAULT_LEAF_SIZE, fanout: int = DEFAULT_FANOUT,
                threads: int | None = None) -> bytes:
    """kmesh-tree-sha256/v1 root (32 bytes) of ``payload``.

    Args:
        payload: bytes-like object, contiguous numpy array or contiguous CPU torch tensor (its bytes
            in memory order).
        leaf_size, fanout: the tree parameters (module docstring).
        threads: host threads hashing each level (default: all cores); 1 hashes on the caller's
            thread. The result does not depend on it.

    Raises:
        IntegrityError: invalid ``leaf_size`` or ``fanout``.
        LayoutError: ``payload`` is not a flat byte buffer on the host.
    """
    check_tree_params(leaf_size, fanout)
    view = _byte_view(payload)
    length = view.nbytes
    n_leaves = max(1, -(-length // leaf_size))
    if threads is not None and (type(threads) is not int or threads < 1):
        raise LayoutError(f"threads: expected an int >= 1, got {threads!r}")
    workers = threads if threads is not None else (os.cpu_count() or 1)
    pool = ThreadPoolExecutor(workers) if workers > 1 and n_leaves >= _PARALLEL_MIN_PIECES else None
    try:
        level = _level(view, leaf_size, n_leaves, pool, workers)
        while len(level) > 32:
            count = -(-len(level) // (32 * fanout))
            level = _level(memoryview(level), 32 * fanout, count, pool, workers)
    finally:
        if pool is not None:
            pool.shutdown()
    return tree_root(level, length, leaf_size, fanout)


@dataclass(frozen=True)
class ObjectDigests:
    """The digests stored next to one object: whole-object SHA-256 and the tree root.

    ``as_record()`` / ``from_record()`` convert to and from plain fields (for Arrow schemas and
    JSON); ``from_record`` refuses unknown formats and invalid parameters.
    """

    sha256: bytes
    tree_root: bytes
    tree_format: str = TREE_FORMAT
    leaf_size: int = DEFAULT_LEAF_SIZE
    fanout: int = DEFAULT_FANOUT

    def __post_init__(self):
        check_tree_format(self.tree_format)
        check_tree_params(self.leaf_size, self.fanout)
        for field in ("sha256", "tree_root"):
            value = getattr(self, field)
            if not isinstance(value, bytes) or len(value) != 32:
                raise IntegrityError(f"{field}: expected 32 bytes, got {value!r}")

    def as_record(self) -> dict:
        return {"sha256": self.sha256, "tree_root": self.tree_root, "tree_format": self.tree_format,
                "tree_leaf_size": self.leaf_size, "tree_fanout": self.fanout}

    @classmethod
    def from_record(cls, record: dict) -> "ObjectDigests":
        try:
            return cls(sha256=bytes(record["sha256"]), tree_root=bytes(record["tree_root"]),
                       tree_format=record["tree_format"], leaf_size=int(record["tree_leaf_size"]),
                       fanout=int(record["tree_fanout"]))
        except KeyError as exc:
            raise IntegrityError(f"digest record: missing field {exc.args[0]!r}") from None


def object_digests(payload, *, leaf_size: int = DEFAULT_LEAF_SIZE, fanout: int = DEFAULT_FANOUT,
                   threads: int | None = None) -> ObjectDigests:
    """Both digests of ``payload`` (what ``kmesh_host`` stores on write)."""
    return ObjectDigests(sha256=sha256(payload),
                         tree_root=tree_digest(payload, leaf_size=leaf_size, fanout=fanout,
                                               threads=threads),
                         leaf_size=leaf_size, fanout=fanout)


def _mismatch(kind: str, name: str, got: bytes, want: bytes) -> IntegrityError:
    return IntegrityError(f"{kind} mismatch for {name!r}: computed {got.hex()}, stored {bytes(want).hex()}")


def verify_sha256(payload, expected: bytes, *, name: str = "object") -> None:
    """Raise :class:`IntegrityError` naming ``name`` unless ``sha256(payload) == expected``."""
    got = sha256(payload)
    if got != bytes(expected):
        raise _mismatch("sha256", name, got, expected)


def verify_tree_digest(payload, expected: bytes, *, name: str = "object",
                       leaf_size: int = DEFAULT_LEAF_SIZE, fanout: int = DEFAULT_FANOUT,
                       threads: int | None = None) -> None:
    """Raise :class:`IntegrityError` naming ``name`` unless the tree root of ``payload`` matches.

    Only the root is stored, so a mismatch cannot name the bad leaf.
    """
    got = tree_digest(payload, leaf_size=leaf_size, fanout=fanout, threads=threads)
    if got != bytes(expected):
        raise _mismatch(TREE_FORMAT, name, got, expected)


def verify_object(payload, digests: ObjectDigests, *, name: str = "object", sha256_check: bool = True,
                  tree_check: bool = True, threads: int | None = None) -> None:
    """Check host-tier bytes against their stored digests (both by default)."""
    if tree_check:
        verify_tree_digest(payload, digests.tree_root, name=name, leaf_size=digests.leaf_size,
                           fanout=digests.fanout, threads=threads)
    if sha256_check:
        verify_sha256(payload, digests.sha256, name=name)
