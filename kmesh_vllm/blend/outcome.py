"""What one child's blend (or full recomputation) produced: :class:`BlendOutcome`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kmesh_gpu import KVLayout
from kmesh_vllm.model import BlockTable, read_kv


@dataclass
class BlendOutcome:
    """One child's result.

    Attributes:
        name: the child's name.
        token_ids: the greedy tokens generated after the prompt.
        logits: fp32 ``[vocab]``: the logits the first generated token was chosen from.
        step_logits: fp32 ``[n, vocab]``: the logits of every generated token (row 0 is ``logits``).
        recompute: per layer, the sorted ``int64`` prompt positions whose K/V this layer recomputed
            (the rows the blend ran; the prompt's last position, which the first decode step
            computes in every layer, is not listed). A full recomputation lists ``0 .. T-2`` everywhere.
        restored: ``bool[T]``: the positions whose K/V came from a saved segment (the last prompt
            position is never restored: its row must be computed for the logits).
        prompt_slots: ``int64[T]``: the child's slots of its prompt positions.
        table: the child's :class:`BlockTable`; prompt_length: ``T``.
        timings: seconds: ``restore_s``, ``layers_s`` (the blend's layer loop), ``decode_s``,
            ``recompute_s`` (a full recomputation: :meth:`Blender.full` or a fallback), ``total_s``
            (the whole call). In a group ``layers_s`` and ``total_s`` are the group's (and in a
            ``batched`` group ``restore_s`` and ``decode_s`` too). Intervals may nest: never add them.
        fallback: None, or why the child was recomputed in full without reuse.
        restore_report: the restorer's :class:`RestoreReport` (None without a restore).

    :meth:`prompt_kv` reads the K/V of the prompt slots from the cache the blend wrote (it reads
    the cache as it is now: call it before anything else writes these blocks).
    """

    name: str
    token_ids: list[int]
    logits: torch.Tensor
    step_logits: torch.Tensor
    recompute: list[torch.Tensor]
    restored: torch.Tensor
    prompt_slots: torch.Tensor
    table: BlockTable
    prompt_length: int
    cache: torch.Tensor = field(repr=False)
    layout: KVLayout = field(repr=False)
    timings: dict = field(default_factory=dict)
    fallback: str | None = None
    restore_report: object = None

    def prompt_kv(self) -> torch.Tensor:
        """``(2, L, T, H, D)`` copy of every layer's K and V at the prompt's slots."""
        ks, vs = [], []
        for layer in range(self.layout.num_layers):
            k, v = read_kv(self.cache, self.layout, layer, self.prompt_slots.to(self.cache.device))
            ks.append(k)
            vs.append(v)
        return torch.stack([torch.stack(ks), torch.stack(vs)])

    @property
    def recomputed_position_layers(self) -> int:
        """The budget spent: over all layers, how many restored positions were recomputed."""
        restored = self.restored.cpu()
        return int(sum(int(restored[r.cpu()].sum()) for r in self.recompute))


@dataclass
class RepairOutcome:
    """What :meth:`Blender.repair` did to one child's prompt rows (no decode): per layer the sorted
    positions recomputed (``recompute``, as :class:`BlendOutcome`'s), the restored mask, timings
    (``restore_s``, ``layers_s``, ``total_s``) and the restorer's report."""

    name: str
    recompute: list[torch.Tensor]
    restored: torch.Tensor
    timings: dict = field(default_factory=dict)
    restore_report: object = None

    @property
    def recomputed_position_layers(self) -> int:
        restored = self.restored.cpu()
        return int(sum(int(restored[r.cpu()].sum()) for r in self.recompute))
