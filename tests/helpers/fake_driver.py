"""Stand-in CUDA driver functions (C callbacks through ctypes) for the compiled driver-call
sequences of ``kmesh_gpu._driver_jit``: on CPU they log every call and can refuse one."""

from __future__ import annotations

import ctypes as C

import numpy as np

_COPY = C.CFUNCTYPE(C.c_int, C.c_uint64, C.c_uint64, C.c_uint64, C.c_uint64)
_RECORD = C.CFUNCTYPE(C.c_int, C.c_uint64, C.c_uint64)
_LAUNCH = C.CFUNCTYPE(C.c_int, C.c_uint64, *([C.c_uint32] * 7), C.c_uint64, C.c_uint64, C.c_uint64)


class FakeDriver:
    """Stand-in driver functions: copies are memmoves (host to host), every call is logged, and
    the n-th call of a kind can be refused. ``arg_count``: a launch also logs the values of its
    first ``arg_count`` parameters, read during the call (the caller may free them afterwards)."""

    def __init__(self, refuse=None, *, arg_count: int = 0):
        self.calls: list = []
        self.refuse = refuse or {}  # kind -> the call number (0-based) that returns an error
        self.arg_count = arg_count
        self.launch_args: list = []

    def _rc(self, kind: str) -> int:
        n = sum(1 for c in self.calls if c[0] == kind) - 1
        return 1 if self.refuse.get(kind) == n else 0

    def copy(self, dst, src, nbytes, stream):
        self.calls.append(("copy", dst, src, nbytes, stream))
        rc = self._rc("copy")
        if rc == 0:
            C.memmove(dst, src, nbytes)
        return rc

    def record(self, event, stream):
        self.calls.append(("record", event, stream))
        return self._rc("record")

    def launch(self, fn, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        p = C.cast(params, C.POINTER(C.c_uint64))
        self.calls.append(("launch", fn, (gx, gy, gz), (bx, by, bz), shmem, stream, p, extra))
        self.launch_args.append([C.cast(p[i], C.POINTER(C.c_int64))[0] for i in range(self.arg_count)])
        return self._rc("launch")

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    def table(self) -> np.ndarray:
        self._keep = (_COPY(self.copy), _RECORD(self.record), _LAUNCH(self.launch))
        return np.array([C.cast(f, C.c_void_p).value for f in self._keep], dtype=np.int64)
