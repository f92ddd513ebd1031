"""How the DMA of a host-tier child compares with one pinned copy of the same bytes.

The host-tier child copies four retained objects (each in its own pinned ``HostBuffer``) into one
device buffer; the benchmark's reference is one copy of the same number of bytes. This probe
times, alternating the order every round, on one stream:

* ``one``: one copy of all the bytes from one pinned buffer (the reference's shape);
* ``pieces_separate``: one copy per object, each from its own pinned buffer (the child's shape);
* ``pieces_one_buffer``: the same copies, all from one pinned buffer;
* the ``huge_*`` variants: the same with the host buffers advised to transparent huge pages
  before they are touched and pinned.

Device time is CUDA events around the copies; wall is issue + synchronise, as the benchmark times
its reference. Prints medians and each variant's ratio to ``one`` (per round, then median).

Usage (GPU machine): PYTHONPATH=. python tools/probe_h2d_pieces.py [--objects 4] [--mib 3] [--rounds 41]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import torch

from kmesh_host.direct_io import HostBuffer


def _huge_buffer(nbytes: int) -> HostBuffer:
    """A pinned HostBuffer whose mapping was advised to huge pages and touched before pinning."""
    buf = HostBuffer(nbytes, pin=False)
    try:
        buf._map.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    buf.tensor.fill_(1)
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.address, buf.nbytes, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister failed ({rc})")
    buf.pinned = True
    return buf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--mib", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=41)
    args = ap.parse_args()
    dev = torch.device("cuda")
    piece = int(args.mib * (1 << 20))
    total = piece * args.objects
    dst = torch.empty(total, dtype=torch.uint8, device=dev)
    variants = {}
    one = HostBuffer(total, pin=True)
    one.tensor.fill_(2)
    variants["one"] = [(one.tensor[:total], 0)]
    seps = [HostBuffer(piece, pin=True) for _ in range(args.objects)]
    for b in seps:
        b.tensor.fill_(3)
    variants["pieces_separate"] = [(b.tensor[:piece], i * piece) for i, b in enumerate(seps)]
    variants["pieces_one_buffer"] = [(one.tensor[i * piece:(i + 1) * piece], i * piece) for i in range(args.objects)]
    huge_one = _huge_buffer(total)
    variants["huge_one"] = [(huge_one.tensor[:total], 0)]
    huge_seps = [_huge_buffer(piece) for _ in range(args.objects)]
    variants["huge_pieces_separate"] = [(b.tensor[:piece], i * piece) for i, b in enumerate(huge_seps)]
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(parts) -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record(stream)
        for src, off in parts:
            dst[off:off + src.numel()].copy_(src, non_blocking=True)
        end.record(stream)
        end.synchronize()
        wall = time.perf_counter() - t0
        return start.elapsed_time(end) * 1e3, wall * 1e6

    names = list(variants)
    for name in names:  # warm-up
        for _ in range(3):
            run(variants[name])
    dev_us = {n: [] for n in names}
    wall_us = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            d, w = run(variants[name])
            dev_us[name].append(d)
            wall_us[name].append(w)
    print(f"{args.objects} x {args.mib} MiB H2D on {torch.cuda.get_device_name()}, {args.rounds} rounds "
          f"(order alternating); medians, and per-round ratio to 'one' (median)")
    print(f"{'variant':24s} {'device us':>10s} {'GB/s':>7s} {'wall us':>9s} {'dev ratio':>10s} {'wall ratio':>11s}")
    for name in names:
        d, w = statistics.median(dev_us[name]), statistics.median(wall_us[name])
        dr = statistics.median(a / b for a, b in zip(dev_us[name], dev_us["one"]))
        wr = statistics.median(a / b for a, b in zip(wall_us[name], wall_us["one"]))
        print(f"{name:24s} {d:10.1f} {total / d / 1e3:7.2f} {w:9.1f} {dr:10.3f} {wr:11.3f}")
    torch.cuda.synchronize()
    for b in [one, huge_one, *seps, *huge_seps]:
        b.close()


if __name__ == "__main__":
    main()
