"""Device and backend parametrisation shared by the tests."""

from __future__ import annotations

import pytest

from kmesh_gpu import _backend

# The same test body runs on CPU and, with -m gpu, on CUDA (Warp's own habit).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def backends_for(device: str) -> list[str]:
    """Backends that can run on ``device``; cupy only where it is installed with a device."""
    if device == "cpu":
        return ["torch", "warp"]
    out = ["torch"] + (["warp"] if _backend.has_warp() else [])
    if _backend.has_cupy():
        out.append("cupy")
    return out
