"""Which restored rows a child keeps recomputing: the :class:`Selection` contract and its two policies.

The blender runs every row of a child through the layers before the first check layer. At a check
layer it shows the policy each child's *candidates* (its restored rows still being recomputed) in a
:class:`CheckView` — fresh K/V computed now, restored K/V read from the cache before they are
overwritten — and keeps the rows the policy returns, plus every row without restored data (gaps,
separators, the question), which are always recomputed. Between check layers the set is fixed.

**cacheblend** (:class:`CacheBlendSelection`) is LMCache's ``LMCBlender.process_qkv``
(``lmcache/v1/compute/blend/blender.py``)::

    diff_k = torch.sum((k.to(torch.float32) - old_k.to(torch.float32)) ** 2, dim=[1])   # k: [T, Hkv*D]
    topk_num = max(int(total_len * ratio), 1)
    top_indices = torch.sort(torch.topk(diff_k, k=topk_num).indices)[0]

over the rows it sees. *Counting*: KMesh shows the policy the restored rows only, so ``total_len``
is the number of restored candidates and the rows without restored data come on top of
``topk_num``. LMCache ranks every token it retrieved, the gaps included, whose "restored" K is the
zero its buffer holds there: their large deviation puts them first, so in LMCache the gaps use up
``topk_num`` before restored rows do, and gaps past ``topk_num`` keep zero K/V. The LMCache control
(issue 28) must count the two the same way before comparing choices. *Several check layers*:
LMCache applies ``ratios[0]`` at every check layer and its code cannot run a second one (``k`` holds
the selected rows, ``old_k`` all rows); here the ``i``-th check layer keeps ``ratios[i]`` (the last
ratio past the list) of the candidates left, CacheBlend's gradual filter. With one check layer the
selection is LMCache's, bit for bit.

**kmesh** (:class:`KMeshSelection`) spends the same budget — recomputed position-layers of restored
positions, :func:`cacheblend_cost` — on each segment's first tokens first, then on the rows of
largest K and V deviation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import BlendConfig, BlendError


@dataclass(frozen=True)
class CheckView:
    """One child's candidates at a check layer (all tensors on the model's device).

    Attributes:
        layer: the layer; check_index: which check layer of the policy it is (0 for the first).
        positions: ``int64[n]`` sorted prompt positions of the candidates (restored rows still
            being recomputed).
        fresh_k, fresh_v: ``[n, Hkv, D]`` (model dtype) computed at this layer, keys post-RoPE.
        restored_k, restored_v: ``[n, Hkv, D]`` the restored (shifted) K/V the cache holds there.
        segment_offsets: ``int64[n]`` each candidate's offset in its segment (0: its first token).
        restored_count: how many positions of the child are restored (its budget's base).
    """

    layer: int
    check_index: int
    positions: torch.Tensor
    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    restored_k: torch.Tensor
    restored_v: torch.Tensor
    segment_offsets: torch.Tensor
    restored_count: int


class Selection(ABC):
    """A selection policy. Attributes and methods, and who uses them:

    * ``check_layers`` — the blender: the layers where it calls :meth:`select`; every row is
      recomputed before the first.
    * :meth:`select` — the blender, at each check layer: once per child (``blend`` and the group's
      ``exact`` mode, a one-element list) or once for all children of a group layer (``batched``).
      Returns, per view, the sorted ``int64`` positions (a subset of ``view.positions``) recomputed
      from this layer on. It must not change the views' tensors.
    """

    check_layers: tuple[int, ...]

    @abstractmethod
    def select(self, views: Sequence[CheckView]) -> list[torch.Tensor]:
        """The rows each child keeps (see the class docstring)."""


def k_deviation(fresh_k: torch.Tensor, restored_k: torch.Tensor) -> torch.Tensor:
    """LMCache's ``diff_k``: per row, the fp32 sum of squared differences over heads and dims
    (``[n, Hkv, D]`` -> fp32 ``[n]``, computed over the ``[n, Hkv*D]`` view as LMCache holds K)."""
    return torch.sum((fresh_k.flatten(1).to(torch.float32) - restored_k.flatten(1).to(torch.float32)) ** 2, dim=[1])


def lmcache_topk(diff: torch.Tensor, ratio: float) -> torch.Tensor:
    """LMCache's choice over the rows of ``diff`` (fp32 ``[n]``): sorted int64 indices of the
    ``max(int(n * ratio), 1)`` largest (none when ``n == 0``)."""
    total_len = diff.shape[0]
    if total_len == 0:
        return torch.zeros(0, dtype=torch.int64, device=diff.device)
    topk_num = max(int(total_len * ratio), 1)
    top_indices = torch.topk(diff, k=topk_num).indices
    top_indices, _ = torch.sort(top_indices)
    return top_indices


def _padded_topk(scores: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
    """Per row ``i`` the sorted indices of the ``counts[i]`` largest of ``scores[i]``, for all rows
    in one ``topk`` and one ``sort`` (rows padded with -inf)."""
    device = scores[0].device
    width = max(s.shape[0] for s in scores)
    kmax = max(counts)
    if width == 0 or kmax == 0:
        return [torch.zeros(0, dtype=torch.int64, device=device) for _ in scores]
    padded = torch.full((len(scores), width), float("-inf"), dtype=torch.float32, device=device)
    for i, s in enumerate(scores):
        padded[i, :s.shape[0]] = s
    top = torch.topk(padded, k=kmax, dim=1).indices                        # [C, kmax], largest first
    keep = torch.arange(kmax, device=device)[None, :] < torch.tensor(counts, device=device)[:, None]
    top = torch.where(keep, top, torch.full_like(top, width))               # dropped: sorted past the rest
    top = torch.sort(top, dim=1).values
    return [top[i, :c] for i, c in enumerate(counts)]


class CacheBlendSelection(Selection):
    """LMCache's selection (see the module docstring): at check layer ``i`` keep the
    ``max(int(n * ratio_i), 1)`` candidates of largest K deviation."""

    def __init__(self, check_layers: Sequence[int] = (1,), ratios: Sequence[float] = (0.15,)):
        self.check_layers = tuple(check_layers)
        self.ratios = tuple(ratios)

    def ratio(self, check_index: int) -> float:
        return self.ratios[min(check_index, len(self.ratios) - 1)]

    def select(self, views: Sequence[CheckView]) -> list[torch.Tensor]:
        if len(views) == 1:
            v = views[0]
            return [v.positions[lmcache_topk(k_deviation(v.fresh_k, v.restored_k), self.ratio(v.check_index))]]
        # a group's layer: one deviation over every child's rows, one padded top-k, one sort
        fresh = torch.cat([v.fresh_k for v in views])
        restored = torch.cat([v.restored_k for v in views])
        diff = k_deviation(fresh, restored).split([v.positions.shape[0] for v in views])
        counts = [max(int(d.shape[0] * self.ratio(v.check_index)), 1) if d.shape[0] else 0
                  for d, v in zip(diff, views)]
        return [v.positions[idx] for v, idx in zip(views, _padded_topk(list(diff), counts))]


def cacheblend_cost(restored: int, num_layers: int, check_layers: Sequence[int], ratios: Sequence[float]) -> int:
    """Recomputed position-layers of restored positions under :class:`CacheBlendSelection`: every
    restored row in each layer before the first check layer, then the rows it keeps."""
    n, cost = restored, 0
    for layer in range(num_layers):
        if layer in check_layers:
            i = list(check_layers).index(layer)
            n = max(int(n * ratios[min(i, len(ratios) - 1)]), 1) if n else 0
        cost += n
    return cost


def kmesh_count(restored: int, num_layers: int, budget: int, check_layer: int) -> int:
    """Rows kept from ``check_layer`` on (at least 1, at most ``restored``) so that the recomputed
    position-layers (every restored row before ``check_layer``, then the kept ones) come as close to
    ``budget`` as whole rows allow without passing it."""
    if restored == 0:
        return 0
    left = budget - restored * check_layer
    return min(restored, max(1, left // (num_layers - check_layer)))


class KMeshSelection(Selection):
    """KMesh's selection, the best of the measured ideas (``perf/quality_blend.py``): the
    ``cacheblend`` budget of ``config`` (:func:`cacheblend_cost`) spent from
    ``config.kmesh_check_layer`` on (:func:`kmesh_count` rows); each segment's first
    ``kmesh_sink_tokens`` tokens first (the tokens whose preceding text changed most: EPIC's
    attention-sink finding), then the largest normalised K deviation plus ``kmesh_value_weight``
    times the normalised V deviation."""

    def __init__(self, config: BlendConfig, num_layers: int):
        self.config = config
        self.num_layers = num_layers
        self.check_layers = (config.kmesh_check_layer,)

    def count(self, restored: int) -> int:
        c = self.config
        budget = cacheblend_cost(restored, self.num_layers, c.blend_check_layers, c.blend_recompute_ratios)
        return kmesh_count(restored, self.num_layers, budget, c.kmesh_check_layer)

    def score(self, v: CheckView) -> torch.Tensor:
        """fp32 ``[n]``: the ranking of the view's candidates (larger first)."""
        c = self.config
        dk = k_deviation(v.fresh_k, v.restored_k)
        score = dk / dk.sum().clamp_min(1e-30)
        if c.kmesh_value_weight:
            dv = k_deviation(v.fresh_v, v.restored_v)
            score = score + c.kmesh_value_weight * dv / dv.sum().clamp_min(1e-30)
        if c.kmesh_sink_tokens and score.numel():
            sink = v.segment_offsets < c.kmesh_sink_tokens
            score = score + sink.to(score.dtype) * (score.max() + 1)
        return score

    def select(self, views: Sequence[CheckView]) -> list[torch.Tensor]:
        if not views:
            return []
        scores = [self.score(v) for v in views]
        counts = [min(self.count(v.restored_count), v.positions.shape[0]) for v in views]
        return [v.positions[idx] for v, idx in zip(views, _padded_topk(scores, counts))]


def selection_for(config: BlendConfig, num_layers: int) -> Selection:
    """The policy ``config.policy`` names, checked against the model's ``num_layers``."""
    for name, layers in (("blend_check_layers", config.blend_check_layers),
                         ("kmesh_check_layer", (config.kmesh_check_layer,))):
        bad = [x for x in layers if x >= num_layers]
        if bad:
            raise BlendError(f"{name}: layer {bad[0]} does not exist (the model has {num_layers} layers)")
    if config.policy == "cacheblend":
        return CacheBlendSelection(config.blend_check_layers, config.blend_recompute_ratios)
    return KMeshSelection(config, num_layers)
