"""Launch tables of the per-token placement kernels, built on the host (NumPy) and moved in one copy.

Per-token kernels (``kmesh_place``, ``kmesh_place_vec``) read one row per token (:func:`_tok_tables`);
the run kernel's table is built by :mod:`._host_tables`. Alignment facts decide which vector widths
are safe (:func:`_align_bits`, :func:`_vec16`, :func:`_vec4`); constant inputs (cos/sin, the fp8
decode table, K scales) are cached per device.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._once import once_per_key
from .layout import KVLayout


@once_per_key(maxsize=8)
def _fp8_table(device: str) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def _i64(vals) -> np.ndarray:
    """Addresses (Python ints) as int64 bit patterns."""
    try:
        return np.array(vals, dtype=np.int64)
    except OverflowError:  # an address at or above 2**63: its two's-complement pattern
        return np.array([v - (1 << 64) if v >= (1 << 63) else v for v in vals], dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _token_index(counts: tuple[int, ...], row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the per-token tables need from the item sizes alone (read-only; restores repeat them):
    ``(item_tok_start, tok_item, t_in_item * row, count[tok_item] * row)``."""
    cnt = np.asarray(counts, dtype=np.int64)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(cnt, out=starts[1:])
    total = int(starts[-1])
    tok_item = np.repeat(np.arange(len(counts), dtype=np.int64), cnt)
    row_off = (np.arange(total, dtype=np.int64) - starts[:-1][tok_item]) * row
    step = (cnt * row)[tok_item]
    for a in (starts, tok_item, row_off, step):
        a.setflags(write=False)
    return starts, tok_item, row_off, step


def _tok_tables(kv_ptrs: np.ndarray, counts: tuple[int, ...], layer_base: np.ndarray, slots, old, new,
                layout: KVLayout, rope, scale, device: torch.device) -> dict:
    """The per-token kernels' tables, built on the host and moved to ``device`` in one copy.

    Small tables: item and cache addresses, strides. Per-token tables (``tok``, the vectorised
    kernel's input): slot, source row address, source step per (K|V, layer), destination offsets of
    K and V within a layer, the cache's first layer-base index, old and new position.
    One destination cache (its layers at ``layer_base``): the kernels' cache column is 0.
    """
    L, itemsize = layout.num_layers, layout.storage_dtype.itemsize
    st, vt = layout.k_strides, layout.v_strides
    row = layout.num_kv_heads * layout.head_size * itemsize
    starts, tok_item, row_off, step = _token_index(counts, row)
    total = int(starts[-1])
    small = {
        "kv_ptrs": kv_ptrs,
        "item_tok_start": starts,
        "layer_base": layer_base,
        "item_cache": np.zeros(len(counts), dtype=np.int64),
        "k_st": np.asarray([st[1], st[2], st[3], st[4], layout.k_offset], dtype=np.int64),
        "v_st": np.asarray([vt[1], vt[2], vt[3], vt[4], layout.v_offset], dtype=np.int64),
    }
    N = layout.block_size
    if N & (N - 1) == 0:  # block sizes are powers of two in practice: shifts instead of divisions
        blk, pos = slots >> (N.bit_length() - 1), slots & (N - 1)
    else:
        blk, pos = slots // N, slots % N
    if rope is None:
        old = new = slots
    # one host buffer, one transfer: the small tables, then the per-token rows (see TokRow in place.cu)
    n_small = sum(a.size for a in small.values())
    # pinned when the launch is on a GPU, so the upload is asynchronous and at full bandwidth
    # (torch's caching host allocator keeps the buffer until the copy has finished)
    host = torch.empty(n_small + 9 * total, dtype=torch.int64, pin_memory=device.type == "cuda")
    packed = host.numpy()
    np.concatenate(list(small.values()), out=packed[:n_small])
    tok = packed[n_small:].reshape(9, total)
    tok[0] = slots
    np.add(kv_ptrs[tok_item], row_off, out=tok[1])
    tok[2] = step
    np.multiply(blk, st[1], out=tok[3])
    tok[3] += pos * st[3]
    tok[3] += layout.k_offset
    np.multiply(blk, vt[1], out=tok[4])
    tok[4] += pos * vt[3]
    tok[4] += layout.v_offset
    tok[5] = 0
    tok[6], tok[7], tok[8] = old, new, tok_item
    dev_packed = host.to(device, non_blocking=True)
    out, p0 = {}, 0
    for name, t in small.items():
        out[name] = dev_packed[p0:p0 + t.size]
        p0 += t.size
    tok_dev = dev_packed[p0:].view(9, total)
    out["tok"] = tok_dev
    out["slots"], out["old_pos"], out["new_pos"], out["tok_item"] = tok_dev[0], tok_dev[6], tok_dev[7], tok_dev[8]
    out["total"] = total
    bits = _align_bits(layout, int(np.bitwise_or.reduce(kv_ptrs)) | int(np.bitwise_or.reduce(layer_base)))
    out["vec16"] = _vec16(layout, bits)
    out["vec4"] = _vec4(layout, rope, bits)
    out["cos_sin"], out["fp8_table"], out["k_scale"] = _consts(layout, rope, scale, device)
    return out


def _align_bits(layout: KVLayout, addr_bits: int) -> int:
    """OR of every address, stride and head run in bytes: vector widths are powers of two, so
    testing the OR for a multiple of the width tests them all at once."""
    itemsize = layout.storage_dtype.itemsize
    st, vt = layout.k_strides, layout.v_strides
    bits = addr_bits
    for x in (st[1], st[2], st[3], vt[1], vt[2], vt[3], layout.k_offset, layout.v_offset, layout.head_size):
        bits |= x * itemsize
    return bits


def _vec16(layout: KVLayout, bits: int) -> bool:
    """16-byte vector copies are safe: every base, stride and head run is 16-byte aligned."""
    return layout.k_strides[4] == 1 and layout.v_strides[4] == 1 and bits % 16 == 0


def _vec4(layout: KVLayout, rope, bits: int) -> bool:
    """4-element vectors (kmesh_place_vec): D and rd multiples of 8, everything aligned to 4 elements."""
    rd_ok = rope is None or rope.rotary_dim % 8 == 0
    return (layout.k_strides[4] == 1 and layout.v_strides[4] == 1 and layout.head_size % 8 == 0 and rd_ok
            and bits % (4 * layout.storage_dtype.itemsize) == 0)


def _consts(layout: KVLayout, rope, scale, device: torch.device) -> tuple:
    """The kernels' constant inputs on ``device``: fp32 cos/sin, the fp8 decode table, K scales."""
    dstr = str(device)
    return (rope.cos_sin_fp32(device) if rope is not None else _ones(1, dstr), _fp8_table(dstr),
            scale.to(device) if scale is not None else _ones(layout.num_layers, dstr))


@once_per_key(maxsize=32)
def _ones(n: int, device: str) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32, device=device)
