"""The one restore contract: :class:`RestoreItem`, :class:`RestoreReport`, :class:`RestoreResult`
and the abstract :class:`Restorer` (DESIGN.md §5b).

A restorer is made for one destination: a paged KV cache (one tensor, or a list of per-layer
tensors as vLLM allocates them) described by a :class:`kmesh_gpu.KVLayout`, the model's
:class:`~kmesh_host.ModelFingerprint` and, for restores that move segments to other positions, its
:class:`kmesh_gpu.RopeSpec`. Two implementations:

* :class:`~kmesh_host.restore.InProcessRestorer` — segment store → host tier → a storage route →
  placement, all in the caller's process;
* :class:`~kmesh_host.restore.ServiceRestorer` — through the cache service, which owns the shared
  originals and writes into the cache the worker registered with it.

Callers (the blender, the vLLM connector's worker side, the LMCache bridge, ``kmesh demo`` and the
benchmarks) restore only through this class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from kmesh_gpu import KVLayout, RopeSpec
from kmesh_gpu.errors import LayoutError

from ..segment import ModelFingerprint, Segment


@dataclass(frozen=True)
class RestoreItem:
    """One segment to restore and where it goes.

    Attributes:
        key: the segment key (``SegmentStore.put``'s, or the service's for its originals).
        slots: ``int64[T]`` destination slots of the cache (``-1`` skips a token), on the CPU or the
            cache's device; ``T`` is the segment's token count.
        new_positions: ``int64[T]`` positions of the tokens in the child; with the restorer's RoPE
            spec, keys are shifted from the segment's stored positions to these. ``None``: placed as
            stored (a restorer with a RoPE spec then places K unchanged).
    """

    key: str
    slots: torch.Tensor
    new_positions: torch.Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.key, str) or not self.key:
            raise LayoutError(f"key: expected a non-empty segment key, got {self.key!r}")
        for name in ("slots", "new_positions"):
            v = getattr(self, name)
            if v is None and name == "new_positions":
                continue
            if not isinstance(v, torch.Tensor) or v.dtype != torch.int64 or v.dim() != 1:
                got = (f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor)
                       else type(v).__name__)
                raise LayoutError(f"{name}: expected an int64[T] tensor, got {got}")
        if self.new_positions is not None and self.new_positions.shape != self.slots.shape:
            raise LayoutError(f"new_positions: expected int64[{self.slots.shape[0]}] like slots, got "
                              f"int64[{self.new_positions.shape[0]}]")


@dataclass
class RestoreReport:
    """What a restore did.

    ``path``: ``"in_process"`` or ``"service"``. ``route``: the storage route that moved the bytes
    (``"host_staging"``, ``"direct"``; the service names its own path, e.g. ``"channel"`` or
    ``"socket"``), ``mechanism`` the mechanism in words (never called direct without evidence).
    ``timings`` holds nested wall intervals in seconds (never add them); ``restore_s`` is the whole
    call. ``verified`` counts objects per check; ``tier_sources`` how many came from the host tier
    (``"hit"``) and how many were read (``"read"``).
    """

    path: str
    route: str
    mechanism: str
    device: str
    objects: int = 0
    bytes_moved: int = 0
    bytes_read: int = 0
    tier_sources: dict = field(default_factory=dict)
    io_engine: str = ""
    o_direct: bool | None = None
    pinned: bool | None = None
    direct_dma: bool = False
    verification: str = ""
    verified: dict = field(default_factory=dict)
    placed: bool = False
    timings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class RestoreResult:
    """A finished restore: its :class:`RestoreReport`, and (in process) the restored objects on the
    device: ``buffer`` (uint8) holds every padded payload at ``offsets``; :attr:`kv` views segment
    ``i``'s ``(2, L, T, H, D)`` tensor inside it (made on first use). The caller owns ``buffer`` and
    drops it when done; a service restore has none (``buffer`` is ``None``)."""

    __slots__ = ("report", "buffer", "offsets", "headers", "_kv")

    def __init__(self, report: RestoreReport, buffer: torch.Tensor | None = None, offsets=(), headers=(),
                 kv: list | None = None):
        self.report, self.buffer, self.offsets, self.headers, self._kv = report, buffer, list(offsets), \
            list(headers), kv

    @property
    def kv(self) -> list[torch.Tensor]:
        if self._kv is None:
            from .staging import kv_views

            self._kv = kv_views(self.buffer, self.headers, self.offsets) if self.buffer is not None else []
        return self._kv

    def segments(self) -> list[Segment]:
        """Each restored object as a :class:`~kmesh_host.Segment` (``kv`` viewing ``buffer``, the stored
        token ids and original positions as int64 CPU tensors); empty for a service restore."""
        return [Segment(kv=kv, token_ids=torch.from_numpy(h.token_ids.astype(np.int64)),
                        positions=torch.from_numpy(h.positions.astype(np.int64)), key=h.key,
                        fingerprint=h.fingerprint) for kv, h in zip(self.kv, self.headers)]


class Restorer(ABC):
    """Restores saved segments into one paged KV cache, and saves a leader's segments from it.

    Made for one destination (the constructor's ``cache``, ``layout``, ``model_fingerprint``,
    ``rope``). Methods and who calls them:

    * :meth:`restore` — the blender (per child, before the model runs over the restored blocks), the
      vLLM connector's worker side (per request, before layer 0), the LMCache bridge's cache engine,
      the demo and the benchmarks. Returns once every item is verified and its placement queued on
      the current stream of the cache's device (work queued there later sees the placed cache).
      Raises a :class:`kmesh_gpu.KmeshError` subclass naming the segment (``SegmentNotFound``,
      ``IntegrityError``, ``FingerprintMismatch``, ``LayoutError``, ``ServiceError``, ...); when it
      raises, no copy into the cache is still in flight (the destination slots hold unspecified
      values and must be recomputed; nothing outside them was written).
    * :meth:`save` — the leader side (the blender's leader run, the connector's leader requests):
      gathers ``slots`` of the cache into a new segment with ``token_ids`` and ``positions`` (the
      positions its keys were rotated at) and returns its key.
    * :meth:`close` — when the worker is done with the cache: waits for work still reading or
      writing it, then frees what the restorer holds (idempotent; also the ``with`` block's end).
    """

    def __init__(self, cache, layout: KVLayout, *, model_fingerprint: ModelFingerprint, rope: RopeSpec | None = None):
        if not isinstance(layout, KVLayout):
            raise LayoutError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        if not isinstance(model_fingerprint, ModelFingerprint):
            raise LayoutError(f"model_fingerprint: expected a ModelFingerprint, got {type(model_fingerprint).__name__}")
        if rope is not None and not isinstance(rope, RopeSpec):
            raise LayoutError(f"rope: expected a RopeSpec or None, got {type(rope).__name__}")
        self.cache, self.layout, self.model_fingerprint, self.rope = cache, layout, model_fingerprint, rope

    @abstractmethod
    def restore(self, items, *, timeout: float | None = None) -> RestoreResult:
        """Restore ``items`` (a sequence of :class:`RestoreItem`) into the cache."""

    @abstractmethod
    def save(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> str:
        """Save the cache's ``slots`` (int64[T]) as a segment; returns its key."""

    def close(self) -> None:
        """Release what this restorer holds (after the work reading or writing the cache)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_items(items) -> list[RestoreItem]:
    """``items`` as a non-empty list of :class:`RestoreItem` (a typed error naming the bad one)."""
    if isinstance(items, RestoreItem) or not hasattr(items, "__iter__"):
        raise LayoutError(f"items: expected a sequence of RestoreItem, got {type(items).__name__}")
    items = list(items)
    for i, it in enumerate(items):
        if not isinstance(it, RestoreItem):
            raise LayoutError(f"items[{i}]: expected a RestoreItem, got {type(it).__name__}")
    if not items:
        raise LayoutError("items: expected at least one RestoreItem")
    return items
