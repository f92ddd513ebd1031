"""Where a forced-read child's landing time goes on the reader's completion thread (GPU machine).

``tools/probe_read_timeline.py`` shows the lent disk completing a child's twelve chunk reads
together, after which the io_uring completion thread runs every chunk's and object's callbacks one
after another before the restore can finish. This tool wraps (for this process only) the functions
those callbacks call with timers that count only on that thread, restores ``--children`` forced-read
children (tier evicted, page cache dropped, verified on the device, placed) and prints per function
the median per child of its calls and inclusive time on that thread and on the restoring (main)
thread, rows with no calls left out (nested functions are inside their callers' times: never add
the rows), next to the whole wake-ups' time from ``kmesh_host.uring.TRACE`` and the route's step
stamps (``routes.TRACE``, ms from the call's start, medians, with the thread that stamped).

Usage: PYTHONPATH=. python tools/profile_landing.py [--children 24] [--off EARLY_LANDINGS,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

from kmesh_gpu import _launch  # noqa: E402
from kmesh_gpu import sha256 as sha  # noqa: E402
from kmesh_host import HostTier, routes, tier as tier_mod, uring  # noqa: E402
from kmesh_host import direct_io  # noqa: E402
from kmesh_host._streams import _Streams  # noqa: E402

TIMES: dict[str, list] = {}  # "label [thread]" -> [calls, seconds], for the current child
THREADS = ("kmesh-uring", "MainThread")


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)
    slots = {t: TIMES.setdefault(f"{label} [{t}]", [0, 0.0]) for t in THREADS}

    def wrapped(*a, **k):
        slot = slots.get(threading.current_thread().name)
        if slot is None:
            return fn(*a, **k)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            slot[0] += 1
            slot[1] += time.perf_counter() - t0

    setattr(owner, name, staticmethod(wrapped) if isinstance(owner.__dict__.get(name), staticmethod) else wrapped)


WRAPPED = [
    (_launch, "copies_htod", "launch: copies_htod"),
    (direct_io.HostBuffer, "set_fence", "direct_io: HostBuffer.set_fence"),
    (direct_io, "_chunk_done", "engine: _chunk_done (a chunk's whole callback)"),
    (tier_mod._PipelinedLoad, "_chunk", "tier: _PipelinedLoad._chunk"),
    (tier_mod._PipelinedLoad, "_finish", "tier: _PipelinedLoad._finish (an object's whole landing)"),
    (tier_mod.HostTier, "_entered", "tier: HostTier._entered"),
    (tier_mod.HostTier, "_count_read", "tier: HostTier._count_read"),
    (routes, "_copy_into", "route: _copy_into (one object's copy)"),
    (routes._Verifier, "landed_many", "route: _Verifier.landed_many"),
    (routes._Verifier, "_digest_to_table", "route: _Verifier._digest_to_table"),
    (_Streams, "digest_side", "streams: digest_side"),
    (_Streams, "copied", "streams: copied"),
    (_Streams, "work_after", "streams: work_after"),
    (sha, "_tree_launch", "sha256: _tree_launch"),
    (_launch, "copy_dtoh", "launch: copy_dtoh"),
    (_launch, "copy_htod", "launch: copy_htod"),
    (_launch.DriverEvent, "recorded", "launch: DriverEvent.recorded"),
    (tier_mod.HostLease, "fence", "tier: HostLease.fence"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--children", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--off", default="", help="kmesh_host.routes switches to turn off (comma separated)")
    args = ap.parse_args()
    for switch in filter(None, (x.strip().upper() for x in args.off.split(","))):
        if not isinstance(getattr(routes, switch, None), bool):
            sys.exit(f"kmesh_host.routes has no switch {switch}")
        setattr(routes, switch, False)
    device = torch.device("cuda")
    for owner, name, label in WRAPPED:
        _wrap(owner, name, label)
    # (classmethods: wrap the bound function)
    per_child: dict[str, list] = {label: [] for label in TIMES}
    wakes = []
    stamps: dict[str, list] = {}
    real_stamp = routes._stamp

    def stamp(step: str) -> None:  # the route's stamps, with the thread that made them
        if routes.TRACE is not None:
            routes.TRACE.append((step, time.perf_counter(), threading.current_thread().name))

    routes._stamp = stamp
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        work, cfg = rs.retained_child(tmp, device)
        with HostTier(work.store, cfg) as tier:
            for c in range(args.children + 2):
                for slot in TIMES.values():
                    slot[0], slot[1] = 0, 0.0
                uring.TRACE = trace = []
                routes.TRACE = steps = []
                try:
                    work.child("host_staging", c % 4, tier, evict=True, verify="device")
                finally:
                    uring.TRACE = routes.TRACE = None
                if c >= 2:
                    t0 = steps[0][1]
                    for step, t, who in steps:
                        stamps.setdefault(f"{step} [{who}]", []).append((t - t0) * 1e3)
                if c >= 2:  # two warm-up children
                    for label in per_child:
                        per_child[label].append(tuple(TIMES[label]))
                    wakes.append(sum(d - w for kind, w, *rest in trace if kind == "wake" for d in rest[1:]))
    lines = [f"forced-read child, {args.children} children; per child on the completion thread, medians: "
             f"calls, inclusive us (nested rows are inside their callers)",
             f"  {'wake-ups (callbacks of every reaped read)':<72} {statistics.median(wakes) * 1e6:9.1f} us"]
    for label, rows in per_child.items():
        calls = statistics.median(r[0] for r in rows)
        us = statistics.median(r[1] for r in rows) * 1e6
        if calls:
            lines.append(f"  {label:<72} {calls:5.0f} x {us:9.1f} us")
    lines.append("route steps (ms since the call's start, medians; [thread]):")
    for step, ts in sorted(stamps.items(), key=lambda kv: statistics.median(kv[1])):
        lines.append(f"  {step:<72} {statistics.median(ts):8.3f}  ({len(ts)} stamps)")
    routes._stamp = real_stamp
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "profile_landing" + (f"_off_{args.off.replace(',', '_')}" if args.off else "")
        (Path(args.out) / f"{name}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
