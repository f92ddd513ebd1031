"""Back-to-back vs alternating restores of perf/bench_service.py's seed-size child: does a restore
pay for switching the GPU between the client's and the service's CUDA contexts?

Times (medians of ``--runs``): in-process restores back to back; service restores back to back
with the client on the default stream (its interprocess event recorded before every request) and
on a side stream (idle, so no event is recorded: the device gets no command of the client's
between the service's copies); and the two paths alternating (as the benchmark's pairs do).

Usage (GPU machine): PYTHONPATH=. python tools/probe_service_switch.py [--runs 41]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

from kmesh_host.service import CacheClient, CacheService, RestoreItem, ServiceConfig  # noqa: E402


def timed(fn, runs: int) -> float:
    for _ in range(5):
        fn()
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=41)
    args = ap.parse_args()
    device = "cuda"
    layout, rope, plan, resident = bs.child_setup(device)
    local = layout.allocate(device, fill=0)
    d = tempfile.mkdtemp(prefix="kmsp-")
    path = os.path.join(d, "svc", "kmesh.sock")
    with CacheService(ServiceConfig(socket_path=path, host_budget_bytes=1 << 30)), \
            CacheClient(path, timeout=120, fast_lane=False) as client:
        for key, kv, pos in bs.originals():
            client.put(key, kv, pos)
        cache = layout.allocate(device, fill=0)
        reg = client.register(cache, layout, rope=rope)
        items = [RestoreItem(k, s, p) for k, s, p in plan]

        def local_run():
            bs.in_process_restore(local, layout, rope, resident, plan, device)

        def service_run():
            client.restore(reg, items)

        rows = {"in-process, back to back": timed(local_run, args.runs),
                "service, back to back, default stream": timed(service_run, args.runs)}
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            rows["service, back to back, idle side stream (no event)"] = timed(service_run, args.runs)
        loc, svc = [], []
        for i in range(args.runs):
            for name in (("local", "service") if i % 2 == 0 else ("service", "local")):
                t = time.perf_counter()
                local_run() if name == "local" else service_run()
                (loc if name == "local" else svc).append((time.perf_counter() - t) * 1e6)
        rows["in-process, alternating with the service"] = statistics.median(loc)
        rows["service, alternating with in-process"] = statistics.median(svc)
        with torch.cuda.stream(side):
            client.restore(reg, items, timings=True)
            t = client.last_timings
        assert client.close_registration(reg, timeout=60)
    shutil.rmtree(d, ignore_errors=True)
    for name, us in rows.items():
        print(f"  {name:<56} {us:8.1f} us")
    c, s = t["client"], t["service"]
    print("  one timed restore on the side stream (us from the client's start): "
          + ", ".join(f"{w}.{k} {(v - c['start']) / 1e3:.1f}" for w, d in (("service", s), ("client", c))
                      for k, v in d.items()))


if __name__ == "__main__":
    main()
