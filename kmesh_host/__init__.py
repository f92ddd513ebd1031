"""KMesh host side: segment files and store, checksums, tiers and routes, the cache service.

Errors are the same classes ``kmesh_gpu`` raises (one hierarchy rooted at :class:`KmeshError`).
"""

from kmesh_gpu.errors import (
    BudgetExceeded,
    DrainError,
    FingerprintMismatch,
    IntegrityError,
    KmeshError,
    LayoutError,
    OwnershipError,
    ProtocolError,
    SegmentNotFound,
    StorageError,
)

from .integrity import TREE_FORMAT, sha256, tree_digest
from .routes import (
    RestoreResult,
    RestoreTarget,
    RouteReport,
    restore,
    restore_direct,
    restore_host_staging,
)
from .segment import ModelFingerprint, Segment, SegmentHeader
from .service import CacheClient, CacheService
from .singleflight import SingleFlight
from .store import SegmentStore
from .tier import HostLease, HostTier, HostTierConfig

__all__ = [
    "BudgetExceeded", "DrainError", "FingerprintMismatch", "IntegrityError", "KmeshError", "LayoutError",
    "OwnershipError", "ProtocolError", "SegmentNotFound", "StorageError",
    "TREE_FORMAT", "sha256", "tree_digest",
    "ModelFingerprint", "Segment", "SegmentHeader", "SegmentStore", "SingleFlight",
    "HostLease", "HostTier", "HostTierConfig",
    "RestoreResult", "RestoreTarget", "RouteReport", "restore", "restore_direct", "restore_host_staging",
    "CacheClient", "CacheService",
]
