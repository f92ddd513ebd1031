"""Host cost of launching the placement's run kernel, split into its parts (µs per call, loops):

* ``cuLaunchKernel`` of ``kmesh_place_runs`` alone (the prepared launch's arguments, the raw ctypes
  function), on an idle stream and behind 12 MiB of queued pinned H2D copies;
* the same call for a trivial kernel with 1 and with 20 integer parameters (is it the kernel or
  any launch?);
* ``_Launch.run`` whole, and its Python part with the driver call replaced by a no-op;
* the prepare's torch calls (pinned ``empty``, ``cat``, ``to``) next to their NumPy/driver twins.

Usage (GPU machine): PYTHONPATH=. python tools/profile_launch.py [--repeat 400]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import sys
from pathlib import Path

import numpy as np
import torch

from kmesh_gpu import RopeSpec, _launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_driver_calls as pdc  # noqa: E402
import profile_place_prepare as ppp  # noqa: E402

place_mod = importlib.import_module("kmesh_gpu.place")
cupy_mod = importlib.import_module("kmesh_gpu._place_cupy")


per_call = pdc.per_call  # (fn, repeat, batch, before): median µs per call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=400)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rope = RopeSpec(ppp.D, ppp.D, 1e6, True, 32768, torch.bfloat16)
    layout, kvs, slots, olds, news = ppp.restore_batch(dev)
    cache = layout.allocate(dev, fill=0)
    launch = place_mod.prepare_place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds,
                                          new_positions=news)
    launch.run()
    torch.cuda.synchronize()
    print(f"run kernel: {launch.tables.get('runs')} runs; device {torch.cuda.get_device_name(dev)}")

    # capture the arguments of one launch through the raw function
    real = _launch._functions()
    seen = []

    def capture(*a):
        seen.append(a)
        return real[0](*a)

    _launch._DRIVER[0] = (capture,) + real[1:]
    launch.run()
    _launch._DRIVER[0] = real
    torch.cuda.synchronize()
    raw = real[0]
    call = seen[0]
    rows = {}
    rows["cuLaunchKernel kmesh_place_runs, idle stream"] = per_call(lambda: raw(*call), args.repeat)

    # behind queued copies: 4 x 3 MiB pinned H2D queued first on the same stream
    src = torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(4 * (3 << 20), dtype=torch.uint8, device=dev)
    stream = _launch.current_stream(dev.index or 0)

    def queue_copies():
        for i in range(4):
            _launch.copy_htod(dst.data_ptr() + i * (3 << 20), src.data_ptr(), 3 << 20, stream)

    rows["cuLaunchKernel kmesh_place_runs, behind 12 MiB of H2D"] = per_call(lambda: raw(*call), args.repeat,
                                                                               batch=1, before=queue_copies)
    import cupy

    mod = cupy.RawModule(code=r'''
extern "C" __global__ void k1(long long a) { if (a == 42 && threadIdx.x == 1000) printf("x"); }
extern "C" __global__ void k20(long long a0, long long a1, long long a2, long long a3, long long a4,
    long long a5, long long a6, long long a7, long long a8, long long a9, long long a10, long long a11,
    long long a12, long long a13, long long a14, long long a15, long long a16, long long a17,
    long long a18, long long a19) { if (a0 + a19 == 42 && threadIdx.x == 1000) printf("x"); }
''')
    for name, nargs in (("k1", 1), ("k20", 20)):
        fn = mod.get_function(name)
        fn((1,), (32,), tuple(np.int64(0) for _ in range(nargs)))
        fn = getattr(fn, "kernel", fn)  # the CuPy Function (its ptr is the CUfunction)
        vals = np.zeros(nargs, dtype=np.int64)
        params = (ctypes.c_void_p * nargs)(*[vals.ctypes.data + 8 * i for i in range(nargs)])
        ptr = fn.ptr
        rows[f"cuLaunchKernel trivial {nargs}-parameter kernel, idle stream"] = per_call(
            lambda: raw(ptr, 1, 1, 1, 32, 1, 1, 0, stream, params, None), args.repeat)
    rows["_Launch.run (whole)"] = per_call(launch.run, args.repeat)
    _launch._DRIVER[0] = (lambda *a: 0,) + real[1:]
    rows["_Launch.run with the driver call a no-op"] = per_call(launch.run, args.repeat)
    _launch._DRIVER[0] = real

    L, T = layout.num_layers, sum(k.shape[2] for k in kvs)
    n = L + 3 * T + 7 * T
    rows["torch.empty pinned int64 table"] = per_call(lambda: torch.empty(n, dtype=torch.int64, pin_memory=True),
                                                      args.repeat)
    out = torch.empty(n, dtype=torch.int64, pin_memory=True)
    rows["torch.cat 12 index tensors (out=)"] = per_call(
        lambda: torch.cat((*olds, *news, *slots), out=out[L:L + 3 * T]), args.repeat)
    nps = [x.numpy() for x in (*olds, *news, *slots)]
    hn = out.numpy()
    rows["numpy.concatenate 12 index arrays (out=)"] = per_call(
        lambda: np.concatenate(nps, out=hn[L:L + 3 * T]), args.repeat)
    rows["tensor.numpy() x12"] = per_call(lambda: [x.numpy() for x in (*olds, *news, *slots)], args.repeat)
    rows["host.to(device, non_blocking)"] = per_call(lambda: out.to(dev, non_blocking=True), args.repeat)
    dev_buf = torch.empty(n, dtype=torch.int64, device=dev)
    rows["copy_htod of the table (driver)"] = per_call(
        lambda: _launch.copy_htod(dev_buf.data_ptr(), out.data_ptr(), 8 * n, stream), args.repeat)
    rows["torch.empty table on the GPU"] = per_call(lambda: torch.empty(n, dtype=torch.int64, device=dev),
                                                    args.repeat)
    ev = _launch.DriverEvent.create() if hasattr(_launch, "DriverEvent") else None
    if ev is not None:
        rows["DriverEvent.create()"] = per_call(_launch.DriverEvent.create, args.repeat)
        rows["DriverEvent.record()"] = per_call(lambda: ev.record(stream), args.repeat)
        rows["DriverEvent.query()"] = per_call(ev.query, args.repeat)
    rows["torch.cuda.Event() + record"] = per_call(lambda: torch.cuda.Event().record(), args.repeat)
    for name, us in rows.items():
        print(f"  {name:<58} {us:8.2f} us")


if __name__ == "__main__":
    main()
