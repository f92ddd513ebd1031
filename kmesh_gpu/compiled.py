"""Building blocks for compiled (Numba, GIL-free) host code that drives the placement itself.

Imported on demand (``import kmesh_gpu.compiled``): it imports Numba at its top. Used by
``kmesh_gpu``'s own compiled driver sequences and by callers that serve restores from a compiled
loop of their own (the cache service's shared-memory channel):

* :func:`ccall` — call a C function by address from compiled code (the CUDA driver's functions,
  libc's), each integer argument with its own width;
* :func:`int64_ptr` — an integer address as an ``int64*`` (for ``numba.carray``);
* :func:`build_runs` — the run kernel's table builder (:func:`kmesh_gpu._host_tables.build_runs`)
  compiled, with its return codes and column constants beside it.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ._host_tables import (DUPLICATE_SLOT, PARAMS, POSITION_RANGE, RUN_COLS, RUN_LEN_COL, RUNS_DO_NOT_PAY,
                           SLOT_RANGE)
from ._host_tables import build_runs as _build_runs

#: options of every compiled function here: no GIL, cached on disk
JIT_OPTIONS = dict(nogil=True, cache=True)

__all__ = ["JIT_OPTIONS", "ccall", "int64_ptr", "build_runs", "PARAMS", "RUN_COLS", "RUN_LEN_COL", "SLOT_RANGE",
           "DUPLICATE_SLOT", "POSITION_RANGE", "RUNS_DO_NOT_PAY"]


@intrinsic
def ccall(typingctx, address, args):
    """``int32 f(args...)`` for the C function at ``address``, each argument passed with its own
    integer width (int64/uint64 as 64-bit, int32/uint32 as 32-bit): the driver's prototypes."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    if not all(isinstance(t, types.Integer) for t in args):
        return None

    def codegen(context, builder, signature, llargs):
        fn_address, packed = llargs
        values = [builder.extract_value(packed, i) for i in range(len(args))]
        fnty = ir.FunctionType(ir.IntType(32), [v.type for v in values])
        return builder.call(builder.inttoptr(fn_address, fnty.as_pointer()), values)

    return types.int32(address, args), codegen


@intrinsic
def int64_ptr(typingctx, address):
    """The integer ``address`` as an ``int64*`` (for ``numba.carray``)."""
    if not isinstance(address, types.Integer):
        return None
    ptr = types.CPointer(types.int64)

    def codegen(context, builder, signature, llargs):
        return builder.inttoptr(llargs[0], context.get_value_type(ptr))

    return ptr(address), codegen


#: :func:`kmesh_gpu._host_tables.build_runs`, compiled
build_runs = numba.njit(**JIT_OPTIONS)(_build_runs)
