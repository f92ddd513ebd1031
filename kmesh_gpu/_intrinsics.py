"""Numba intrinsics shared by the compiled host paths: C calls by address, raw int64 pointers, and
the atomic loads, stores and fences that two processes polling one shared page need.

Imports Numba at its top; imported only by modules that are themselves loaded on first use.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


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


def _word(builder, address):
    return builder.inttoptr(address, ir.IntType(64).as_pointer())


@intrinsic
def load_acquire(typingctx, address):
    """The int64 at ``address`` (8-byte aligned), read with acquire ordering: what was written
    before the matching :func:`store_release` is visible after it. Never hoisted out of a loop."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, llargs):
        return builder.load_atomic(_word(builder, llargs[0]), "acquire", 8)

    return types.int64(address), codegen


@intrinsic
def store_release(typingctx, address, value):
    """Write the int64 ``value`` at ``address`` with release ordering (every earlier write is
    visible to a reader that sees this one)."""
    if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, llargs):
        v = context.cast(builder, llargs[1], signature.args[1], types.int64)
        builder.store_atomic(v, _word(builder, llargs[0]), "release", 8)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic
def fence(typingctx):
    """A sequentially consistent fence: a store before it and a load after it are not reordered
    (the half of a sleep/wake handshake each side does, so that one of them sees the other)."""

    def codegen(context, builder, signature, llargs):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def cpu_relax(typingctx):
    """``pause`` on x86 (a polling loop yields the core's shared resources); nothing elsewhere."""

    def codegen(context, builder, signature, llargs):
        if _X86:  # the SSE2 intrinsic (Numba's JIT does not assemble inline asm)
            module = builder.module
            name = "llvm.x86.sse2.pause"
            fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.VoidType(), []), name)
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen
