"""The cache service's two transports side by side: perf/bench_service.py's seed-size child restored
through a connection's shared-memory channel and through its socket, alternating, one client per
transport (each with its own registered cache), the same service.

Both clients restore from an idle side stream (no interprocess event: nothing of the client's
context runs between the service's copies), so the GPU context switch that dominates the
benchmark's pairs is out of the comparison; what is left differs only in the transport. Reports
the median time per transport, the median of the per-round ratios channel/socket, and each
transport's stage medians (bench_service's breakdown).

Usage: PYTHONPATH=. python tools/ab_channel.py [--device cuda|cpu] [--rounds 200] [--timing-runs 41]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

from kmesh_host.service import CacheClient, CacheService, RestoreItem, ServiceConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--timing-runs", type=int, default=41)
    args = ap.parse_args()
    layout, rope, plan, _ = bs.child_setup(args.device)
    items = [RestoreItem(k, s, p) for k, s, p in plan]
    d = tempfile.mkdtemp(prefix="kmsc-")
    path = os.path.join(d, "svc", "kmesh.sock")
    side = torch.cuda.stream(torch.cuda.Stream()) if args.device == "cuda" else nullcontext()
    try:
        with CacheService(ServiceConfig(socket_path=path, host_budget_bytes=1 << 30)), \
                CacheClient(path, timeout=120, channel=True) as ch, CacheClient(path, timeout=120, channel=False) as so, \
                side:
            for key, kv, pos in bs.originals():
                ch.put(key, kv, pos)
            shared = []
            regs = {}
            for name, client in (("channel", ch), ("socket", so)):
                shared_cache, registrable, _ = bs._alloc(layout, args.device)
                shared.append(shared_cache)
                regs[name] = (client, client.register(registrable, layout, rope=rope))
            times = {name: [] for name in regs}
            order = list(regs)
            for i in range(args.rounds + 10):
                for name in (order if i % 2 == 0 else order[::-1]):
                    client, reg = regs[name]
                    t = time.perf_counter()
                    client.restore(reg, items)
                    if i >= 10:
                        times[name].append((time.perf_counter() - t) * 1e6)
            stages = {}
            for name, (client, reg) in regs.items():
                rows = []
                for _ in range(args.timing_runs):
                    client.restore(reg, items, timings=True)
                    rows.append(client.last_timings)
                stages[name] = bs.stage_medians(rows)
            for client, reg in regs.values():
                client.close_registration(reg, timeout=60)
            for s in shared:
                if s is not None:
                    s.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ratios = [c / s for c, s in zip(times["channel"], times["socket"])]
    print(f"seed child through the service on {args.device}, {args.rounds} alternating rounds (side stream):")
    print(f"  channel {statistics.median(times['channel']):.1f} us, socket {statistics.median(times['socket']):.1f} us, "
          f"median per-round ratio channel/socket {statistics.median(ratios):.3f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}..{statistics.quantiles(ratios, n=4)[2]:.3f})")
    for name, rows in stages.items():
        print(f"  stages through the {name} (median of {args.timing_runs}, us): "
              + ", ".join(f"{label.split(' -> ')[1] if '->' in label else label} {us:.1f}" for label, us in rows))


if __name__ == "__main__":
    main()
