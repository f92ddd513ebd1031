"""Where the cache service's device memory goes across rounds of concurrent clients.

Runs the service in this process (so its allocations can be inspected), then ``--cycles`` times
perf/bench_service.py's concurrency part (``--clients`` processes, ``--rounds`` restores each, every
registration closed at the end), printing ``torch.cuda.memory_allocated()`` after each cycle and
the live allocations grouped by the Python frames that made them (torch's memory history).
Memory that grows from cycle to cycle with nothing registered is a leak; memory made in the first
cycle and constant afterwards is a cache.

Usage (GPU machine): PYTHONPATH=. python tools/probe_service_memory.py [--clients 16] [--cycles 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

from kmesh_host.service import CacheClient, ServiceConfig  # noqa: E402
from kmesh_host.service.server import _Service  # noqa: E402


def live_allocations(top: int) -> list[tuple[int, int, str]]:
    groups = collections.defaultdict(lambda: [0, 0])
    for seg in torch.cuda.memory_snapshot():
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            frames = blk.get("frames") or []
            where = " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
                                for f in frames if f.get("filename", "").endswith(".py"))[:400] or "(no frames)"
            g = groups[where]
            g[0] += 1
            g[1] += blk["size"]
    rows = sorted(((v[1], v[0], k) for k, v in groups.items()), reverse=True)
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    d = tempfile.mkdtemp(prefix="kmsm-")
    path = os.path.join(d, "svc", "kmesh.sock")
    service = _Service(ServiceConfig(socket_path=path, host_budget_bytes=1 << 30))
    service.start()
    try:
        with CacheClient(path, timeout=300) as client:
            for key, kv, pos in bs.originals():
                client.put(key, kv, pos)
            ns = argparse.Namespace(device="cuda", clients=args.clients, rounds=args.rounds, reply_spin_s=None,
                                    inputs="tensors")
            for cycle in range(args.cycles):
                res = bs.concurrent(ns, client, path)
                status = client.status()
                print(f"cycle {cycle}: {res['restores_per_s'] or 0:.0f} restores/s, errors {res['errors']}, "
                      f"registrations {len(status['registrations'])}, pending {len(status['pending_ops'])}, "
                      f"device memory allocated {torch.cuda.memory_allocated()} "
                      f"(before the cycle {res['device_memory_before']}), sources {status['sources']}", flush=True)
                for size, count, where in live_allocations(args.top):
                    print(f"   {size:>12} B in {count:>4} blocks: {where}")
    finally:
        service.stop()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
