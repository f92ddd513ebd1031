""":class:`ServiceRestorer`: the restore contract (:class:`~.contract.Restorer`) through the cache
service, which owns the shared originals and writes into the cache the worker registered with it."""

from __future__ import annotations

import time

import torch

from kmesh_gpu import KVLayout, RopeSpec
from kmesh_gpu.errors import DrainError, KmeshError, LayoutError

from ..segment import ModelFingerprint
from .contract import RestoreReport, RestoreResult, Restorer, check_items

#: what checked every original before its bytes reached the cache (the service's host tier)
VERIFICATION = "host SHA-256 as the original entered the service's host tier"


class ServiceRestorer(Restorer):
    """Restores through a :class:`~kmesh_host.service.CacheClient`'s connection into ``cache``,
    registered with the service at construction (``model_fingerprint``, ``rope`` and ``instance``
    as :meth:`CacheClient.register <kmesh_host.service.CacheClient.register>` takes them).

    ``cache``: what the service can map: a CUDA tensor, a :class:`~kmesh_host.service.VmmCache`, a
    :class:`~kmesh_host.service.SharedCache` (CPU caches live in shared memory), or a list of
    ``layout.num_layers`` of them. Keys are the service's store's (``SegmentStore.put``,
    :meth:`save`, ``CacheClient.put``). The report's ``route`` is the transport the restore took
    (``"channel"``: the registration's shared-memory channel; ``"socket"``).

    Ownership: the worker keeps ``cache`` allocated until :meth:`close` returned (the service has
    drained every copy into or out of it and unmapped it). The client stays the caller's.
    """

    def __init__(self, client, cache, layout: KVLayout, *, model_fingerprint: ModelFingerprint,
                 rope: RopeSpec | None = None, instance: int = 0):
        from ..service.client import CacheClient  # (the service package imports this contract's items)

        if not isinstance(client, CacheClient):
            raise LayoutError(f"client: expected a CacheClient, got {type(client).__name__}")
        super().__init__(cache, layout, model_fingerprint=model_fingerprint, rope=rope)
        self.client = client
        self.registration = client.register(cache, layout, model_fingerprint=model_fingerprint, rope=rope,
                                            instance=instance)
        self._closed = False

    @property
    def device(self) -> torch.device:
        return self.registration.device

    def restore(self, items, *, timeout: float | None = None) -> RestoreResult:
        """Restore ``items`` into the cache: returns once every copy has physically finished (the
        service's ``wait=True``). On a failure after the service submitted a copy, that copy is
        drained before the error is raised (a drain that fails too is raised as a
        :class:`DrainError`: the service keeps the blocks held until a later drain succeeds)."""
        items = check_items(items)
        start = time.perf_counter()
        client, reg = self.client, self.registration
        try:
            op = client.restore(reg, items, timeout=timeout)
        except KmeshError as exc:
            op_id = getattr(exc, "op_id", None)
            if op_id:
                try:
                    client.drain(reg, [op_id], timeout=timeout)
                except DrainError as again:
                    raise again from exc
            raise
        report = RestoreReport(path="service", route=client.last_route, mechanism=_MECHANISMS[client.last_route],
                               device=str(reg.device), objects=len(items), verification=VERIFICATION,
                               verified={"service_host_sha256": len(items)}, placed=True,
                               timings={"restore_s": time.perf_counter() - start},
                               facts={"registration": reg.reg_id, "operation": op})
        return RestoreResult(report)

    def save(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> str:
        """Save the cache's ``slots`` (int64[T]) as a segment of the service's store (with
        ``token_ids`` and the ``positions`` its keys were rotated at); returns its key."""
        return self.client.save(self.registration, slots, token_ids, positions)

    def close(self) -> None:
        """Close the registration, waiting for every copy into or out of the cache (idempotent)."""
        if self._closed:
            return
        freed = self.client.close_registration(self.registration)
        self._closed = True
        if not freed:
            raise DrainError(f"registration {self.registration.reg_id}: closed, copies still pending")


_MECHANISMS = {
    "channel": "cache service: the registration's shared-memory channel (compiled loop in the service)",
    "socket": "cache service: binary restore request over its Unix socket",
}
