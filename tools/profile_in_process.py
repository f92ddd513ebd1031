"""Where the cache-service benchmark's in-process restore (perf/bench_service.py: the seed-size
child placed with ``place_many`` from device-resident originals) spends its host time: wall per
call, which preparation path it takes (the fast path with the compiled run builder, the fast
path's NumPy tables, or the general path), and cProfile's top functions.

Usage (GPU machine): PYTHONPATH=. python tools/profile_in_process.py [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

place_mod = importlib.import_module("kmesh_gpu.place")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    device = "cuda"
    layout, rope, plan, resident = bs.child_setup(device)
    cache = layout.allocate(device, fill=0)
    counts = {"fast": 0, "fast returned None": 0, "compiled": 0, "compiled returned None": 0}
    real_fast, real_comp = place_mod._fast_prepare, place_mod._compiled_runs

    def fast(*a, **k):
        out = real_fast(*a, **k)
        counts["fast" if out is not None else "fast returned None"] += 1
        return out

    def comp(*a, **k):
        out = real_comp(*a, **k)
        counts["compiled" if out is not None else "compiled returned None"] += 1
        return out

    place_mod._fast_prepare, place_mod._compiled_runs = fast, comp
    for _ in range(20):
        bs.in_process_restore(cache, layout, rope, resident, plan, device)
    print("preparation paths over 20 calls:", counts)
    place_mod._fast_prepare, place_mod._compiled_runs = real_fast, real_comp
    walls = []
    for _ in range(args.calls):
        t = time.perf_counter()
        bs.in_process_restore(cache, layout, rope, resident, plan, device)
        walls.append((time.perf_counter() - t) * 1e6)
    print(f"in-process restore: median {statistics.median(walls):.1f} us (min {min(walls):.1f})")
    launch_only = []
    for _ in range(args.calls):
        t = time.perf_counter()
        place_mod.prepare_place_many([kv for _, kv, _ in resident], cache, layout, [s for _, s, _ in plan], rope=rope,
                                     old_positions=[p for _, _, p in resident],
                                     new_positions=[n for _, _, n in plan])
        launch_only.append((time.perf_counter() - t) * 1e6)
    print(f"prepare_place_many alone: median {statistics.median(launch_only):.1f} us")
    sync = []
    for _ in range(args.calls):
        t = time.perf_counter()
        torch.cuda.synchronize()
        sync.append((time.perf_counter() - t) * 1e6)
    print(f"idle torch.cuda.synchronize(): median {statistics.median(sync):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        bs.in_process_restore(cache, layout, rope, resident, plan, device)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
    print(s.getvalue())


if __name__ == "__main__":
    main()
