"""The connector's scheduler side (vLLM's engine-core process): which requests are KMesh's, what
a child may claim, when a leader's prompt is complete, and what ``request_finished`` returns.

Per request (``kv_transfer_params["kmesh"]``, :mod:`.params`):

* a **leader** is never claimed; in the step whose forward computes its last prompt token, the
  step's metadata carries a :class:`~.metadata.SaveJob` (its blocks then), which the worker runs
  after the forward. ``request_finished`` returns the keys from the worker's receipt.
* a **child** is claimed when every segment it names is available, checked here without reading
  any payload: a name resolves to a key (:class:`~.records.ConnectorRecords`), the key's header is
  read (``SegmentStore.read_header``), its model fingerprint must be the engine's and its tokens
  the prompt's at ``start``. Then ``get_num_new_matched_tokens`` claims every prompt token but the
  last, synchronously (``load_async=False``: the worker restores and repairs them before layer 0
  of the next step, and vLLM computes only the last token). Anything that is not so — and every
  engine-wide reason below — leaves the child to vLLM untouched, and ``request_finished`` says why.

Engine-wide reasons not to claim children: the worker could not register the cache or find the
model (its handshake); prefix caching is on (a child's approximate KV would be cached as an exact
prefix of its tokens; serve with ``--no-enable-prefix-caching``); ``kv_load_failure_policy`` is not
``"recompute"`` (a failed restore would fail the request instead of recomputing it).

Chunked prefill and prompts past one step's token budget: a claimed child schedules one token
(the blend of the others runs in the worker outside vLLM's token budget), so any prompt vLLM
admits is handled; a leader's prompt may take several steps, and is saved after the last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kmesh_gpu.errors import KmeshError
from kmesh_vllm.model import ModelConfig, ModelError

from .config import ConnectorConfig, ConnectorError
from .metadata import KMeshConnectorMetadata, KMeshHandshake, ReuseJob, SaveJob, SegmentPlan
from .params import ChildParams, LeaderParams, parse_request
from .records import ConnectorRecords

logger = logging.getLogger("kmesh_vllm.connector")


@dataclass
class _Tracked:
    """One request of the connector's (it has ``"kmesh"`` params)."""

    request: Any
    params: LeaderParams | ChildParams | None
    refusal: str | None = None
    plan: tuple[SegmentPlan, ...] | None = None
    claimed: int = 0
    save_emitted: bool = False


def engine_fingerprint(vllm_config):
    """The :class:`kmesh_host.ModelFingerprint` of the engine's model and dtype (its HF config)."""
    config = ModelConfig.from_hf(vllm_config.model_config.hf_config.to_dict())
    return config.fingerprint(vllm_config.model_config.dtype)


class SchedulerSide:
    """The scheduler half of :class:`~kmesh_vllm.connector.KMeshConnector` (see the module docstring)."""

    def __init__(self, vllm_config, config: ConnectorConfig, *, engine_id: str):
        from kmesh_host import SegmentStore

        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self._store = SegmentStore(config.store_root) if config.store_root is not None else None
        self._records = (ConnectorRecords(config.store_root, namespace=config.namespace, engine_id=engine_id)
                         if config.store_root is not None else None)
        self._requests: dict[str, _Tracked] = {}
        self._to_load: dict[str, ReuseJob] = {}
        self._kv_cache_manager = None
        self._worker: KMeshHandshake | None = None
        try:
            self._fingerprint = engine_fingerprint(vllm_config)
            model_problem = None
        except (ModelError, KmeshError) as exc:
            self._fingerprint, model_problem = None, f"the engine's model is not one KMesh knows: {exc}"
        self._engine_reasons = [r for r in (
            model_problem,
            None if self._store is not None else "restores through the cache service are not available to this "
                                                 "connector (set store_root)",
            ("prefix caching is on: a child's approximate KV would become an exact prefix hit of later requests "
             "(serve with --no-enable-prefix-caching)") if vllm_config.cache_config.enable_prefix_caching else None,
            (f"kv_load_failure_policy is {vllm_config.kv_transfer_config.kv_load_failure_policy!r}: a failed restore "
             "would fail the request (set kv_load_failure_policy='recompute')")
            if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute" else None,
        ) if r is not None]

    # ------------------------------------------------------------------ engine state
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def set_worker_handshake(self, metadata: dict) -> None:
        """The workers' :class:`KMeshHandshake` (one per rank; the connector runs with one)."""
        got = [m for m in metadata.values() if isinstance(m, KMeshHandshake)]
        if len(got) != 1:
            self._worker = KMeshHandshake(False, False, f"expected one worker's registration, got {len(got)}")
        else:
            self._worker = got[0]

    def reuse_refusal(self) -> str | None:
        """Why no child can be claimed in this engine (None: children can be)."""
        if self._engine_reasons:
            return self._engine_reasons[0]
        if self._worker is None:
            return "the worker has not reported its cache registration"
        return None if self._worker.reuses else f"the worker cannot restore: {self._worker.reason}"

    # ------------------------------------------------------------------ requests
    def on_new_request(self, request) -> None:
        self._track(request)

    def _track(self, request) -> _Tracked | None:
        rid = request.request_id
        if rid in self._requests:
            return self._requests[rid]
        try:
            params = parse_request(request.kv_transfer_params, request.num_prompt_tokens)
        except ConnectorError as exc:
            self._requests[rid] = _Tracked(request, None, refusal=str(exc))
            return self._requests[rid]
        if params is None:
            return None
        t = self._requests[rid] = _Tracked(request, params)
        if isinstance(params, LeaderParams) and (self._store is None or self._fingerprint is None):
            t.refusal = self._engine_reasons[0]
        return t

    def _resolve(self, t: _Tracked) -> str | None:
        """Fill ``t.plan`` with the child's segments, or say why they are not available."""
        prompt = list(t.request.prompt_token_ids or ())
        T = len(prompt)
        plans = []
        for ref in t.params.segments:
            try:
                key = ref.key if ref.key is not None else self._records.lookup(ref.name)
                if key is None:
                    return f"segment {ref.label} is not saved in namespace {self.config.namespace!r}"
                header = self._store.read_header(key)
            except (KmeshError, OSError) as exc:
                return f"segment {ref.label}: {exc}"
            if header.fingerprint != self._fingerprint:
                diff = "; ".join(header.fingerprint.differences(self._fingerprint)) or "digest differs"
                return f"segment {ref.label} ({key}) was saved by a different model ({diff})"
            tokens = [int(x) for x in header.token_ids]
            if ref.start + len(tokens) > T:
                return (f"segment {ref.label} at start {ref.start}: its {len(tokens)} tokens pass the prompt's end "
                        f"({T} tokens)")
            here = prompt[ref.start:ref.start + len(tokens)]
            if here != tokens:
                p = next(i for i, (a, b) in enumerate(zip(here, tokens)) if a != b)
                return (f"segment {ref.label} at start {ref.start}: the prompt's token at position {ref.start + p} is "
                        f"{here[p]}, the segment's is {tokens[p]}")
            plans.append(SegmentPlan(ref.label, key, ref.start, tuple(tokens),
                                     tuple(int(x) for x in header.positions)))
        plans.sort(key=lambda s: s.start)
        for a, b in zip(plans, plans[1:]):
            if a.start + len(a.token_ids) > b.start:
                return f"segments {a.label} and {b.label} overlap in the prompt"
        if not any(s.start < T - 1 for s in plans):
            return "no segment covers a position before the prompt's last (which vLLM computes)"
        t.plan = tuple(plans)
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """A child's claim: every prompt token but the last, when its segments are available now
        (checked again on every call until claimed: a leader may finish saving in between)."""
        t = self._track(request)
        if t is None or not isinstance(t.params, ChildParams):
            return 0, False
        if t.claimed:
            return t.claimed, False
        try:
            t.refusal = self.reuse_refusal() or self._resolve(t)
        except Exception as exc:  # never let a child's lookup stop the engine: vLLM serves it unclaimed
            logger.exception("KMesh connector: resolving the segments of request %s failed", request.request_id)
            t.refusal = f"resolving its segments failed: {type(exc).__name__}: {exc}"
        if t.refusal is None and num_computed_tokens:
            # a local prefix hit: its blocks are shared and exact; a blend would write into them
            t.refusal = f"{num_computed_tokens} prompt tokens are already cached locally (prefix caching)"
        if t.refusal is not None:
            return 0, False
        t.claimed = request.num_prompt_tokens - 1
        return t.claimed, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        t = self._requests.get(request.request_id)
        if t is None or not num_external_tokens or t.plan is None:
            return
        self._to_load[request.request_id] = ReuseJob(
            request.request_id, tuple(request.prompt_token_ids), tuple(blocks.get_block_ids()[0]), t.plan,
            t.params.recompute_ratio)

    def build_connector_meta(self, scheduler_output) -> KMeshConnectorMetadata:
        meta = KMeshConnectorMetadata(reuses=list(self._to_load.values()))
        self._to_load.clear()
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            t = self._requests.get(rid)
            if t is None or not isinstance(t.params, LeaderParams) or t.save_emitted or t.refusal is not None:
                continue
            r = t.request
            if r.num_computed_tokens + n >= r.num_prompt_tokens:  # this step computes the prompt's last token
                block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
                meta.saves.append(SaveJob(rid, tuple(r.prompt_token_ids), tuple(block_ids), t.params.ranges))
                t.save_emitted = True
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        t = self._requests.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        if t is None:
            return False, None
        try:
            receipt = self._records.take_receipt(request.request_id) if self._records is not None else None
        except (KmeshError, OSError) as exc:
            receipt = {"error": f"its receipt is unreadable: {exc}", "reused": False, "fallback": str(exc)}
        if t.params is None:
            out = {"error": t.refusal}
        elif isinstance(t.params, LeaderParams):
            out = {"saved": [], "error": t.refusal}
            if receipt is not None:
                out.update(saved=receipt.get("saved", []), error=receipt.get("error"))
            elif t.refusal is None:
                out["error"] = "not saved: the request ended before its prompt was computed"
        else:
            out = {"reused": False, "reason": t.refusal}
            if t.claimed and receipt is not None:
                out = {k: v for k, v in receipt.items() if k != "kind"}
            elif t.claimed:
                out["reason"] = "the request ended before its restore ran"
        return False, {"kmesh": {k: v for k, v in out.items() if v is not None}}
