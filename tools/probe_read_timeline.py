"""When each chunk of a forced-read child lands, read raw and through the route (GPU machine).

``tools/probe_read_factors.py`` found the route's read interval 8–13% longer than the same ranges
read raw with the same engine, and ~4% longer with ``verify="none"``. This probe asks where that
time goes: whether the disk delivers the chunks later (completions spaced further apart from the
first one on) or the completion thread sees them later (completions piling up while it runs the
previous chunks' callbacks). It records the io_uring completion thread's wake-ups
(``kmesh_host.uring.TRACE``: each wake-up's time, how many completions it reaped, when their
callbacks were done) for, round by round and order alternating, page cache dropped before each:

* ``raw``: the benchmark's same-shape raw read into page-locked buffers, each chunk copied to the
  GPU with one driver call from its callback (what the route does per chunk, nothing else);
* ``route``: ``restore_host_staging`` (tier evicted, verified on the device, placed);
* ``unchecked``: the route with ``verify="none"``;
* ``earlier``: the route with each chunk copied as it lands (``routes.OBJECT_COPIES`` off), each
  object hashed by its own launch as it lands (``routes.BATCH_LANDINGS`` off) and the placement
  launched after the host's root comparison (``routes.GATED_PLACEMENT`` off), as before this probe;
  ``--switches`` names a subset to turn off instead.

Per variant, medians over rounds (ms from the first submission): when the 1st, 4th, 8th, 12th and
last completion was reaped, when the last callback was done, the longest wake-up (callbacks of one
batch), the most completions reaped at once, and the callback time in all; for the route also its
``read_s`` and ``restore_s``, and when each of its steps (``routes.TRACE``) was stamped.

Usage: PYTHONPATH=. python tools/probe_read_timeline.py [--rounds 12] [--switches GATED_PLACEMENT,...] [--out DIR]
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
import run_ssd_routes as rs  # noqa: E402
from probe_read_factors import Reader  # noqa: E402

from kmesh_host import HostTier, uring  # noqa: E402
from kmesh_host import routes as routes_mod  # noqa: E402
from kmesh_host.direct_io import ReadEngine  # noqa: E402

VARIANTS = ("raw", "route", "unchecked", "earlier")
EARLIER = ("OBJECT_COPIES", "GATED_PLACEMENT", "BATCH_LANDINGS")  # the switches "earlier" turns off


def summarise(trace: list) -> dict | None:
    """The figures of one run's trace (ms from its first submission)."""
    submits = [t for kind, t, *_ in trace if kind == "submit"]
    wakes = [w for w in trace if w[0] == "wake"]
    if not submits or not wakes:
        return None
    t0 = submits[0]
    landed = []  # reap time of each completion, in order
    for _, woke, n, _done in wakes:
        landed += [woke] * n
    out = {"completions": len(landed), "wakeups": len(wakes), "submissions": len(submits),
           "most_at_once": max(n for _, _, n, _ in wakes),
           "longest_wakeup_ms": max(d - w for _, w, _, d in wakes) * 1e3,
           "callbacks_ms": sum(d - w for _, w, _, d in wakes) * 1e3,
           "last_callback_ms": (wakes[-1][3] - t0) * 1e3}
    for k in (1, 4, 8, 12):
        if k <= len(landed):
            out[f"landed_{k}_ms"] = (landed[k - 1] - t0) * 1e3
    out["landed_last_ms"] = (landed[-1] - t0) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--switches", default=",".join(EARLIER),
                    help="the kmesh_host.routes switches the 'earlier' variant turns off (default: all of them)")
    args = ap.parse_args()
    switches = [x.strip().upper() for x in args.switches.split(",") if x.strip()]
    for switch in switches:
        if not isinstance(getattr(routes_mod, switch, None), bool):
            sys.exit(f"kmesh_host.routes has no switch {switch}")
    device = torch.device("cuda")
    if not uring.available()[0]:
        sys.exit(f"io_uring is not available here: {uring.available()[1]}")
    rows = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        work, cfg = rs.retained_child(tmp, device)
        engine = ReadEngine(16, 1 << 20, engine="io_uring")
        raw = Reader(work, engine, True, "driver", device)
        with HostTier(work.store, cfg) as tier:
            if tier.io_engine.engine != "io_uring":
                sys.exit(f"the tier reads through {tier.io_engine.engine}, not io_uring")
            for r in range(args.rounds + 1):
                names = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
                for name in names:
                    uring.TRACE = trace = []
                    routes_mod.TRACE = steps = []
                    try:
                        if name == "raw":
                            raw.once()
                            extra = {}
                        else:
                            for switch in switches:
                                setattr(routes_mod, switch, name != "earlier")
                            got = work.child("host_staging", r % 4, tier, evict=True,
                                             verify="none" if name == "unchecked" else "device")
                            extra = {"read_s_ms": got["read_s"] * 1e3, "restore_s_ms": got["restore_s"] * 1e3}
                    finally:
                        uring.TRACE = routes_mod.TRACE = None
                        for switch in switches:
                            setattr(routes_mod, switch, True)
                    fig = summarise(trace)
                    if r and fig is not None:  # the first round warms every path
                        t0 = next(t for kind, t, *_ in trace if kind == "submit")
                        at = {step: (t - t0) * 1e3 for step, t in steps}  # (before the submission: < 0)
                        rows[name].append({**fig, **extra, "steps": at})
        raw.close()
        engine.close()
    keys = ("landed_1_ms", "landed_4_ms", "landed_8_ms", "landed_12_ms", "landed_last_ms", "last_callback_ms",
            "longest_wakeup_ms", "callbacks_ms", "most_at_once", "wakeups", "read_s_ms", "restore_s_ms")
    med = {v: {k: statistics.median(x[k] for x in rows[v]) for k in keys if rows[v] and k in rows[v][0]}
           for v in VARIANTS}
    lines = [f"'earlier' = the route with {', '.join(switches)} off",
             f"forced-read child ({work.child_bytes / 2**20:.0f} MiB, {len(work.keys)} objects), io_uring queue depth "
             f"16, 1 MiB chunks, O_DIRECT, page cache dropped; {args.rounds} rounds, order alternating; medians, "
             "ms from the first submission"]
    lines.append(f"  {'':<22}" + "".join(f"{v:>11}" for v in VARIANTS))
    for k in keys:
        lines.append(f"  {k:<22}" + "".join(f"{med[v][k]:>11.3f}" if k in med[v] else f"{'':>11}" for v in VARIANTS))
    lines.append("  route steps from the first submission (the last stamp of each name per child; medians, ms):")
    for v in ("route", "earlier"):
        names = list(dict.fromkeys(k for x in rows[v] for k in x["steps"]))
        for k in names:
            got = [x["steps"][k] for x in rows[v] if k in x["steps"]]
            lines.append(f"    {v:<8} {k:<58} {statistics.median(got):>8.3f}  ({len(got)} children)")
    ratios = {}
    for name in ("route", "unchecked"):
        pairs = [(a["restore_s_ms"], b["restore_s_ms"]) for a, b in zip(rows[name], rows["earlier"])]
        if pairs:
            ratios[name] = statistics.median(a / b for a, b in pairs)
            lines.append(f"  restore {name} / earlier, per round: {ratios[name]:.3f}")
    report(args.out, "probe_read_timeline", lines, {"medians": med, "ratios_to_earlier": ratios, "runs": rows})


def report(out: str | None, name: str, lines: list, data: dict) -> None:
    """Print ``lines``; with ``out``, also write them to ``out/name.txt`` and ``data`` to ``out/name.json``."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.txt").write_text(text + "\n")
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
