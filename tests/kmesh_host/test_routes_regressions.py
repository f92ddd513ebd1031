"""Regressions of the routes found by an audit on CPU (each failed before its fix): ``restore`` never
checked that its device could be used (an AssertionError from torch on a machine without CUDA, a
"success" restoring into ``meta`` tensors, the direct route naming a missing package rather than
the missing GPU).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kmesh_gpu.errors import BackendError
from kmesh_host import RestoreTarget, SegmentStore, restore
from tests.helpers.tier import FP, put_segments


@pytest.fixture
def store(tmp_path):
    return SegmentStore(tmp_path / "s")


# ---- 1. device not available / not a data device: typed refusal before any work ----------
@pytest.mark.skipif(torch.cuda.is_available(), reason="states the CPU-only machine's behaviour")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_host_staging_on_cuda_without_cuda_is_a_typed_refusal(store, device):
    keys = put_segments(store, 2)
    with pytest.raises(BackendError, match="CUDA"):
        restore("host_staging", store, [RestoreTarget(k) for k in keys], model_fingerprint=FP, device=device)


def test_host_staging_to_meta_device_is_refused(store):
    """A meta buffer holds no data: the restore must not report success (nothing was restored)."""
    keys = put_segments(store, 2)
    with pytest.raises(BackendError):
        restore("host_staging", store, [RestoreTarget(k) for k in keys], model_fingerprint=FP, device="meta",
                verify="host")


@pytest.mark.skipif(torch.cuda.is_available(), reason="states the CPU-only machine's behaviour")
def test_direct_on_cpu_only_machine_says_no_cuda_even_with_kvikio(store, monkeypatch):
    keys = put_segments(store, 1)
    monkeypatch.setitem(sys.modules, "kvikio", types.ModuleType("kvikio"))  # kvikio installed
    with pytest.raises(BackendError, match="CUDA"):
        restore("direct", store, [RestoreTarget(keys[0])], model_fingerprint=FP, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="states the CPU-only machine's behaviour")
def test_direct_on_cpu_only_machine_names_the_missing_gpu(store):
    keys = put_segments(store, 1)
    with pytest.raises(BackendError, match="CUDA"):
        restore("direct", store, [RestoreTarget(keys[0])], model_fingerprint=FP, device="cuda")


# ---- 2. singleflight without retention: a joiner reads the key again ----------------------
