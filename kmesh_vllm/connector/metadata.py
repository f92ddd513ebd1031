"""What the scheduler side tells the worker side each step, and what the worker tells it once.

* :class:`KMeshConnectorMetadata` (scheduler -> worker, every step): the leaders whose prompt is
  computed by this step's forward (:class:`SaveJob`: saved after it) and the children whose
  prompt the connector claimed (:class:`ReuseJob`: restored and repaired before layer 0).
* :class:`KMeshHandshake` (worker -> scheduler, once, after the caches are registered): whether
  the worker can save and reuse, and why not.

All are plain picklable dataclasses (vLLM sends them between processes in multi-process mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from .params import SaveRange


@dataclass(frozen=True)
class SaveJob:
    """Save ``ranges`` of leader ``request_id``'s prompt (``token_ids``) from its blocks (``block_ids``,
    in order: position ``p`` lives in slot ``block_ids[p // N] * N + p % N``)."""

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    ranges: tuple[SaveRange, ...]


@dataclass(frozen=True)
class SegmentPlan:
    """One segment of a child: its ``key`` (``label`` says how the child named it), placed at prompt
    position ``start``; ``token_ids`` and the ``positions`` its keys were rotated at, from its header."""

    label: str
    key: str
    start: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass(frozen=True)
class ReuseJob:
    """Restore and repair child ``request_id``: prompt ``token_ids``, blocks ``block_ids``, its segments
    in prompt order, the recompute ratio (None: the configured ratios). vLLM computes position
    ``len(token_ids) - 1`` itself; the job prepares every position before it."""

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    segments: tuple[SegmentPlan, ...]
    recompute_ratio: float | None


@dataclass
class KMeshConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveJob] = field(default_factory=list)
    reuses: list[ReuseJob] = field(default_factory=list)


@dataclass
class KMeshHandshake(KVConnectorHandshakeMetadata):
    """The worker's registration outcome. ``saves``/``reuses``: whether it can save leaders' segments
    and restore children; ``reason``: why not (None when both work); ``layout``: the cache layout
    read from vLLM's tensors (its name), ``path``: where restores run (``"in_process"``)."""

    saves: bool
    reuses: bool
    reason: str | None = None
    layout: str | None = None
    path: str | None = None
