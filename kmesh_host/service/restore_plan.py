"""What a restore's items need beyond their index arrays (:class:`_ItemPlan`, remembered per
registration and distinct item list), and the security check of a restore's slots that yields the
blocks it writes (:func:`_restore_blocks`: compiled for the usual request, NumPy for the rest).
"""

from __future__ import annotations

import weakref

import numpy as np

from kmesh_gpu.errors import LayoutError

from . import _compiled, protocol
from .registry import Registry

#: distinct item lists whose checks a registration remembers (see :func:`_item_plan`)
_PLANS_KEPT = 64


class _ItemPlan:
    """What a restore's items need beyond their index arrays, derived from the registration and the
    originals they name: the per-item checks passed, which items shift, how the body splits into
    per-item arrays. Valid for exactly the segment objects it was made for (originals are
    immutable; a key published again is another object), which it refers to weakly (an evicted
    original is not kept alive by it), and for the registration it is kept on (its layout and RoPE
    spec never change)."""

    __slots__ = ("segs", "shifted", "plain", "split_sizes", "num_positions", "starts", "check_params", "counts",
                 "_old_positions")

    def __init__(self, segs, slot_counts, position_counts, num_positions, reg):
        self.segs = [weakref.ref(seg) for seg in segs]
        self.shifted = [i for i, c in enumerate(position_counts) if c is not None]
        self.plain = [i for i, c in enumerate(position_counts) if c is None]
        #: the body's arrays in its order: every item's slots, then the shifted items' new positions
        self.split_sizes = list(slot_counts) + [position_counts[i] for i in self.shifted]
        self.num_positions = num_positions
        #: the compiled slot check's arguments (see :func:`_restore_blocks`): each item's first slot
        #: in the body, and the registration's slot count, block size and the positions' bound
        self.starts = np.cumsum([0, *slot_counts], dtype=np.int64)
        self.check_params = np.array([reg.num_slots, reg.block_size, num_positions or 0], dtype=np.int64)
        self.counts = tuple(slot_counts)  # each item's token count
        self._old_positions = None

    def old_positions(self, segs) -> np.ndarray:
        """The shifted items' stored positions end to end (int64; made once: originals are immutable,
        and the plan serves only the very segment objects ``segs`` it was made for)."""
        if self._old_positions is None:
            self._old_positions = np.ascontiguousarray(
                np.concatenate([segs[i].positions.numpy() for i in self.shifted]), dtype=np.int64)
        return self._old_positions

    def made_for(self, segs) -> bool:
        return len(segs) == len(self.segs) and all([ref() is seg for ref, seg in zip(self.segs, segs)])


def _item_plan(reg, req: protocol.RestoreRequest, segs) -> _ItemPlan:
    """Check ``req``'s items against the originals ``segs`` and the registration ``reg`` (shapes,
    dtype, slot and position counts, RoPE); the result is remembered on ``reg`` and reused while
    the same items name the very same segment objects, whose checks would pass again."""
    signature = (req.keys, req.slot_counts, req.position_counts)
    memo = reg.memo
    plan = memo.get(signature)
    if plan is not None and plan.made_for(segs):
        return plan
    rope, layout = reg.extra["rope"], reg.layout
    L, _, H, _, D = layout.sizes
    for i, (key, count, shift, seg) in enumerate(zip(req.keys, req.slot_counts, req.position_counts, segs)):
        shape, dtype = seg.signature
        T = shape[2]
        if shape != (2, L, T, H, D) or dtype != layout.dtype:
            raise LayoutError(f"items[{i}]: original {key!r} is {shape} {dtype}, the "
                              f"registration holds (2, {L}, T, {H}, {D}) {layout.dtype}")
        if count != T:
            raise LayoutError(f"items[{i}].slots: expected {T} slots (the original's tokens), got {count}")
        if shift is not None:
            if rope is None:
                raise LayoutError(f"items[{i}].new_positions: the registration has no RoPE spec to shift with")
            if shift != T:
                raise LayoutError(f"items[{i}].new_positions: expected {T} positions, got {shift}")
    plan = _ItemPlan(segs, req.slot_counts, req.position_counts, reg.extra.get("num_positions"), reg)
    if len(memo) >= _PLANS_KEPT:
        memo.clear()
    memo[signature] = plan
    return plan


def _restore_blocks(registry: Registry, reg, req: protocol.RestoreRequest, plan: _ItemPlan) -> np.ndarray:
    """The blocks ``req`` writes, sorted and unique, once its slots and new positions are checked.

    The security boundary: every slot in [-1, num_slots) of this registration and none twice;
    place_many is told so (``_slots_checked``) instead of checking the same values again. The usual
    request is checked in one compiled pass (:mod:`._compiled`); anything else, errors included,
    by the NumPy path, which names what is wrong."""
    compiled = _compiled.compiled()
    values = req.values
    # the compiled signature takes writable C-contiguous int64 only (np.frombuffer of bytes is read-only)
    if (compiled is not None and values is not None and values.dtype == np.int64 and values.flags.c_contiguous
            and values.flags.writeable):
        out = np.empty(len(req.slots), dtype=np.int64)
        count = compiled.restore_blocks(values, plan.starts, plan.check_params, out)
        if count >= 0:
            return out[:count]
    pos = req.new_positions
    # one reduction: viewed as unsigned, a negative position is larger than any valid one
    if pos.size and int(np.maximum.reduce(pos.view(np.uint64))) >= plan.num_positions:
        j = int(np.flatnonzero((pos < 0) | (pos >= plan.num_positions))[0])
        ends = np.cumsum([c or 0 for c in req.position_counts])
        i = int(np.searchsorted(ends, j, side="right"))
        raise LayoutError(f"items[{i}].new_positions: {int(pos[j])} outside [0, {plan.num_positions})")
    return registry.block_ids_of_slots(reg, req.slots, name="items[*].slots")
