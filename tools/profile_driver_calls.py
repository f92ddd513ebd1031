"""Host cost of the CUDA calls a host-tier restore makes, each timed alone in a loop (µs per call):
``cuMemcpyHtoDAsync`` through ``kmesh_gpu._launch.copy_htod`` from pinned memory at 4 KiB and at the
restore's 3 MiB, the same through torch's ``copy_``, an event record (torch), a device allocation of
the staging buffer's size (torch's caching allocator), and a stream synchronisation of an idle stream.
Tells which part of "resident copies issued" is the driver and which is Python.

Usage (GPU machine): PYTHONPATH=. python tools/profile_driver_calls.py [--repeat 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kmesh_gpu import _launch


def per_call(fn, repeat: int, sync_every: int = 16, before=None) -> float:
    """Median over batches of ``sync_every`` calls (synchronised between batches, outside the timing;
    ``before()``, when given, also runs untimed ahead of each batch)."""
    times = []
    for _ in range(max(1, repeat // sync_every)):
        torch.cuda.synchronize()
        if before is not None:
            before()
        t = time.perf_counter()
        for _ in range(sync_every):
            fn()
        times.append((time.perf_counter() - t) / sync_every * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=400)
    args = ap.parse_args()
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    small, big = 4096, 3 << 20
    src = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(4 * big, dtype=torch.uint8, device=dev)
    rows = {
        "copy_htod 4 KiB (driver, ctypes)": lambda: _launch.copy_htod(dst.data_ptr(), src.data_ptr(), small, stream),
        "copy_htod 3 MiB (driver, ctypes)": lambda: _launch.copy_htod(dst.data_ptr(), src.data_ptr(), big, stream),
        "torch copy_ 4 KiB non_blocking": lambda: dst[:small].copy_(src[:small], non_blocking=True),
        "torch copy_ 3 MiB non_blocking": lambda: dst[:big].copy_(src, non_blocking=True),
        "torch.cuda.Event() + record": lambda: torch.cuda.Event().record(),
        "torch.empty 12 MiB on the GPU": lambda: torch.empty(4 * big, dtype=torch.uint8, device=dev),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    }
    print(f"host µs per call on {torch.cuda.get_device_name(dev)} (median of batches of 16, {args.repeat} calls):")
    for name, fn in rows.items():
        fn()
        print(f"  {name:<36} {per_call(fn, args.repeat):8.2f}")
    from kmesh_host.direct_io import HostBuffer

    with HostBuffer(4 * big, pin=True) as reg:
        raddr = reg.address

        def busy():  # a 12 MiB copy running when the timed calls are made
            _launch.copy_htod(dst.data_ptr(), raddr, 4 * big, stream)

        name = "copy_htod 3 MiB, registered, idle"
        fn = lambda: _launch.copy_htod(dst.data_ptr(), raddr, big, stream)  # noqa: E731
        print(f"  {name:<36} {per_call(fn, args.repeat, sync_every=1):8.2f}")
        name = "copy_htod 3 MiB, registered, busy"
        print(f"  {name:<36} {per_call(fn, args.repeat, sync_every=1, before=busy):8.2f}")
        name = "copy_htod 3 MiB, cudaHostAlloc, idle"
        fn = lambda: _launch.copy_htod(dst.data_ptr(), src.data_ptr(), big, stream)  # noqa: E731
        print(f"  {name:<36} {per_call(fn, args.repeat, sync_every=1):8.2f}")
        torch.cuda.synchronize()
    idle = torch.cuda.Stream()
    print(f"  {'idle stream synchronize()':<36} {per_call(idle.synchronize, args.repeat):8.2f}")


if __name__ == "__main__":
    main()
