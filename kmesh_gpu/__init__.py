"""KMesh device math: KV layouts, placement with RoPE shift, hashing kernels.

Backends: ``torch`` (reference), ``warp`` (CPU and CUDA), ``cupy`` (CUDA). Warp and CuPy are
imported lazily, on first use, so this package imports on a machine without a GPU.
Knows no files, sockets or processes.
"""

from .errors import (
    BackendError,
    DrainError,
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    LayoutError,
    OwnershipError,
    ProtocolError,
    SegmentNotFound,
)
from .layout import KVLayout
from .rope import RopeSpec, rope_shift
from .place import gather, place, place_many
from .sha256 import sha256_batched, tree_digests, verify_tree_roots

__all__ = [
    "BackendError", "DrainError", "FingerprintMismatch", "IntegrityError", "KmeshError",
    "LayoutError", "OwnershipError", "ProtocolError", "SegmentNotFound",
    "KVLayout", "RopeSpec", "rope_shift", "place", "place_many", "gather",
    "sha256_batched", "tree_digests", "verify_tree_roots",
]
