"""In-process restore of perf/bench_service.py's seed child into one allocation per layer (vLLM's
own caches) against one cache tensor, and per-layer through the placement's general path (the fast
path switched off: what per-layer caches took before it covered them); alternating per round,
synchronised wall time per restore, medians.

Usage: PYTHONPATH=. python tools/ab_per_layer.py [--rounds 201]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

place_mod = importlib.import_module("kmesh_gpu.place")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=201)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dev = args.device
    layout, rope, plan, resident = bs.child_setup(dev)
    whole = bs._local(layout, dev, False)
    layers = bs._local(layout, dev, True)
    general = bs._local(layout, dev, True)

    def run(cache, fast: bool):
        place_mod._FAST = fast
        try:
            t = time.perf_counter()
            bs.in_process_restore(cache, layout, rope, resident, plan, dev)
            return time.perf_counter() - t
        finally:
            place_mod._FAST = True

    variants = {"one tensor, fast path": (whole, True), "per-layer, fast path": (layers, True),
                "per-layer, general path": (general, False)}
    names = list(variants)
    for name in names:
        for _ in range(5):
            run(*variants[name])
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            times[name].append(run(*variants[name]))
    same = torch.equal(bs._bytes(layers), bs._bytes(general)) and torch.equal(bs._bytes(layers), bs._bytes(whole))
    print(f"seed child in-process on {dev}: {args.rounds} rounds, medians (us); bit-identical across the three: {same}")
    base = statistics.median(times[names[1]])
    for name in names:
        m = statistics.median(times[name])
        print(f"  {name:<26}{m * 1e6:>10.1f}   x{m / base:.2f} of per-layer fast")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
