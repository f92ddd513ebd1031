"""What fills the tail of a forced-read restore (host_staging, 12 MiB child read with O_DIRECT): host
time stamps of the steps after the last object lands, per child, medians over the children.

Wraps (for this process only) the route's verifier, placement and synchronisation steps with time
stamps; ``read_end`` is the reader thread's stamp of the last object's load completing.

Usage (GPU machine): PYTHONPATH=. python tools/profile_forced_read.py [--children 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

from kmesh_host import HostTier, HostTierConfig, routes  # noqa: E402

STAMPS: dict[str, list[float]] = {}


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapped(*a, **k):
        STAMPS.setdefault(label + ".start", []).append(time.perf_counter())
        try:
            return fn(*a, **k)
        finally:
            STAMPS.setdefault(label + ".end", []).append(time.perf_counter())
    setattr(owner, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--children", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _wrap(routes._Verifier, "landed_many", "landed")
    _wrap(routes._Verifier, "finish", "finish")
    _wrap(routes._Placement, "run", "place")
    _wrap(routes._Streams, "join", "join")
    _wrap(routes._Streams, "sync", "sync")
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        wargs = argparse.Namespace(data_dir=tmp, shift=True, objects=4, tokens=256, place=True, children=4)
        work = rs.Workload(wargs, device)
        cfg = HostTierConfig(budget_bytes=64 * rs.MIB, pin=device.type == "cuda", retain=False, singleflight=False,
                             verify="none", read_threads=16, chunk_bytes=rs.MIB, parallel_loads=4)
        rows = []
        with HostTier(work.store, cfg) as tier:
            work.child("host_staging", 0, tier, verify="device", evict=True)  # warm-up
            for c in range(args.children):
                STAMPS.clear()
                t_call = time.perf_counter()
                r = work.child("host_staging", c % 4, tier, verify="device", evict=True)
                t0 = t_call + (r["outer_s"] - r["restore_s"])  # approx. restore start (eviction precedes it)
                read_end = t0 + r["read_s"]
                last = max(STAMPS["landed.start"])
                rows.append({
                    "last landed() call after the last load completed": last - read_end,
                    "last landed() (digest launch)": max(STAMPS["landed.end"]) - last,
                    "until finish() starts": STAMPS["finish.start"][-1] - max(STAMPS["landed.end"]),
                    "finish() (roots compared, one sync)": STAMPS["finish.end"][-1] - STAMPS["finish.start"][-1],
                    "until placement run": STAMPS["place.start"][-1] - STAMPS["finish.end"][-1],
                    "placement run (launch)": STAMPS["place.end"][-1] - STAMPS["place.start"][-1],
                    "join + sync": STAMPS["sync.end"][-1] - STAMPS["place.end"][-1],
                    "tail_s (route's own)": r["tail_s"],
                    "restore_s": r["restore_s"],
                    "read_s": r["read_s"],
                })
    lines.append(f"forced-read children: {len(rows)}; medians (ms)")
    for k in rows[0]:
        lines.append(f"  {k:52s} {statistics.median(x[k] for x in rows) * 1e3:8.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_forced_read.txt").write_text(text)


if __name__ == "__main__":
    main()
