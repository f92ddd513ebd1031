"""The one way to restore saved segments into a paged KV cache (DESIGN.md §5b).

Public: :class:`RestoreItem` (segment key, destination slots, new positions), :class:`RestoreReport`,
:class:`RestoreResult`, the abstract :class:`Restorer`, :class:`InProcessRestorer` (store → host tier
→ a storage route → placement, configured by a frozen :class:`RouteConfig`) and
:class:`ServiceRestorer` (through the cache service's :class:`~kmesh_host.CacheClient`).

Modules: ``contract`` (the types), ``config`` (``RouteConfig``), ``in_process`` (the restorer),
``host_staging`` and ``direct`` (the routes), ``verifier`` (tree-root checks where the bytes
landed), ``placement`` (the restorer's placement plans), ``staging`` (the staging buffer's layout),
``streams`` (where the device work runs), ``service`` (``ServiceRestorer``).
"""

from .config import RouteConfig
from .contract import RestoreItem, RestoreReport, RestoreResult, Restorer
from .in_process import InProcessRestorer
from .service import ServiceRestorer

__all__ = ["RestoreItem", "RestoreReport", "RestoreResult", "Restorer", "InProcessRestorer", "RouteConfig",
           "ServiceRestorer"]
