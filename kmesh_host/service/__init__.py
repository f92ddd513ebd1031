"""The cache service: a separate process that owns shared originals and restores them into
registered client memory under ownership and drain rules (see DESIGN.md §5).

Public API: :class:`CacheService` (start/stop the service process), :class:`CacheClient`
(a model worker's connection), :class:`ServiceConfig`, :class:`SharedCache` (a CPU cache in
shared memory), :class:`VmmCache` (a CUDA cache in exportable virtual memory). A CUDA tensor
registers through CUDA IPC (``cudaMalloc`` memory) or, when it lies in virtual memory
(``cuMemCreate``: PyTorch's expandable segments, chunked pools), through its chunks' POSIX file
descriptors. Restores through the one restore contract: :class:`kmesh_host.restore.ServiceRestorer`.
"""

from .client import CacheClient, Registration
from .memory import MemoryHandle, SharedCache
from .process import CacheService, run_foreground
from .server import ServiceConfig
from .vmm import VmmCache

__all__ = ["CacheClient", "CacheService", "MemoryHandle", "Registration", "ServiceConfig", "SharedCache", "VmmCache",
           "run_foreground"]
