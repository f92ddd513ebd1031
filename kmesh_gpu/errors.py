"""The one exception hierarchy of KMesh.

Every package raises from here (``kmesh_host`` and ``kmesh_vllm`` re-export these names), so a
caller can catch :class:`KmeshError` for anything KMesh refuses.
"""

from __future__ import annotations


class KmeshError(Exception):
    """Base class of every error KMesh raises on purpose."""


class LayoutError(KmeshError, ValueError):
    """A tensor, layout, slot or position argument does not fit the contract."""


class BackendError(KmeshError, RuntimeError):
    """A requested backend is unavailable here, or its kernel failed to compile (log attached)."""


class IntegrityError(KmeshError):
    """Stored or restored bytes do not match their digest, or a file is not a valid segment."""


class SegmentNotFound(KmeshError, KeyError):
    """No segment is stored under the requested key."""


class FingerprintMismatch(IntegrityError):
    """A segment was saved by a different model (architecture, shape, dtype or RoPE)."""


class OwnershipError(KmeshError):
    """A client used a registration, block or buffer it does not own (or no longer owns)."""


class DrainError(KmeshError):
    """Waiting for submitted GPU work did not complete; the buffers involved stay held."""


class ProtocolError(KmeshError):
    """A malformed, oversized or unauthenticated message reached the cache service."""


class ServiceError(KmeshError, RuntimeError):
    """The cache service failed a request for a reason of its own, or could not be reached."""


class StorageError(KmeshError, OSError):
    """Writing or reading a segment failed in the filesystem (disk full, permission, I/O error)."""


class BudgetExceeded(KmeshError, MemoryError):
    """A host-RAM tier or buffer pool cannot hold a request within its byte budget."""
