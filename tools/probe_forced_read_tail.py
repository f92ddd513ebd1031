"""Where a forced-read child's time goes after its last byte is read: the host-staging route's
stamps (``routes.TRACE``) for perf/run_ssd_routes.py's child (4 objects of 3 MiB, RoPE shift,
placed, host tier evicted and page cache dropped before every child), by verification mode in
turn within each round (``device``: a tree digest per object as it lands; ``device-batched``: one
digest call for all objects after the last lands; ``none``: no check, the floor of the tail).

Per mode, medians over ``--rounds`` x ``--children`` children (ms): the read interval, the tail
(last byte read -> restore returned) and its steps: landings (each object's digest queued), roots
compared (every digest done, one synchronisation), placement launched, synced, end.

Usage: PYTHONPATH=. python tools/probe_forced_read_tail.py [--rounds 7] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

import kmesh_gpu  # noqa: E402
from kmesh_host import HostTier  # noqa: E402
from kmesh_host import routes as routes_mod  # noqa: E402

MODES = ("device", "device-batched", "none")
#: ``--ab``: verify="device" with the tail's current arrangement against the earlier one (every
#: digest stream joined into the work stream before the roots are compared; the caller's join
#: through torch's wait_stream), alternating child by child
AB = {"device, root events": (False, True), "device, joined (before)": (True, False)}


class DigestTimes:
    """Wraps ``kmesh_gpu.tree_digests`` (as the route calls it) to time each digest on the GPU:
    CUDA events before and after it on the stream it is launched on, read against an event
    recorded as the child starts; host time of the call too."""

    def __init__(self):
        self.real = kmesh_gpu.tree_digests
        self.calls: list = []
        self.e0 = None
        self.t0 = 0.0

    def start(self) -> None:
        self.calls.clear()
        if torch.cuda.is_available():
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e0.record()
        self.t0 = time.perf_counter()

    def __call__(self, *args, **kwargs):
        if self.e0 is None:
            return self.real(*args, **kwargs)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        a.record()
        out = self.real(*args, **kwargs)
        b.record()
        self.calls.append((h0, time.perf_counter(), a, b))
        return out

    def read(self, last_landing: float) -> dict:
        """ms after the last landing (host clock; the GPU's through the start event)."""
        if self.e0 is None or not self.calls:
            return {}
        torch.cuda.synchronize()
        lag = last_landing - self.t0
        starts = [self.e0.elapsed_time(a) - lag * 1e3 for _, _, a, _ in self.calls]
        ends = [self.e0.elapsed_time(b) - lag * 1e3 for _, _, _, b in self.calls]
        return {"digest calls": len(self.calls),
                "digest host call ms (median)": statistics.median((h1 - h0) * 1e3 for h0, h1, _, _ in self.calls),
                "digest device ms (median)": statistics.median(e - s for s, e in zip(starts, ends)),
                "last digest starts on GPU (after last landing)": max(starts),
                "last digest done on GPU (after last landing)": max(ends)}


def child_steps(trace, report, digests: DigestTimes | None = None) -> dict:
    """A child's stamps as ms after its last object landed (the route's read end)."""
    names = [n for n, _ in trace]
    landed = [t for n, t in trace if n == "objects landed, digests queued"]
    start = trace[0][1]
    last = max(landed) if landed else start
    out = {"read_ms": report.timings["read_s"] * 1e3, "tail_ms": report.timings["tail_s"] * 1e3,
           "restore_ms": report.timings["restore_s"] * 1e3,
           "landings_spread_ms": (max(landed) - min(landed)) * 1e3 if landed else 0.0,
           "placement_prepared_after_start_ms": None}
    for n, t in trace:
        if n == "placement prepared":
            out["placement_prepared_after_start_ms"] = (t - start) * 1e3
        elif n in ("loads settled", "roots downloaded", "roots compared", "verified", "placement launched", "synced",
                   "end"):
            out[f"{n} (after last landing)"] = (t - last) * 1e3
    if digests is not None:
        out.update(digests.read(last))
    out["stamps"] = names
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--data-dir", default=None, help="default: a temporary folder under perf/out")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ab", action="store_true", help="compare the tail's arrangements (see AB) instead of modes")
    args = ap.parse_args(argv)
    from kmesh_host import _streams
    modes = list(AB) if args.ab else list(MODES)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = Path(__file__).resolve().parent.parent / "perf" / "out"
    base.mkdir(parents=True, exist_ok=True)
    tmp = args.data_dir or tempfile.mkdtemp(prefix="tailprobe-", dir=base)
    try:
        work, _ = rs.retained_child(tmp, device)
        cfg = rs.HostTierConfig(budget_bytes=64 * rs.MIB, pin=device.type == "cuda", retain=True, singleflight=False,
                                verify="none", read_threads=16, chunk_bytes=rs.MIB, parallel_loads=4)
        rows = {m: [] for m in modes}

        def child(m, c):
            if m in AB:
                routes_mod.JOIN_BEFORE_COMPARE, _streams._Streams.DRIVER_JOIN = AB[m]
                try:
                    return work.child("host_staging", c, tier, verify="device", evict=True)
                finally:
                    routes_mod.JOIN_BEFORE_COMPARE, _streams._Streams.DRIVER_JOIN = False, True
            return work.child("host_staging", c, tier, verify=m, evict=True)

        with HostTier(work.store, cfg) as tier:
            for m in modes:  # warm-up: kernels compiled, buffers pinned
                child(m, 0)
            routes_mod.TRACE = trace = []
            digests = kmesh_gpu.tree_digests = DigestTimes()
            try:
                for r in range(args.rounds):
                    for c in range(args.children):  # modes alternate child by child, order rotating
                        k = (r * args.children + c) % len(modes)
                        for m in modes[k:] + modes[:k]:
                            trace.clear()
                            digests.start()
                            run = child(m, c)
                            rows[m].append(child_steps(list(trace), run["report"], digests))
            finally:
                routes_mod.TRACE = None
                kmesh_gpu.tree_digests = digests.real
    finally:
        if args.data_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = {}
    print(f"forced-read children on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"{args.rounds} rounds x {args.children} children per mode; medians, ms")
    for m in modes:
        keys = list(dict.fromkeys(k for r in rows[m] for k in r if k != "stamps"))
        med = {}
        for k in keys:
            vals = [r[k] for r in rows[m] if r.get(k) is not None]
            med[k] = statistics.median(vals) if vals else None
        summary[m] = med
        print(f"  verify={m}")
        for k, v in med.items():
            print(f"    {k:<42}{'n/a' if v is None else f'{v:8.3f}'}")
    print("  stamps of one child per mode:")
    for m in modes:
        print(f"    {m}: {rows[m][-1]['stamps']}")
    if args.ab:
        a, b = (rows[m] for m in AB)
        ratios = sorted(x["restore_ms"] / y["restore_ms"] for x, y in zip(a, b))
        tails = [x["tail_ms"] - y["tail_ms"] for x, y in zip(a, b)]
        print(f"  per-child ratio of restore times (root events / joined): median {statistics.median(ratios):.3f} "
              f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}..{statistics.quantiles(ratios, n=4)[2]:.3f}); "
              f"median tail difference {statistics.median(tails):+.3f} ms")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_forced_read_tail.json"), "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
