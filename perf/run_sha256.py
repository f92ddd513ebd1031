"""Integrity hashing benchmark: the seed's standalone GPU SHA-256 table, and the tree digest.

12 MiB = four 3 MiB objects of deterministic synthetic bytes, resident on the device, and one large
object (default 1 GiB) for throughput. Methods, each timed end to end (digests ready on the host):

  cpu_sha256_download   whole-object SHA-256 (hashlib, one object after another, as the seed) of the
                        objects after their D2H download into a pinned host buffer (the download is
                        inside the timing; on --device cpu there is nothing to download)
  gpu_naive_serial      the seed's GPU design, one thread per whole object: four calls, one object each
  gpu_naive_concurrent  the same kernel, one call hashing the four objects concurrently
  gpu_tree              kmesh-tree-sha256/v1 on the GPU (kmesh_gpu.tree_digests as a user calls it,
                        CuPy: under 256 MiB the whole tree of all objects in one launch, from 256 MiB
                        one launch per level), the digest bytes downloaded
  gpu_tree_fused        the one-launch path forced (same as gpu_tree under 256 MiB)
  gpu_tree_levels       the one-launch-per-level path forced: one batched SHA-256 launch per tree
                        level and one for the roots
  gpu_tree_warp         the same with the Warp kernels (CUDA), for reference
  warp_cpu_tree         the Warp kernels on the CPU (--device cpu)
  cpu_tree              kmesh_host.tree_digest on all cores over host-resident bytes

Each trial runs every method once, in an order rotated by one per trial (15 trials by default);
the table shows medians and the median of the per-trial (paired) ratios against gpu_tree. Writes a
table to stdout and sha256.json + sha256.png (when matplotlib is installed) to --out.

    python perf/run_sha256.py                      # CUDA, 15 trials, 1 GiB throughput
    python perf/run_sha256.py --device cpu --big-mib 64 --trials 3      # smoke test without a GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kmesh_gpu import _backend  # noqa: E402
from kmesh_gpu import sha256 as sha_mod  # noqa: E402
from kmesh_gpu import tree_digests  # noqa: E402
from kmesh_host import tree_digest  # noqa: E402
from perf.sha256_baseline import sha256_one_thread_per_object  # noqa: E402

MIB = 1 << 20
TARGETS = {
    "gpu_tree_vs_cpu_sha256_download": 20.0,
    "gpu_tree_vs_gpu_naive_concurrent": 200.0,
    "gpu_tree_1GiB_GB_per_s": 200.0,
}


def synthetic_bytes(n: int, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes (fixed generator and seed: the same bytes on every run)."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Workload:
    """Objects laid out back to back in one device buffer, with their offsets and lengths."""

    def __init__(self, name: str, n_objects: int, object_bytes: int, device: torch.device, seed: int):
        self.name, self.n, self.object_bytes = name, n_objects, object_bytes
        self.total = n_objects * object_bytes
        host = synthetic_bytes(self.total, seed)
        self.host = host.pin_memory() if device.type == "cuda" else host
        self.data = self.host.to(device)
        self.offsets = np.arange(n_objects, dtype=np.int64) * object_bytes
        self.lengths = np.full(n_objects, object_bytes, dtype=np.int64)
        self.download = torch.empty_like(self.host, device="cpu", pin_memory=device.type == "cuda")

    def slices(self, buf: torch.Tensor):
        view = memoryview(buf.numpy())
        return [view[o:o + self.object_bytes] for o in self.offsets.tolist()]


def make_methods(w: Workload, device: torch.device, big: bool) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    methods = {}

    def cpu_sha256_download():
        if device.type == "cuda":
            w.download.copy_(w.data)                 # synchronous D2H into pinned memory
            src = w.download
        else:
            src = w.data
        return [hashlib.sha256(s).digest() for s in w.slices(src)]

    methods["cpu_sha256_download"] = cpu_sha256_download

    if device.type == "cuda":
        if not big:
            def gpu_naive_serial():
                out = []
                for o, n in zip(w.offsets.tolist(), w.lengths.tolist()):
                    d = sha256_one_thread_per_object(w.data, [o], [n])
                    out.append(bytes(d.cpu().numpy()[0]))
                return out

            def gpu_naive_concurrent():
                d = sha256_one_thread_per_object(w.data, w.offsets, w.lengths)
                return [bytes(r) for r in d.cpu().numpy()]

            methods["gpu_naive_serial"] = gpu_naive_serial
            methods["gpu_naive_concurrent"] = gpu_naive_concurrent

        def gpu_tree():
            d = tree_digests(w.data, w.offsets, w.lengths, backend="cupy")
            return [bytes(r) for r in d.cpu().numpy()]

        methods["gpu_tree"] = gpu_tree

        def gpu_tree_fused():
            d = sha_mod._tree_digests_by_path(w.data, w.offsets, w.lengths, path="fused")
            return [bytes(r) for r in d.cpu().numpy()]

        if big:  # under 256 MiB gpu_tree is this path already
            methods["gpu_tree_fused"] = gpu_tree_fused

        def gpu_tree_levels():
            d = sha_mod._tree_digests_by_path(w.data, w.offsets, w.lengths, path="levels")
            return [bytes(r) for r in d.cpu().numpy()]

        methods["gpu_tree_levels"] = gpu_tree_levels
        if not big and _backend.has_warp():
            def gpu_tree_warp():
                d = tree_digests(w.data, w.offsets, w.lengths, backend="warp")
                return [bytes(r) for r in d.cpu().numpy()]

            methods["gpu_tree_warp"] = gpu_tree_warp
    elif not big:
        def warp_cpu_tree():
            d = tree_digests(w.data, w.offsets, w.lengths, backend="warp")
            return [bytes(r) for r in d.numpy()]

        methods["warp_cpu_tree"] = warp_cpu_tree

    def cpu_tree():
        return [tree_digest(s) for s in w.slices(w.host)]

    methods["cpu_tree"] = cpu_tree

    def timed(fn):
        def run():
            sync()
            t0 = time.perf_counter()
            result = fn()
            sync()
            return time.perf_counter() - t0, result
        return run

    return {name: timed(fn) for name, fn in methods.items()}


def check_results(w: Workload, methods: dict) -> None:
    """Every method must produce the right digests before it is timed (also warms up and compiles)."""
    raw = w.slices(w.host)
    want_sha = [hashlib.sha256(s).digest() for s in raw]
    want_tree = [tree_digest(s) for s in raw]
    for name, run in methods.items():
        _, got = run()
        want = want_tree if "tree" in name else want_sha
        if got != want:
            raise SystemExit(f"{w.name}: method {name} produced wrong digests")


def measure(w: Workload, methods: dict, trials: int) -> dict:
    names = list(methods)
    times = {n: [] for n in names}
    for t in range(trials):
        k = t % len(names)
        for name in names[k:] + names[:k]:
            seconds, _ = methods[name]()
            times[name].append(seconds)
    return times


def summarise(w: Workload, times: dict, reference: str | None) -> dict:
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        row = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3,
               "trials_ms": [x * 1e3 for x in ts], "GB_per_s": w.total / med / 1e9}
        if reference in times and name != reference:
            ratios = [a / b for a, b in zip(ts, times[reference])]
            row[f"paired_ratio_vs_{reference}"] = statistics.median(ratios)
        out[name] = row
    return out


def print_table(title: str, rows: dict, reference: str | None) -> None:
    print(f"\n{title}")
    head = f"{'method':<22} {'median ms':>11} {'min ms':>10} {'GB/s':>9}"
    if reference:
        head += f" {'x ' + reference:>20}"
    print(head)
    print("-" * len(head))
    for name, r in rows.items():
        line = f"{name:<22} {r['median_ms']:>11.3f} {r['min_ms']:>10.3f} {r['GB_per_s']:>9.2f}"
        if reference:
            ratio = r.get(f"paired_ratio_vs_{reference}")
            line += f" {ratio:>20.1f}" if ratio is not None else f" {'(reference)':>20}"
        print(line)


def plot(path: Path, small: dict, big: dict, small_title: str, big_title: str, device_name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping {path.name}")
        return
    fig, axes = plt.subplots(1, 2 if big else 1, figsize=(13 if big else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    names = list(small)
    ax.barh(names, [small[n]["median_ms"] for n in names], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("median ms (log scale)")
    ax.set_title(small_title)
    ax.invert_yaxis()
    if big:
        ax = axes[0][1]
        names = list(big)
        ax.barh(names, [big[n]["GB_per_s"] for n in names], color="tab:green")
        ax.set_xlabel("GB/s (median)")
        ax.set_title(big_title)
        ax.invert_yaxis()
    fig.suptitle(f"kmesh integrity hashing — {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--objects", type=int, default=4)
    parser.add_argument("--object-mib", type=float, default=3.0)
    parser.add_argument("--big-mib", type=int, default=1024, help="throughput object size (0: skip)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for a smoke test)")
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    object_bytes = int(args.object_mib * MIB)

    small = Workload(f"{args.objects} x {args.object_mib:g} MiB", args.objects, object_bytes, device, seed=0)
    small_methods = make_methods(small, device, big=False)
    check_results(small, small_methods)
    reference = "gpu_tree" if device.type == "cuda" else "cpu_tree"
    small_rows = summarise(small, measure(small, small_methods, args.trials), reference)
    small_title = f"{small.name} = {small.total / MIB:g} MiB, {args.trials} trials, rotating order"
    print(f"device: {device_name}   host CPU: {cpu_name()} ({os.cpu_count()} threads)")
    print_table(small_title, small_rows, reference)

    big_rows, big_title = {}, ""
    if args.big_mib > 0:
        big = Workload(f"1 x {args.big_mib} MiB", 1, args.big_mib * MIB, device, seed=1)
        big_methods = make_methods(big, device, big=True)
        check_results(big, big_methods)
        big_rows = summarise(big, measure(big, big_methods, args.trials), reference)
        big_title = f"{big.name}, {args.trials} trials (throughput)"
        print_table(big_title, big_rows, reference)
        del big

    device_span = levels_span = None
    if device.type == "cuda":
        device_span = gpu_tree_device_span(small, args.trials)
        levels_span = gpu_tree_device_span(small, args.trials, path="levels")
        print(f"\ngpu_tree device span (CUDA events around the call, no download): median "
              f"{device_span['median_ms']:.3f} ms, min {device_span['min_ms']:.3f} ms; the wall-clock row above "
              f"adds host work and the 128-byte download")
        print(f"gpu_tree_levels device span: median {levels_span['median_ms']:.3f} ms, "
              f"min {levels_span['min_ms']:.3f} ms")

    targets = {}
    if device.type == "cuda":
        vs_cpu = small_rows["cpu_sha256_download"]["paired_ratio_vs_gpu_tree"]
        vs_naive = small_rows["gpu_naive_concurrent"]["paired_ratio_vs_gpu_tree"]
        targets["gpu_tree_vs_cpu_sha256_download"] = vs_cpu
        targets["gpu_tree_vs_gpu_naive_concurrent"] = vs_naive
        if big_rows and args.big_mib == 1024:
            targets["gpu_tree_1GiB_GB_per_s"] = big_rows["gpu_tree"]["GB_per_s"]
        print("\ntargets (issue 3)")
        for key, value in targets.items():
            verdict = "met" if value >= TARGETS[key] else "NOT met"
            print(f"  {key:<36} {value:>10.1f}  (target >= {TARGETS[key]:g}: {verdict})")

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "device": device_name, "device_type": device.type, "host_cpu": cpu_name(),
        "host_threads": os.cpu_count(), "torch": torch.__version__, "trials": args.trials,
        "order": "rotated by one method per trial", "statistic": "median",
        "small": {"objects": args.objects, "object_bytes": object_bytes, "methods": small_rows},
        "big": {"object_bytes": args.big_mib * MIB, "methods": big_rows} if big_rows else None,
        "targets": {k: {"value": v, "target": TARGETS[k], "met": v >= TARGETS[k]} for k, v in targets.items()},
        "gpu_tree_device_span": device_span,
        "gpu_tree_levels_device_span": levels_span,
    }
    json_path = args.out / "sha256.json"
    json_path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {json_path}")
    plot(args.out / "sha256.png", small_rows, big_rows, small_title, big_title, device_name)
    return 0


def gpu_tree_device_span(w, trials: int, path: str = "fused") -> dict:
    """Device time of one tree_digests call, from CUDA events recorded around it (no host sync inside);
    ``path`` "fused" is tree_digests itself, "levels" the one-launch-per-level path."""
    spans = []
    for _ in range(trials + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        if path == "fused":
            tree_digests(w.data, w.offsets, w.lengths, backend="cupy")
        else:
            sha_mod._tree_digests_by_path(w.data, w.offsets, w.lengths, path=path)
        b.record()
        torch.cuda.synchronize()
        spans.append(a.elapsed_time(b))
    spans = spans[2:]  # the first calls compile and plan
    return {"median_ms": statistics.median(spans), "min_ms": min(spans), "trials": trials}


if __name__ == "__main__":
    raise SystemExit(main())
