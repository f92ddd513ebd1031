"""Rotary position embedding (RoPE) as vLLM builds it, and the key shift between positions.

:class:`RopeSpec` reproduces vLLM's ``cos_sin_cache`` construction for the default, linear,
dynamic-NTK, llama3 and YaRN variants: fp32 ``inv_freq = 1 / base**(arange(0, rd, 2)/rd)`` (with the
variant's adjustment), fp32 angles ``t ⊗ inv_freq``, ``cat(cos, sin)``, cast to the model dtype.

Shifting a key from position ``p`` to ``p'`` undoes the rotation at ``p`` and applies the one at
``p'`` in fp32 with one rounding at the end. The fp32 operation order is fixed (no fused
multiply-adds) and is the same in every backend, so all of them produce identical bits::

    u0 = x0*c_p + x1*s_p ;  u1 = x1*c_p - x0*s_p     (undo the rotation at p)
    z0 = u0*c_q - u1*s_q ;  z1 = u1*c_q + u0*s_q     (apply the rotation at p')

Pairs are ``(i, i + rd/2)`` for neox style and ``(2i, 2i+1)`` for GPT-J style, ``i < rd/2``; dims
from ``rotary_dim`` to ``head_size`` are copied unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._once import once_per_key
from .errors import LayoutError

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALING_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL = {
    "dynamic": ("max_trained_positions",),
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
}


def _freeze_scaling(scaling) -> tuple[tuple[str, object], ...] | None:
    if scaling is None:
        return None
    if isinstance(scaling, tuple):
        scaling = dict(scaling)
    if not isinstance(scaling, dict):
        raise LayoutError(f"scaling: expected None or a dict like vLLM's rope_parameters, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SCALING_TYPES:
        raise LayoutError(f"scaling: rope_type must be one of {SCALING_TYPES}, got {kind!r}")
    if kind == "default":
        return None
    missing = [k for k in _REQUIRED[kind] if k not in scaling]
    if missing:
        raise LayoutError(f"scaling: rope_type {kind!r} needs {missing}")
    keep = {k: scaling[k] for k in _REQUIRED[kind] + _OPTIONAL.get(kind, ()) if k in scaling}
    for k, v in keep.items():  # every parameter a finite number (counts: positive whole numbers)
        if k == "truncate" or (v is None and k in _OPTIONAL.get(kind, ())):
            continue
        try:
            x = float(v)
        except (TypeError, ValueError, OverflowError):
            x = math.nan
        if isinstance(v, bool) or not math.isfinite(x):
            raise LayoutError(f"scaling: {k} must be a finite number, got {v!r}")
        if (k in ("factor", "low_freq_factor", "high_freq_factor") or k.endswith("positions")
                or k.endswith("embeddings")) and x <= 0:
            raise LayoutError(f"scaling: {k} must be positive, got {v!r}")
        if (k.endswith("positions") or k.endswith("embeddings")) and not x.is_integer():
            raise LayoutError(f"scaling: {k} must be a whole number, got {v!r}")
    return (("rope_type", kind),) + tuple(sorted(keep.items()))


def _yarn_correction_range(low_rot, high_rot, dim, base, max_pos, truncate):
    def dim_for(rot):
        return (dim * math.log(max_pos / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_for(low_rot), dim_for(high_rot)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    """A model's rotary embedding.

    Args:
        head_size: D, the per-head size of the keys.
        rotary_dim: rd <= D, even; dims ``rd..D-1`` are not rotated.
        base: rope theta.
        is_neox_style: neox pairs ``(i, i+rd/2)``; otherwise GPT-J pairs ``(2i, 2i+1)``.
        max_position: the model's max_position_embeddings (for YaRN vLLM passes the original one).
        dtype: the model dtype; the cos/sin cache is cast to it, exactly as vLLM does.
        scaling: None or a dict as vLLM's ``rope_parameters``: ``{"rope_type": "linear"|"dynamic"|
            "llama3"|"yarn", "factor": ..., ...}``.
    """

    head_size: int
    rotary_dim: int
    base: float
    is_neox_style: bool
    max_position: int
    dtype: torch.dtype
    scaling: tuple | None = None

    def __post_init__(self):
        for name in ("head_size", "rotary_dim", "max_position"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise LayoutError(f"{name}: expected a positive int, got {v!r}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_size or self.head_size % 2:
            raise LayoutError(f"rotary_dim: expected an even value <= head_size={self.head_size} "
                              f"(head_size even), got {self.rotary_dim}")
        if not (isinstance(self.base, (int, float)) and not isinstance(self.base, bool) and self.base > 1
                and math.isfinite(self.base)):
            raise LayoutError(f"base: expected a finite number > 1, got {self.base!r}")
        if self.dtype not in MODEL_DTYPES:
            raise LayoutError(f"dtype: expected one of {MODEL_DTYPES}, got {self.dtype}")
        object.__setattr__(self, "scaling", _freeze_scaling(self.scaling))
        if self.scaling_type == "dynamic":  # vLLM's NTK base: a positive bracket, rd > 2
            p = self.scaling_params
            f, trained = float(p["factor"]), float(p.get("max_trained_positions", self.max_position))
            if self.rotary_dim <= 2 or f * self.max_position / trained - (f - 1) <= 0:
                raise LayoutError(f"scaling: dynamic NTK needs rotary_dim > 2 and factor * max_position / "
                                  f"max_trained_positions > factor - 1, got {dict(self.scaling)}")
        object.__setattr__(self, "is_neox_style", bool(self.is_neox_style))
        object.__setattr__(self, "base", float(self.base))

    # ------------------------------------------------------------------ descriptions
    @property
    def scaling_type(self) -> str:
        return "default" if self.scaling is None else dict(self.scaling)["rope_type"]

    @property
    def scaling_params(self) -> dict:
        return {} if self.scaling is None else {k: v for k, v in self.scaling if k != "rope_type"}

    @property
    def num_positions(self) -> int:
        """Rows of the cos/sin cache: the valid positions are ``0 .. num_positions-1``."""
        p = self.scaling_params
        kind = self.scaling_type
        if kind == "linear":
            return math.ceil(self.max_position * float(p["factor"]))
        if kind == "yarn":
            return math.ceil(int(p["original_max_position_embeddings"]) * float(p["factor"]))
        return self.max_position

    def to_dict(self) -> dict:
        """JSON-able description (stored in segment fingerprints, sent over the service protocol)."""
        return {"head_size": self.head_size, "rotary_dim": self.rotary_dim, "base": self.base,
                "is_neox_style": self.is_neox_style, "max_position": self.max_position,
                "dtype": str(self.dtype).removeprefix("torch."),
                "scaling": None if self.scaling is None else dict(self.scaling)}

    @classmethod
    def from_dict(cls, d: dict) -> "RopeSpec":
        try:
            if not isinstance(d["is_neox_style"], bool):
                raise TypeError(f"is_neox_style: expected a bool, got {d['is_neox_style']!r}")
            ints = [d[k] for k in ("head_size", "rotary_dim", "max_position")]
            if any(isinstance(v, bool) or int(v) != v for v in ints):
                raise TypeError(f"head_size/rotary_dim/max_position: expected integers, got {ints}")
            return cls(*(int(v) for v in ints[:2]), float(d["base"]), d["is_neox_style"],
                       int(ints[2]), getattr(torch, d["dtype"]), d.get("scaling"))
        except (KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
            if isinstance(exc, LayoutError):
                raise
            raise LayoutError(f"rope: malformed description {d!r}: {exc}") from exc

    # ------------------------------------------------------------------ vLLM construction
    def _inv_freq(self, device) -> torch.Tensor:
        rd = self.rotary_dim
        kind, p = self.scaling_type, self.scaling_params
        exps = torch.arange(0, rd, 2, dtype=torch.float, device=device) / rd
        if kind == "dynamic":
            trained = int(p.get("max_trained_positions", self.max_position))
            f = float(p["factor"])
            base = self.base * ((f * self.max_position / trained) - (f - 1)) ** (rd / (rd - 2))
            return 1.0 / (base ** exps)
        if kind == "yarn":
            f = float(p["factor"])
            pos_freqs = self.base ** exps
            extrapolation = 1.0 / pos_freqs
            interpolation = 1.0 / (f * pos_freqs)
            low, high = _yarn_correction_range(p.get("beta_fast", 32), p.get("beta_slow", 1), rd, self.base,
                                               int(p["original_max_position_embeddings"]), p.get("truncate", True))
            if low == high:
                high += 0.001
            ramp = torch.clamp((torch.arange(rd // 2, dtype=torch.float, device=device) - low) / (high - low), 0, 1)
            mask = 1 - ramp
            return interpolation * (1 - mask) + extrapolation * mask
        inv = 1.0 / (self.base ** exps)
        if kind == "llama3":
            f = float(p["factor"])
            lo, hi = float(p["low_freq_factor"]), float(p["high_freq_factor"])
            orig = int(p["original_max_position_embeddings"])
            wave_len = 2 * math.pi / inv
            smooth = (orig / wave_len - lo) / (hi - lo) if lo != hi else 0
            inv = torch.where(wave_len < orig / hi, inv,
                              torch.where(wave_len > orig / lo, inv / f, (1 - smooth) * inv / f + smooth * inv))
        return inv

    def _yarn_magnitude(self) -> float:
        p = self.scaling_params
        f = float(p["factor"])
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        if p.get("mscale") and p.get("mscale_all_dim"):
            return float(_yarn_mscale(f, p["mscale"]) / _yarn_mscale(f, p["mscale_all_dim"]))
        return float(_yarn_mscale(f))

    def cos_sin_cache(self, device="cpu") -> torch.Tensor:
        """vLLM's ``cos_sin_cache``: ``[num_positions, rotary_dim]`` in the model dtype.

        Built with torch ops on ``device``; vLLM builds it on the device the model is initialised
        on, so pass the cache's device to reproduce its bits there.
        """
        return _cos_sin_cache(self, str(torch.device(device)))

    def cos_sin_fp32(self, device="cpu") -> torch.Tensor:
        """The model-dtype cache widened to fp32 (exact), the table the placement kernels read."""
        return _cos_sin_fp32(self, str(torch.device(device)))

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (queries or keys, ``[..., T, H, D]``, D = ``head_size``) at ``positions``
        (int64[T], each in ``[0, num_positions)``), as a model's forward does before attention.

        The cos/sin values are this spec's model-dtype cache (vLLM's table) widened to fp32; the
        rotation runs in fp32 in a fixed order (``x0*c - x1*s``, ``x1*c + x0*s``) and is rounded
        once to ``x.dtype``. Dims from ``rotary_dim`` on are returned unchanged. Keys rotated here
        at ``p`` and shifted to ``p'`` by the placement equal keys rotated here at ``p'`` up to one
        fp32 rounding per step (the two are not bit-identical, DESIGN.md §2).
        """
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[-1] != self.head_size:
            raise LayoutError(f"x: expected a tensor [..., T, H, D={self.head_size}], got "
                              f"{type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}")
        if x.dtype not in MODEL_DTYPES:
            raise LayoutError(f"x: expected fp32/fp16/bf16, got {x.dtype}")
        T = x.shape[-3]
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != (T,):
            got = (f"{str(positions.dtype).removeprefix('torch.')}{list(positions.shape)}"
                   if isinstance(positions, torch.Tensor) else type(positions).__name__)
            raise LayoutError(f"positions: expected int64[T={T}], got {got}")
        self.check_positions("positions", positions)
        return rotate_fp32(x.float(), positions.to(x.device), self).to(x.dtype)

    def check_positions(self, name: str, positions: torch.Tensor) -> None:
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.num_positions):
            raise LayoutError(f"{name}: positions must lie in [0, {self.num_positions}), got range "
                              f"[{int(positions.min())}, {int(positions.max())}]")


@once_per_key(maxsize=32)
def _cos_sin_cache(spec: RopeSpec, device: str) -> torch.Tensor:
    kind, p = spec.scaling_type, spec.scaling_params
    inv_freq = spec._inv_freq(device)
    if kind == "linear":
        f = float(p["factor"])
        t = torch.arange(spec.max_position * f, dtype=torch.float, device=device) / f
    elif kind == "yarn":
        t = torch.arange(int(p["original_max_position_embeddings"]) * float(p["factor"]),
                         dtype=torch.float32, device=device)
    else:
        t = torch.arange(spec.max_position, dtype=torch.float, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if kind == "yarn":
        m = spec._yarn_magnitude()
        cos, sin = cos * m, sin * m
    return torch.cat((cos, sin), dim=-1).to(spec.dtype)


@once_per_key(maxsize=32)
def _cos_sin_fp32(spec: RopeSpec, device: str) -> torch.Tensor:
    return _cos_sin_cache(spec, device).float().contiguous()


def _pair_index(rope: RopeSpec, device) -> tuple[torch.Tensor, torch.Tensor]:
    half = rope.rotary_dim // 2
    i = torch.arange(half, device=device)
    if rope.is_neox_style:
        return i, i + half
    return 2 * i, 2 * i + 1


def rotate_fp32(x: torch.Tensor, positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """fp32 ``x`` ``[..., T, H, D]`` rotated at ``positions`` (int64[T] on ``x``'s device); a new tensor."""
    table = rope.cos_sin_fp32(x.device)
    half = rope.rotary_dim // 2
    e0, e1 = _pair_index(rope, x.device)
    c = table[positions, :half].unsqueeze(-2)  # [T, 1, half]
    s = table[positions, half:].unsqueeze(-2)
    x0, x1 = x[..., e0], x[..., e1]
    out = x.clone()
    out[..., e0] = x0 * c - x1 * s
    out[..., e1] = x1 * c + x0 * s
    return out


def shift_fp32(x: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
               rope: RopeSpec) -> torch.Tensor:
    """fp32 keys ``[..., T, H, D]`` moved from ``old_positions`` to ``new_positions`` (int64[T]).

    Returns a new fp32 tensor; the operation order is the contract shared with every kernel.
    """
    table = rope.cos_sin_fp32(x.device)
    half = rope.rotary_dim // 2
    e0, e1 = _pair_index(rope, x.device)
    c_p = table[old_positions, :half].unsqueeze(-2)  # [T, 1, half]
    s_p = table[old_positions, half:].unsqueeze(-2)
    c_q = table[new_positions, :half].unsqueeze(-2)
    s_q = table[new_positions, half:].unsqueeze(-2)
    x0, x1 = x[..., e0], x[..., e1]
    u0 = x0 * c_p + x1 * s_p
    u1 = x1 * c_p - x0 * s_p
    z0 = u0 * c_q - u1 * s_q
    z1 = u1 * c_q + u0 * s_q
    out = x.clone()
    out[..., e0] = z0
    out[..., e1] = z1
    return out


def rope_shift(k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
               rope: RopeSpec) -> torch.Tensor:
    """Move post-RoPE keys from ``old_positions`` to ``new_positions``.

    Args:
        k: keys ``[..., T, H, D]`` in fp32/fp16/bf16 (D = ``rope.head_size``), any device.
        old_positions, new_positions: int64[T] on any device, each in ``[0, rope.num_positions)``.
    Returns:
        A new tensor like ``k``: undo at old, apply at new, fp32 math, one rounding.
    """
    if not isinstance(rope, RopeSpec):
        raise LayoutError(f"rope: expected a RopeSpec, got {type(rope).__name__}")
    if k.dim() < 3 or k.shape[-1] != rope.head_size:
        raise LayoutError(f"k: expected [..., T, H, D={rope.head_size}], got {tuple(k.shape)}")
    if k.dtype not in MODEL_DTYPES:
        raise LayoutError(f"k: expected fp32/fp16/bf16, got {k.dtype}")
    T = k.shape[-3]
    out_pos = []
    for name, pos in (("old_positions", old_positions), ("new_positions", new_positions)):
        pos = torch.as_tensor(pos)
        if pos.dtype != torch.int64 or pos.shape != (T,):
            raise LayoutError(f"{name}: expected int64[T={T}], got {str(pos.dtype).removeprefix('torch.')}"
                              f"{list(pos.shape)}")
        rope.check_positions(name, pos)
        out_pos.append(pos.to(k.device))
    return shift_fp32(k.float(), out_pos[0], out_pos[1], rope).to(k.dtype)
