"""The staging buffer of a restore: where each object lies in it, its segments' views, and the
spare buffers a restorer keeps for its next all-resident child.

A restore lands every object's padded payload in one uint8 device buffer, each at an
:data:`~kmesh_host.direct_io.ALIGN`-aligned offset (:func:`offsets_of`). The placement reads the
segments from there as a :class:`kmesh_gpu.StagedSegments` (their addresses, no tensor view per
segment: :func:`staged_segments`); :func:`kv_views` builds the ``(2, L, T, H, D)`` views for callers
that want the restored tensors.
"""

from __future__ import annotations

import math
import threading

import torch

from kmesh_gpu import StagedSegments

from ..direct_io import ALIGN, round_up
from ..segment import SegmentHeader


def offsets_of(lengths) -> tuple[list[int], int]:
    """Each object's offset in the staging buffer (aligned) and the buffer's size, for ``lengths`` bytes."""
    offsets, total = [], 0
    for nbytes in lengths:
        offsets.append(total)
        total += round_up(nbytes, ALIGN)
    return offsets, max(total, ALIGN)


def layout_offsets(headers: list[SegmentHeader]) -> tuple[list[int], int]:
    """:func:`offsets_of` the headers' padded payloads."""
    return offsets_of([h.padded_length for h in headers])


def kv_views(buffer: torch.Tensor, headers: list[SegmentHeader], offsets: list[int]) -> list[torch.Tensor]:
    """Each object's ``(2, L, T, H, D)`` tensor as a view of ``buffer`` (``SegmentHeader.kv_view``'s
    result, made with one strided view per object of one typed view of the buffer)."""
    kvs, typed = [], {}
    for h, o in zip(headers, offsets):
        dt = h.torch_dtype
        size = dt.itemsize
        shape = h.shape
        if o % size or h.payload_length != math.prod(shape) * size or buffer.numel() % size:
            kvs.append(h.kv_view(buffer[o: o + h.padded_length]))
            continue
        view = typed.get(dt)
        if view is None:
            view = typed[dt] = buffer.view(dt)
        strides, acc = [0] * len(shape), 1
        for i in range(len(shape) - 1, -1, -1):
            strides[i] = acc
            acc *= shape[i]
        kvs.append(view.as_strided(shape, strides, o // size))
    return kvs


def staged_segments(buffer: torch.Tensor, headers: list[SegmentHeader], offsets: list[int]):
    """The objects in ``buffer`` as one :class:`kmesh_gpu.StagedSegments` where every one is exactly
    its shape's bytes (``SegmentHeader.dense_kv``) in one shared dtype at an offset of that dtype's
    size; else the list of their :func:`kv_views` (what the placement takes otherwise)."""
    dt = headers[0].torch_dtype
    size = dt.itemsize
    for h, o in zip(headers, offsets):
        if not h.dense_kv or o % size or h.torch_dtype is not dt:
            return kv_views(buffer, headers, offsets)
    return StagedSegments(buffer, tuple(offsets), tuple(h.num_tokens for h in headers), dt)


class SpareStaging:
    """Staging buffers made while an all-resident child's copies run, for the next such child of the
    same size on the same device and stream: its first copy is then queued without an allocation
    before it. At most :attr:`MAX` are kept, one per ``(device index, raw stream)``. The owner (a
    restorer) frees them with :meth:`drop`."""

    MAX = 4

    def __init__(self):
        self._spares: dict = {}  # (device index, raw stream) -> an unused staging buffer
        self._lock = threading.Lock()

    def take(self, index: int, stream: int, total: int) -> torch.Tensor | None:
        """The spare kept for this device and stream when it has ``total`` bytes, else ``None``;
        either way it is no longer kept (one child takes it, a size that differs frees it)."""
        spare = self._spares.pop((index, stream), None)  # one pop: two threads cannot both take it
        return spare if spare is not None and spare.numel() == total else None

    def stock(self, device: torch.device, index: int, stream: int, total: int) -> None:
        """Keep a fresh staging buffer of ``total`` bytes for the next ready child on this device and
        stream (allocated on that stream, which the caching allocator ties it to)."""
        with self._lock:
            if (index, stream) not in self._spares and len(self._spares) < self.MAX:
                self._spares[(index, stream)] = torch.empty(total, dtype=torch.uint8, device=device)

    def kept(self) -> dict:
        """``{(device index, raw stream): buffer}`` of the spares kept now (a copy)."""
        return dict(self._spares)

    def drop(self) -> int:
        """Free every spare; returns how many were kept."""
        with self._lock:
            n = len(self._spares)
            self._spares.clear()
        return n


__all__ = ["offsets_of", "layout_offsets", "kv_views", "staged_segments", "SpareStaging"]
