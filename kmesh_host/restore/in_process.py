"""The in-process restorer: segment store → host tier → a storage route → placement, all in the
caller's process (:class:`InProcessRestorer`)."""

from __future__ import annotations

import torch

from kmesh_gpu import KVLayout, RopeSpec
from kmesh_gpu.errors import BackendError, LayoutError

from ..segment import ModelFingerprint
from ..store import SegmentStore
from ..tier import HostTier, HostTierConfig
from .config import RouteConfig
from .contract import RestoreResult, Restorer, check_items
from .direct import restore_direct
from .host_staging import restore_host_staging
from .placement import Placer
from .staging import SpareStaging


class InProcessRestorer(Restorer):
    """Restores segments of ``store`` into one paged cache through a storage route (DESIGN.md §4, §5b).

    Args:
        store: where the segments live (a local filesystem for O_DIRECT reads and the direct route).
        cache, layout: the destination, as for :class:`kmesh_gpu.PlacementPlan` (one tensor, or a
            list of per-layer tensors); the restore runs on the cache's device (``"cpu"`` runs the
            host side alone: the "H2D" is a memcpy).
        model_fingerprint: the model; a segment of another model raises FingerprintMismatch.
        rope: the model's :class:`kmesh_gpu.RopeSpec`: items with ``new_positions`` get K shifted
            from the stored positions to those; ``None`` places every item as stored.
        tier: the :class:`~kmesh_host.HostTier` over ``store`` whose pinned buffers stage the
            reads (retention and singleflight are its configuration; shared by every restorer that
            should see its resident segments). ``None``: a private tier of this restorer (no
            retention, no singleflight; it is closed with the restorer). Not used by the direct route.
        config: the :class:`RouteConfig` (route, verification, backends).
        k_scale: an fp8 cache's K scale (a float or float32[L]) for shifted items.

    One :class:`kmesh_gpu.PlacementPlan` is made here for the cache (and one without the RoPE spec
    the first time an item without ``new_positions`` comes); :meth:`restore` returns a
    :class:`RestoreResult` whose ``buffer`` holds the restored payloads (``kv`` views them) and
    whose report says which mechanism moved the bytes (``path="in_process"``). ``timeout`` bounds
    nothing here: an in-process restore waits only for its own reads and device work.

    Ownership: the restorer holds a reference to the cache, its plans, its private tier (if any) and
    the spare staging buffers it keeps for its next all-resident child; :meth:`close` frees the
    spares and closes the private tier. Every restore has finished its device work when it returns
    or raises, so ``close`` waits for nothing else.
    """

    def __init__(self, store: SegmentStore, cache, layout: KVLayout, *, model_fingerprint: ModelFingerprint,
                 rope: RopeSpec | None = None, tier: HostTier | None = None, config: RouteConfig = RouteConfig(),
                 k_scale=None):
        super().__init__(cache, layout, model_fingerprint=model_fingerprint, rope=rope)
        if not isinstance(store, SegmentStore):
            raise LayoutError(f"store: expected a SegmentStore, got {type(store).__name__}")
        if not isinstance(config, RouteConfig):
            raise LayoutError(f"config: expected a RouteConfig, got {type(config).__name__}")
        if tier is not None:
            if not isinstance(tier, HostTier):
                raise LayoutError(f"tier: expected a HostTier or None, got {type(tier).__name__}")
            if config.route == "direct":
                raise LayoutError("tier: the direct route reads into device memory and uses no host tier")
            if tier.store is not store:
                raise LayoutError("tier: a host tier over another SegmentStore than store")
        self.store, self.config = store, config
        self.placer = Placer(cache, layout, rope, config.backend, k_scale)
        self.device = _check_device(self.placer.device, config.route)
        self.device_index = self.device.index if self.device.type == "cuda" else None
        self._own_tier = tier is None and config.route == "host_staging"
        if self._own_tier:
            tier = HostTier(store, HostTierConfig(retain=False, singleflight=False, verify="none",
                                                  pin=self.device.type == "cuda"))
        self.tier = tier
        #: the all-resident start (``HostTier.acquire_ready``) can apply: a shared tier (a private
        #: one retains nothing), CUDA, and resident objects that need no check
        self.ready_start = tier is not None and not self._own_tier and self.device.type == "cuda" and \
            (config.verify == "none" or config.trust_verified)
        self.spares = SpareStaging()
        self._closed = False

    def restore(self, items, *, timeout: float | None = None) -> RestoreResult:
        """Restore ``items`` into the cache (see :class:`~kmesh_host.restore.contract.Restorer`)."""
        if self._closed:
            raise LayoutError("restorer: closed")
        items = check_items(items)
        # a caller in inference mode (vLLM's steps) must not make the staging buffer an inference
        # tensor: the reader's completion thread, outside that mode, writes into it
        with torch.inference_mode(False):
            try:
                if self.config.route == "host_staging":
                    return restore_host_staging(self, items)
                return restore_direct(self, items)
            except BaseException:
                self._quiesce()
                raise

    def save(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> str:
        """Gather the cache's ``slots`` (int64[T]) into a segment of ``token_ids`` and ``positions``
        (the positions its keys were rotated at) and put it into the store; returns its key."""
        if self._closed:
            raise LayoutError("restorer: closed")
        kv = self.placer.gather(slots)
        return self.store.put(kv, token_ids, positions, model_fingerprint=self.model_fingerprint)

    def close(self) -> None:
        """Free the spare staging buffers and close the private tier (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.spares.drop()
        if self._own_tier:
            self.tier.close()

    def _quiesce(self) -> None:
        """After a failure: no copy into the cache is still in flight (each route joined every
        stream it used into the caller's current stream before raising; wait for that one)."""
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError:  # a device error: the restore's own error is the one to report
            pass


def _check_device(device: torch.device, route: str) -> torch.device:
    """``device`` (the cache's) as one a route can restore into; a typed refusal (BackendError)
    naming why when it is not: a device type that holds no data (``meta``), a CUDA device this
    process cannot use, or the direct route on a device that is not CUDA."""
    if route == "direct" and device.type != "cuda":
        raise BackendError(f"route 'direct' reads into GPU memory; device {device} is not a CUDA device")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendError(f"route {route!r}: device {device} needs CUDA, and this process has no usable CUDA "
                               f"device (torch {torch.__version__}, CUDA available: False)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise BackendError(f"route {route!r}: device {device}: only {torch.cuda.device_count()} CUDA "
                               "device(s) visible")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise BackendError(f"route {route!r}: device {device}: expected a CUDA device or 'cpu'")
    return device


__all__ = ["InProcessRestorer"]
