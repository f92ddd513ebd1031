"""The seed's GPU SHA-256 design (one thread per whole object), the baseline ``run_sha256.py``
measures the tree digest against (DESIGN.md §3). Not part of KMesh: its kernel lives in
``perf/csrc/sha256_naive.cu`` and is compiled here with CuPy, on first use."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

_SOURCE = Path(__file__).with_name("csrc") / "sha256_naive.cu"
_THREADS = 128


@functools.cache
def _kernel(device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawKernel(_SOURCE.read_text(), "kmesh_sha256_object_naive", options=("--std=c++17",))


def sha256_one_thread_per_object(data: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """``uint8[N, 32]`` SHA-256 of ``data[offsets[i]:offsets[i] + lengths[i]]`` (a contiguous CUDA
    uint8 tensor), one thread per whole message, on torch's current stream."""
    import cupy

    offs = np.asarray(offsets, dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.int64)
    n = offs.size
    out = torch.empty((n, 32), dtype=torch.uint8, device=data.device)
    if n == 0:
        return out
    index = torch.from_numpy(np.concatenate((offs, lens))).to(data.device)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(data.device).cuda_stream, data.device.index)
    with cupy.cuda.Device(data.device.index), stream:
        _kernel(data.device.index)(((n + _THREADS - 1) // _THREADS,), (_THREADS,),
                                   (np.uint64(data.data_ptr()), np.uint64(index.data_ptr()),
                                    np.uint64(index.data_ptr() + 8 * n), np.uint64(out.data_ptr()), np.int64(n)))
    return out
