"""Paged KV-cache layouts as affine element strides.

A :class:`KVLayout` describes one paged cache allocation holding K and V for ``L`` layers, ``B``
blocks of ``N`` tokens, ``H`` KV heads and head size ``D``. The element of K at logical index
``(l, b, h, n, d)`` lives at ``k_offset + l*k_strides[0] + b*k_strides[1] + h*k_strides[2] +
n*k_strides[3] + d*k_strides[4]`` elements from the start of the cache (likewise V). Every vLLM
arrangement is one such set of strides; all index arithmetic is int64.

A slot ``s`` means block ``s // N``, offset ``s % N``; slot ``-1`` is skipped (vLLM's padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import LayoutError

# vLLM's named orders of the logical [L, B, H, N, C] cache: memory order as a permutation.
VLLM_LAYOUTS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
VLLM_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
_AXES = "LBHNC"

#: dtypes a cache may hold. fp8 e4m3 is held as uint8 (or torch.float8_e4m3fn) with a scale.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float8_e4m3fn)


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels address: fp8 e4m3 is moved as its uint8 bit pattern."""
    return torch.uint8 if dtype == torch.float8_e4m3fn else dtype


def _check_ints(name: str, values, n: int, *, positive: bool = False, nonneg: bool = False) -> tuple[int, ...]:
    try:
        values = tuple(values)
        out = tuple(int(v) for v in values)
        whole = all(o == v for o, v in zip(out, values))
    except (TypeError, ValueError, OverflowError) as exc:
        raise LayoutError(f"{name}: expected {n} integers, got {values!r}") from exc
    if len(out) != n or not whole or any(isinstance(v, bool) for v in values):
        raise LayoutError(f"{name}: expected {n} integers, got {values!r}")
    if positive and any(v <= 0 for v in out):
        raise LayoutError(f"{name}: expected positive integers, got {out}")
    if nonneg and any(v < 0 for v in out):
        raise LayoutError(f"{name}: expected non-negative integers, got {out}")
    return out


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


@dataclass(frozen=True)
class KVLayout:
    """One paged KV-cache allocation as affine element strides (see module docstring).

    Attributes:
        sizes: ``(L, B, H, N, D)`` — layers, blocks, KV heads, tokens per block, head size.
        k_strides, v_strides: element strides of K and V along ``(L, B, H, N, D)``.
        k_offset, v_offset: element offsets of K[0,0,0,0,0] and V[0,0,0,0,0].
        dtype: the cache dtype (float32, float16, bfloat16, or uint8 / float8_e4m3fn for fp8 e4m3).
        physical_shape: the shape of the tensor :meth:`allocate` returns (memory order).
        name: a readable description ("LBHNC/content", "legacy/kv-first/NHD", "custom").
    """

    sizes: tuple[int, int, int, int, int]
    k_strides: tuple[int, int, int, int, int]
    v_strides: tuple[int, int, int, int, int]
    k_offset: int
    v_offset: int
    dtype: torch.dtype
    physical_shape: tuple[int, ...]
    name: str = "custom"
    _extent: int = field(default=0, repr=False, compare=False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_strides(cls, sizes, k_strides, v_strides, k_offset: int = 0, v_offset: int = 0, *,
                     dtype: torch.dtype, physical_shape=None, name: str = "custom") -> "KVLayout":
        """The general form. ``physical_shape`` defaults to one flat dimension of the extent.

        K and V addresses must not overlap; this is checked exhaustively for caches of up to
        2**24 elements and by a stride-ordering argument above that.
        """
        sizes = _check_ints("sizes", sizes, 5, positive=True)
        k_strides = _check_ints("k_strides", k_strides, 5, nonneg=True)
        v_strides = _check_ints("v_strides", v_strides, 5, nonneg=True)
        k_offset, v_offset = _check_ints("k_offset/v_offset", (k_offset, v_offset), 2, nonneg=True)
        if dtype not in CACHE_DTYPES:
            raise LayoutError(f"dtype: expected one of {CACHE_DTYPES}, got {dtype}")
        if sizes[4] % 2:
            raise LayoutError(f"sizes: head size D must be even (RoPE pairs), got {sizes[4]}")
        last = [s - 1 for s in sizes]
        extent = 1 + max(k_offset + sum(a * b for a, b in zip(last, k_strides)),
                         v_offset + sum(a * b for a, b in zip(last, v_strides)))
        if extent * storage_dtype(dtype).itemsize >= 1 << 63:  # all index math (and byte addresses) in int64
            raise LayoutError(f"sizes/strides: the layout addresses {extent} elements, more than int64 byte "
                              f"offsets reach (sizes={sizes})")
        if physical_shape is None:
            physical_shape = (extent,)
        try:
            rank = len(tuple(physical_shape))
        except TypeError as exc:
            raise LayoutError(f"physical_shape: expected a tuple of positive integers, got {physical_shape!r}") from exc
        physical_shape = _check_ints("physical_shape", physical_shape, rank, positive=True)
        if math.prod(physical_shape) < extent:
            raise LayoutError(f"physical_shape: {physical_shape} holds {math.prod(physical_shape)} elements, "
                              f"the strides address {extent}")
        layout = cls(sizes, k_strides, v_strides, k_offset, v_offset, dtype, physical_shape, name, extent)
        layout._check_disjoint()
        return layout

    @classmethod
    def from_vllm(cls, name: str, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_size: int, dtype: torch.dtype, kv_packing: str = "content") -> "KVLayout":
        """vLLM's named layouts over the logical ``[L, B, H, N, C]`` cache.

        ``kv_packing="content"``: ``C = 2*D``, K in the first D elements, V in the next D (GPU
        attention backends). ``kv_packing="planes"``: vLLM's CPU backend (``vec``/``vec16`` ISAs) —
        a K/V axis of size 2 sits immediately before the N axis in memory order, so within each
        (block, head) there is a K plane stored transposed, ``[D, N]`` (tokens contiguous), followed
        by a V plane ``[N, D]`` (for LBHNC). The CPU ``amx`` ISA tiles its planes and is not affine.
        """
        key = VLLM_ALIASES.get(name, name)
        if key not in VLLM_LAYOUTS:
            raise LayoutError(f"name: expected one of {sorted(VLLM_LAYOUTS) + sorted(VLLM_ALIASES)}, got {name!r}")
        L, B, N, H, D = _check_ints("num_layers/num_blocks/block_size/num_kv_heads/head_size",
                                    (num_layers, num_blocks, block_size, num_kv_heads, head_size), 5, positive=True)
        perm = VLLM_LAYOUTS[key]
        logical = {"L": L, "B": B, "H": H, "N": N}
        if kv_packing == "content":
            axes = [_AXES[i] for i in perm]  # memory order, ends with C
            shape = [logical[a] if a != "C" else 2 * D for a in axes]
            strides = dict(zip(axes, _contiguous_strides(shape)))
            st = tuple(strides[a] for a in "LBHN") + (1,)
            return cls.from_strides((L, B, H, N, D), st, st, 0, D, dtype=dtype, physical_shape=shape,
                                    name=f"{key}/content")
        if kv_packing == "planes":
            axes = [_AXES[i] for i in perm][:-1]  # memory order without C
            axes.insert(axes.index("N"), "2")
            axes.append("D")
            sz = dict(logical, **{"2": 2, "D": D})
            shape = [sz[a] for a in axes]
            strides = dict(zip(axes, _contiguous_strides(shape)))
            v_st = tuple(strides[a] for a in "LBHN") + (1,)
            # cpu_attn_reshape_and_cache writes K with N and D swapped (the kernel reads keys token-wise).
            k_axes = [{"N": "D", "D": "N"}.get(a, a) for a in axes]
            k_strides = dict(zip(k_axes, _contiguous_strides([sz[a] for a in k_axes])))
            k_st = tuple(k_strides[a] for a in "LBHND")
            return cls.from_strides((L, B, H, N, D), k_st, v_st, 0, strides["2"], dtype=dtype,
                                    physical_shape=shape, name=f"{key}/planes")
        raise LayoutError(f"kv_packing: expected 'content' or 'planes', got {kv_packing!r}")

    @classmethod
    def from_vllm_legacy(cls, kv_axis: str, order: str, *, num_layers: int, num_blocks: int, block_size: int,
                         num_kv_heads: int, head_size: int, dtype: torch.dtype) -> "KVLayout":
        """vLLM's legacy per-layer 5-D shapes, stacked as one allocation ``[L, *per_layer]``.

        ``kv_axis="first"``: per layer ``(2, B, N, H, D)`` (``order="NHD"``) or ``(2, B, H, N, D)``
        (``"HND"``); ``kv_axis="second"``: ``(B, 2, N, H, D)`` or ``(B, 2, H, N, D)``.
        """
        if kv_axis not in ("first", "second"):
            raise LayoutError(f"kv_axis: expected 'first' or 'second', got {kv_axis!r}")
        if order not in ("NHD", "HND"):
            raise LayoutError(f"order: expected 'NHD' or 'HND', got {order!r}")
        L, B, N, H, D = _check_ints("num_layers/num_blocks/block_size/num_kv_heads/head_size",
                                    (num_layers, num_blocks, block_size, num_kv_heads, head_size), 5, positive=True)
        inner = ["N", "H", "D"] if order == "NHD" else ["H", "N", "D"]
        axes = ["L"] + (["2", "B"] if kv_axis == "first" else ["B", "2"]) + inner
        sz = {"L": L, "B": B, "H": H, "N": N, "D": D, "2": 2}
        shape = [sz[a] for a in axes]
        strides = dict(zip(axes, _contiguous_strides(shape)))
        st = tuple(strides[a] for a in "LBHND")
        return cls.from_strides((L, B, H, N, D), st, st, 0, strides["2"], dtype=dtype, physical_shape=shape,
                                name=f"legacy/kv-{kv_axis}/{order}")

    @classmethod
    def from_layer_tensors(cls, tensors, kv_axis: str, order: str) -> tuple["KVLayout", torch.Tensor]:
        """Describe a list of per-layer legacy tensors that live in one storage at equal spacing.

        Returns ``(layout, base)``: ``base`` is a flat view starting at layer 0 that ``place`` and
        ``gather`` address with ``layout``. Raises :class:`LayoutError` when the tensors are not
        contiguous, disagree in shape/dtype/device, or are not equally spaced in one storage.
        """
        tensors = list(tensors)
        if not tensors:
            raise LayoutError("tensors: expected at least one per-layer tensor")
        t0 = tensors[0]
        if t0.dim() != 5:
            raise LayoutError(f"tensors[0]: expected a 5-D legacy per-layer tensor, got shape {tuple(t0.shape)}")
        if kv_axis == "first":
            two, B = t0.shape[0], t0.shape[1]
        elif kv_axis == "second":
            B, two = t0.shape[0], t0.shape[1]
        else:
            raise LayoutError(f"kv_axis: expected 'first' or 'second', got {kv_axis!r}")
        if two != 2:
            raise LayoutError(f"tensors[0]: the K/V axis ({kv_axis}) has size {two}, expected 2")
        if order == "NHD":
            N, H, D = t0.shape[2:]
        elif order == "HND":
            H, N, D = t0.shape[2:]
        else:
            raise LayoutError(f"order: expected 'NHD' or 'HND', got {order!r}")
        itemsize = t0.element_size()
        per_layer = t0.numel()
        spacing = None
        for i, t in enumerate(tensors):
            if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device or not t.is_contiguous():
                raise LayoutError(f"tensors[{i}]: expected a contiguous {tuple(t0.shape)} {t0.dtype} tensor on "
                                  f"{t0.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
            if t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr():
                raise LayoutError(f"tensors[{i}]: not in the same storage as tensors[0]; separate per-layer "
                                  "allocations are passed to place()/gather() as a list instead")
            if i:
                d = t.data_ptr() - tensors[i - 1].data_ptr()
                spacing = d if spacing is None else spacing
                if d != spacing or d % itemsize or d < per_layer * itemsize:
                    raise LayoutError(f"tensors[{i}]: layers are not equally spaced without overlap in storage")
        lstride = (spacing // itemsize) if spacing else per_layer
        one = cls.from_vllm_legacy(kv_axis, order, num_layers=1, num_blocks=B, block_size=N, num_kv_heads=H,
                                   head_size=D, dtype=t0.dtype)
        L = len(tensors)
        k = (lstride,) + one.k_strides[1:]
        layout = cls.from_strides((L, B, H, N, D), k, k, 0, one.v_offset, dtype=t0.dtype,
                                  physical_shape=((L - 1) * lstride + per_layer,), name=one.name)
        base = torch.empty(0, dtype=t0.dtype, device=t0.device)
        base.set_(t0.untyped_storage(), t0.storage_offset(), ((L - 1) * lstride + per_layer,), (1,))
        return layout, base

    # ------------------------------------------------------------------ properties
    @property
    def num_layers(self) -> int:
        return self.sizes[0]

    @property
    def num_blocks(self) -> int:
        return self.sizes[1]

    @property
    def num_kv_heads(self) -> int:
        return self.sizes[2]

    @property
    def block_size(self) -> int:
        return self.sizes[3]

    @property
    def head_size(self) -> int:
        return self.sizes[4]

    @property
    def num_slots(self) -> int:
        return self.sizes[1] * self.sizes[3]

    @property
    def extent(self) -> int:
        """Elements from the cache start to one past the highest addressed element."""
        return self._extent

    @property
    def storage_dtype(self) -> torch.dtype:
        return storage_dtype(self.dtype)

    def per_layer(self) -> "KVLayout":
        """The same layout for a single layer (used with per-layer cache tensors)."""
        s = self.sizes
        shape = self.physical_shape[1:] if self.physical_shape[0] == s[0] and len(self.physical_shape) > 1 else None
        return KVLayout.from_strides((1,) + s[1:], self.k_strides, self.v_strides, self.k_offset, self.v_offset,
                                     dtype=self.dtype, physical_shape=shape, name=self.name + "/layer")

    def allocate(self, device="cpu", *, fill=None) -> torch.Tensor:
        """A new cache tensor of ``physical_shape`` (contiguous). The caller owns it.

        ``fill``: a value to write everywhere (tests poison caches); default leaves memory uninitialised.
        """
        t = torch.empty(self.physical_shape, dtype=self.dtype, device=device)
        if fill is not None:
            t.view(self.storage_dtype).fill_(fill)
        return t

    def to_dict(self) -> dict:
        """A JSON-able description (the service protocol sends layouts this way)."""
        return {"sizes": list(self.sizes), "k_strides": list(self.k_strides), "v_strides": list(self.v_strides),
                "k_offset": self.k_offset, "v_offset": self.v_offset, "dtype": str(self.dtype).removeprefix("torch."),
                "physical_shape": list(self.physical_shape), "name": self.name}

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        try:
            dtype = getattr(torch, d["dtype"])
            return cls.from_strides(d["sizes"], d["k_strides"], d["v_strides"], d["k_offset"], d["v_offset"],
                                    dtype=dtype, physical_shape=d["physical_shape"], name=str(d.get("name", "custom")))
        except (KeyError, TypeError, AttributeError) as exc:
            raise LayoutError(f"layout: malformed description {d!r}: {exc}") from exc

    # ------------------------------------------------------------------ element offsets
    def element_offsets(self, which: str, layer: int, block, head: int, token_in_block, device="cpu") -> torch.Tensor:
        """int64 element offsets of K or V for ``d = 0..D-1`` (broadcast over block/token tensors)."""
        st = self.k_strides if which == "k" else self.v_strides
        off = self.k_offset if which == "k" else self.v_offset
        block = torch.as_tensor(block, dtype=torch.int64, device=device)
        token_in_block = torch.as_tensor(token_in_block, dtype=torch.int64, device=device)
        d = torch.arange(self.head_size, dtype=torch.int64, device=device)
        base = off + layer * st[0] + block * st[1] + head * st[2] + token_in_block * st[3]
        return base.unsqueeze(-1) + d * st[4]

    def _check_disjoint(self) -> None:
        """K and V elements must map to distinct addresses (else writes would clobber each other)."""
        total = 2 * math.prod(self.sizes)
        if total <= (1 << 24):
            offs = []
            for which, st, off in (("k", self.k_strides, self.k_offset), ("v", self.v_strides, self.v_offset)):
                idx = torch.full((), off, dtype=torch.int64)
                for size, stride in zip(self.sizes, st):
                    idx = idx.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
                offs.append(idx.reshape(-1))
            allo = torch.cat(offs)
            if torch.unique(allo).numel() != allo.numel():
                raise LayoutError(f"strides: K/V addresses overlap (sizes={self.sizes}, k_strides={self.k_strides}, "
                                  f"v_strides={self.v_strides}, k_offset={self.k_offset}, v_offset={self.v_offset})")
            return
        # Large caches: each (array, axis) must step over everything finer than it (sufficient condition).
        dims = []
        for st, off in ((self.k_strides, self.k_offset), (self.v_strides, self.v_offset)):
            dims.append(sorted((s, n) for s, n in zip(st, self.sizes) if n > 1))
        for axes in dims:
            span = 1
            for s, n in axes:
                if s < span:
                    raise LayoutError(f"strides: axes overlap within K or V (k_strides={self.k_strides}, "
                                      f"v_strides={self.v_strides}, sizes={self.sizes})")
                span = s * n
        # ... and K must not meet V. Axes along which K and V step alike are shared; the others
        # (vLLM's CPU planes: K transposed) span an inner tile, enumerated; the shared axes must then
        # step over the tile (with equal strides the tile is the two offsets: one axis of size 2).
        shared = [(s, n) for s, t, n in zip(self.k_strides, self.v_strides, self.sizes) if n > 1 and s == t]
        inner = [i for i, (s, t, n) in enumerate(zip(self.k_strides, self.v_strides, self.sizes)) if n > 1 and s != t]
        if not inner:
            axes, span = sorted(shared + [(abs(self.v_offset - self.k_offset), 2)]), 1
        else:
            tile = math.prod(self.sizes[i] for i in inner)
            if tile > (1 << 22):
                raise LayoutError(f"strides: cannot prove K and V disjoint (k_strides={self.k_strides}, "
                                  f"v_strides={self.v_strides}, sizes={self.sizes})")
            offs = []
            for st, off in ((self.k_strides, self.k_offset), (self.v_strides, self.v_offset)):
                idx = torch.full((), off, dtype=torch.int64)
                for i in inner:
                    idx = idx.unsqueeze(-1) + torch.arange(self.sizes[i], dtype=torch.int64) * st[i]
                offs.append(idx.reshape(-1))
            allo = torch.cat(offs)
            if torch.unique(allo).numel() != allo.numel():
                raise LayoutError(f"strides: K/V addresses overlap (k_strides={self.k_strides}, "
                                  f"v_strides={self.v_strides}, k_offset={self.k_offset}, v_offset={self.v_offset})")
            axes, span = sorted(shared), int(allo.max() - allo.min()) + 1
        for s, n in axes:
            if s < span:
                raise LayoutError(f"strides: K/V addresses overlap or cannot be proven disjoint (sizes={self.sizes}, "
                                  f"k_strides={self.k_strides}, v_strides={self.v_strides}, "
                                  f"k_offset={self.k_offset}, v_offset={self.v_offset})")
            span = s * n
