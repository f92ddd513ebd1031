"""Compiling and caching the CUDA sources in ``kmesh_gpu/csrc`` (CuPy NVRTC), lazily, per device.

One helper owns compilation: kernels are built on first use (never at import), memoised per
(device, source, options, name expressions). Compile errors raise :class:`BackendError` carrying the
compiler log. ``-fmad=false`` is always passed: KMesh fixes the order of fp32 operations so that the
CUDA, Warp and torch backends agree bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ._once import once_per_key
from .errors import BackendError

CSRC = Path(__file__).with_name("csrc")
BASE_OPTIONS = ("--std=c++17", "-fmad=false", "-I" + str(CSRC))


@functools.cache
def _source(name: str) -> str:
    return (CSRC / name).read_text()


@once_per_key(maxsize=None)
def _module(device_id: int, source_name: str, name_expressions: tuple[str, ...], options: tuple[str, ...]):
    """Compiled once per key, also when threads ask at the same time (the cache service's request
    threads setting up new clients' first restores together each compiled the whole source with
    NVRTC, seconds of CPU each, with ``functools.cache``)."""
    import cupy

    with cupy.cuda.Device(device_id):
        mod = cupy.RawModule(
            code=_source(source_name),
            options=BASE_OPTIONS + options,
            name_expressions=name_expressions or None,
        )
        try:
            mod.compile()
        except cupy.cuda.compiler.CompileException as exc:  # carries the NVRTC log
            raise BackendError(f"compiling kmesh_gpu/csrc/{source_name} failed:\n{exc}") from exc
    return mod


@once_per_key(maxsize=None)
def get_kernel(source_name: str, kernel_name: str, *, device_id: int,
               name_expressions: tuple[str, ...] = (), options: tuple[str, ...] = ()):
    """Return the compiled ``kernel_name`` from ``csrc/source_name`` for CUDA device ``device_id``.

    ``kernel_name`` must be one of ``name_expressions`` for templated kernels. Function objects are
    memoised too: looking one up costs microseconds, and launches are on latency-critical paths.
    """
    mod = _module(device_id, source_name, tuple(name_expressions), tuple(options))
    import cupy

    with cupy.cuda.Device(device_id):
        return mod.get_function(kernel_name)


@functools.lru_cache(maxsize=64)
def cupy_stream(handle: int, device_id: int):
    """CuPy's view of a CUDA stream handle (torch's current stream), cached per handle and device."""
    import warnings

    import cupy

    with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14 but is the raw-handle form
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device_id)
