"""What the blender is given: saved segments, a child's prompt, its segment uses and its blocks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kmesh_gpu import KVLayout
from kmesh_vllm.model import BlockTable
from kmesh_vllm.workload import Request

from .config import BlendError


def _int64(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
        got = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else \
            type(t).__name__
        raise BlendError(f"{name}: expected an int64[T] tensor, got {got}")
    return t.cpu()


@dataclass(frozen=True)
class SavedSegment:
    """A segment the restorer holds: ``key`` (its :meth:`Restorer.save` key), the workload ``name``,
    its ``token_ids`` and the ``positions`` its keys were rotated at (``int64[n]``, CPU)."""

    name: str
    key: str
    token_ids: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self):
        object.__setattr__(self, "token_ids", _int64(f"segment {self.name!r}: token_ids", self.token_ids))
        object.__setattr__(self, "positions", _int64(f"segment {self.name!r}: positions", self.positions))
        if self.token_ids.shape != self.positions.shape or not self.token_ids.numel():
            raise BlendError(f"segment {self.name!r}: expected as many positions as token ids (at least one), got "
                             f"{self.positions.shape[0]} and {self.token_ids.shape[0]}")

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class SegmentUse:
    """A saved segment placed at prompt positions ``start .. start + len(segment) - 1`` of a child."""

    segment: SavedSegment
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.segment)


@dataclass(frozen=True)
class BlendChild:
    """One child: its prompt ``token_ids`` (int64[T], CPU), the segments it reuses (in prompt order,
    not overlapping) and its own :class:`BlockTable` (its blocks of the restorer's cache, holding the
    prompt and the generated tokens). ``answer``: the known answer (for quality tables), or None."""

    name: str
    token_ids: torch.Tensor
    segments: tuple[SegmentUse, ...]
    table: BlockTable
    answer: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "token_ids", _int64(f"child {self.name!r}: token_ids", self.token_ids))
        if not self.token_ids.numel():
            raise BlendError(f"child {self.name!r}: token_ids: a prompt needs at least one token")
        if not isinstance(self.table, BlockTable):
            raise BlendError(f"child {self.name!r}: table: expected a BlockTable, got {type(self.table).__name__}")
        uses = tuple(self.segments)
        for u in uses:
            if not isinstance(u, SegmentUse):
                raise BlendError(f"child {self.name!r}: segments: expected SegmentUse items, got {type(u).__name__}")
        object.__setattr__(self, "segments", tuple(sorted(uses, key=lambda u: u.start)))

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def from_request(cls, request: Request, saved: Mapping[str, SavedSegment], table: BlockTable) -> "BlendChild":
        """The child of a workload :class:`Request`, reusing the leader's ``saved`` segments by name."""
        uses = []
        for span in request.segments:
            if span.name not in saved:
                raise BlendError(f"child {request.name!r}: segment {span.name!r} was not saved")
            uses.append(SegmentUse(saved[span.name], span.start))
        return cls(request.name, request.token_ids, tuple(uses), table, request.answer)


def block_tables(layout: KVLayout, capacities: Sequence[int], *, first_block: int = 0) -> list[BlockTable]:
    """Disjoint tables of consecutive blocks of ``layout``, each holding ``capacities[i]`` positions,
    from block ``first_block`` on (a :class:`BlendError` when the cache has too few blocks)."""
    N, out, b = layout.block_size, [], first_block
    for cap in capacities:
        n = -(-int(cap) // N)
        out.append(BlockTable(range(b, b + n), N))
        b += n
    if b > layout.num_blocks:
        raise BlendError(f"capacities: {list(capacities)} need {b - first_block} blocks of {N} from block "
                         f"{first_block}; layout {layout.name} has {layout.num_blocks}")
    return out
