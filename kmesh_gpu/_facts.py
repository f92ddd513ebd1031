"""What every placement into one cache shares, worked out once (:class:`_Facts`), and its memo."""

from __future__ import annotations

import numpy as np
import torch

from . import _backend, cuda
from ._checks import _cache_layers, _meets, _ranges
from ._host_tables import PARAMS
from ._tables import _align_bits, _consts, _i64, _vec16
from .layout import KVLayout


class _Facts:
    """What every placement into one (cache, layout, RoPE spec, backend, kernel shape) shares,
    worked out once. Keyed by the cache's addresses, shapes and strides, not the tensor (which is
    not kept alive by the memo): another tensor with those passes the same checks."""

    __slots__ = ("layout", "rope", "device", "cuda", "backend", "shape", "layer_base", "spans", "span", "bits",
                 "S", "N", "P", "vec16", "cap", "gather_cap", "row", "kv_shape", "consts", "params", "ring",
                 "template", "single", "tokens_ok")

    def __init__(self, cache, layout: KVLayout, rope, backend: str, shape):
        flats, per_layer = _cache_layers(cache, layout, "cache")  # LayoutError naming what is wrong
        L, _, H, N, D = layout.sizes
        itemsize = layout.storage_dtype.itemsize
        self.layout, self.rope, self.shape = layout, rope, shape
        self.device = flats[0].device
        self.cuda = self.device.type == "cuda"
        self.backend = _backend.choose(backend, self.device)
        ranges = _ranges(flats)
        if per_layer:  # a tensor per layer (vLLM's own): each layer's base is its tensor's address
            self.layer_base = _i64([f.data_ptr() for f in flats])
            self.spans = sorted(ranges)
        else:
            self.layer_base = flats[0].data_ptr() + np.arange(L, dtype=np.int64) * (layout.k_strides[0] * itemsize)
            self.spans = None
        self.layer_base.setflags(write=False)
        # the cache's bytes (sources must lie outside): [lowest, highest) over its layers
        self.span = (min(r[0] for r in ranges), max(r[1] for r in ranges))
        # the kernels address a layer through one base: K and V must share the layer stride
        self.tokens_ok = per_layer or layout.k_strides[0] == layout.v_strides[0]
        self.bits = _align_bits(layout, int(np.bitwise_or.reduce(self.layer_base)))
        self.S, self.N = layout.num_slots, N
        self.P = rope.num_positions if rope is not None else 0
        self.vec16 = _vec16(layout, self.bits)
        runs = shape.run_kernel and self.backend == "cupy" and self.vec16 and self.tokens_ok
        self.cap = _run_cap(layout, rope, shape) if runs else 0
        self.gather_cap = _run_cap(layout, None, shape) if runs else 0
        self.row = H * D * itemsize
        self.kv_shape = (L, H, D)
        self.consts = _consts(layout, rope, None, self.device)  # K scales of 1 (fp8 with RoPE: per call)
        self.params: dict = {}  # longest run -> the run builder's constants (PARAMS order)
        self.ring = None  # the device's table ring, looked up on first use; False: none
        self.template = None  # the run kernel's packed launch arguments; False: CuPy launches
        self.single = None  # the one-call placement's constants; False: it does not apply

    def aliases(self, ptr: int, nbytes: int) -> bool:
        """``[ptr, ptr + nbytes)`` shares bytes with the cache (with any layer of a per-layer one)."""
        if not (ptr < self.span[1] and self.span[0] < ptr + nbytes):
            return False
        return self.spans is None or _meets((ptr, ptr + nbytes), self.spans)

    def run_params(self, cap: int) -> np.ndarray:
        params = self.params.get(cap)
        if params is None:
            layout = self.layout
            st, vt = layout.k_strides, layout.v_strides
            params = np.array([self.row, self.N, cap, self.S, self.P, st[1], st[3], layout.k_offset, vt[1], vt[3],
                               layout.v_offset], dtype=np.int64)
            assert params.size == len(PARAMS)
            params.setflags(write=False)
            self.params[cap] = params
        return params

    def table_ring(self):
        if self.ring is None:
            from ._table_ring import ring_for

            ring = ring_for(self.device.index, cuda.DriverEvent.create)
            self.ring = ring if ring is not None else False
        return self.ring


def _run_cap(layout: KVLayout, rope, shape) -> int:
    """Longest run (tokens) for the run kernel, or 0 when the layout or RoPE does not fit it.

    A run's K rows hold ``cap * per_tok`` pair groups, one per lane (``run_groups`` per lane)."""
    epv = 16 // layout.storage_dtype.itemsize
    if layout.head_size % epv:
        return 0
    # offsets inside a run are 32-bit in the kernel: heads x head stride + tokens x token stride
    L, B, H, N, D = layout.sizes
    span = max(abs(st[2]) * H + abs(st[3]) * min(N, 32) + D for st in (layout.k_strides, layout.v_strides))
    if span >= 1 << 31:
        return 0
    if rope is None:
        return 16
    rd = rope.rotary_dim
    per_tok = rd // 2 // epv if rope.is_neox_style else rd // epv
    if per_tok == 0 or (rope.is_neox_style and (rd // 2) % epv) or rd % epv:
        return 0
    return 32 * shape.run_groups // per_tok


_FACTS: dict = {}  # (cache identity, id(layout), id(rope), backend, shape) -> _Facts (a bounded memo)
_FACTS_MAX = 32


def _cache_key(cache) -> tuple | None:
    if isinstance(cache, torch.Tensor):
        return cache.data_ptr(), cache.shape, cache.stride(), cache.dtype, cache.device
    if type(cache) in (list, tuple) and cache and all(isinstance(t, torch.Tensor) for t in cache):
        return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in cache)
    return None


def _facts(cache, layout: KVLayout, rope, backend: str, shape) -> _Facts:
    ident = _cache_key(cache)
    if ident is None:
        return _Facts(cache, layout, rope, backend, shape)  # raises the LayoutError that names it
    key = (ident, id(layout), id(rope), backend, shape)
    f = _FACTS.get(key)
    if f is None or f.layout is not layout or f.rope is not rope:
        f = _Facts(cache, layout, rope, backend, shape)
        if len(_FACTS) >= _FACTS_MAX:
            _FACTS.clear()
        _FACTS[key] = f
    return f
