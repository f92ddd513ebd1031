"""KMesh host side: segment files and store, checksums, tiers and routes, the cache service.

Errors are the same classes ``kmesh_gpu`` raises (one hierarchy rooted at :class:`KmeshError`).
"""

from kmesh_gpu.errors import (
    DrainError,
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    LayoutError,
    OwnershipError,
    ProtocolError,
    SegmentNotFound,
)

from .integrity import TREE_FORMAT, sha256, tree_digest

__all__ = [
    "DrainError", "FingerprintMismatch", "IntegrityError", "KmeshError", "LayoutError",
    "OwnershipError", "ProtocolError", "SegmentNotFound", "TREE_FORMAT", "sha256", "tree_digest",
]
