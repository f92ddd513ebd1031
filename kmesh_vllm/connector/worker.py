"""The connector's worker side (vLLM's worker process): registration, leaders' saves, children's
restore and CacheBlend repair, load errors.

* :meth:`WorkerSide.register_kv_caches` (once, after ``load_model``): vLLM's cache as a
  :class:`kmesh_gpu.KVLayout` (:mod:`.registration`), the model through the plugin
  (:func:`kmesh_vllm.vllm_plugin.loaded_model`) as a :class:`~.vllm_model.VllmModel`, and a
  :class:`kmesh_host.restore.InProcessRestorer` over the store for that cache. What fails is
  logged and reported to the scheduler side in the handshake (no save / no reuse); vLLM then runs
  as if there were no connector.
* :meth:`WorkerSide.start_load_kv` (before layer 0 of a step with claimed children): per child,
  the KMesh :class:`~kmesh_vllm.blend.Blender` over vLLM's own layers restores its segments into
  its blocks (keys shifted to the child's positions) and recomputes what CacheBlend recomputes;
  the prompt's last position is left to vLLM's forward, which then decodes as usual. A child whose
  restore or repair fails has its claimed blocks reported by :meth:`take_load_errors`; vLLM (with
  ``kv_load_failure_policy="recompute"``) drops that step's token and recomputes the whole prompt,
  so its tokens are those of a run without reuse; other requests are untouched.
* :meth:`WorkerSide.wait_for_save` (after the forward that computed a leader's last prompt
  token): its ranges gathered from its blocks and saved (``Restorer.save``, with the model's
  fingerprint), names bound, keys written to the request's receipt.
"""

from __future__ import annotations

import logging
import time

import torch

from kmesh_gpu.errors import KmeshError
from kmesh_vllm.model import BlockTable, ModelConfig, ModelError

from .config import ConnectorConfig, ConnectorError
from .metadata import KMeshConnectorMetadata, KMeshHandshake, ReuseJob, SaveJob
from .records import ConnectorRecords
from .registration import RegisteredCache, attention_facts, register_caches

logger = logging.getLogger("kmesh_vllm.connector")


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, KmeshError) else f"{type(exc).__name__}: {exc}"


class WorkerSide:
    """The worker half of :class:`~kmesh_vllm.connector.KMeshConnector` (see the module docstring).

    Ownership: vLLM owns the cache and the model; the restorer (made here, closed by
    :meth:`close`) holds what it needs to read the store and write the cache.
    """

    def __init__(self, vllm_config, kv_cache_config, config: ConnectorConfig, *, engine_id: str):
        self.config = config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._records = (ConnectorRecords(config.store_root, namespace=config.namespace, engine_id=engine_id)
                         if config.store_root is not None else None)
        self.cache: RegisteredCache | None = None
        self.model = None
        self.restorer = None
        self._save_problem: str | None = "the KV caches are not registered yet"
        self._reuse_problem: str | None = "the KV caches are not registered yet"
        self._blenders: dict = {}
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: dict) -> None:
        vc = self._vllm_config
        # whatever fails here leaves vLLM serving as without a connector (or without reuse), never down
        try:
            self._register(kv_caches)
        except Exception as exc:
            self._save_problem = self._reuse_problem = _describe(exc)
            logger.error("KMesh connector: %s; no segments are saved or reused (vLLM runs as without a connector)",
                         self._save_problem, exc_info=not isinstance(exc, KmeshError))
            return
        self._save_problem = None
        try:
            self._load_model(vc)
        except Exception as exc:
            self._reuse_problem = _describe(exc)
            logger.error("KMesh connector: %s; leaders' segments are saved, no child reuses them",
                         self._reuse_problem, exc_info=not isinstance(exc, KmeshError))
            return
        self._reuse_problem = None
        logger.info("KMesh connector: cache %s (%s%s), restores in process from %s", self.cache.layout.name,
                    self.cache.backend, f", ISA {self.cache.isa}" if self.cache.isa else "", self.config.store_root)

    def _register(self, kv_caches: dict) -> None:
        vc = self._vllm_config
        if self.config.store_root is None:
            raise ConnectorError("service_socket: vLLM's CPU cache is private memory of the worker, which the cache "
                                 "service cannot write; restores run in process (set store_root)")
        if vc.parallel_config.tensor_parallel_size != 1 or vc.parallel_config.pipeline_parallel_size != 1:
            raise ConnectorError("tensor/pipeline parallelism: the connector runs with one worker (TP = PP = 1)")
        if len(self._kv_cache_config.kv_cache_groups) != 1:
            raise ConnectorError(f"kv_cache_groups: {len(self._kv_cache_config.kv_cache_groups)}; the connector "
                                 "needs the model's attention layers in one KV cache group")
        mc = vc.model_config
        names = sorted(kv_caches)
        backend, isa = attention_facts(vc, names)
        model_config = ModelConfig.from_hf(mc.hf_config.to_dict())
        self.cache = register_caches(kv_caches, layout_name=vc.cache_config.get_resolved_kv_cache_layout().name,
                                     backend=backend, isa=isa, num_kv_heads=model_config.num_kv_heads,
                                     head_size=model_config.head_dim, dtype=mc.dtype,
                                     cache_dtype=vc.cache_config.cache_dtype)
        if self.cache.layout.num_layers != model_config.num_layers:
            raise ConnectorError(f"kv_caches: {self.cache.layout.num_layers} attention layers, the model has "
                                 f"{model_config.num_layers}")
        from kmesh_host import SegmentStore
        from kmesh_host.restore import InProcessRestorer

        self.restorer = InProcessRestorer(SegmentStore(self.config.store_root), self.cache.cache, self.cache.layout,
                                          model_fingerprint=model_config.fingerprint(mc.dtype),
                                          rope=model_config.rope_spec(mc.dtype))

    def _load_model(self, vc) -> None:
        from kmesh_vllm.vllm_plugin import loaded_model

        from .vllm_model import VllmModel

        module = loaded_model(vc)
        if module is None:
            raise ConnectorError("the model: KMesh's vLLM plugin did not run in this worker (entry point "
                                 "'vllm.general_plugins' = 'kmesh', installed with the kmesh package; check "
                                 "VLLM_PLUGINS)")
        model = VllmModel(module, vc.model_config.hf_config.to_dict())
        if model.rope != self.restorer.rope:
            raise ModelError(f"the model's RoPE {model.rope} differs from the cache's {self.restorer.rope}")
        self.model = model
        self._blender(None)  # the blender's checks run now, not at the first child

    def handshake(self) -> KMeshHandshake:
        return KMeshHandshake(saves=self._save_problem is None, reuses=self._reuse_problem is None,
                              reason=self._reuse_problem or self._save_problem,
                              layout=None if self.cache is None else self.cache.layout.name,
                              path=None if self._reuse_problem else "in_process")

    def _blender(self, recompute_ratio):
        if recompute_ratio not in self._blenders:
            from kmesh_vllm.blend import Blender

            self._blenders[recompute_ratio] = Blender(self.model, self.restorer,
                                                      self.config.blend_config(recompute_ratio))
        return self._blenders[recompute_ratio]

    # ------------------------------------------------------------------ children
    def start_load_kv(self, meta: KMeshConnectorMetadata) -> None:
        if not meta.reuses:
            return
        # vLLM steps run in inference mode; the blend's tensors stay ordinary ones (as the save's)
        with torch.inference_mode(False), torch.no_grad():
            for job in meta.reuses:
                self._reuse(job)

    def _reuse(self, job: ReuseJob) -> None:
        N = self.cache.layout.block_size if self.cache is not None else self._vllm_config.cache_config.block_size
        claimed = job.block_ids[:-(-(len(job.token_ids) - 1) // N)]
        t0 = time.perf_counter()
        try:
            receipt = self._blend(job, N)
        except Exception as exc:  # any fault falls back to vLLM's recomputation of the request
            receipt = {"reused": False, "fallback": f"{type(exc).__name__}: {exc}"}
        if not receipt["reused"]:
            self._load_errors.update(claimed)
            logger.warning("KMesh connector: request %s recomputes without reuse (%s)", job.request_id,
                           receipt.get("fallback"))
        receipt["timings"] = dict(receipt.get("timings", {}), connector_s=time.perf_counter() - t0)
        self._write_receipt(job.request_id, {"kind": "child", **receipt})

    def _blend(self, job: ReuseJob, N: int) -> dict:
        if self._reuse_problem is not None:
            raise ConnectorError(self._reuse_problem)
        from kmesh_vllm.blend import BlendChild, SavedSegment, SegmentUse

        uses = tuple(SegmentUse(SavedSegment(s.label, s.key, torch.tensor(s.token_ids, dtype=torch.int64),
                                             torch.tensor(s.positions, dtype=torch.int64)), s.start)
                     for s in job.segments)
        child = BlendChild(job.request_id, torch.tensor(job.token_ids, dtype=torch.int64), uses,
                           BlockTable(job.block_ids, N))
        from kmesh_vllm.blend import ReuseFailed

        try:  # restore and repair rows 0 .. T-2; vLLM computes the last row and decodes
            outcome = self._blender(job.recompute_ratio).repair(child)
        except ReuseFailed as exc:
            return {"reused": False, "fallback": str(exc)}
        report = outcome.restore_report
        return {"reused": True, "path": report.path if report else None, "route": report.route if report else None,
                "segments": [{"label": s.label, "key": s.key, "start": s.start} for s in job.segments],
                "restored_tokens": int(outcome.restored.sum()),
                "recomputed_position_layers": outcome.recomputed_position_layers,
                "prompt_tokens": len(job.token_ids), "timings": outcome.timings}

    def take_load_errors(self) -> set[int]:
        """Blocks of children whose reuse failed in this step (vLLM recomputes those requests)."""
        out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------------ leaders
    def wait_for_save(self, meta: KMeshConnectorMetadata) -> None:
        if not meta.saves:
            return
        with torch.inference_mode(False), torch.no_grad():  # as in start_load_kv
            for job in meta.saves:
                self._save(job)

    def _save(self, job: SaveJob) -> None:
        saved, errors = [], []
        if self._save_problem is not None:
            errors.append(self._save_problem)
        else:
            table = BlockTable(job.block_ids, self.cache.layout.block_size)
            ids = torch.tensor(job.token_ids, dtype=torch.int64)
            for r in job.ranges:
                positions = torch.arange(r.start, r.end, dtype=torch.int64)
                try:
                    key = self.restorer.save(table.slots(positions), ids[r.start:r.end], positions)
                    if r.name is not None:
                        self._records.bind(r.name, key)
                except (KmeshError, OSError) as exc:
                    errors.append(f"range {r.name or ''}@{r.start}+{r.length}: {exc}")
                    continue
                saved.append({"name": r.name, "start": r.start, "length": r.length, "key": key})
        self._write_receipt(job.request_id, {"kind": "leader", "saved": saved,
                                             "error": "; ".join(errors) if errors else None})

    def _write_receipt(self, request_id: str, receipt: dict) -> None:
        if self._records is None:
            return
        try:
            self._records.write_receipt(request_id, receipt)
        except OSError as exc:
            logger.error("KMesh connector: the receipt of request %s was not written: %s", request_id, exc)

    def close(self) -> None:
        if self.restorer is not None:
            self.restorer.close()
            self.restorer = None
