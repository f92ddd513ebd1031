"""Where a host-tier restore's host time goes, function by function, inside the route (not in a
loop of one call, where everything stays in the CPU's caches): each listed function is wrapped with
a timer, 40 children of the 12 MiB host-tier workload run, and the inclusive time per child of
each (all its calls in that child added up) is reported as the median over the children.

A wrapper adds ~0.3 µs per call; the totals are for comparing the parts, the route's own stamps
(tools/profile_host_tier.py) for its wall.

Usage (GPU machine): PYTHONPATH=. python tools/profile_route_prepare.py
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

from kmesh_host import HostTier  # noqa: E402

# (module, attribute, label): module attributes the route's code looks up at call time
TARGETS = [
    ("kmesh_host.tier", "HostTier.acquire_resident_many", "tier.acquire_resident_many"),
    ("kmesh_host.routes", "_layout_offsets", "routes._layout_offsets"),
    ("kmesh_gpu._launch", "copies_htod", "_launch.copies_htod (4 copies)"),
    ("kmesh_host._streams", "_CallerStream.copied", "_CallerStream.copied (fence event)"),
    ("kmesh_host.routes", "_check_placement", "routes._check_placement"),
    ("kmesh_host.routes", "_Placement", "routes._Placement (whole preparation)"),
    ("kmesh_host.routes", "_addresses", "routes._addresses"),
    ("kmesh_host.routes", "_prepare_at", "place._prepare_at"),
    ("kmesh_gpu.place", "_check_args", "place._check_args"),
    ("kmesh_gpu.place", "_facts", "place._facts"),
    ("kmesh_gpu.place", "_fast_tables", "place._fast_tables"),
    ("kmesh_gpu.place", "_host_ints", "place._host_ints"),
    ("kmesh_gpu.place", "_compiled_runs", "place._compiled_runs"),
    ("kmesh_gpu._place_driver", "prepare_runs", "_place_driver.prepare_runs"),
    ("kmesh_gpu._table_ring", "TableRing.reserve", "TableRing.reserve"),
    ("kmesh_gpu._driver_jit", "build_upload", "_driver_jit.build_upload"),
    ("kmesh_gpu._place_driver", "_launch_plan", "_place_driver._launch_plan"),
    ("kmesh_gpu.place", "_Launch.run", "place._Launch.run (launch)"),
    ("torch", "cat", "torch.cat (every call)"),
    ("torch", "empty", "torch.empty (every call)"),
    ("kmesh_gpu._launch", "current_stream", "_launch.current_stream (every call)"),
    ("kmesh_gpu._place_driver", "_state", "_place_driver._state"),
    ("kmesh_gpu._place_driver", "_i64", "_place_driver._i64"),
    ("kmesh_host.routes", "_new_report", "routes._new_report"),
    ("kmesh_host.routes", "_Verifier", "routes._Verifier"),
    ("kmesh_host.routes", "_finish_report", "routes._finish_report"),
    ("kmesh_host._streams", "_CallerStream.sync", "_CallerStream.sync (the wait)"),
]


def _wrap(fn, label, spent):
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
    return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--children", type=int, default=40)
    args = ap.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        work, cfg = rs.retained_child(tmp, device)
        with HostTier(work.store, cfg) as tier:
            work.child("host_staging", 0, tier, verify="device", evict=False)
            for c in range(20):
                work.child("host_staging", c % 4, tier, verify="device", evict=False)
            spent: dict = {}
            for mod_name, attr, label in TARGETS:
                obj = importlib.import_module(mod_name)
                *owner_path, name = attr.split(".")
                for part in owner_path:
                    obj = getattr(obj, part)
                setattr(obj, name, _wrap(getattr(obj, name), label, spent))
            per_child: dict = {label: [] for _, _, label in TARGETS}
            walls = []
            for c in range(args.children):
                spent.clear()
                r = work.child("host_staging", c % 4, tier, verify="device", evict=False)
                walls.append(r["restore_s"])
                for label in per_child:
                    per_child[label].append(spent.get(label, 0.0))
    print(f"host-tier child (4 x 3 MiB, RoPE shift) on {torch.cuda.get_device_name()}: restore median "
          f"{statistics.median(walls) * 1e3:.3f} ms with the timers; inclusive µs per child (median of "
          f"{args.children}):")
    for label, vals in per_child.items():
        print(f"  {label:<42} {statistics.median(vals) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
