"""KMesh device math: KV layouts, placement with RoPE shift, hashing kernels.

Backends: ``torch`` (reference), ``warp`` (CPU and CUDA), ``cupy`` (CUDA). Warp and CuPy are
imported lazily, on first use, so this package imports on a machine without a GPU.
Knows no files, sockets or processes. Public modules beside the names below: :mod:`kmesh_gpu.cuda`
(driver calls on raw handles, for host code on the restore path) and :mod:`kmesh_gpu.compiled`
(building blocks for compiled loops; imports Numba).
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
from .plan import CompiledLaunch, KernelShape, Launch, PlacementPlan, StagedSegments
from .place import gather, place, place_many
from .sha256 import sha256_batched, tree_digests, verify_tree_roots

__all__ = [
    "BackendError", "DrainError", "FingerprintMismatch", "IntegrityError", "KmeshError",
    "LayoutError", "OwnershipError", "ProtocolError", "SegmentNotFound",
    "KVLayout", "RopeSpec", "rope_shift", "PlacementPlan", "Launch", "StagedSegments", "KernelShape",
    "CompiledLaunch", "place", "place_many", "gather",
    "sha256_batched", "tree_digests", "verify_tree_roots",
]
