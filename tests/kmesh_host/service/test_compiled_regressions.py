"""Regressions of the service's compiled host paths found by a differential audit (each failed before
its fix): read-only int64 arrays (``np.frombuffer`` of bytes) made the compiled slot check, reserve
and release raise Numba's TypeError instead of taking the NumPy path (release after marking the
operation drained, which then kept its blocks forever); the NumPy reserve checked only the first
and last block ids (an interior -1 wrapped to the last block).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kmesh_gpu import KVLayout
from kmesh_gpu.errors import LayoutError
from kmesh_host.service import _compiled, restores
from kmesh_host.service.registry import PeerIdentity, Registry


def _registry():
    layout = KVLayout.from_vllm("NHD", num_layers=1, num_blocks=12, block_size=2, num_kv_heads=1, head_size=4,
                                dtype=torch.float32)
    registry = Registry(lambda reg: None)
    return registry, registry.register(PeerIdentity(1, 1, 1), instance=0, handle_key=b"h", layout=layout,
                                       memory=None)


def _readonly(values):
    a = np.array(values, dtype=np.int64)
    a.setflags(write=False)
    return a


def test_restore_check_of_read_only_values_declines_to_numpy_instead_of_raising_type_error():
    assert _compiled.compiled() is not None
    registry, reg = _registry()
    values = np.frombuffer(np.array([0, 1, 5], dtype="<i8").tobytes(), dtype="<i8")  # as decode_restore(bytes)
    req = types.SimpleNamespace(values=values, slots=values, new_positions=values[3:], position_counts=(None,))
    plan = restores.ItemPlan([], (3,), (None,), None, reg)
    assert restores.restore_blocks(registry, reg, req, plan).tolist() == [0, 2]


def test_begin_with_a_read_only_block_array_reserves_like_the_numpy_path():
    registry, reg = _registry()
    op = registry.begin(reg, "restore", _readonly([1, 2]))
    assert reg.held_blocks == {1: op.op_id, 2: op.op_id}
    registry.submitted(op, None, outcome="ok")
    assert reg.held_blocks == {} and op.op_id not in reg.ops


def test_release_of_blocks_made_read_only_after_begin_frees_them():
    registry, reg = _registry()
    blocks = np.array([3, 4], dtype=np.int64)
    op = registry.begin(reg, "restore", blocks)
    blocks.setflags(write=False)
    registry.submitted(op, None, outcome="ok")  # nothing submitted: releases at once
    assert op.state == "drained" and reg.held_blocks == {} and op.op_id not in reg.ops


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint64])
@pytest.mark.parametrize("blocks", [[0, -1, 3], [0, 99, 3], [5, 12, 6]])
def test_begin_refuses_any_out_of_range_id_on_every_path(dtype, blocks):
    if dtype is np.uint64 and min(blocks) < 0:
        blocks = [b % (1 << 64) for b in blocks]  # -1 as uint64: far out of range
    registry, reg = _registry()
    with pytest.raises(LayoutError, match="outside"):
        registry.begin(reg, "restore", np.array(blocks, dtype=dtype))
    assert reg.held_blocks == {} and not reg.ops
