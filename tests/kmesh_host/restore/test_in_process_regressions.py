"""Regressions of the in-process restorer found by an audit on CPU (each failed before its fix): a
restore never checked that its device could be used (an AssertionError from torch on a machine
without CUDA, a "success" restoring into ``meta`` tensors, the direct route naming a missing
package rather than the missing GPU). The device is now the cache's, checked when the restorer
is made.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kmesh_gpu import KVLayout
from kmesh_gpu.errors import BackendError
from kmesh_host import InProcessRestorer, RouteConfig, SegmentStore
from kmesh_host.restore.in_process import _check_device
from tests.helpers.restore import cache_for
from tests.helpers.tier import FP, put_segments


@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "s")


# ---- 1. device not available / not a data device: typed refusal before any work ----------
@pytest.mark.skipif(torch.cuda.is_available(), reason="states the CPU-only machine's behaviour")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("route", ["host_staging", "direct"])
def test_a_cuda_destination_without_cuda_is_a_typed_refusal(device, route):
    """(No CUDA tensor can be made here: the restorer's device check itself, which it applies to
    the cache's device.)"""
    with pytest.raises(BackendError, match="CUDA"):
        _check_device(torch.device(device), route)


def test_a_meta_cache_is_refused(store):
    """A meta cache holds no data: the restorer must not be made (nothing could be restored)."""
    put_segments(store, 2)
    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=8,
                                dtype=torch.bfloat16)
    with pytest.raises(BackendError, match="meta"):
        InProcessRestorer(store, layout.allocate("meta"), layout, model_fingerprint=FP,
                          config=RouteConfig(verify="host"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="states the CPU-only machine's behaviour")
def test_direct_on_cpu_only_machine_says_no_cuda_even_with_kvikio(store, monkeypatch):
    keys = put_segments(store, 1)
    monkeypatch.setitem(sys.modules, "kvikio", types.ModuleType("kvikio"))  # kvikio installed
    layout, cache, _ = cache_for(store, keys)
    with pytest.raises(BackendError, match="CUDA"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP, config=RouteConfig(route="direct"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="states the CPU-only machine's behaviour")
def test_direct_on_cpu_only_machine_names_the_missing_gpu(store):
    keys = put_segments(store, 1)
    layout, cache, _ = cache_for(store, keys)
    with pytest.raises(BackendError, match="CUDA"):
        InProcessRestorer(store, cache, layout, model_fingerprint=FP, config=RouteConfig(route="direct"))
