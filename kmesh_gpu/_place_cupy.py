"""CuPy launcher of the placement kernels in ``csrc/place.cu`` (the CUDA twin of ``_place_warp``).

:func:`run` launches the kernel that ``place._Launch`` chose on torch's current stream: the run
kernel ``kmesh_place_runs`` when its table was built, else a per-token kernel (``kmesh_place_vec``
for 4-element-aligned layouts, ``kmesh_place`` otherwise). Kernels are looked up once per device,
dtype and shape; launches go through the CUDA driver (:mod:`kmesh_gpu.cuda`), CuPy's call where it declines.
The kernels' compile-time shape comes with each call (:class:`kmesh_gpu.plan.KernelShape`).
"""

from __future__ import annotations

import numpy as np
import torch

from . import cuda
from .layout import KVLayout

_CUDA_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16",
               torch.uint8: "unsigned char"}


def run(tables, layout: KVLayout, device: torch.device, *, gather: bool, rope, shape) -> None:
    """Launch the placement (or gather) that ``tables`` describe on ``device``'s current stream."""
    dev_id = device.index if device.index is not None else torch.cuda.current_device()
    ctype = _CUDA_TYPES[layout.storage_dtype]
    if tables.get("runs") is not None:
        _runs(tables, layout, dev_id, ctype, gather=gather, rope=rope, shape=shape)
        return
    total = tables["total"]
    if total == 0:
        return
    vec = tables["vec4"]
    kname = f"kmesh_place_vec<{ctype}, {shape.vec_per}, {shape.vec_layers}>" if vec else f"kmesh_place<{ctype}>"
    fn, getdev, device_ctx = _token_function(dev_id, kname, shape)
    L, _, H, N, D = layout.sizes
    rd = rope.rotary_dim if rope is not None else 0
    neox = int(rope.is_neox_style) if rope is not None else 0
    i32, i64 = np.int32, np.int64
    common = (i32(int(gather)), i32(int(rope is not None)), i32(neox), i32(rd))
    tail = (tables["cos_sin"].data_ptr(), tables["fp8_table"].data_ptr(), tables["k_scale"].data_ptr())
    if vec:  # lanes of _VEC_PER x 8 elements; several tokens per 256-thread block; grid.x = (K|V, layer)
        lanes = min(-(-(H * D // 8) // shape.vec_per), 256)
        rows_per_block = max(1, 256 // lanes)
        grid = (2 * (-(-L // shape.vec_layers)), min(-(-total // rows_per_block), 65535))
        args = (tables["tok"].data_ptr(), tables["layer_base"].data_ptr(), i64(L), i64(H), i64(D), i64(total),
                i64(layout.k_strides[2]), i64(layout.v_strides[2])) + common + tail
    else:
        lanes = 32  # one lane per element pair (or 16-byte vector), a warp at least
        while lanes < 128 and lanes < H * (D // 2):
            lanes *= 2
        rows_per_block = max(1, 256 // lanes)
        grid = (min(-(-(2 * L * total) // rows_per_block), 132 * 16),)
        args = tuple(tables[k].data_ptr() for k in ("kv_ptrs", "item_tok_start", "tok_item", "slots", "old_pos",
                                                    "new_pos", "layer_base", "item_cache", "k_st", "v_st")) \
            + (i64(L), i64(H), i64(D), i64(N), i64(total)) + common + (i32(int(tables["vec16"])),) + tail
    _launch_on(fn, getdev, device_ctx, dev_id, grid, (lanes, rows_per_block), args)


_TOKEN_FNS: dict = {}  # (device, kernel name) -> (CUDA function, cupy getDevice, cupy Device)


def _token_function(dev_id: int, kname: str, shape) -> tuple:
    """A per-token kernel (kmesh_place / kmesh_place_vec) as a CuPy Function, looked up once."""
    found = _TOKEN_FNS.get((dev_id, kname))
    if found is None:
        import cupy

        from ._jit import get_kernel

        names = tuple(f"kmesh_place<{t}>" for t in _CUDA_TYPES.values()) + \
            tuple(f"kmesh_place_vec<{t}, {shape.vec_per}, {shape.vec_layers}>" for t in _CUDA_TYPES.values())
        kernel = get_kernel("place.cu", kname, device_id=dev_id, name_expressions=names)
        with cupy.cuda.Device(dev_id):
            fn = getattr(kernel, "kernel", kernel)
        found = _TOKEN_FNS[(dev_id, kname)] = (fn, cupy.cuda.runtime.getDevice, cupy.cuda.Device)
    return found


def _cupy_current_stream(dev_id: int):
    """CuPy's view of torch's current stream on ``dev_id`` (the null stream when that is current)."""
    from ._jit import cupy_stream

    handle = _stream_handle(dev_id)
    if handle:
        return cupy_stream(handle, dev_id)
    import cupy

    return cupy.cuda.Stream.null


_stream_handle = cuda.current_stream  # torch's current stream as a raw handle (no Stream object)
_RUN_FNS: dict = {}  # (device, dtype, kernel shape) -> (CUDA function, cupy getDevice, cupy Device)


def _runs_function(dev_id: int, ctype: str, kernel_shape) -> tuple:
    """kmesh_place_runs for one device and dtype as a CuPy Function (which takes the stream as an
    argument: no device or stream context per launch), looked up once."""
    shape = (f"{kernel_shape.run_groups}, {kernel_shape.run_heads}, {kernel_shape.run_vectors}, "
             f"{int(kernel_shape.run_kv_fused)}")
    key = (dev_id, ctype, shape)
    found = _RUN_FNS.get(key)
    if found is None:
        import cupy

        from ._jit import get_kernel

        names = tuple(f"kmesh_place_runs<{t}, {shape}>" for t in _CUDA_TYPES.values())
        kernel = get_kernel("place.cu", f"kmesh_place_runs<{ctype}, {shape}>", device_id=dev_id,
                            name_expressions=names)
        with cupy.cuda.Device(dev_id):
            fn = getattr(kernel, "kernel", kernel)
        found = _RUN_FNS[key] = (fn, cupy.cuda.runtime.getDevice, cupy.cuda.Device)
    return found


def _runs(tables, layout: KVLayout, dev_id: int, ctype: str, *, gather: bool, rope, shape) -> None:
    """Launch kmesh_place_runs on torch's current stream: one warp per (K|V, run, group of layers).

    ``tables["run_args"]``: (runs table address, [2, T] old|new positions address, layer bases
    address, number of runs R)."""
    if tables["run_args"][3] == 0:
        return
    fn, getdev, device_ctx, grid, args = _runs_call(tables, layout, dev_id, ctype, gather=gather, rope=rope,
                                                    shape=shape)
    _launch_on(fn, getdev, device_ctx, dev_id, grid, (256,), args)


def _runs_call(tables, layout: KVLayout, dev_id: int, ctype: str, *, gather: bool, rope, shape) -> tuple:
    """``(function, getDevice, Device, grid, arguments)`` of the run kernel's launch (R > 0)."""
    runs_ptr, pos_ptr, base_ptr, R = tables["run_args"]
    key = (dev_id, ctype, id(layout), id(rope), gather, shape)
    found = _RUN_STATIC.get(key)
    if found is None or found[0] is not layout or found[1] is not rope:
        found = _RUN_STATIC[key] = (layout, rope, _runs_function(dev_id, ctype, shape)) + \
            _run_static(layout, gather, rope, shape)
    _, _, (fn, getdev, device_ctx), L, per_run, tail = found
    groups = min(L, max(1, -(-shape.run_units // (per_run * R))))
    lg = -(-L // groups)
    units = per_run * R * (-(-L // lg))
    args = (runs_ptr, pos_ptr, base_ptr, np.int64(R), np.int64(tables["total"]), tail[0], np.int32(lg)) + tail[1:] \
        + (tables["cos_sin"].data_ptr(), tables["fp8_table"].data_ptr(), tables["k_scale"].data_ptr())
    return fn, getdev, device_ctx, (-(-units // 8),), args


def driver_template(layout: KVLayout, dev_id: int, rope, consts, shape) -> tuple | None:
    """What every launch of the run kernel into ``layout`` on ``dev_id`` shares, packed for one
    compiled driver call (:mod:`._driver_jit`): ``(CUfunction, warps per run, layers, int64
    arguments with the per-launch ones left 0, followed by as many scratch slots, count)``; ``None``
    where the function has no driver handle (CuPy launches). ``consts``: the placement's constant
    tables (cos/sin, fp8 table, K scales), whose addresses close the argument list."""
    static = _run_static(layout, False, rope, shape)
    fn = _runs_function(dev_id, _CUDA_TYPES[layout.storage_dtype], shape)[0]
    ptr = getattr(fn, "ptr", None)
    if not ptr:
        return None
    L, per_run, tail = static
    # (runs, positions, layer bases, R, T, L, layers per group | the rest of the layout's | constants)
    args = [0, 0, 0, 0, 0, int(tail[0]), 0] + [int(x) for x in tail[1:]] + [c.data_ptr() for c in consts]
    n = len(args)
    packed = np.zeros(2 * n, dtype=np.int64)
    packed[:n] = args
    packed.setflags(write=False)
    return ptr, per_run, L, packed, n



# (device, dtype, id(layout), id(rope), gather, kernel shape) -> (layout, rope, function, L, warps per run,
# the run kernel's typed arguments that depend on the layout and RoPE only), made once
_RUN_STATIC: dict = {}


def _run_static(layout: KVLayout, gather: bool, rope, shape) -> tuple:
    L, _, H, _, D = layout.sizes
    rd = rope.rotary_dim if rope is not None else 0
    neox = int(rope.is_neox_style) if rope is not None else 0
    i32 = np.int32
    tail = (i32(L), i32(H), i32(D), i32(layout.k_strides[2]), i32(layout.v_strides[2]), i32(layout.k_strides[3]),
            i32(layout.v_strides[3]), i32(int(gather)), i32(int(rope is not None)), i32(neox), i32(rd))
    if len(_RUN_STATIC) >= 64:  # layouts come and go with caches: keep the table small
        _RUN_STATIC.clear()
    return L, 1 if shape.run_kv_fused else 2, tail  # warps per (run, layer group)


def _launch_on(fn, getdev, device_ctx, dev_id: int, grid: tuple, block: tuple, args: tuple) -> None:
    """Launch ``fn`` on torch's current stream of ``dev_id``: through the driver when ``dev_id`` is
    the current device (one ctypes call), else, or when the driver declines, through CuPy."""
    if getdev() == dev_id:
        if cuda.launch(fn, grid, block, _stream_handle(dev_id), args):
            return
        fn(grid, block, args, stream=_cupy_current_stream(dev_id))
    else:
        with device_ctx(dev_id):
            fn(grid, block, args, stream=_cupy_current_stream(dev_id))
