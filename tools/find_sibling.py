"""Which CPU, kept busy, slows a given CPU's Python the most (its hyperthread sibling, as a rule):
for the A/B tools, to put the benchmark thread deliberately on a half-speed virtual CPU (the state
the lent machine's CPUs fall into by themselves, for seconds at a time) instead of waiting for it.

For every other CPU j: a spinning process pinned to j, then this thread (pinned to ``--cpu``) times
``cpu_speed_map``'s loop; prints ns per iteration with each j busy, the idle figure, and the
slowest j last as ``sibling=J``.

Usage: python tools/find_sibling.py --cpu 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_speed_map  # noqa: E402

SPIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def spinner(cpu: int) -> subprocess.Popen:
    """A process spinning on ``cpu`` until killed."""
    return subprocess.Popen([sys.executable, "-c", SPIN, str(cpu)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", type=int, default=4)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    idle = cpu_speed_map.speed(20.0)
    print(f"cpu {args.cpu} idle neighbours: {idle:.0f} ns/iteration")
    found = {}
    for j in sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))):
        if j == args.cpu:
            continue
        p = spinner(j)
        time.sleep(0.1)
        found[j] = cpu_speed_map.speed(20.0)
        p.kill()
        p.wait()
        print(f"  cpu {j:2d} busy: {found[j]:.0f} ns/iteration")
    j = max(found, key=found.get)
    print(f"sibling={j} ({found[j] / idle:.2f}x the idle time)")


if __name__ == "__main__":
    main()
