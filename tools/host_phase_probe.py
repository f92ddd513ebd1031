"""Why the same host-tier child runs slower in one phase of a process than in another.

One process, one host tier, the benchmark's workload (``perf/run_ssd_routes.py``); phases in turn:

* ``fresh``: right after the tier was loaded (what ``tools/profile_host_tier.py`` times);
* ``after-forced``: after ``--forced`` forced-read children (eviction, page cache dropped, O_DIRECT
  reads), as the benchmark's headline figure is measured;
* the same two again with the main thread pinned to one CPU (``--pin``; the tier's reading threads
  keep every CPU).

Per phase: the median host-tier child, the median of a fixed host-only calibration (one
``prepare_place_many`` of the child's placement, back to back), the main thread's voluntary and
involuntary context switches per child, how many CPUs it ran on, and the CPU time every other
thread of the process used while the children ran (a busy neighbour thread would show here), and
the machine's busy and hypervisor-stolen CPU fractions over the phase (``/proc/stat``).

Usage (GPU machine): PYTHONPATH=. python tools/host_phase_probe.py [--forced 16] [--children 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

import importlib  # noqa: E402

from kmesh_host import HostTier, HostTierConfig  # noqa: E402
from kmesh_host.routes import _kv_views  # noqa: E402

place_mod = importlib.import_module("kmesh_gpu.place")  # the module (the package exports the function)


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """``{tid: (name, CPU seconds)}`` of every thread of this process (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _switches() -> tuple[int, int]:
    """The calling thread's (voluntary, involuntary) context switches."""
    vol = inv = 0
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                inv = int(line.split()[1])
    return vol, inv


def _cpu_times() -> list[int]:
    """The whole machine's CPU jiffies (/proc/stat ``cpu`` line: user nice system idle iowait irq
    softirq steal ...)."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def _cpu_now() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2:].split()[36])  # field 39: the CPU it last ran on


def calibration(work, tier, device) -> float:
    """Median µs of one prepare_place_many of child 0's placement, back to back (host only)."""
    leases = [tier.acquire_resident(t.key, model_fingerprint=work.fp) for t in work.targets[0]]
    try:
        headers = [lease.header for lease in leases]
        offsets, total = [], 0
        for h in headers:
            offsets.append(total)
            total += h.padded_length
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        kvs = _kv_views(buffer, headers, offsets)
        ts = work.targets[0]
        args = dict(rope=work.rope, old_positions=[torch.as_tensor(h.positions) for h in headers],
                    new_positions=[t.new_positions for t in ts])
        times = []
        for _ in range(200):
            t = time.perf_counter()
            place_mod.prepare_place_many(kvs, work.cache, work.layout, [t.slots for t in ts], **args)
            times.append(time.perf_counter() - t)
        return statistics.median(times[50:]) * 1e6
    finally:
        for lease in leases:
            lease.release()


def phase(work, tier, device, n: int) -> dict:
    me = threading.get_native_id()
    before = _thread_cpu()
    sw0 = _switches()
    jiffies0 = _cpu_times()
    walls, cpus = [], set()
    for c in range(n):
        r = work.child("host_staging", c % len(work.targets), tier, verify="device", evict=False)
        walls.append(r["restore_s"] * 1e3)
        cpus.add(_cpu_now())
    sw1 = _switches()
    jiffies = [b - a for a, b in zip(jiffies0, _cpu_times())]
    after = _thread_cpu()
    others = {}
    for tid, (name, cpu) in after.items():
        if tid == me:
            continue
        used = cpu - before.get(tid, (name, 0.0))[1]
        if used > 0:
            others[f"{name}[{tid}]"] = round(used * 1e3, 1)
    return {"child_ms": round(statistics.median(walls), 4), "child_min_ms": round(min(walls), 4),
            "prepare_alone_us": round(calibration(work, tier, device), 1),
            "voluntary_switches_per_child": round((sw1[0] - sw0[0]) / n, 2),
            "involuntary_switches_per_child": round((sw1[1] - sw0[1]) / n, 2),
            "cpus_seen": sorted(cpus), "other_threads_cpu_ms": others,
            # the machine as a whole while the children ran: busy (user+system) and stolen by the
            # hypervisor, as fractions of all CPU time
            "machine_busy": round((jiffies[0] + jiffies[2]) / max(1, sum(jiffies)), 4),
            "machine_steal": round(jiffies[7] / max(1, sum(jiffies)), 4) if len(jiffies) > 7 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--children", type=int, default=40)
    ap.add_argument("--forced", type=int, default=16, help="forced-read children between the phases")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pin", type=int, default=None, help="CPU for the main thread in the pinned rounds "
                    "(default: the one it runs on)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    results = []
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        wargs = argparse.Namespace(data_dir=tmp, shift=True, objects=4, tokens=256, place=True, children=4)
        work = rs.Workload(wargs, device)
        cfg = HostTierConfig(budget_bytes=64 * rs.MIB, pin=device.type == "cuda", retain=True, singleflight=False,
                             verify="none", read_threads=16, chunk_bytes=rs.MIB, parallel_loads=4)
        all_cpus = os.sched_getaffinity(0)
        with HostTier(work.store, cfg) as tier:
            work.child("host_staging", 0, tier, verify="device", evict=False)
            for _ in range(20):
                work.child("host_staging", 1, tier, verify="device", evict=False)
            for rnd in range(args.rounds):
                for pinned in (False, True):
                    if pinned:
                        cpu = args.pin if args.pin is not None else _cpu_now()
                        os.sched_setaffinity(threading.get_native_id(), {cpu})
                    try:
                        fresh = phase(work, tier, device, args.children)
                        for c in range(args.forced):
                            work.child("host_staging", c % 4, tier, verify="device", evict=True)
                        # the tier holds the objects again (the last forced reads loaded them): the
                        # first child after is a hit, as in the benchmark after its 20 warm-up children
                        after = phase(work, tier, device, args.children)
                    finally:
                        os.sched_setaffinity(threading.get_native_id(), all_cpus)
                    for name, res in (("fresh", fresh), ("after-forced", after)):
                        res.update(round=rnd, phase=name, main_thread_pinned=pinned)
                        results.append(res)
                        print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_phase_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
