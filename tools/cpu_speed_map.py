"""How fast each CPU of this machine runs the same pure-Python work, now.

The calling thread is pinned to each CPU in turn and times a fixed interpreter-bound loop (dict and
attribute work, no memory traffic to speak of); ``--rounds`` sweeps show whether a CPU is slow
steadily (a virtual CPU that shares its physical core with a busy neighbour, say) or only at times.
Prints ns per loop iteration for every CPU and round, and each CPU's median relative to the fastest.

Usage: python tools/cpu_speed_map.py [--rounds 3] [--ms 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time


def _work(n: int) -> int:
    d, acc = dict.fromkeys(range(64), 0), 0
    for i in range(n):
        d[i & 63] = i
        acc += d[(i * 7) & 63]
    return acc


def speed(ms: float) -> float:
    """ns per iteration of :func:`_work`, best of three bursts of about ``ms`` each."""
    n = 2000
    _work(n)
    t = time.perf_counter()
    _work(n)
    per = (time.perf_counter() - t) / n
    n = max(2000, int(ms / 1e3 / per))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        _work(n)
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e9


def sweep(cpus: list[int], ms: float) -> dict[int, float]:
    me = threading.get_native_id()
    keep = os.sched_getaffinity(me)
    out = {}
    try:
        for cpu in cpus:
            os.sched_setaffinity(me, {cpu})
            out[cpu] = speed(ms)
    finally:
        os.sched_setaffinity(me, keep)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ms", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    rounds = [sweep(cpus, args.ms) for _ in range(args.rounds)]
    med = {c: statistics.median(r[c] for r in rounds) for c in cpus}
    fastest = min(med.values())
    print(f"ns per iteration by CPU ({args.rounds} rounds); last column: median / fastest CPU's median")
    for c in cpus:
        print(f"  cpu {c:>3}: " + " ".join(f"{r[c]:7.2f}" for r in rounds) + f"   x{med[c] / fastest:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": [{str(c): v for c, v in r.items()} for r in rounds],
                       "relative": {str(c): med[c] / fastest for c in cpus}}, f, indent=1)


if __name__ == "__main__":
    main()
