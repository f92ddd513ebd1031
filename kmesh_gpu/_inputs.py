"""The segments and index arrays of one placement, checked and normalised (:func:`_sources`,
:func:`_indices`), and their gathering into a launch table (:func:`_fill`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._checks import _check_kv, _fmt, _host_cat, _index
from .errors import LayoutError
from .layout import KVLayout, storage_dtype


class _Sources:
    """The segments of one placement: addresses, token counts, and the tensors (or buffer) that
    hold them (kept alive by the launch)."""

    __slots__ = ("ptrs", "counts", "kvs", "staged", "bits", "labels")

    def __init__(self, ptrs, counts, kvs, staged, bits, labels=None):
        self.ptrs, self.counts, self.kvs, self.staged, self.bits = ptrs, counts, kvs, staged, bits
        #: each segment's index in the caller's call, for error messages (``None``: 0, 1, ...)
        self.labels = labels

    def tensors(self, layout: KVLayout) -> list[torch.Tensor]:
        if self.kvs is None:
            self.kvs = self.staged.views(layout)
        return self.kvs


def _suffix(labels, i: int, n: int) -> str:
    """``[k]`` naming item ``i`` of ``n`` in an error message (``labels``: the call's index of each
    item, when a caller splits one call into several placements); nothing for a lone item."""
    if labels is not None:
        return f"[{labels[i]}]"
    return "" if n == 1 else f"[{i}]"


def _sources(f, segments, *, gather: bool, labels=None) -> _Sources:
    layout = f.layout
    want = layout.storage_dtype
    L, H, D = f.kv_shape
    from .plan import StagedSegments  # (the public type; imported when a placement runs)

    if isinstance(segments, StagedSegments):
        buf = segments.buffer
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 \
                or not buf.is_contiguous():
            raise LayoutError(f"segments.buffer: expected a contiguous uint8[M] tensor, got "
                              f"{_fmt(buf) if isinstance(buf, torch.Tensor) else type(buf).__name__}")
        if buf.device != f.device:
            raise LayoutError(f"segments.buffer: expected device {f.device} (the cache's), got {buf.device}")
        if storage_dtype(segments.dtype) != want:
            raise LayoutError(f"segments.dtype: expected {layout.dtype} (the cache's), got {segments.dtype}")
        offs, counts = tuple(segments.offsets), tuple(segments.token_counts)
        if len(offs) != len(counts):
            raise LayoutError(f"segments: {len(offs)} offsets for {len(counts)} token counts")
        base, size, bits, ptrs = buf.data_ptr(), want.itemsize, f.bits, []
        for i, (o, t) in enumerate(zip(offs, counts)):
            if type(o) is not int or type(t) is not int or o < 0 or t < 0 or o % size:
                raise LayoutError(f"segments[{i}]: offset {o!r} and token count {t!r} must be non-negative "
                                  f"integers, the offset a multiple of {size}")
            nbytes = 2 * L * t * H * D * size
            if o + nbytes > buf.numel():
                raise LayoutError(f"segments[{i}]: {nbytes} bytes at offset {o} exceed the buffer's {buf.numel()}")
            p = base + o
            if p % size:
                raise LayoutError(f"segments[{i}]: address {p:#x} (buffer + offset) is not a multiple of {size} "
                                  f"bytes (the element size of {segments.dtype})")
            if nbytes and f.aliases(p, nbytes):
                raise LayoutError(f"segments[{i}]: shares memory with the cache; copy it first")
            ptrs.append(p)
            bits |= p
        return _Sources(ptrs, counts, None, segments, bits)
    if not isinstance(segments, Sequence) or isinstance(segments, (str, bytes)):
        raise LayoutError(f"kvs: expected a list of (2, L, T, H, D) tensors or a StagedSegments, got "
                          f"{type(segments).__name__}")
    n = len(segments)
    kvs, ptrs, counts, bits = [], [], [], f.bits
    for i, kv in enumerate(segments):
        sfx = _suffix(labels, i, n)
        name = "out" if gather else "kv" if not sfx else f"kvs{sfx}"
        kv = _check_kv(name, kv, layout, f.device)
        p, nbytes = kv.data_ptr(), kv.numel() * kv.element_size()
        if nbytes and f.aliases(p, nbytes):
            raise LayoutError(f"{name}: shares memory with the cache" + (" it is gathered from" if gather else
                                                                        " it is placed into; copy it first"))
        kvs.append(kv)
        ptrs.append(p)
        counts.append(kv.shape[2])
        bits |= p
    return _Sources(ptrs, tuple(counts), kvs, None, bits, labels)


def _flat(x) -> np.ndarray | None:
    """``x`` as a host int64 vector when it is one array for all items (a 1-D tensor or ndarray)."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == np.int64 and x.ndim == 1 else None
    if isinstance(x, torch.Tensor) and x.dim() == 1 and x.dtype == torch.int64 and not x.is_meta:
        return x.detach().cpu().numpy()
    return None


class _Index:
    """One kind of index values (slots, old or new positions) of a placement: ``items`` (a list of
    per-item host int64 tensors, gathered straight into the launch table) or ``flat`` (one host
    int64 array for all items)."""

    __slots__ = ("items", "flat", "name")

    def __init__(self, name: str, items, flat):
        self.name, self.items, self.flat = name, items, flat

    def host(self) -> np.ndarray:
        if self.flat is None:
            self.flat = _host_cat(self.items)
        return self.flat

    def into(self, out_t: torch.Tensor, out_a: np.ndarray) -> None:
        """Write every value into ``out`` (the same memory as a tensor and as an array)."""
        if self.flat is not None:
            out_a[:] = self.flat
        elif len(self.items) == 1:
            out_t.copy_(self.items[0])
        else:
            torch.cat(self.items, out=out_t)

    def addresses(self, starts: np.ndarray) -> list[int] | None:
        """Each item's first value's address (host, contiguous), or ``None``."""
        if self.flat is not None:
            if not self.flat.flags.c_contiguous:
                return None
            base = self.flat.ctypes.data
            return [base + 8 * int(s) for s in starts[:-1]]
        out = []
        for x in self.items:
            if not x.is_cpu or not x.is_contiguous():
                return None
            out.append(x.data_ptr())
        return out


def _indices(name: str, x, counts: tuple, labels=None) -> _Index:
    n, T = len(counts), sum(counts)
    flat = _flat(x)
    if flat is not None:
        if flat.shape[0] != T:
            raise LayoutError(f"{name}: expected int64[{T}] (all items' values) or {n} int64 tensors, got "
                              f"int64[{flat.shape[0]}]")
        return _Index(name, None, flat)
    if not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
        raise LayoutError(f"{name}: expected a list of {n} int64 tensors or one int64[{T}] array, got "
                          f"{type(x).__name__}")
    if len(x) != n:
        raise LayoutError(f"{name}: expected {n} entries (one per segment), got {len(x)}")
    items, host = [], True
    for i, (v, c) in enumerate(zip(x, counts)):
        v = _index(name + _suffix(labels, i, n), v, c)
        host = host and v.is_cpu
        items.append(v)
    if not host:  # CUDA index tensors: read back once
        return _Index(name, None, _host_cat(items))
    return _Index(name, items, None)


def _fill(h: np.ndarray, t64: torch.Tensor, layer_base, sl: _Index, old, new, L: int, T: int) -> None:
    """``[layer bases L | old, new positions 2T | slots T]`` into the table buffer."""
    h[:L] = layer_base
    if old is not None:
        old.into(t64[L:L + T], h[L:L + T])
        new.into(t64[L + T:L + 2 * T], h[L + T:L + 2 * T])
    else:
        h[L:L + 2 * T] = 0  # never read without RoPE
    sl.into(t64[L + 2 * T:L + 3 * T], h[L + 2 * T:L + 3 * T])
