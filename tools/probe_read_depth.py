"""A forced-read child at several read queue depths: do completions still arrive all at once?

``tools/probe_read_timeline.py`` shows the lent virtio disk completing all twelve chunk reads of a
child (queue depth 16) in one batch, so the route's landing work follows the last byte. With fewer
reads in flight, the first reads might complete (and be copied and hashed) while later ones are
still on the disk, at the price of a shallower queue. This probe reads the benchmark's child raw
(page-locked buffers, one driver copy per chunk) and through the route (tier evicted, verified on
the device, placed) with one reader per queue depth, rounds alternating the order, page cache
dropped before each, and reports per (variant, depth) the medians of: the first and last
completion (ms from the first submission), wake-ups of the completion thread, the most completions
reaped at once, the route's restore time, and the route's per-round ratio to the first depth given.

Usage: PYTHONPATH=. python tools/probe_read_depth.py [--depths 16,6,4] [--rounds 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_ssd_routes as rs  # noqa: E402
from probe_read_factors import Reader  # noqa: E402
from probe_read_timeline import report, summarise  # noqa: E402

from kmesh_host import HostTier, uring  # noqa: E402
from kmesh_host.direct_io import ReadEngine  # noqa: E402


def figures(trace: list) -> dict | None:
    """One run's figures, from :func:`probe_read_timeline.summarise` (ms from the first submission)."""
    got = summarise(trace)
    if got is None:
        return None
    return {"first_ms": got["landed_1_ms"], "last_ms": got["landed_last_ms"], "wakeups": got["wakeups"],
            "most_at_once": got["most_at_once"], "done_ms": got["last_callback_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="16,6,4")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    device = torch.device("cuda")
    if not uring.available()[0]:
        sys.exit(f"io_uring is not available here: {uring.available()[1]}")
    rows: dict = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        work, cfg = rs.retained_child(tmp, device)
        engines = {d: ReadEngine(d, 1 << 20, engine="io_uring") for d in depths}
        raws = {d: Reader(work, engines[d], True, "driver", device) for d in depths}
        tiers = {d: HostTier(work.store, dataclasses.replace(cfg, read_threads=d, io_engine="io_uring"))
                 for d in depths}
        combos = [(v, d) for d in depths for v in ("raw", "route")]
        try:
            for r in range(args.rounds + 1):
                for v, d in (combos if r % 2 == 0 else list(reversed(combos))):
                    uring.TRACE = trace = []
                    try:
                        if v == "raw":
                            raws[d].once()
                            extra = {}
                        else:
                            got = work.child("host_staging", r % 4, tiers[d], evict=True, verify="device")
                            extra = {"restore_ms": got["restore_s"] * 1e3}
                    finally:
                        uring.TRACE = None
                    fig = figures(trace)
                    if r and fig is not None:
                        rows.setdefault(f"{v}@{d}", []).append({**fig, **extra})
        finally:
            for t in tiers.values():
                t.close()
            for x in raws.values():
                x.close()
            for e in engines.values():
                e.close()
    keys = ("first_ms", "last_ms", "done_ms", "wakeups", "most_at_once", "restore_ms")
    med = {c: {k: statistics.median(x[k] for x in rs_) for k in keys if k in rs_[0]} for c, rs_ in rows.items()}
    lines = [f"forced-read child ({work.child_bytes / 2**20:.0f} MiB), io_uring, 1 MiB chunks, O_DIRECT, page cache "
             f"dropped; {args.rounds} rounds, order alternating; medians (ms from the first submission)"]
    lines.append(f"  {'':<12}" + "".join(f"{k:>14}" for k in keys))
    for c, m in med.items():
        lines.append(f"  {c:<12}" + "".join(f"{m[k]:>14.3f}" if k in m else f"{'':>14}" for k in keys))
    base = f"route@{depths[0]}"
    ratios = {}
    for d in depths[1:]:
        pairs = list(zip(rows.get(f"route@{d}", []), rows.get(base, [])))
        if pairs:
            ratios[d] = statistics.median(a["restore_ms"] / b["restore_ms"] for a, b in pairs)
            lines.append(f"  restore route@{d} / {base}, per round: {ratios[d]:.3f}")
    report(args.out, "probe_read_depth", lines, {"medians": med, "ratios": ratios, "runs": rows})


if __name__ == "__main__":
    main()
