"""A restorer's placement into its cache: :class:`Placer` holds the :class:`kmesh_gpu.PlacementPlan`
(made once per destination) and turns one restore's items, landed in the staging buffer, into
launches.

Items with ``new_positions`` are placed through the plan with the restorer's RoPE spec (K shifted
from the stored positions); items without them, or every item of a restorer without a RoPE spec,
through a plan without one (K and V as stored). A restore whose items are all of one kind (the
usual case) is one launch; one that mixes both is two, after a check that no slot is named twice
across them. Preparation (validation of slots and positions, launch tables) needs the objects'
device addresses, not their bytes, so the routes prepare while the bytes are still moving.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kmesh_gpu import KVLayout, PlacementPlan, RopeSpec
from kmesh_gpu.errors import LayoutError

from .staging import staged_segments


class Placer:
    """The placement plans of one destination (``cache``, ``layout``, ``rope``; see the module
    docstring). ``k_scale``: an fp8 cache's K scale (float or float32[L]), used with the RoPE shift."""

    __slots__ = ("plan", "_plain", "rope", "k_scale", "_cache", "_layout", "_backend")

    def __init__(self, cache, layout: KVLayout, rope: RopeSpec | None, backend: str, k_scale=None):
        self.plan = PlacementPlan(cache, layout, rope=rope, backend=backend)
        self._plain = self.plan if rope is None else None  # made on first use
        self.rope, self.k_scale = rope, k_scale
        self._cache, self._layout, self._backend = cache, layout, backend

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def plain(self) -> PlacementPlan:
        """The plan without a RoPE spec (the restorer's own plan when it has none)."""
        if self._plain is None:
            self._plain = PlacementPlan(self._cache, self._layout, backend=self._backend)
        return self._plain

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` of the cache as a ``(2, L, T, H, D)`` tensor (keys as stored, whatever the plan's
        RoPE spec)."""
        return self.plan.gather(slots)

    @staticmethod
    def check(items, headers) -> None:
        """What can be checked before any byte moves: each item names one slot per token of its
        segment (a placement that cannot work then costs no read)."""
        for i, (item, header) in enumerate(zip(items, headers)):
            if item.slots.shape[0] != header.num_tokens:
                raise LayoutError(f"slots[{i}]: expected int64[T={header.num_tokens}] (segment {item.key}'s tokens), "
                                  f"got int64[{item.slots.shape[0]}]")

    def _groups(self, items) -> list:
        """``[(plan, item indices or None for all, shifted)]``: the launches this restore needs."""
        if self.rope is None:
            return [(self.plan, None, False)]
        shifted = [i for i, it in enumerate(items) if it.new_positions is not None]
        if len(shifted) == len(items):
            return [(self.plan, None, True)]
        if not shifted:
            return [(self.plain, None, False)]
        plain = [i for i, it in enumerate(items) if it.new_positions is None]
        slots = np.concatenate([items[i].slots.cpu().numpy() for i in range(len(items))])
        slots = slots[slots >= 0]
        if np.unique(slots).size != slots.size:
            raise LayoutError("slots: the same destination slot appears more than once for one cache")
        return [(self.plan, shifted, True), (self.plain, plain, False)]

    def _arguments(self, buffer, offsets, items, headers, idx, shifted):
        if idx is not None:
            items = [items[i] for i in idx]
            headers = [headers[i] for i in idx]
            offsets = [offsets[i] for i in idx]
        segments = staged_segments(buffer, headers, offsets)
        slots = [it.slots for it in items]
        if not shifted:
            return segments, slots, None, None
        # the stored positions stay on the host (placement checks and tabulates indices there)
        return segments, slots, [h.positions_int64 for h in headers], [it.new_positions for it in items]

    def prepare(self, buffer: torch.Tensor, offsets: list[int], items, headers, streams) -> "Placement":
        """Every launch of this restore, prepared on the work stream of ``streams`` (one table upload
        each, queued before any digest there); :attr:`Placement.seconds` is how long it took."""
        t0 = time.perf_counter()
        launches = []
        with streams.on_work():
            for plan, idx, shifted in self._groups(items):
                segments, slots, old, new = self._arguments(buffer, offsets, items, headers, idx, shifted)
                try:
                    launches.append(plan.prepare(segments, slots, old_positions=old, new_positions=new,
                                                 k_scale=self.k_scale))
                except LayoutError as exc:
                    if idx is None:
                        raise
                    raise LayoutError(f"items {idx} ({'shifted' if shifted else 'placed as stored'}): {exc}") from exc
        return Placement(launches, streams, time.perf_counter() - t0)

    def place(self, buffer: torch.Tensor, offsets: list[int], items, headers) -> None:
        """Prepare and launch on the current stream at once (``PlacementPlan.place``: on CUDA one
        compiled call), for a restore with nothing to overlap the preparation with."""
        for plan, idx, shifted in self._groups(items):
            segments, slots, old, new = self._arguments(buffer, offsets, items, headers, idx, shifted)
            plan.place(segments, slots, old_positions=old, new_positions=new, k_scale=self.k_scale)


class Placement:
    """A restore's prepared launches (:meth:`run` submits them on the work stream)."""

    __slots__ = ("launches", "streams", "seconds")

    def __init__(self, launches: list, streams, seconds: float):
        self.launches, self.streams, self.seconds = launches, streams, seconds

    def run(self) -> None:
        with self.streams.on_work():
            for launch in self.launches:
                launch.run()


__all__ = ["Placer", "Placement"]
