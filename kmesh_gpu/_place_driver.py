"""The run kernel's placement prepared and launched through compiled driver calls (the usual CUDA
restore's path; ``place._compiled_runs`` tries it first).

Preparation gathers the indices into a region of a page-locked :class:`~._table_ring.TableRing`
with one concatenation, then one compiled call (:func:`._driver_jit.build_upload`) checks the slots,
writes the run table, queues its upload and fences the region; the launch's arguments are packed
from a per-layout template (``_place_cupy.driver_template``), so ``_Launch.run`` is one compiled
``cuLaunchKernel``. The table on the device is a torch allocation on the current stream, as on the
other paths (torch's allocator orders its reuse after the launch on that stream). Anything this
path does not cover, or a driver refusal, returns ``None``: the caller takes the path through torch
and CuPy, which also reports any error properly.
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

from . import _launch
from ._place_tables import _RUN_COLS, _i64
from ._table_ring import ring_for

ENABLED = True  # tests and benchmarks switch it off to compare with the torch/CuPy path

_STATE: list = []  # [(the _driver_jit module, driver table, cupy's getDevice, _place_cupy) or None], once


def _state():
    if not _STATE:
        found = None
        jit = _launch.driver_jit()
        if jit is not None:
            try:
                import cupy

                from . import _place_cupy

                found = jit + (cupy.cuda.runtime.getDevice, _place_cupy)
            except ImportError:
                found = None
        _STATE.append(found)
    return _STATE[0]


def prepare_runs(f, layout, rope, slots, olds, news, counts: tuple, ptrs: list, starts, params, cap: int,
                 slots_checked: bool, consts, *, flat: bool = False) -> dict | None:
    """The run kernel's tables (as ``place._compiled_runs`` returns them, plus ``driver_launch``),
    built and uploaded on the current stream of the cache's device; ``None`` where this path does
    not apply (the caller's own compiled path may), ``False`` where the run builder declined these
    indices (a skipped token, slots not increasing, a position out of range, runs too short: the
    NumPy path decides). ``f``: the cache's ``place._Facts``. ``flat``: ``slots``, ``olds`` and
    ``news`` are each one int64 array of all items' values (NumPy, checked by the caller)."""
    state = _state() if ENABLED and _launch.ENABLED else None
    if state is None:
        return None
    jit, fns, getdev, cupy_launcher = state
    dev_id = f.device.index
    if dev_id is None or getdev() != dev_id:  # events and copies belong to the current device's context
        return None
    ring = f.ring if f.ring is not None else _ring(f, dev_id)
    if ring is False:
        return None
    L, T = f.kv_shape[0], sum(counts)
    runs_at = L + 3 * T
    n64 = runs_at + T * _RUN_COLS
    got = ring.reserve(8 * n64)
    if got is None:
        return None
    offset, event = got
    o = offset // 8
    h = ring.a64[o:o + n64]
    h[:L] = f.layer_base
    if flat:
        if rope is not None:
            h[L:L + T] = olds
            h[L + T:L + 2 * T] = news
        h[L + 2 * T:runs_at] = slots
    elif rope is not None:
        torch.cat((*olds, *news, *slots), out=ring.t64[o + L:o + runs_at])
    else:
        torch.cat(slots, out=ring.t64[o + L + 2 * T:o + runs_at])
    if rope is not None:
        pos = h[L:L + 2 * T]
    else:
        h[L:L + 2 * T] = 0  # never read without RoPE
        pos = h[:0]
    dev = torch.empty(n64, dtype=torch.int64, device=f.device)
    p = dev.data_ptr()
    stream = _launch.current_stream(dev_id)
    R = jit.build_upload(fns, h[L + 2 * T:runs_at], starts, _i64(ptrs), params, not slots_checked, pos,
                         h[runs_at:].reshape(T, _RUN_COLS), runs_at, ring.base + offset, p, stream, event.cuda_event)
    if R == jit.RECORD_REFUSED:  # the upload is queued but unfenced: wait for it, the region is then free
        if not _launch.stream_synchronize(stream):
            torch.cuda.current_stream(f.device).synchronize()
        return None
    if R <= 0:  # nothing was queued from the region
        ring.cancel(offset)
        return None if R == jit.COPY_REFUSED else False
    tables = {"total": T, "vec16": True, "runs": R, "run_args": (p + 8 * runs_at, p + 8 * L, p, R),
              "buffer": dev, "cos_sin": consts[0], "fp8_table": consts[1], "k_scale": consts[2]}
    tables["driver_launch"] = _launch_plan(cupy_launcher, f, layout, rope, consts, dev_id, getdev, p, runs_at, L, T,
                                           R)
    return tables


def _launch_plan(_place_cupy, f, layout, rope, consts, dev_id: int, getdev, p: int, runs_at: int, L: int, T: int,
                 R: int):
    """:func:`launch`'s plan: the layout's packed arguments (made once per cache, layout, RoPE spec
    and kernel shape) with this launch's table addresses, sizes and grid filled in; ``None``
    where CuPy must launch."""
    P = _place_cupy.P
    shape = (P._RUN_GROUPS, P._RUN_HEADS, P._RUN_VPL, P._RUN_KVF)
    # kept only for the cache's own constants (per-call ones, fp8 K scales with RoPE, come and go)
    keep = consts is f.consts
    found = f.launches.get(shape) if keep and f.launches is not None else None
    if found is None:
        found = _place_cupy.driver_template(layout, dev_id, rope, consts)
        if found is None:
            return None
        if keep:
            if f.launches is None or len(f.launches) >= 8:
                f.launches = {}
            f.launches[shape] = found
    fn, per_run, _, template, n = found
    # as _place_cupy._runs_call: enough warps to fill the GPU before a warp takes several layers
    groups = min(L, max(1, -(-P._RUN_UNITS // (per_run * R))))
    lg = -(-L // groups)
    units = per_run * R * (-(-L // lg))
    args = template.copy()
    args[0], args[1], args[2], args[3], args[4], args[6] = p + 8 * runs_at, p + 8 * L, p, R, T, lg
    return fn, np.array([-(-units // 8), 1, 1], dtype=np.int64), _BLOCK, args, n, dev_id, getdev


_BLOCK = np.array([256, 1, 1], dtype=np.int64)


def prepare_flat(kvs, cache, layout, counts: tuple, slots: np.ndarray, *, rope=None, old_positions=None,
                  new_positions=None):
    """``place.prepare_place_many`` with ``_slots_checked``, for a caller whose index inputs are already
    one int64 array each over all items (``slots``, ``old_positions``, ``new_positions``: NumPy,
    ``sum(counts)`` values; ``counts``: the items' token counts): the cache service, whose request
    body holds them so. Only the run kernel's compiled driver path; ``None`` whenever it does not
    apply (the caller then passes per-item tensors to ``place.prepare_place_many``, which decides and
    names any error). Positions are still checked; slots are the caller's promise (private)."""
    P = _place()
    if not P._FAST or not P._COMPILED or not P._RUNS:
        return None
    T = sum(counts)
    if T == 0 or len(counts) != len(kvs) or slots.shape != (T,) or slots.dtype != np.int64:
        return None
    if rope is not None and (old_positions is None or new_positions is None or old_positions.shape != (T,)
                             or new_positions.shape != (T,)):
        return None
    try:
        P._check_args(layout, rope, old_positions, new_positions)
    except P.LayoutError:
        return None
    f = P._facts(cache, layout, rope, "cache")  # (one tensor, or a list of per-layer tensors)
    if f is None or not f.ok or not f.cuda or layout.storage_dtype == torch.uint8:  # fp8: K scales are per call
        return None
    try:
        if P._backend.choose("auto", f.device) != "cupy":
            return None
    except P.BackendError:
        return None
    want, device = layout.storage_dtype, f.device
    L, H, D = f.kv_shape
    ptrs, bits = [], f.bits
    for kv, c in zip(kvs, counts):
        s = kv.shape
        if type(kv) is not torch.Tensor or len(s) != 5 or s[0] != 2 or s[1] != L or s[2] != c or s[3] != H \
                or s[4] != D or (kv.dtype is not want and P.storage_dtype(kv.dtype) != want) or kv.device != device \
                or not kv.is_contiguous():
            return None
        p = kv.data_ptr()
        ptrs.append(p)
        bits |= p
    if f.cap[0] != P._RUN_GROUPS:
        f.cap = (P._RUN_GROUPS, P._run_cap(f.layout, f.rope, False))
    cap = f.cap[1] if f.vec16 and bits % 16 == 0 else 0
    if not cap:
        return None
    tables = prepare_runs(f, layout, rope, slots, old_positions, new_positions, counts, ptrs,
                          P._token_index(counts, f.row)[0], P._run_params(f, layout, cap), cap, True, f.consts,
                          flat=True)
    if not tables:
        return None
    return P._Launch._built(layout, device, rope, None, "cupy", tables)


def place_now(addresses, shapes, dtype: torch.dtype, cache, layout, slots, *, rope=None, old_positions=None,
              new_positions=None, backend: str = "auto") -> bool:
    """``place._prepare_at(...).run()`` in one compiled call (:func:`._driver_jit.place_now`): the
    indices gathered, checked and tabulated in a region of the device's table ring, the table
    uploaded to the same region of the ring's device mirror and the run kernel launched on the
    current stream, with the region's fence recorded after the kernel (which reads the mirror).

    For a restore's staging buffer (items by address, as ``_prepare_at``; private: a wrong address
    or shape lets the launch read other memory). ``True`` once launched; ``False`` when this path
    does not apply or declines (nothing of the placement is queued): the caller takes
    ``_prepare_at`` / ``prepare_place_many``, which decide and name any error.
    """
    state = _STATE[0] if _STATE else _state()
    if state is None or not ENABLED or not _launch.ENABLED or backend not in ("auto", "cupy"):
        return False
    P = _PLACE[0] if _PLACE else _place()
    n = len(addresses)
    if not (P._FAST and P._COMPILED and P._RUNS) or not n or len(slots) != n or len(shapes) != n:
        return False
    if rope is None:
        seqs = slots
    elif old_positions is None or new_positions is None or len(old_positions) != n or len(new_positions) != n:
        return False
    else:
        seqs = (*old_positions, *new_positions, *slots)
    try:
        P._check_args(layout, rope, old_positions, new_positions)
        f = P._facts(cache, layout, rope, "cache")  # (one tensor, or a list of per-layer tensors)
    except P.LayoutError:
        return False
    if f is None:
        return False
    lane = f.lane
    if lane is None or (lane and lane[0] != (P._RUN_GROUPS, P._RUN_HEADS, P._RUN_VPL, P._RUN_KVF, P._RUN_UNITS)):
        lane = _lane(f, layout, rope, state)
    if not lane:
        return False
    _, dev_id, want, kernel, template, params, ring, mirror = lane
    jit = state[0]
    if state[2]() != dev_id or (dtype is not want and P.storage_dtype(dtype) != want):
        return False
    L, H, D = f.kv_shape
    bits, counts = f.bits, []
    for s, p in zip(shapes, addresses):
        if len(s) != 5 or s[0] != 2 or s[1] != L or s[3] != H or s[4] != D:
            return False
        counts.append(s[2])
        bits |= p
    if bits % 16:
        return False
    srcs = []
    for x, c in zip(seqs, counts * (len(seqs) // n)):
        if type(x) is not torch.Tensor or x.dtype is not torch.int64 or not x.is_cpu or x.dim() != 1 \
                or x.shape[0] != c or not x.is_contiguous():
            return False
        srcs.append(x.data_ptr())
    T = sum(counts)
    got = ring.reserve(8 * (L + 10 * T)) if T else None
    if got is None:
        return False
    offset, event = got
    stream = _launch.current_stream(dev_id)
    R = jit.place_now(state[1], _i64(srcs), f.layer_base, P._token_index(tuple(counts), f.row)[0], _i64(addresses),
                      params, True, ring.a64, offset // 8, ring.base + offset, mirror + offset, stream,
                      event.cuda_event, kernel, template)
    if R > 0:
        return True
    if R == jit.UNFENCED or R == jit.LAUNCH_REFUSED:  # queued work reads the region: wait, it is then free
        if not _launch.stream_synchronize(stream):
            torch.cuda.current_stream(f.device).synchronize()
    ring.cancel(offset)
    return R == jit.UNFENCED


def _lane(f, layout, rope, state):
    """:func:`place_now`'s constants for the cache of ``f``: ``(kernel shape, device index, storage
    dtype, (function, warps per run, warps to fill the GPU, argument count), packed arguments, run
    builder constants, table ring, its device mirror's address)``, or ``False`` (stored on ``f``)."""
    P = _place()
    f.lane = False
    dev_id = f.device.index
    if not f.ok or not f.cuda or dev_id is None or layout.storage_dtype == torch.uint8 or not f.vec16:
        return False  # (fp8: its K scales come with each call)
    try:
        if P._backend.choose("auto", f.device) != "cupy":
            return False
    except P.BackendError:
        return False
    if f.cap[0] != P._RUN_GROUPS:
        f.cap = (P._RUN_GROUPS, P._run_cap(f.layout, f.rope, False))
    cap = f.cap[1]
    ring = f.ring if f.ring is not None else _ring(f, dev_id)
    mirror = ring.device_mirror(f.device) if ring is not False else 0
    found = state[3].driver_template(layout, dev_id, rope, f.consts) if cap and mirror else None
    if found is None:
        return False
    fn, per_run, _, template, count = found
    kernel = np.array([fn, per_run, P._RUN_UNITS, count], dtype=np.int64)
    kernel.setflags(write=False)
    shape = (P._RUN_GROUPS, P._RUN_HEADS, P._RUN_VPL, P._RUN_KVF, P._RUN_UNITS)  # (tools sweep them)
    f.lane = (shape, dev_id, layout.storage_dtype, kernel, template, P._run_params(f, layout, cap), ring, mirror)
    return f.lane


_PLACE: list = []  # [the placement module], once


def _place():
    """The placement module (imported by name: it imports this one while it loads)."""
    if not _PLACE:
        _PLACE.append(importlib.import_module("kmesh_gpu.place"))
    return _PLACE[0]


def _ring(f, dev_id: int):
    ring = ring_for(dev_id, _launch.DriverEvent.create)
    f.ring = ring if ring is not None else False
    return f.ring


def launch(plan) -> bool:
    """Launch ``driver_launch``'s plan on the current stream of its device; ``False`` when it
    cannot be launched this way (another device current, or the driver refused: nothing queued)."""
    fn, grid, block, args, count, dev_id, getdev = plan
    state = _STATE[0]  # set: a plan exists
    if state is None or not _launch.ENABLED or getdev() != dev_id:
        return False
    return state[0].launch(state[1], fn, grid, block, _launch.current_stream(dev_id), args, count) == 0
