"""Where the GPU tree digest of 4 x 3 MiB spends its time: per-level kernel time of the per-level path
(CUDA events, each level synchronised on its own), the one-launch (fused) kernel alone, and the wall
time of one call and its download for both paths.

Usage (GPU machine): PYTHONPATH=. python tools/sha256_breakdown.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kmesh_gpu import sha256 as sha


def main() -> None:
    dev = torch.device("cuda")
    n, size = 4, 3 << 20
    data = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device=dev)
    offs = np.arange(n, dtype=np.int64) * size
    lens = np.full(n, size, dtype=np.int64)
    for _ in range(3):
        sha.tree_digests(data, offs, lens, backend="cupy").cpu()
    plan = sha._tree_plan(offs.tobytes(), lens.tobytes(), 4096, 64)
    levels = list(plan.levels) + [plan.root]
    per_level = {i: [] for i in range(len(levels))}
    for _ in range(20):
        buf = torch.empty(plan.total_bytes, dtype=torch.uint8, device=dev)
        sha._upload(plan.host_bytes, buf)
        out = torch.empty((n, 32), dtype=torch.uint8, device=dev)
        launch = sha._CupyLauncher(dev)
        torch.cuda.synchronize()
        for i, lvl in enumerate(levels):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            src = data if lvl.from_data else buf
            dst = out if lvl is plan.root else buf
            a.record()
            launch("kmesh_sha256_tree_level", lvl.n_msgs,
                   (sha._ptr(src), np.int64(lvl.piece), sha._ptr(buf, 8 * lvl.table_at), np.int64(lvl.n_obj),
                    np.int64(lvl.n_msgs), sha._ptr(dst)))
            b.record()
            torch.cuda.synchronize()
            per_level[i].append(a.elapsed_time(b))
    for i, lvl in enumerate(levels):
        print(f"level {i}: {lvl.n_msgs:5d} messages of <= {lvl.piece} B: kernel {statistics.median(per_level[i]):.4f} ms")
    print(f"sum of level kernels: {sum(statistics.median(v) for v in per_level.values()):.4f} ms")
    fused = sha._fused_plan(offs.tobytes(), lens.tobytes(), 4096, 64)
    spans = []
    for _ in range(20):
        out = torch.empty((n, 32), dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        sha._cupy_tree_fused(data, fused, out, 4096, 64)
        b.record()
        torch.cuda.synchronize()
        spans.append(a.elapsed_time(b))
    print(f"fused: one launch for {fused.n_leaves} leaves and {fused.n_counters} inner nodes: "
          f"{statistics.median(spans):.4f} ms (events around the launch)")
    for path in ("fused", "levels"):
        walls, calls, downs = [], [], []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            d = sha._tree_digests_path(data, offs, lens, path=path)
            t1 = time.perf_counter()
            d.cpu()
            t2 = time.perf_counter()
            calls.append((t1 - t0) * 1e3)
            downs.append((t2 - t1) * 1e3)
            walls.append((t2 - t0) * 1e3)
        print(f"{path:6s}: call returns after {statistics.median(calls):.4f} ms (host issue time); "
              f"download+sync {statistics.median(downs):.4f} ms; wall {statistics.median(walls):.4f} ms")

if __name__ == "__main__":
    main()
