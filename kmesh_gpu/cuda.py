"""CUDA driver calls for host code on the restore path: kernel launches, async copies, events, streams.

Public, for ``kmesh_host`` (the routes, the cache service) as for ``kmesh_gpu`` itself. Every call
takes raw handles (``cudaStream_t``, ``cudaEvent_t``, device addresses) and returns ``False`` (or
``None``) instead of raising where the driver is not loadable or refuses: the caller then takes its
torch or CuPy path, which sets up what is missing and raises the proper error.

A CuPy ``Function`` call converts every argument to a C value on each launch; with twenty
arguments that is tens of microseconds of host time on the GPU machine, more than the placement
kernel of a restore runs. Here each thread keeps, per argument count, one int64 slot per argument
and the array of pointers to those slots (``kernelParams``), built once; a launch writes the values
into the slots and makes one ctypes call. The driver reads each parameter's size from the kernel
image, so a 32-bit parameter takes the low half of its little-endian slot.

Arguments must be integers (addresses, sizes, flags): the kernels launched this way take no
floating-point parameters. :func:`launch` returns ``False`` without launching where the driver is
not loadable or refuses the call (no context current on this thread, for one); callers then launch
through CuPy, which sets up what is missing and raises the proper error.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

#: Driver calls that return at once (launch, asynchronous copy, record, query, stream wait, event
#: create/destroy) keep the GIL (``ctypes.PyDLL``); the waits (event and stream synchronisation)
#: release it (``ctypes.CDLL``). Releasing the GIL around a call of a few microseconds lets
#: another thread take it, and the caller then waits for that thread to give it back: in a
#: process whose threads all run Python (the cache service serving many clients) every such call
#: became a hand-over (docs/perf-history.md).
_QUICK_LIB = ctypes.PyDLL

# [(cuLaunchKernel, cuMemcpyHtoDAsync_v2, cuEventRecord, cuStreamWaitEvent) or Nones], resolved once
_DRIVER: list = []


def _functions() -> tuple:
    if not _DRIVER:
        fns = (None, None, None, None)
        try:
            lib = _QUICK_LIB("libcuda.so.1")
            launch_fn, copy_fn = lib.cuLaunchKernel, lib.cuMemcpyHtoDAsync_v2
            record_fn, wait_fn = lib.cuEventRecord, lib.cuStreamWaitEvent
            launch_fn.restype = copy_fn.restype = record_fn.restype = wait_fn.restype = ctypes.c_int
            launch_fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            copy_fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            record_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            wait_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            fns = (launch_fn, copy_fn, record_fn, wait_fn)
        except (OSError, AttributeError):
            pass
        _DRIVER.append(fns)
    return _DRIVER[0]


def _driver():
    return _functions()[0]


def copy_htod(dst: int, src: int, nbytes: int, stream: int) -> bool:
    """``cuMemcpyHtoDAsync``: ``nbytes`` from host address ``src`` (page-locked, or the copy is not
    asynchronous) to device address ``dst`` on the raw stream ``stream``; ``True`` once the driver
    accepted it (``False``: nothing was queued, and the caller copies another way)."""
    fn = _functions()[1]
    if fn is None:
        return False
    return fn(dst, src, nbytes, stream) == 0


_DTOH: list = []  # [cuMemcpyDtoHAsync_v2 or None], resolved once


def copy_dtoh(dst: int, src: int, nbytes: int, stream: int) -> bool:
    """``cuMemcpyDtoHAsync``: ``nbytes`` from device address ``src`` to host address ``dst``
    (page-locked, or the copy is not asynchronous) on the raw stream ``stream``; ``True`` once the
    driver accepted it (``False``: nothing was queued, and the caller copies another way)."""
    if not _DTOH:
        fn = None
        try:
            fn = _QUICK_LIB("libcuda.so.1").cuMemcpyDtoHAsync_v2
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        except (OSError, AttributeError):
            fn = None
        _DTOH.append(fn)
    fn = _DTOH[0]
    if fn is None:
        return False
    return fn(dst, src, nbytes, stream) == 0


def copies_htod(desc: np.ndarray, count: int, stream: int) -> int:
    """``count`` host-to-device copies queued on the raw stream ``stream`` (``desc``: int64 rows of
    device address, host address, bytes; the host memory page-locked, or a copy is not
    asynchronous): one compiled call for all where Numba serves (:mod:`._driver_jit`), else one
    ctypes call each. Returns how many the driver accepted: those are queued, in order; the rest
    (from the first refused) are not, and the caller copies them another way."""
    jit = compiled_driver()
    if jit is not None:
        return jit[0].copies(jit[1], desc, count, stream, 0)
    fn = _functions()[1]
    if fn is None:
        return 0
    for i in range(count):
        if fn(int(desc[i, 0]), int(desc[i, 1]), int(desc[i, 2]), stream) != 0:
            return i
    return count


_JIT: list = []  # [(the _driver_jit module, its driver table) or None], resolved once


def compiled_driver():
    """``(kmesh_gpu._driver_jit, its driver table)``, or ``None`` where the driver is not loadable or
    Numba cannot compile the driver-call sequences here (callers keep their ctypes path). For
    ``kmesh_gpu``'s own modules; others call :func:`warm_up`."""
    if not _JIT:
        found = None
        try:
            from . import _driver_jit

            fns = _driver_jit.driver_table()
            if fns is not None:
                found = (_driver_jit, fns)
        except Exception:  # no Numba here, or it cannot compile: the ctypes path serves
            found = None
        _JIT.append(found)
    return _JIT[0]


def warm_up() -> bool:
    """Compile (or load from Numba's disk cache) the compiled driver sequences now, not inside a
    first restore (seconds when cold, with the GIL held); ``True`` where they are usable here."""
    return compiled_driver() is not None


def _current_stream_slow(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


#: torch's current stream on device ``index`` as a raw ``cudaStream_t``, without building a torch
#: Stream object (torch's private accessor where it has one)
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _current_stream_slow


def record_event(event: int, stream: int) -> bool:
    """``cuEventRecord``: record the CUDA event ``event`` (a ``cudaEvent_t``, e.g. a torch event's
    ``cuda_event``; 0 is refused) on the raw stream ``stream``; ``True`` once the driver accepted it
    (``False``: nothing was recorded, and the caller records another way)."""
    fn = _functions()[2] if event else None
    if fn is None:
        return False
    return fn(event, stream) == 0


def wait_event(stream: int, event: int) -> bool:
    """``cuStreamWaitEvent``: work queued on the raw stream ``stream`` from now on waits for the
    event's last record; ``True`` once the driver accepted it (``False``: nothing was queued)."""
    fn = _functions()[3] if event else None
    if fn is None:
        return False
    return fn(stream, event, 0) == 0


def stream_synchronize(stream: int) -> bool:
    """``cuStreamSynchronize`` of the raw stream ``stream`` (the GIL is released while it waits);
    ``True`` once every piece of work queued there has completed without error (``False``: the
    driver is not loadable or reported an error, and the caller waits another way, which raises
    the error properly)."""
    fns = _event_functions()
    if fns is None:
        return False
    return fns[4](stream) == 0


def stream_query(stream: int) -> bool | None:
    """``cuStreamQuery`` of the raw stream ``stream``: ``True`` (everything queued there has
    completed), ``False`` (work pending), ``None`` (no driver, or an error)."""
    fns = _event_functions()
    if fns is None:
        return None
    rc = fns[5](stream)
    return True if rc == 0 else False if rc == _NOT_READY else None


def event_query(event: int) -> bool | None:
    """``cuEventQuery`` of the raw event ``event``: ``True`` (its last record has completed),
    ``False`` (not yet), ``None`` (no driver, or an error: the caller asks torch, which raises it)."""
    fns = _event_functions() if event else None
    if fns is None:
        return None
    rc = fns[1](event)
    return True if rc == 0 else False if rc == _NOT_READY else None


_EVENT_FNS: list = []  # [(cuEventCreate, cuEventQuery, cuEventSynchronize, cuEventDestroy_v2,
#                          cuStreamSynchronize, cuStreamQuery, cuCtxGetCurrent) or None]
_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING


def _event_functions():
    if not _EVENT_FNS:
        fns = None
        try:
            quick, waits = _QUICK_LIB("libcuda.so.1"), ctypes.CDLL("libcuda.so.1")
            create, query = quick.cuEventCreate, quick.cuEventQuery
            sync, destroy = waits.cuEventSynchronize, quick.cuEventDestroy_v2
            stream_sync, stream_query = waits.cuStreamSynchronize, quick.cuStreamQuery
            current = quick.cuCtxGetCurrent
            for f in (create, query, sync, destroy, stream_sync, stream_query, current):
                f.restype = ctypes.c_int
            create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            for f in (query, sync, destroy, stream_sync, stream_query):
                f.argtypes = [ctypes.c_void_p]
            fns = (create, query, sync, destroy, stream_sync, stream_query, current)
        except (OSError, AttributeError):
            pass
        _EVENT_FNS.append(fns)
    return _EVENT_FNS[0]


#: events no DriverEvent holds any more, per CUDA context, for create() to hand out again
#: (creating one costs the driver more than recording it; a pool's handle has no other user)
_SPARE_EVENTS: dict = {}
_SPARE_MAX = 64  # per context; beyond it dropped events are destroyed


class DriverEvent:
    """A CUDA event (timing disabled) created, recorded, queried and waited for through the driver:
    a record costs one ctypes call (~2 µs) where torch's ``Event()`` + ``record()`` cost ~8.

    Quacks like the parts of ``torch.cuda.Event`` that fences use: ``query()``, ``synchronize()``
    and ``cuda_event`` (the raw handle). :meth:`create` returns ``None`` where the driver is not
    loadable or refuses (no context current on this thread, for one); callers then use torch's
    event. When the object is dropped its event goes back to a pool of its context for the next
    :meth:`create` (or, the pool full, is destroyed: the driver defers that until a pending record
    has completed); an event from the pool is recorded afresh before anyone waits on it.
    """

    __slots__ = ("cuda_event", "_fns", "_ctx")

    def __init__(self, handle: int, fns, ctx: int = 0):
        self.cuda_event, self._fns, self._ctx = handle, fns, ctx

    @classmethod
    def create(cls) -> "DriverEvent | None":
        fns = _event_functions()
        if fns is None:
            return None
        ctx = ctypes.c_void_p()
        if fns[6](ctypes.byref(ctx)) != 0 or not ctx.value:
            return None
        spare = _SPARE_EVENTS.get(ctx.value)
        if spare:
            try:
                return cls(spare.pop(), fns, ctx.value)
            except IndexError:  # another thread took the last one
                pass
        handle = ctypes.c_void_p()
        if fns[0](ctypes.byref(handle), _DISABLE_TIMING) != 0 or not handle.value:
            return None
        return cls(handle.value, fns, ctx.value)

    @classmethod
    def recorded(cls, stream: int) -> "DriverEvent | None":
        """A new event recorded on the raw stream ``stream``; ``None`` where the driver declines."""
        event = cls.create()
        if event is None or not event.record(stream):
            return None
        return event

    def record(self, stream: int) -> bool:
        """Record on the raw stream ``stream``; ``True`` once the driver accepted it."""
        return record_event(self.cuda_event, stream)

    def query(self) -> bool:
        """``True`` when the work before the last record has completed (or it was never recorded)."""
        rc = self._fns[1](self.cuda_event)
        if rc == 0:
            return True
        if rc == _NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery failed: CUDA driver error {rc}")

    def synchronize(self) -> None:
        """Block until the work before the last record has completed."""
        rc = self._fns[2](self.cuda_event)
        if rc != 0:
            raise RuntimeError(f"cuEventSynchronize failed: CUDA driver error {rc}")

    def __del__(self):
        try:
            spare = _SPARE_EVENTS.get(self._ctx)
            if spare is None:
                spare = _SPARE_EVENTS.setdefault(self._ctx, [])
            if len(spare) < _SPARE_MAX:
                spare.append(self.cuda_event)
            else:
                self._fns[3](self.cuda_event)
        except Exception:  # interpreter shutdown: the driver cleans up with the context
            pass


class _Slots(threading.local):
    """Per thread: argument count -> (int64 value slots, kernelParams pointer array)."""

    def __init__(self):
        self.by_count: dict = {}


_SLOTS = _Slots()


def launch(function, grid: tuple, block: tuple, stream: int, args: tuple) -> bool:
    """Launch ``function`` (a CuPy ``Function``: its ``ptr`` is the ``CUfunction``) on the raw stream
    ``stream`` (0: the legacy default stream) with integer ``args``; ``True`` once the driver
    accepted the launch."""
    fn = _driver()
    function_ptr = getattr(function, "ptr", None)
    if fn is None or not function_ptr:
        return False
    n = len(args)
    found = _SLOTS.by_count.get(n)
    if found is None:
        vals = np.zeros(max(n, 1), dtype=np.int64)
        base = vals.ctypes.data
        params = (ctypes.c_void_p * max(n, 1))(*[base + 8 * i for i in range(n)])
        found = _SLOTS.by_count[n] = (vals, params)
    vals, params = found
    try:  # each as a Python int: a NumPy mix of uint64 and int64 would round through float64
        vals[:n] = [int(a) for a in args]
    except OverflowError:  # a value over 63 bits (no address is): CuPy converts it
        return False
    g = tuple(grid) + (1, 1)
    b = tuple(block) + (1, 1)
    return fn(function_ptr, g[0], g[1], g[2], b[0], b[1], b[2], 0, stream, params, None) == 0
