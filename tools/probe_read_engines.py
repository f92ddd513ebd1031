"""The two O_DIRECT read engines side by side on this disk: ``os.preadv`` on a pool of threads and
io_uring (one ring, one submitting thread), each at the same queue depth and chunk size, alternating
every round: a big file read through (the disk figure's shape) and a child's shape (the payloads of
four 3 MiB segment files read at once, as the host-staging route queues them). Also prints the
block device's hardware queue count (requests from one submitting CPU go to one queue).

Usage (GPU machine or any Linux box): PYTHONPATH=. python tools/probe_read_engines.py [--dir DIR]
    [--rounds 9] [--seq-mib 512] [--depth 16] [--chunk-kib 1024]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
from run_ssd_routes import MIB, write_file  # noqa: E402

from kmesh_host.direct_io import ALIGN, DirectFile, HostBuffer, ReadEngine  # noqa: E402


def _read_all(engine: ReadEngine, paths: list[str], sizes: list[int], buffers: list[HostBuffer]) -> float:
    files = [DirectFile(p) for p in paths]
    for f in files:
        f.drop_cache()
    left = threading.Semaphore(0)
    errors: list = []
    try:
        t0 = time.perf_counter()
        count = 0
        for f, n, b in zip(files, sizes, buffers):
            count += engine.start(f, 0, n, b.view, lambda lo, hi, err: (err and errors.append(err), left.release()))
        for _ in range(count):
            left.acquire()
        dt = time.perf_counter() - t0
    finally:
        for f in files:
            f.close()
    if errors:
        raise errors[0]
    if not all(f.o_direct for f in files):
        raise SystemExit("O_DIRECT refused here: the probe would time the page cache")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seq-mib", type=int, default=512)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    args = ap.parse_args()
    for q in sorted(glob.glob("/sys/block/*/mq")):
        dev = q.split("/")[3]
        if not dev.startswith(("loop", "ram")):
            print(f"{dev}: {len(os.listdir(q))} hardware queues")
    chunk = args.chunk_kib * 1024
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        seq = os.path.join(tmp, "seq.bin")
        write_file(seq, args.seq_mib * MIB, 1)
        child = [os.path.join(tmp, f"obj{i}.bin") for i in range(4)]
        for i, p in enumerate(child):
            write_file(p, 3 * MIB + ALIGN, 10 + i)
        seq_buf = [HostBuffer(args.seq_mib * MIB)]
        child_bufs = [HostBuffer(3 * MIB + ALIGN) for _ in child]
        engines = {name: ReadEngine(args.depth, chunk, engine=name) for name in ("threads", "io_uring")}
        shapes = {"sequential": ([seq], [args.seq_mib * MIB], seq_buf),
                  "child (4 x 3 MiB)": (child, [3 * MIB + ALIGN] * 4, child_bufs)}
        times = {(s, e): [] for s in shapes for e in engines}
        try:
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for shape, (paths, sizes, bufs) in shapes.items():
                    for name in order:
                        times[(shape, name)].append(_read_all(engines[name], paths, sizes, bufs))
        finally:
            for e in engines.values():
                e.close()
            for b in seq_buf + child_bufs:
                b.close()
    print(f"O_DIRECT, queue depth {args.depth}, {args.chunk_kib} KiB chunks, {args.rounds} rounds alternating:")
    for shape, (paths, sizes, _) in shapes.items():
        total = sum(sizes)
        line = []
        for name in engines:
            line.append(f"{name} {total / statistics.median(times[(shape, name)]) / 1e9:.2f} GB/s")
        ratio = statistics.median(a / b for a, b in zip(times[(shape, "io_uring")], times[(shape, "threads")]))
        print(f"  {shape:<18} " + ", ".join(line) + f"; time io_uring / threads per round: median {ratio:.3f}")


if __name__ == "__main__":
    main()
