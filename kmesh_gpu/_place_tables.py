"""Launch tables of the placement kernels, built on the host (NumPy) and moved in one copy.

Per-token kernels (``kmesh_place``, ``kmesh_place_vec``) read one row per token (:func:`_tok_tables`);
the run kernel (``kmesh_place_runs``) reads one row per run of tokens that fill consecutive slots of
one block (:func:`_runs`, :func:`_run_table`). Alignment facts decide which vector widths are safe
(:func:`_align_bits`, :func:`_vec16`, :func:`_vec4`); constant inputs (cos/sin, the fp8 decode table,
K scales) are cached per device. ``place`` picks the kernel and calls these; the compiled builder
(``_host_tables``) makes the run table of the usual restore in one pass with the same layout.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._once import once_per_key
from .errors import LayoutError
from .layout import KVLayout

RUN_LEN_COL = 1  # a run's token count (RUN_LEN): 0 makes the run kernel skip the run (gate.cu)
_RUN_COLS = 7  # RunCol in place.cu: first token, length, source address, source step, K/V offsets, cache


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


def _tables(items, cache_views, layout: KVLayout, rope, scale, device: torch.device) -> dict:
    """Build the launch tables where the indices live and move them to ``device`` in one copy
    (the general path's adapter to :func:`_tok_tables`)."""
    keys = list(cache_views)
    L, itemsize = layout.num_layers, layout.storage_dtype.itemsize
    bases = []
    for key in keys:
        flats, per_layer = cache_views[key]
        if per_layer:
            bases.append(_i64([f.data_ptr() for f in flats]))
        else:
            bases.append(flats[0].data_ptr() + np.arange(L, dtype=np.int64) * (layout.k_strides[0] * itemsize))
    layer_base = bases[0] if len(bases) == 1 else np.concatenate(bases)
    if layout.k_strides[0] != layout.v_strides[0]:
        raise LayoutError("layout: K and V layer strides differ; the kernels address one layer base per layer")
    item_cache = [keys.index(it.cache_key) for it in items] if len(keys) > 1 else None
    slots = np.concatenate([it.slots for it in items]) if len(items) > 1 else items[0].slots
    old = new = None
    if rope is not None:
        old = np.concatenate([it.old for it in items]) if len(items) > 1 else items[0].old
        new = np.concatenate([it.new for it in items]) if len(items) > 1 else items[0].new
    return _tok_tables(_i64([it.kv.data_ptr() for it in items]), tuple(it.kv.shape[2] for it in items),
                       layer_base, item_cache, slots, old, new, layout, rope, scale, device)


def _tok_tables(kv_ptrs: np.ndarray, counts: tuple[int, ...], layer_base: np.ndarray, item_cache, slots, old, new,
                layout: KVLayout, rope, scale, device: torch.device) -> dict:
    """The per-token kernels' tables, built on the host and moved to ``device`` in one copy.

    Small tables: item and cache addresses, strides. Per-token tables (``tok``, the vectorised
    kernel's input): slot, source row address, source step per (K|V, layer), destination offsets of
    K and V within a layer, the cache's first layer-base index, old and new position.
    ``item_cache``: each item's cache index (``None``: one cache).
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
        "item_cache": np.asarray(item_cache if item_cache is not None else [0] * len(counts), dtype=np.int64),
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
    if item_cache is not None:
        np.multiply(small["item_cache"][tok_item], L, out=tok[5])
    else:
        tok[5] = 0
    tok[6], tok[7], tok[8] = old, new, tok_item
    dev_packed = host.to(device, non_blocking=True)
    out, p0 = {}, 0
    for name, t in small.items():
        out[name] = dev_packed[p0:p0 + t.size]
        p0 += t.size
    tok_dev = dev_packed[p0:].view(9, total)
    out["tok"] = tok_dev
    out["tok_host"] = tok  # kept for the run table (_Launch); holds the pinned buffer, not a copy
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


def _run_rows(slots: np.ndarray, tok_item: np.ndarray, block_size: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the placed tokens (slot >= 0) into runs: consecutive tokens of one item in consecutive
    slots of one block, at most ``cap`` long (a run also ends before a slot that is a multiple of
    ``cap``). Returns (first token, length) per run."""
    n = slots.size
    bounds = np.flatnonzero(tok_item[1:] != tok_item[:-1]) + 1 if n > 1 else np.zeros(0, dtype=np.int64)
    valid = slots >= 0
    return _runs(slots, bounds, block_size, cap, None if valid.all() else valid)


def _runs(slots: np.ndarray, bounds, block_size: int, cap: int, valid: np.ndarray | None,
          diff: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_run_rows` given the tokens where a new item begins (``bounds``, each < slots.size),
    the placed-token mask (``valid``; ``None`` when every slot is placed) and optionally
    ``slots[1:] - slots[:-1]``."""
    n = slots.size
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z
    brk = np.empty(n, dtype=bool)  # a token that starts a run
    brk[0] = True
    if diff is None:
        diff = slots[1:] - slots[:-1]
    np.not_equal(diff, 1, out=brk[1:])
    N = block_size
    # a run starts at a block's first slot and, splitting long runs, at every multiple of cap
    for m in ((cap,) if cap < N and N % cap == 0 else (N, cap) if cap < N else (N,)):
        brk |= ((slots & (m - 1)) if m & (m - 1) == 0 else (slots % m)) == 0
    brk[bounds] = True
    if valid is not None:
        brk[1:] |= ~valid[:-1]  # the token after a skipped one
        brk &= valid
    first = np.flatnonzero(brk)
    if first.size == 0:
        return first, first
    # a run ends where the next starts or at the first skipped token after it
    end = np.empty_like(first)
    end[:-1] = first[1:]
    end[-1] = n
    if valid is not None:
        stop = np.flatnonzero(~valid)
        if stop.size:
            end = np.minimum(end, np.append(stop, n)[np.searchsorted(stop, first)])
    return first, end - first


def _run_table(tok: np.ndarray, block_size: int, cap: int, device: torch.device) -> torch.Tensor | None:
    """The run kernel's table [R, _RUN_COLS] (RunCol in place.cu) from the host per-token rows, on
    ``device``; ``None`` when runs average under half of ``cap`` tokens (scattered slots): a warp per
    run would then leave most of its lanes idle, and the per-token kernel is faster."""
    first, length = _run_rows(tok[0], tok[8], block_size, cap)
    if not _runs_pay(first, length, cap):
        return None
    host = torch.empty((first.size, _RUN_COLS), dtype=torch.int64, pin_memory=device.type == "cuda")
    t = host.numpy()
    t[:, 0], t[:, 1] = first, length
    t[:, 2:] = tok[1:6, first].T  # source address, source step, K offset, V offset, cache layer index
    return host.to(device, non_blocking=True)


def _runs_pay(first: np.ndarray, length: np.ndarray, cap: int) -> bool:
    """Whether the run kernel pays off: runs average at least half of ``cap`` tokens."""
    return first.size > 0 and 2 * int(length.sum()) >= cap * first.size


@once_per_key(maxsize=32)
def _ones(n: int, device: str) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32, device=device)
