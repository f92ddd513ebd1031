"""The blender's configuration (one frozen dataclass) and its error."""

from __future__ import annotations

from dataclasses import dataclass

from kmesh_gpu.errors import KmeshError

POLICIES = ("cacheblend", "kmesh")


class BlendError(KmeshError, ValueError):
    """A blend the blender refuses before any work (the message names the child and the field)."""


def _ints(name: str, v) -> tuple[int, ...]:
    if isinstance(v, (int, float, str)) or not hasattr(v, "__iter__"):
        raise BlendError(f"{name}: expected a sequence of ints, got {v!r}")
    v = tuple(v)
    if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise BlendError(f"{name}: expected a non-empty sequence of ints >= 0, got {list(v)!r}")
    if list(v) != sorted(set(v)):
        raise BlendError(f"{name}: expected increasing layers without repeats, got {list(v)!r}")
    return v


def _floats(name: str, v, lo: float, hi: float) -> tuple[float, ...]:
    if isinstance(v, (int, float, str)) or not hasattr(v, "__iter__"):
        raise BlendError(f"{name}: expected a sequence of numbers, got {v!r}")
    v = tuple(v)
    if not v or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi for x in v):
        raise BlendError(f"{name}: expected a non-empty sequence of numbers in [{lo}, {hi}], got {list(v)!r}")
    return tuple(float(x) for x in v)


class ReuseFailed(KmeshError):
    """:meth:`Blender.repair` could not reuse the child's segments (its cause says why); the child's
    blocks must be recomputed without reuse."""


@dataclass(frozen=True)
class BlendConfig:
    """How the blender recomputes.

    Attributes:
        blend_check_layers: LMCache's name: the layers where the ``cacheblend`` policy selects rows
            (default ``(1,)``). Every restored position is recomputed in the layers before the first.
        blend_recompute_ratios: LMCache's name: the share of the candidate rows kept at each check
            layer (default ``(0.15,)``; a check layer past the list uses the last ratio). The
            recompute *budget* of both policies is the ``cacheblend`` cost of these two fields.
        policy: ``"cacheblend"`` (LMCache's selection, see :class:`CacheBlendSelection`) or
            ``"kmesh"`` (:class:`KMeshSelection`: the same budget spent by the fields below; their
            defaults are the measured best, ``perf/quality_blend.py``).
        kmesh_check_layer: the ``kmesh`` policy's one check layer.
        kmesh_sink_tokens: each segment's first tokens, kept first (within the budget).
        kmesh_value_weight: weight of the V deviation next to the K deviation (each normalised).
        max_new_tokens: greedy tokens generated after each prompt.
    """

    blend_check_layers: tuple[int, ...] = (1,)
    blend_recompute_ratios: tuple[float, ...] = (0.15,)
    policy: str = "cacheblend"
    kmesh_check_layer: int = 1
    kmesh_sink_tokens: int = 8
    kmesh_value_weight: float = 1.0
    max_new_tokens: int = 20

    def __post_init__(self):
        object.__setattr__(self, "blend_check_layers", _ints("blend_check_layers", self.blend_check_layers))
        object.__setattr__(self, "blend_recompute_ratios",
                           _floats("blend_recompute_ratios", self.blend_recompute_ratios, 0.0, 1.0))
        if self.policy not in POLICIES:
            raise BlendError(f"policy: expected one of {POLICIES}, got {self.policy!r}")
        for name, lo in (("kmesh_check_layer", 0), ("kmesh_sink_tokens", 0), ("max_new_tokens", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise BlendError(f"{name}: expected an int >= {lo}, got {v!r}")
        v = self.kmesh_value_weight
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise BlendError(f"kmesh_value_weight: expected a number >= 0, got {v!r}")
