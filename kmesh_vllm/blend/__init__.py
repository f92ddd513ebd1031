"""The CacheBlend blender (DESIGN.md §6): restore a child's saved segments into its own blocks with
the RoPE shift, recompute the rows a selection policy picks and every row without restored data,
decode; one child (:meth:`Blender.blend`) or a group layer-major (:meth:`Blender.blend_group`,
``exact`` or ``batched``).

Public names:

* :class:`Blender` (``save_segments``, ``children``, ``blend``, ``blend_group``, ``repair``, ``full``) and its
  :class:`BlendConfig` (LMCache's ``blend_check_layers``, ``blend_recompute_ratios``; ``policy``);
* inputs :class:`BlendChild`, :class:`SegmentUse`, :class:`SavedSegment`, :func:`block_tables`;
  the results :class:`BlendOutcome` and :class:`RepairOutcome`;
* policies: the :class:`Selection` contract with :class:`CheckView`; :class:`CacheBlendSelection`
  (LMCache's), :class:`KMeshSelection`; :func:`lmcache_topk`, :func:`k_deviation`,
  :func:`cacheblend_cost`, :func:`kmesh_count`, :func:`selection_for`;
* quality: :func:`compare`, :func:`teacher_forced_logits`, :func:`kl_divergence`, :func:`answer_correct`;
* :class:`BlendError` and :class:`ReuseFailed`, :class:`kmesh_gpu.KmeshError` subclasses.
"""

from .blender import MODES, Blender
from .child import BlendChild, SavedSegment, SegmentUse, block_tables
from .config import POLICIES, BlendConfig, BlendError, ReuseFailed
from .outcome import BlendOutcome, RepairOutcome
from .quality import answer_correct, compare, kl_divergence, teacher_forced_logits
from .selection import (CacheBlendSelection, CheckView, KMeshSelection, Selection, cacheblend_cost, k_deviation,
                        kmesh_count, lmcache_topk, selection_for)

__all__ = [
    "Blender", "MODES", "BlendConfig", "BlendError", "POLICIES", "BlendChild", "SavedSegment", "SegmentUse",
    "block_tables", "BlendOutcome", "RepairOutcome", "ReuseFailed", "Selection", "CheckView", "CacheBlendSelection", "KMeshSelection",
    "lmcache_topk", "k_deviation", "cacheblend_cost", "kmesh_count", "selection_for", "compare",
    "teacher_forced_logits", "kl_divergence", "answer_correct",
]
