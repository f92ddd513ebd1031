"""Compiled sequences of CUDA driver calls (Numba), for the few host steps of a restore that run on
every request: the copies out of the host tier, the placement's run table built and uploaded, and
its launch.

Each of those is a handful of driver calls, but made one by one from Python every call costs its
ctypes conversion plus the Python around it: tens of microseconds per restore on the GPU machine,
doubled whenever its virtual CPU runs at half speed, and that is what kept the host-tier route
from being bound by the DMA. Here one compiled call makes the whole sequence, calling the driver's
functions by address (:func:`_ccall`, an LLVM indirect call with the exact C argument widths), so
the only Python left is the call itself.

This module imports Numba at its top and is itself imported only on first use (through
:func:`compiled`), like the other optional backends; :func:`compiled` returns ``None`` where Numba
cannot compile here and callers keep their Python path. Driver function addresses are passed in as
data (an int64 array, :func:`driver_table`), so the compiled code is cached on disk like the rest
and tests can pass addresses of stand-in C callbacks instead of the driver's.
"""

from __future__ import annotations

import ctypes
import functools

import numba
import numpy as np

from .compiled import JIT_OPTIONS as _JIT
from .compiled import build_runs, ccall, int64_ptr

#: positions in :func:`driver_table`'s array
COPY_HTOD, EVENT_RECORD, LAUNCH = 0, 1, 2
_NAMES = ("cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuLaunchKernel")

# codes below zero from build_upload and place_now, beside build_runs' (-1..-4)
COPY_REFUSED = -11  # the driver refused the table's upload: nothing was queued
RECORD_REFUSED = -12  # the upload is queued but its fence was not recorded (wait for the stream)
LAUNCH_REFUSED = -13  # place_now: the table's upload is queued, unfenced; the launch was refused
UNFENCED = -14  # place_now: launched, but the fence after it was not recorded


@numba.njit(**_JIT)
def copies(fns, desc, count, stream, event):
    """Queue ``count`` host-to-device copies on ``stream`` (``desc[i]``: device address, host
    address, bytes), then record ``event`` there (0: none). Returns how many copies the driver
    accepted (``count``, or the index of the first it refused: the rest are not queued and the
    event is not recorded), or ``-1`` when every copy was queued but the record was refused."""
    for i in range(count):
        if ccall(fns[COPY_HTOD], (desc[i, 0], desc[i, 1], desc[i, 2], stream)) != 0:
            return i
    if event != 0 and ccall(fns[EVENT_RECORD], (event, stream)) != 0:
        return -1
    return count


@numba.njit(**_JIT)
def build_upload(fns, sl, starts, ptrs, params, pos, out, head, host, device, stream, event):
    """The run table of ``sl`` (:func:`kmesh_gpu.compiled.build_runs`, slots checked distinct) built
    into ``out`` (R x 7 rows that follow ``head`` int64 values in the host buffer at address
    ``host``), then the first ``head + 7 R`` values uploaded to ``device`` on ``stream`` and
    ``event`` recorded after the copy (it fences the host buffer). Returns R (0: every token
    skipped, nothing queued), a code of ``build_runs`` (nothing queued), :data:`COPY_REFUSED` or
    :data:`RECORD_REFUSED`."""
    R = build_runs(sl, starts, ptrs, params, True, pos, out)
    if R <= 0:
        return R
    nbytes = (head + 7 * R) * 8
    if ccall(fns[COPY_HTOD], (device, host, nbytes, stream)) != 0:
        return COPY_REFUSED
    if ccall(fns[EVENT_RECORD], (event, stream)) != 0:
        return RECORD_REFUSED
    return R


@numba.njit(**_JIT)
def launch(fns, function, grid, block, stream, args, count):
    """``cuLaunchKernel(function, grid, block, 0 bytes shared, stream)`` with the ``count`` integer
    arguments ``args[:count]``; ``args[count:2 count]`` is scratch for their addresses (the
    driver reads each parameter's size from the kernel: a 32-bit one takes the low half of its
    little-endian slot). Returns the driver's code (0: launched)."""
    base = args.ctypes.data
    for i in range(count):
        args[count + i] = base + 8 * i
    u32 = np.uint32
    return ccall(fns[LAUNCH], (function, u32(grid[0]), u32(grid[1]), u32(grid[2]), u32(block[0]), u32(block[1]),
                                u32(block[2]), u32(0), stream, base + 8 * count, np.int64(0)))


@numba.njit(**_JIT)
def place_now(fns, srcs, layer_base, starts, ptrs, params, ring, o, host, device, stream, event, kernel, template):
    """Gather, build, upload and launch the run kernel's placement in one call.

    ``srcs``: addresses of each item's host int64 indices, ``n`` (slots) or ``3 n`` (old positions,
    new positions, slots: with RoPE) of them, item ``i`` holding ``starts[i + 1] - starts[i]``
    values. They are gathered into ``ring[o:]`` (the table ring's int64 view; the region's address
    is ``host``) after ``layer_base`` as ``[layer bases L | old, new positions 2T | slots T | runs
    7T]``, the run table is built there (:func:`build_upload`) and uploaded to ``device``, the
    kernel ``kernel = (function, warps per run, warps to fill the GPU, argument count)`` is launched
    with ``template``'s packed arguments (``_place_cupy.driver_template``) and this table's
    addresses, and ``event`` is recorded after it: it fences both the host region and the device
    table, which the kernel reads.

    Returns R (launched and fenced; 0: every token skipped, nothing queued), a code of
    :func:`kmesh_gpu.compiled.build_runs` (nothing queued), :data:`COPY_REFUSED` (nothing queued), :data:`LAUNCH_REFUSED` (the upload is queued,
    unfenced, nothing launched) or :data:`UNFENCED` (launched, not fenced). After the last two the
    caller waits for the stream before the region is used again."""
    L = layer_base.shape[0]
    n = starts.shape[0] - 1
    T = starts[n]
    h = ring[o:o + L + 10 * T]
    h[:L] = layer_base
    rope = srcs.shape[0] == 3 * n
    for k in range(srcs.shape[0]):
        i = k % n
        c = starts[i + 1] - starts[i]
        at = L + (k // n if rope else 2) * T + starts[i]
        h[at:at + c] = numba.carray(int64_ptr(srcs[k]), (c,))
    if rope:
        pos = h[L:L + 2 * T]
    else:
        h[L:L + 2 * T] = 0  # never read without RoPE
        pos = h[:0]
    runs_at = L + 3 * T
    R = build_runs(h[L + 2 * T:runs_at], starts, ptrs, params, True, pos, h[runs_at:].reshape((T, 7)))
    if R <= 0:
        return R
    if ccall(fns[COPY_HTOD], (device, host, (runs_at + 7 * R) * 8, stream)) != 0:
        return COPY_REFUSED
    # as kmesh_gpu.plan: enough warps to fill the GPU before a warp takes several layers
    function, per_run, units, count = kernel[0], kernel[1], kernel[2], kernel[3]
    groups = min(L, max(1, -(-units // (per_run * R))))
    lg = -(-L // groups)
    warps = per_run * R * (-(-L // lg))
    args = template.copy()
    args[0], args[1], args[2], args[3], args[4], args[6] = device + 8 * runs_at, device + 8 * L, device, R, T, lg
    base = args.ctypes.data
    for i in range(count):
        args[count + i] = base + 8 * i
    u32 = np.uint32
    rc = ccall(fns[LAUNCH], (function, u32(-(-warps // 8)), u32(1), u32(1), u32(256), u32(1), u32(1), u32(0),
                              stream, base + 8 * count, np.int64(0)))
    args[0] = 0  # args (the parameters the driver reads during the call) stays alive until here
    if rc != 0:
        return LAUNCH_REFUSED
    if ccall(fns[EVENT_RECORD], (event, stream)) != 0:
        return UNFENCED
    return R


def _compile_used_signatures() -> None:
    """Compile (or load from Numba's cache) each function for the argument types its callers pass,
    now rather than inside a caller's first restore; nothing is called."""
    i64 = np.int64
    fns = np.zeros(3, dtype=i64)
    fns.setflags(write=False)  # driver_table()'s array is read-only
    vec, mat, n = np.zeros(4, dtype=i64), np.zeros((4, 7), dtype=i64), 0
    ro = np.zeros(4, dtype=i64)  # read-only inputs (layer bases, item starts, the launch's constants)
    ro.setflags(write=False)
    # as kmesh_gpu.plan passes them: item starts (_tables._token_index) and the cache's run
    # parameters (_Facts.run_params) are read-only; a writable example would compile another
    # signature and leave the one in use to the first restore
    examples = ((copies, (fns, np.zeros((1, 3), dtype=i64), n, n, n)),
                (build_upload, (fns, vec, ro, vec, ro, vec, mat, n, n, n, n, n)),
                (launch, (fns, n, vec, vec, n, vec, n)),
                (place_now, (fns, vec, ro, ro, vec, ro, vec, n, n, n, n, n, ro, ro)))
    for fn, args in examples:
        fn.compile(tuple(numba.typeof(a) for a in args))


_compile_used_signatures()


@functools.lru_cache(maxsize=1)
def driver_table() -> np.ndarray | None:
    """The driver functions' addresses (``COPY_HTOD``, ``EVENT_RECORD``, ``LAUNCH``) as int64, or
    ``None`` where ``libcuda`` is not loadable."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        table = np.array([ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _NAMES],
                         dtype=np.int64)
    except (OSError, AttributeError):
        return None
    table.setflags(write=False)
    return table
