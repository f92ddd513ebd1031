"""KMesh inside a vLLM engine: :class:`KMeshConnector`, a ``KVConnectorBase_V1`` that saves a
leader's prompt ranges as segments and blends them into children with CacheBlend repair.

One line of vLLM configuration (``docs/vllm.md``)::

    --kv-transfer-config '{"kv_connector": "KMeshConnector", "kv_connector_module_path": "kmesh_vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store_root": "/var/kmesh"}}'

plus ``--no-enable-prefix-caching`` for children to reuse. Per request, ``kv_transfer_params``:
``{"kmesh": {"save": [{"name", "start", "length"}]}}`` (or ``"save": "all"``) for a leader,
``{"kmesh": {"segments": [{"name" or "key", "start"}], "recompute_ratio"?}}`` for a child;
``RequestOutput.kv_transfer_params["kmesh"]`` says what happened (keys saved; reused or why not).

The two halves live in :mod:`.scheduler` (:class:`SchedulerSide`) and :mod:`.worker`
(:class:`WorkerSide`); this class only routes vLLM's calls to the half of its role. The model is
reached through the ``vllm.general_plugins`` entry point :mod:`kmesh_vllm.vllm_plugin`.

Public names: :class:`KMeshConnector`, :class:`ConnectorConfig`, :class:`ConnectorError`,
:class:`VllmModel` (vLLM's modules through :class:`kmesh_vllm.model.Model`'s row-wise steps),
:func:`register_caches` / :class:`RegisteredCache` (vLLM's cache as a :class:`kmesh_gpu.KVLayout`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import ConnectorConfig, ConnectorError
from .metadata import KMeshConnectorMetadata
from .registration import RegisteredCache, register_caches
from .scheduler import SchedulerSide
from .vllm_model import VllmModel
from .worker import WorkerSide


class KMeshConnector(KVConnectorBase_V1):
    """vLLM's connector contract (``kv_connector/v1/base.py``), routed to :class:`SchedulerSide`
    (scheduler role) or :class:`WorkerSide` (worker role). Loads are synchronous (before layer 0)
    and saves happen after the forward of a leader's last prompt token; nothing is asynchronous,
    so no block outlives its request (``request_finished`` never delays a free)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        config.blend_config()  # refuse bad blend settings when the engine starts
        engine_id = self._kv_transfer_config.engine_id
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, config, engine_id=engine_id)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, config, engine_id=engine_id)

    @property
    def scheduler(self) -> SchedulerSide | None:
        """The scheduler half (scheduler role), else None."""
        return self._scheduler

    @property
    def worker(self) -> WorkerSide | None:
        """The worker half (worker role), else None."""
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker.handshake()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv has finished every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # leaders are saved whole in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ scheduler role
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self._scheduler.set_worker_handshake(metadata)

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KMeshConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)


__all__ = ["KMeshConnector", "ConnectorConfig", "ConnectorError", "RegisteredCache", "register_caches",
           "SchedulerSide", "WorkerSide", "VllmModel"]
