"""A test :class:`~kmesh_host.restore.Restorer` over in-memory originals.

``save`` gathers the slots with a :class:`kmesh_gpu.PlacementPlan` (no shift) and keeps the copy
under a key derived from its bytes; ``restore`` places every item with one plan launch (keys
shifted from the saved positions to the new ones), as the in-process restorer does after its
storage route. Faults for the failure controls:

* a key that was never saved raises :class:`kmesh_gpu.SegmentNotFound` before anything is written;
* ``corrupt(key)``: restoring that key writes NaN into every destination slot of the call's items
  (what a half-finished copy may leave) and raises :class:`kmesh_gpu.IntegrityError`;
* ``fail_after(n)``: the ``n``-th later ``restore`` call (1 = the next) raises
  :class:`kmesh_gpu.DrainError` after placing its items.

``digests()`` are SHA-256 of every original's bytes: they must never change.
"""

from __future__ import annotations

import hashlib

import torch

from kmesh_gpu import PlacementPlan
from kmesh_gpu.errors import DrainError, IntegrityError, SegmentNotFound
from kmesh_host.restore import RestoreReport, RestoreResult, Restorer
from kmesh_host.restore.contract import check_items


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class MemoryRestorer(Restorer):
    def __init__(self, cache, layout, *, model_fingerprint, rope=None, backend: str = "torch"):
        super().__init__(cache, layout, model_fingerprint=model_fingerprint, rope=rope)
        self._plan = PlacementPlan(cache, layout, rope=rope, backend=backend)
        self._plain = self._plan if rope is None else PlacementPlan(cache, layout, backend=backend)
        self.originals: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._corrupt: set[str] = set()
        self._fail_in: int | None = None
        self.calls: list[list[str]] = []

    # ------------------------------------------------------------------ faults
    def corrupt(self, key: str) -> None:
        self._corrupt.add(key)

    def fail_after(self, calls: int = 1) -> None:
        self._fail_in = calls

    # ------------------------------------------------------------------ the contract
    def save(self, slots, token_ids, positions) -> str:
        kv = self._plain.gather(slots.to(self._plain.device))
        token_ids, positions = token_ids.cpu().clone(), positions.cpu().clone()
        key = "mem-" + _digest(kv, token_ids, positions)[:24]
        self.originals[key] = (kv, token_ids, positions)
        return key

    def restore(self, items, *, timeout=None) -> RestoreResult:
        items = check_items(items)
        self.calls.append([it.key for it in items])
        for it in items:
            if it.key not in self.originals:
                raise SegmentNotFound(f"segment {it.key!r}: not found")
            if it.slots.shape[0] != self.originals[it.key][0].shape[2]:
                raise IntegrityError(f"segment {it.key!r}: {self.originals[it.key][0].shape[2]} tokens, "
                                     f"{it.slots.shape[0]} slots")
        if any(it.key in self._corrupt for it in items):
            self._poison(items)
            bad = next(it.key for it in items if it.key in self._corrupt)
            raise IntegrityError(f"segment {bad!r}: digest mismatch (test fault)")
        shifted = [it for it in items if it.new_positions is not None and self.rope is not None]
        plain = [it for it in items if it not in shifted]
        if shifted:
            self._plan.place([self.originals[it.key][0] for it in shifted], [it.slots for it in shifted],
                             old_positions=[self.originals[it.key][2] for it in shifted],
                             new_positions=[it.new_positions for it in shifted])
        if plain:
            self._plain.place([self.originals[it.key][0] for it in plain], [it.slots for it in plain])
        if self._fail_in is not None:
            self._fail_in -= 1
            if self._fail_in == 0:
                self._fail_in = None
                raise DrainError("restore: the copy's completion could not be confirmed (test fault)")
        report = RestoreReport(path="memory", route="memory", mechanism="in-memory originals, one plan launch",
                               device=str(self._plan.device), objects=len(items), placed=True)
        return RestoreResult(report)

    def _poison(self, items) -> None:
        L, _, H, _, D = self.layout.sizes
        for it in items:
            T = it.slots.shape[0]
            nan = torch.full((2, L, T, H, D), float("nan"), dtype=self.layout.dtype, device=self._plain.device)
            self._plain.place([nan], [it.slots])

    def digests(self) -> dict[str, str]:
        return {k: _digest(*v) for k, v in self.originals.items()}
