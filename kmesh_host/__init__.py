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

from .service import CacheClient, CacheService  # noqa: E402  (the cache service process and its client)

__all__ += ["CacheClient", "CacheService"]

# Segment files, the Arrow segment store, the host-RAM tier and the storage routes (issue 4).
from kmesh_gpu.errors import BudgetExceeded, StorageError  # noqa: E402
from .segment import ModelFingerprint, Segment, SegmentHeader  # noqa: E402
from .store import SegmentStore  # noqa: E402
from .singleflight import SingleFlight  # noqa: E402
from .tier import HostLease, HostTier, HostTierConfig  # noqa: E402
from .routes import RestoreResult, RestoreTarget, RouteReport, restore, restore_direct, restore_host_staging  # noqa: E402

__all__ += ["BudgetExceeded", "StorageError", "ModelFingerprint", "Segment", "SegmentHeader", "SegmentStore",
            "SingleFlight", "HostLease", "HostTier", "HostTierConfig", "RestoreResult", "RestoreTarget",
            "RouteReport", "restore", "restore_direct", "restore_host_staging"]
