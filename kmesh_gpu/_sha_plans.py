"""Host-side plans of the kmesh-tree-sha256/v1 digest (used by :mod:`kmesh_gpu.sha256`): where every
level of every object's tree reads and writes, as a few int64 columns built once per (offsets,
lengths, leaf size, fanout) and uploaded to a device once, and the layout of the root records.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import torch

TREE_FORMAT = "kmesh-tree-sha256/v1"
DEFAULT_LEAF_SIZE = 4096
DEFAULT_FANOUT = 64
TREE_DOMAIN = b"kmesh-tree-sha256/v1\x00"
_ROOT_HEADER = len(TREE_DOMAIN) + 8 + 4 + 4          # bytes before the top digest in a root record
_ROOT_RECORD = 128                                   # root records sit 128 bytes apart (aligned)
_THREADS = 128                                       # SHA256_THREADS in csrc/sha256.cu


def root_header(length: int, leaf_size: int, fanout: int) -> bytes:
    """The 37 bytes that precede the top digest in the root record (DESIGN §3 step 3)."""
    return TREE_DOMAIN + struct.pack("<QII", length, leaf_size, fanout)


# ----------------------------------------------------------------------------------------------
# Tree plan: every level of every object as a few int64 columns, built once on the host
# ----------------------------------------------------------------------------------------------

class _Level:
    """One launch: ``n_msgs`` messages of ``n_obj`` objects, columns at ``table[table_at:]``."""

    __slots__ = ("piece", "from_data", "n_obj", "n_msgs", "table_at", "starts", "src_off",
                 "src_bytes", "out_off")

    def __init__(self, piece, from_data, starts, src_off, src_bytes, out_off):
        self.piece, self.from_data = piece, from_data
        self.starts, self.src_off, self.src_bytes, self.out_off = starts, src_off, src_bytes, out_off
        self.n_obj, self.n_msgs = len(src_off), int(starts[-1])
        self.table_at = 0



def _on_device_once(uploaded: dict, array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``, uploaded on the first call per device and kept in ``uploaded``."""
    key = str(device)
    t = uploaded.get(key)
    if t is None:
        t = uploaded[key] = torch.from_numpy(array.copy()).to(device)
    return t

class _TreePlan:
    """The device buffer of a tree computation and the launches over it.

    Buffer (uint8, one allocation): ``[table | root records | digest regions]``. The first
    ``upload_bytes`` (table and root records with their 37-byte headers) come from the host in one
    copy; the digest regions are written by the launches. Offsets in the table that point into the
    buffer are absolute (from its start); level 0 reads the payload (``from_data``).
    """

    __slots__ = ("levels", "root", "host_bytes", "total_bytes", "_on_device")

    def __init__(self, levels, root, host_bytes, total_bytes):
        self.levels, self.root = levels, root
        self.host_bytes, self.total_bytes = host_bytes, total_bytes
        self._on_device: dict[str, torch.Tensor] = {}

    def device_bytes(self, device: torch.device) -> torch.Tensor:
        """The constant front of the buffer (table, root records), uploaded once per device: a call
        then starts with a device-to-device copy instead of a pinned host upload."""
        return _on_device_once(self._on_device, self.host_bytes, device)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@functools.lru_cache(maxsize=64)
def _tree_plan(offsets: bytes, lengths: bytes, leaf_size: int, fanout: int) -> _TreePlan:
    offs = np.frombuffer(offsets, dtype=np.int64)
    lens = np.frombuffer(lengths, dtype=np.int64)
    n = lens.size
    # Pass 1, offsets relative to the workspace (root records, then one digest region per level).
    # A level's digest goes to the root record when it is the object's only one (the top).
    region = n * _ROOT_RECORD
    obj = np.arange(n, dtype=np.int64)
    src_off, src_bytes, piece, from_data = offs.copy(), lens.copy(), leaf_size, True
    staged = []
    while obj.size:
        counts = np.maximum(1, -(-src_bytes // piece))
        top = counts == 1
        inner = np.where(top, 0, counts)
        inner_start = np.cumsum(inner) - inner
        out_off = np.where(top, obj * _ROOT_RECORD + _ROOT_HEADER, region + 32 * inner_start)
        staged.append((piece, from_data, counts, src_off, src_bytes, out_off))
        region += 32 * int(inner.sum())
        keep = ~top
        obj, src_off, src_bytes = obj[keep], out_off[keep], 32 * counts[keep]
        piece, from_data = 32 * fanout, False
    # Pass 2: the table in front of the workspace; absolute offsets into the buffer.
    n_entries = sum(4 * len(s[2]) + 1 for s in staged) + 4 * n + 1
    ws = _align(8 * n_entries, _ROOT_RECORD)
    levels = []
    for piece, from_data, counts, src_off, src_bytes, out_off in staged:
        starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        levels.append(_Level(piece, from_data, starts, src_off if from_data else src_off + ws,
                             src_bytes, out_off + ws))
    ids = np.arange(n, dtype=np.int64)
    root = _Level(_ROOT_RECORD, False, np.arange(n + 1, dtype=np.int64), ws + _ROOT_RECORD * ids,
                  np.full(n, _ROOT_HEADER + 32, dtype=np.int64), 32 * ids)
    table = np.zeros(ws // 8, dtype=np.int64)
    at = 0
    for lvl in levels + [root]:
        lvl.table_at = at
        for col in (lvl.starts, lvl.src_off, lvl.src_bytes, lvl.out_off):
            table[at:at + col.size] = col
            at += col.size
    records = np.zeros((n, _ROOT_RECORD), dtype=np.uint8)
    for i, length in enumerate(lens.tolist()):
        records[i, :_ROOT_HEADER] = np.frombuffer(root_header(length, leaf_size, fanout), np.uint8)
    host = np.concatenate((table.view(np.uint8), records.reshape(-1)))
    host.setflags(write=False)
    return _TreePlan(tuple(levels), root, host, ws + region)


class _FusedPlan:
    """The table of ``kmesh_sha256_tree_fused`` (csrc/sha256.cu) for one (offsets, lengths, params).

    ``table`` (int64): ``leaf_start[n+1] | data_off[n] | length[n] | lv_at[n] | (base, count) pairs``.
    Digest slots: leaves first (slot = global leaf index), then the inner nodes of every level of every
    object; one u32 counter per inner node (``slot - n_leaves``). ``end`` is ``max(offset + length)``:
    the fewest payload bytes the plan's messages need (its offsets and lengths are known valid).
    """

    __slots__ = ("table", "n_obj", "n_leaves", "n_slots", "n_counters", "leaf_size", "fanout", "end",
                 "grid", "_on_device")

    def __init__(self, table, n_obj, n_leaves, n_slots, leaf_size=DEFAULT_LEAF_SIZE, fanout=DEFAULT_FANOUT,
                 end=0):
        self.table, self.n_obj, self.n_leaves, self.n_slots = table, n_obj, n_leaves, n_slots
        self.n_counters = n_slots - n_leaves
        self.leaf_size, self.fanout, self.end = leaf_size, fanout, end
        self.grid = ((n_leaves + _THREADS - 1) // _THREADS,)
        self._on_device: dict[str, torch.Tensor] = {}

    def device_table(self, device: torch.device) -> torch.Tensor:
        """The table on ``device``, uploaded once (the "memset" comparison path; the default path keeps
        one copy per stream, :class:`_Lane`)."""
        return _on_device_once(self._on_device, self.table, device)


@functools.lru_cache(maxsize=64)
def _fused_shape(lengths: bytes, leaf_size: int, fanout: int) -> tuple[np.ndarray, int, int]:
    """Everything of a fused plan but the data offsets (it depends on the lengths only): the table with
    ``data_off`` zero, the leaf count and the slot count. Calls that hash new places of same-sized
    objects (routes: one call per object as it lands) reuse it."""
    lens = np.frombuffer(lengths, dtype=np.int64)
    n = lens.size
    counts = np.maximum(1, -(-lens // leaf_size))
    leaf_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    n_leaves = int(leaf_start[-1])
    # Levels above the leaves: objects with more than one digest at level k-1 have a level k.
    heights = np.zeros(n, dtype=np.int64)
    per_level = []                                   # (objects, counts) for k = 1, 2, ...
    alive = np.nonzero(counts > 1)[0]
    cur = counts[alive]
    while alive.size:
        cur = -(-cur // fanout)
        per_level.append((alive, cur))
        heights[alive] += 1
        keep = cur > 1
        alive, cur = alive[keep], cur[keep]
    head = 4 * n + 1
    lv_at = head + 2 * (np.cumsum(heights) - heights)
    table = np.zeros(head + 2 * int(heights.sum()), dtype=np.int64)
    table[:n + 1] = leaf_start
    table[2 * n + 1:3 * n + 1] = lens
    table[3 * n + 1:4 * n + 1] = np.where(heights > 0, lv_at, 0)
    slot = n_leaves
    for k, (objs, cnt) in enumerate(per_level):
        bases = slot + np.cumsum(cnt) - cnt
        at = lv_at[objs] + 2 * k
        table[at] = bases
        table[at + 1] = cnt
        slot += int(cnt.sum())
    table.setflags(write=False)
    return table, n_leaves, slot


@functools.lru_cache(maxsize=64)
def _fused_plan(offsets: bytes, lengths: bytes, leaf_size: int, fanout: int) -> _FusedPlan:
    shape, n_leaves, n_slots = _fused_shape(lengths, leaf_size, fanout)
    offs = np.frombuffer(offsets, dtype=np.int64)
    n = offs.size
    table = shape.copy()
    table[n + 1:2 * n + 1] = offs
    table.setflags(write=False)
    end = int((offs + np.frombuffer(lengths, dtype=np.int64)).max()) if n else 0
    return _FusedPlan(table, n, n_leaves, n_slots, leaf_size, fanout, end)
