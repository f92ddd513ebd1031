"""GPU tree digest, one-launch (fused) path against the one-launch-per-level path, on one GPU.

12 MiB = 4 objects x 3 MiB resident on the device (the issue 3 workload), each call timed three ways:
wall (synchronised start -> 128 digest bytes on the host), host issue time (until the call returns)
and CUDA-event span (events recorded on the stream right before and after the call: includes any wait
of the GPU for the host). Conditions: back to back; after a 10 ms sleep; after ~10 ms of CPU hashing
(the GPU idle meanwhile, as in the rotating-order benchmark). In every trial each method runs once,
in an order rotated by one per trial; medians over --trials (>= 9). The CPU whole-object SHA-256 with
its download (the target's reference, 20x) runs in the same rotation. Methods: ``tree_digests`` (the
public call; repeated calls take its fast path: no checks beyond a cached key, one allocation, one
launch), the fused path with self-resetting counters (the same code, through ``_tree_digests_path``)
and with a memset, and the one-launch-per-level path. "call" is the issue time of the call alone (the
event record before it left out). Then the host path of ``tree_digests`` step by step (microseconds,
hot: back to back; cold: after CPU hashing with the GPU idle), and 1 GiB throughput of the paths.

Usage (GPU machine): PYTHONPATH=. python3 tools/sha256_gpu_probe.py [--trials 15] [--big-mib 1024]
                     [--out report.txt]   (the whole report is also written there)
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time

import numpy as np
import torch

from kmesh_gpu import sha256 as sha
from kmesh_host import tree_digest

MIB = 1 << 20
REPORT: list[str] = []


def say(line: str = "") -> None:
    """Print a report line and keep it for --out."""
    print(line, flush=True)
    REPORT.append(line)


def _methods(data, offs, lens, download, host_view):
    def cpu_sha256_download():
        download.copy_(data)
        v = memoryview(download.numpy())
        return [hashlib.sha256(v[o:o + n]).digest() for o, n in zip(offs.tolist(), lens.tolist())]

    def path(name, counters=None):
        return lambda: sha._tree_digests_path(data, offs, lens, path=name, counters=counters)

    return {
        "tree_digests": lambda: sha.tree_digests(data, offs, lens, backend="cupy"),
        "fused_reset": path("fused", "reset"),
        "fused_memset": path("fused", "memset"),
        "levels": path("levels"),
        "cpu_sha256_download": cpu_sha256_download,
    }


def _one(fn):
    """(wall ms, issue ms, event span ms, call ms) of one call, digests on the host at the end. Issue
    time includes the event record before the call; "call" is the call alone."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a.record()
    tc = time.perf_counter()
    d = fn()
    t1 = time.perf_counter()
    b.record()
    if isinstance(d, torch.Tensor):
        d.cpu()
    t2 = time.perf_counter()
    b.synchronize()
    return (t2 - t0) * 1e3, (t1 - t0) * 1e3, a.elapsed_time(b), (t1 - tc) * 1e3


def _fmt(xs):
    return f"{statistics.median(xs):8.3f} (min {min(xs):7.3f}, max {max(xs):7.3f})"


def small(args) -> None:
    dev = torch.device("cuda")
    n, size = args.objects, int(args.object_mib * MIB)
    host = torch.from_numpy(np.random.default_rng(0).integers(0, 256, n * size, dtype=np.uint8)).pin_memory()
    data = host.to(dev)
    offs = np.arange(n, dtype=np.int64) * size
    lens = np.full(n, size, dtype=np.int64)
    download = torch.empty_like(host).pin_memory()
    raw = host.numpy().tobytes()
    want = [tree_digest(raw[o:o + size]) for o in offs.tolist()]
    methods = _methods(data, offs, lens, download, raw)
    for name, fn in methods.items():                  # warm up, compile, check
        for _ in range(3):
            got = fn()
        if name != "cpu_sha256_download":
            assert [bytes(r) for r in got.cpu().numpy()] == want, f"{name}: wrong digests"
    torch.cuda.synchronize()
    busy_bytes = raw[: max(1, int(args.cpu_busy_mib * MIB))]
    conditions = {
        "back-to-back": lambda: None,
        "after 10 ms sleep": lambda: time.sleep(0.010),
        f"after CPU hashing {args.cpu_busy_mib:g} MiB": lambda: hashlib.sha256(busy_bytes).digest(),
    }
    names = list(methods)
    say(f"device: {torch.cuda.get_device_name(dev)}; {n} x {args.object_mib:g} MiB; "
        f"{args.trials} trials per condition, method order rotated per trial")
    gpu_methods = [m for m in names if m != "cpu_sha256_download"]
    for cond, before in conditions.items():
        res = {m: ([], [], [], []) for m in names}
        for t in range(args.trials):
            k = t % len(names)
            for m in names[k:] + names[:k]:
                before()
                for col, v in zip(res[m], _one(methods[m])):
                    col.append(v)
        say(f"\n{cond}:  median ms (min, max)")
        say(f"  {'method':<22} {'wall':>30} {'host issue':>30} {'event span':>30} {'call':>30}")
        for m in names:
            say(f"  {m:<22} " + " ".join(f"{_fmt(col):>30}" for col in res[m]))
        cpu = res["cpu_sha256_download"][0]
        for m in gpu_methods:
            ratio = statistics.median([c / g for c, g in zip(cpu, res[m][0])])
            say(f"  paired cpu_sha256_download / {m}: {ratio:6.1f}x (target >= 20x)")
    host_steps(args, data, offs, lens, busy_bytes)


def host_steps(args, data, offs, lens, busy_bytes) -> None:
    """Microseconds of each host step of tree_digests' fast path on this machine, hot and cold."""
    n = offs.size
    idx = data.get_device()
    sha.tree_digests(data, offs, lens, backend="cupy")
    plan = sha._VALIDATED.get((sha._key_part(offs), sha._key_part(lens), 4096, 64))
    if plan is None:
        say("\nhost steps: the fast path did not engage (no validated plan); skipped")
        return
    lane = sha._LANES[(idx, sha._stream_handle(idx))]
    out = data.new_empty((n, 32))
    args_t = (np.uint64(data.data_ptr()),) + lane.prepared[plan] + (np.uint64(out.data_ptr()), sha._RESET)
    ev = torch.cuda.Event(enable_timing=True)
    shift = [0]
    size = int(lens[0])

    short = lens - 4096 if size > 8192 else lens

    def miss():
        # New offsets every call (1024 of them, more than the caches hold): checks, a plan from the cached
        # shape of the lengths, a table upload, then the launch.
        shift[0] = (shift[0] + 1) % 1024
        return sha.tree_digests(data, offs + 4 * shift[0], short, backend="cupy")

    steps = {
        "event record (probe's, not the call's)": ev.record,
        "current stream handle": lambda: sha._stream_handle(idx),
        "key + validated-plan lookup": lambda: sha._VALIDATED.get((sha._key_part(offs), sha._key_part(lens), 4096, 64)),
        "output allocation (new_empty)": lambda: data.new_empty((n, 32)),
        "bare CuPy launch (cached args)": lambda: lane.fn(plan.grid, sha._BLOCK, args_t, stream=lane.stream),
        "lane.run (alloc + args + launch)": lambda: lane.run(data, plan),
        "tree_digests, repeated call": lambda: sha.tree_digests(data, offs, lens, backend="cupy"),
        "tree_digests, new offsets each call": miss,
    }
    reps_hot, reps_cold = 200, max(args.trials, 30)
    res = {}
    for name, fn in steps.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        hot = []
        for _ in range(reps_hot):
            t0 = time.perf_counter_ns(); fn(); hot.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        cold = []
        for _ in range(reps_cold):
            torch.cuda.synchronize()
            hashlib.sha256(busy_bytes).digest()
            t0 = time.perf_counter_ns(); fn(); cold.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        res[name] = (statistics.median(hot) / 1e3, statistics.median(cold) / 1e3, max(cold) / 1e3)
    say(f"\nhost steps of tree_digests (us; hot: {reps_hot} back to back; cold: {reps_cold}, each after "
        f"CPU hashing {len(busy_bytes) / MIB:g} MiB with the GPU idle)")
    say(f"  {'step':<40} {'hot':>9} {'cold':>9} {'cold max':>9}")
    for name, (h, c, cm) in res.items():
        say(f"  {name:<40} {h:9.1f} {c:9.1f} {cm:9.1f}")


def big(args) -> None:
    if args.big_mib <= 0:
        return
    dev = torch.device("cuda")
    size = args.big_mib * MIB
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
    offs, lens = np.zeros(1, np.int64), np.full(1, size, np.int64)
    ref = None
    say(f"\n1 x {args.big_mib} MiB throughput, {args.big_trials} trials, order alternating")
    rows = {"fused_reset": ("fused", "reset"), "fused_memset": ("fused", "memset"), "levels": ("levels", None)}
    res = {m: ([], []) for m in rows}
    for m, (p, c) in rows.items():
        got = bytes(sha._tree_digests_path(data, offs, lens, path=p, counters=c).cpu().numpy()[0])
        ref = got if ref is None else ref
        assert got == ref, f"{m}: differs from the other paths"
    names = list(rows)
    for t in range(args.big_trials):
        k = t % len(names)
        for m in names[k:] + names[:k]:
            p, c = rows[m]
            w, _, ev = _one(lambda: sha._tree_digests_path(data, offs, lens, path=p, counters=c))
            res[m][0].append(w); res[m][1].append(ev)
    for m in names:
        w, ev = res[m]
        say(f"  {m:<14} wall {_fmt(w)} ms = {size / statistics.median(w) / 1e6:7.1f} GB/s; "
              f"events {_fmt(ev)} ms = {size / statistics.median(ev) / 1e6:7.1f} GB/s  (target >= 200 GB/s)")
    if args.big_check:
        t0 = time.perf_counter()
        want = tree_digest(data.cpu().numpy())
        say(f"  host reference {'agrees' if want == ref else 'DISAGREES'} ({time.perf_counter() - t0:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--object-mib", type=float, default=3.0)
    ap.add_argument("--cpu-busy-mib", type=float, default=12.0, help="bytes hashed on the CPU before a call "
                    "(12 MiB is about 10 ms with hashlib)")
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--big-trials", type=int, default=9)
    ap.add_argument("--big-check", action="store_true", help="also check the big root against kmesh_host")
    ap.add_argument("--out", default=None, help="also write the whole report to this file")
    args = ap.parse_args()
    if args.trials < 9:
        raise SystemExit("--trials: at least 9")
    say("$ " + " ".join(sys.argv))
    try:
        small(args)
        big(args)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(REPORT) + "\n")
            print(f"report written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
