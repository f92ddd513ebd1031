"""KMesh host side: segment files and store, checksums, the host tier, the restore contract and its
two restorers (:mod:`kmesh_host.restore`), the cache service (:mod:`kmesh_host.service`).

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
from .restore import (InProcessRestorer, RestoreItem, RestoreReport, RestoreResult, Restorer, RouteConfig,
                      ServiceRestorer)
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
    "RestoreItem", "RestoreReport", "RestoreResult", "Restorer", "InProcessRestorer", "RouteConfig",
    "ServiceRestorer", "CacheClient", "CacheService",
]

