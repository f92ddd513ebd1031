"""The cache service: a separate process that owns shared originals and restores them into
registered client memory under ownership and drain rules (see DESIGN.md §5).

Public API: :class:`CacheService` (start/stop the service process), :class:`CacheClient`
(a model worker's connection), :class:`ServiceConfig`, :class:`SharedCache` (a CPU cache in
shared memory), :class:`RestoreItem`.
"""

from .client import CacheClient, Registration, RestoreItem
from .memory import MemoryHandle, SharedCache
from .process import CacheService, run_foreground
from .server import ServiceConfig

__all__ = ["CacheClient", "CacheService", "MemoryHandle", "Registration", "RestoreItem", "ServiceConfig",
           "SharedCache", "run_foreground"]
