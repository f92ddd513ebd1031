"""A/B of a switch of the all-resident restore's placement in one process: ``--switch lane``
(``kmesh_host.routes.LANE``: ``True``, prepared and launched in one compiled call, against
``False``, in steps as the other paths) or another module-level switch of ``kmesh_host.routes``
named by ``--switch NAME`` (``True`` against ``False``).
Each round restores the 12 MiB host-tier child once per setting, alternating which goes first, next
to one pinned H2D copy of the same bytes (as ``perf/run_ssd_routes.py`` times it); reports
per-setting medians, per-round ratios to ``False``, each setting's fraction of the H2D copy, the
route's step stamps per setting, and the interpreter's speed on this thread's CPU afterwards.
``--timeline N``: then N children per setting under the torch profiler (device activity only):
the device span from the first copy's start to the last copy's end and from there to the last
kernel's end (the tail the placement adds after the DMA), medians.

``--spin-cpus J,K,..`` keeps those CPUs busy meanwhile (on the lent machine any busy CPU from 3 up
slows CPU 4's Python ~1.9x, ``tools/find_sibling.py``), so the host-bound case is measured on
purpose rather than whenever the machine's CPUs happen to slow down.

Usage (GPU machine): PYTHONPATH=. taskset -c 4 python tools/ab_lane.py [--switch lane] [--rounds 60]
    [--timeline 20] [--spin-cpus J,K] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_speed_map  # noqa: E402
import find_sibling  # noqa: E402
import run_ssd_routes as rs  # noqa: E402

from kmesh_host import HostTier  # noqa: E402
from kmesh_host import routes as routes_mod  # noqa: E402

LANES = (True, False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--switch", default="lane", help="the routes module's switch (lane: routes.LANE)")
    ap.add_argument("--timeline", type=int, default=0, help="children per setting under the profiler afterwards")
    ap.add_argument("--out", default=None)
    ap.add_argument("--spin-cpus", default="", help="comma-separated CPUs to keep busy during the rounds")
    args = ap.parse_args()
    args.spin_cpus = [int(c) for c in args.spin_cpus.split(",") if c]
    spins = [find_sibling.spinner(c) for c in args.spin_cpus]
    try:
        run(args)
    finally:
        for p in spins:
            p.kill()
            p.wait()


def device_spans(work, tier, children: int) -> dict:
    """Median device spans (us) of ``children`` host-tier children, each run alone: the first copy's
    start to the last copy's end (``dma``), and the last copy's end to the last kernel's end (``tail``)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in range(children):
                torch.cuda.synchronize()
                torch.cuda._sleep(2_000_000)  # a gap of ~1 ms on the device between children
                torch.cuda.synchronize()
                work.child("host_staging", c % 4, tier, verify="device", evict=False)
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel")),
                 key=lambda e: e["ts"])
    groups, cur = [], []
    for e in gpu:
        if "spin" in e.get("name", "").lower() or "sleep" in e.get("name", "").lower():  # the spacer ends a child
            if cur:
                groups.append(cur)
            cur = []
            continue
        cur.append(e)
    if cur:
        groups.append(cur)
    dma, tail = [], []
    for g in groups:
        copies = [e for e in g if e["cat"] == "gpu_memcpy" and e["dur"] > 5]  # the objects, not the table
        kernels = [e for e in g if e["cat"] == "kernel"]
        if not copies or not kernels:
            continue
        end = max(e["ts"] + e["dur"] for e in copies)
        dma.append(end - min(e["ts"] for e in copies))
        tail.append(max(e["ts"] + e["dur"] for e in kernels) - end)
    return {"children": len(dma), "dma_us": statistics.median(dma) if dma else None,
            "tail_us": statistics.median(tail) if tail else None}


def run(args) -> None:
    device = torch.device("cuda")
    out = {"rounds": args.rounds, "switch": args.switch, "spin_cpus": args.spin_cpus, "lanes": {}}
    switch = args.switch.upper()
    if not isinstance(getattr(routes_mod, switch, None), bool):
        raise SystemExit(f"kmesh_host.routes has no switch {switch}")
    with tempfile.TemporaryDirectory() as tmp:
        work, cfg = rs.retained_child(tmp, device)
        with HostTier(work.store, cfg) as tier:
            work.child("host_staging", 0, tier, verify="device", evict=False)
            for lane in LANES * 5:  # warm every lane
                setattr(routes_mod, switch, lane)
                work.child("host_staging", 1, tier, verify="device", evict=False)
            ref = rs.PairedH2D(device, work.child_bytes)
            walls = {lane: [] for lane in LANES}
            steps = {lane: {} for lane in LANES}
            refs = []
            routes_mod.TRACE = trace = []
            for r in range(args.rounds):
                refs.append(ref.once())
                order = LANES if r % 2 == 0 else LANES[::-1]
                for lane in order:
                    setattr(routes_mod, switch, lane)
                    trace.clear()
                    got = work.child("host_staging", r % 4, tier, verify="device", evict=False)
                    assert got["report"].placed and got["report"].tier_sources == {"hit": 4}
                    walls[lane].append(got["restore_s"])
                    for (_, a), (name, b) in zip(trace, trace[1:]):
                        steps[lane].setdefault(name, []).append(b - a)
            routes_mod.TRACE = None
            spans = {}
            for lane in LANES if args.timeline else ():
                setattr(routes_mod, switch, lane)
                spans[lane] = device_spans(work, tier, args.timeline)
            setattr(routes_mod, switch, True)
            ref.close()
    speed = cpu_speed_map.speed(5.0)  # (before the spinner stops)
    lines = [f"host-tier child (12 MiB, 4 objects, RoPE shift), {args.rounds} rounds, lanes alternating; "
             f"pinned H2D copy median {statistics.median(refs) * 1e6:.1f} us; "
             f"this thread's CPU afterwards {speed:.0f} ns/iteration (~82 = full speed)"
             + (f"; CPUs {args.spin_cpus} kept busy" if args.spin_cpus else "")]
    base = walls[False]
    for lane in LANES:
        w = walls[lane]
        ratios = [a / b for a, b in zip(w, base)]
        fr = [h / a for h, a in zip(refs, w)]
        row = {"restore_us_median": statistics.median(w) * 1e6, "ratio_to_steps_median": statistics.median(ratios),
               "fraction_of_h2d_median": statistics.median(fr),
               "fraction_of_h2d_quartiles": statistics.quantiles(fr, n=4)[::2],
               "steps_us": {k: statistics.median(v) * 1e6 for k, v in steps[lane].items()}}
        out["lanes"][str(lane)] = row
        if lane in spans:
            row["device"] = spans[lane]
        lines.append(f"{switch}={lane!s:<6} restore {row['restore_us_median']:.1f} us, ratio to False "
                     f"{row['ratio_to_steps_median']:.3f}, {row['fraction_of_h2d_median']:.1%} of the H2D copy "
                     f"(quartiles {row['fraction_of_h2d_quartiles'][0]:.1%}..{row['fraction_of_h2d_quartiles'][1]:.1%})")
        lines.append("    steps (us): " + ", ".join(f"{k} {v:.1f}" for k, v in row["steps_us"].items()))
        if lane in spans and spans[lane]["dma_us"] is not None:
            sp = spans[lane]
            lines.append(f"    device ({sp['children']} children): copies {sp['dma_us']:.1f} us, then "
                         f"{sp['tail_us']:.1f} us to the last kernel's end")
    out["h2d_us_median"] = statistics.median(refs) * 1e6
    out["python_ns_per_iteration"] = speed
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"ab_{args.switch}.txt").write_text(text + "\n")
        (Path(args.out) / f"ab_{args.switch}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
