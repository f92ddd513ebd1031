"""Backend availability and choice. Heavy packages are imported here lazily, never at import time."""

from __future__ import annotations

import functools
import importlib.util
import os

from .errors import BackendError

BACKENDS = ("torch", "warp", "cupy")


@functools.cache
def has_cupy() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver / no device: cupy imports but cannot run
        return False


@functools.cache
def has_warp() -> bool:
    return importlib.util.find_spec("warp") is not None


@functools.cache
def warp():
    """Import and initialise Warp once per process (quietly unless KMESH_WARP_VERBOSE is set)."""
    if not has_warp():
        raise BackendError("backend 'warp' requested but the warp-lang package is not installed")
    import warp as wp

    if os.environ.get("KMESH_WARP_VERBOSE", "") == "":
        wp.config.log_level = wp.LOG_WARNING  # keep start-up and per-module compile lines out of logs
    wp.init()
    return wp


def warp_device(device) -> str:
    """Warp device string for a torch device."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    raise BackendError(f"warp backend: unsupported device {device}")


def choose(backend: str, device) -> str:
    """Resolve ``backend`` ("auto" or a name) for tensors living on ``device`` (a torch.device)."""
    if backend not in BACKENDS + ("auto",):
        raise BackendError(f"backend: expected one of {BACKENDS + ('auto',)}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            if has_cupy():
                return "cupy"
            return "warp" if has_warp() else "torch"
        return "warp" if has_warp() else "torch"
    if backend == "cupy":
        if device.type != "cuda":
            raise BackendError(f"backend 'cupy' needs CUDA tensors, got device {device}")
        if not has_cupy():
            raise BackendError("backend 'cupy' requested but cupy (with a CUDA device) is unavailable")
    if backend == "warp" and not has_warp():
        raise BackendError("backend 'warp' requested but the warp-lang package is not installed")
    return backend
