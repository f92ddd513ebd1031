"""The in-process restorer's configuration: one frozen :class:`RouteConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from kmesh_gpu.errors import LayoutError

from .verifier import VERIFY_MODES

ROUTES = ("host_staging", "direct")


@dataclass(frozen=True)
class RouteConfig:
    """How an :class:`~kmesh_host.restore.InProcessRestorer` moves and checks the bytes.

    Attributes:
        route: ``"host_staging"`` (O_DIRECT reads into the host tier's pinned buffers, then async
            H2D; resident segments are copied from RAM) or ``"direct"`` (KvikIO/cuFile reads into
            GPU memory; CUDA and the kvikio package; no host tier).
        verify: the check of every object not yet verified: ``"device"`` (tree root on the device
            as objects land, compared once; the placement gated on the device), ``"device-batched"``
            (one digest launch once all have landed), ``"host"`` (tree root on the host, before the
            placement) or ``"none"``.
        trust_verified: objects whose host-tier entry was verified (when it entered the tier, or by
            an earlier restore's device check of that very buffer) are not checked again;
            ``False`` checks them too, with ``verify``.
        backend: the placement backend (``kmesh_gpu.PlacementPlan``'s).
        hash_backend: ``kmesh_gpu.tree_digests``' backend.
        register_buffer: the direct route registers its destination with cuFile
            (``cuFileBufRegister``) when GPUDirect Storage is active.
    """

    route: str = "host_staging"
    verify: str = "device"
    trust_verified: bool = True
    backend: str = "auto"
    hash_backend: str = "auto"
    register_buffer: bool = True

    def __post_init__(self):
        if self.route not in ROUTES:
            raise LayoutError(f"route: expected one of {ROUTES}, got {self.route!r}")
        if self.verify not in VERIFY_MODES:
            raise LayoutError(f"verify: expected one of {VERIFY_MODES}, got {self.verify!r}")
        for name in ("trust_verified", "register_buffer"):
            if type(getattr(self, name)) is not bool:
                raise LayoutError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("backend", "hash_backend"):
            if not isinstance(getattr(self, name), str):
                raise LayoutError(f"{name}: expected a backend name, got {getattr(self, name)!r}")


__all__ = ["ROUTES", "RouteConfig"]
