"""Where a host-tier restore (12 MiB child from retained pinned RAM, placed with the RoPE shift)
spends its time: wall per child, the route's own step stamps (``routes.TRACE``), then cProfile of 40
children (top functions by own and cumulative time), then a CUDA-event view of the device side of
one child.

On a machine without a GPU, ``--device cpu --skip-kernel`` measures the host path alone: the
placement launch (the Warp kernel running on the CPU there) is skipped, and the host memcpy that
stands in for the H2D copies is timed separately and reported beside the wall; ``--emulate-cupy``
then builds the CUDA backend's tables (the run kernel's, as on the GPU) instead of Warp's.

Usage (GPU machine): PYTHONPATH=. python tools/profile_host_tier.py [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

from kmesh_host import HostTier, HostTierConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-kernel", action="store_true",
                    help="do not run the placement launch (CPU: time the host path without Warp's CPU kernel)")
    ap.add_argument("--emulate-cupy", action="store_true",
                    help="with --skip-kernel on the CPU: build the CUDA backend's launch tables (the GPU's host path)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.skip_kernel:
        import importlib

        importlib.import_module("kmesh_gpu.place")._Launch.run = lambda self: None
        if args.emulate_cupy:
            from kmesh_gpu import _backend

            _backend.choose = lambda backend, dev: "cupy"
    with tempfile.TemporaryDirectory() as tmp:
        wargs = argparse.Namespace(data_dir=tmp, shift=True, objects=4, tokens=256, place=True, children=4)
        work = rs.Workload(wargs, device)
        cfg = HostTierConfig(budget_bytes=64 * rs.MIB, pin=device.type == "cuda", retain=True, singleflight=False,
                             verify="none", read_threads=16, chunk_bytes=rs.MIB, parallel_loads=4)
        lines = []
        with HostTier(work.store, cfg) as tier:
            work.child("host_staging", 0, tier, verify="device", evict=False)
            for _ in range(10):
                work.child("host_staging", 1, tier, verify="device", evict=False)
            walls, prep = [], []
            for c in range(40):
                r = work.child("host_staging", c % 4, tier, verify="device", evict=False)
                walls.append(r["restore_s"] * 1e3)
                prep.append(r["prepare_s"] * 1e3)
            lines.append(f"host-tier restore: median {statistics.median(walls):.3f} ms (min {min(walls):.3f}); "
                         f"placement preparation median {statistics.median(prep):.3f} ms"
                         + (" (placement launch skipped)" if args.skip_kernel else ""))
            if device.type == "cpu":  # the host memcpy standing in for the H2D copies
                src = [torch.empty(h.padded_length, dtype=torch.uint8) for h in work.headers]
                dst = torch.empty(sum(h.padded_length for h in work.headers), dtype=torch.uint8)
                cps = []
                for _ in range(20):
                    t = time.perf_counter()
                    o = 0
                    for x in src:
                        dst[o:o + x.numel()].copy_(x)
                        o += x.numel()
                    cps.append((time.perf_counter() - t) * 1e3)
                cp = statistics.median(cps)
                lines.append(f"host memcpy of the child's bytes: median {cp:.3f} ms; restore wall minus memcpy: "
                             f"{statistics.median(walls) - cp:.3f} ms")
            # where the host time goes: the route's own step stamps, medians of 40 children
            from kmesh_host import routes as routes_mod

            routes_mod.TRACE = trace = []
            steps: dict[str, list[float]] = {}
            for c in range(40):
                trace.clear()
                work.child("host_staging", c % 4, tier, verify="device", evict=False)
                for (_, a), (name, b) in zip(trace, trace[1:]):
                    steps.setdefault(name, []).append((b - a) * 1e3)
            routes_mod.TRACE = None
            lines.append("host-tier restore steps (ms since the previous stamp, medians of 40 children):")
            for name, vals in steps.items():
                lines.append(f"  -> {name:<28} {statistics.median(vals):.3f}")
            prof = cProfile.Profile()
            prof.enable()
            for c in range(40):
                work.child("host_staging", c % 4, tier, verify="device", evict=False)
            prof.disable()
            st = pstats.Stats(prof)
            lines.append(f"Python function calls per child (cProfile): {st.total_calls / 40:.0f}")
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
                lines.append(s.getvalue())
            if device.type == "cuda":  # device side: event span of one child vs its wall
                spans = []
                for c in range(9):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    a.record()
                    work.child("host_staging", c % 4, tier, verify="device", evict=False)
                    b.record()
                    torch.cuda.synchronize()
                    spans.append((a.elapsed_time(b), (time.perf_counter() - t) * 1e3))
                lines.append("event span / wall per child (ms): "
                             + ", ".join(f"{e:.3f}/{w:.3f}" for e, w in spans))
                # device activity of 5 children: copies (pinned or pageable) and kernels, by total time
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    for c in range(5):
                        work.child("host_staging", c % 4, tier, verify="device", evict=False)
                    torch.cuda.synchronize()
                lines.append(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
                names = sorted({e.name for e in p.events() if "Memcpy" in e.name or "memcpy" in e.name})
                lines.append("copy kinds seen: " + "; ".join(names))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_host_tier.txt").write_text(text)


if __name__ == "__main__":
    main()
