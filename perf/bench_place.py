"""Placement + RoPE shift benchmark (issue: placement foundation).

Cases:
  seed   — 4 segments of 104 tokens into each of 4 children (16 placements), Qwen2.5-0.5B KV shape
           (24 layers, 2 KV heads, head 64, bf16), LBHNC cache: one batched launch vs 16 calls.
  large  — one segment of >= 1 GiB of KV placed with shift, against a device-to-device copy of the
           same bytes measured in the same run, and against the torch reference.

Timing: CUDA events around the launch (``kernel``) and wall time around the whole call including
validation and table upload (``call``); variants alternate order inside each of 7 matched pairs;
medians of per-pair ratios are reported. Prints a table, writes JSON to --out.

  PYTHONPATH=. python perf/bench_place.py --device cuda [--out perf/out]
  PYTHONPATH=. python perf/bench_place.py --device cpu     (small smoke run)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kmesh_gpu import BackendError, KernelShape, KVLayout, PlacementPlan, RopeSpec, place, place_many

PAIRS = 7


def _available(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs on ``device`` here (a plan for a one-block cache is refused otherwise)."""
    layout = KVLayout.from_vllm("LBHNC", num_layers=1, num_blocks=1, block_size=16, num_kv_heads=1, head_size=64,
                                dtype=torch.bfloat16)
    try:
        PlacementPlan(layout.allocate(device, fill=0), layout, backend=backend)
    except BackendError:
        return False
    return True


def _timer(device: torch.device):
    """Returns run(fn) -> (event_ms, wall_ms)."""
    def run(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            w0 = time.perf_counter()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            return a.elapsed_time(b), (time.perf_counter() - w0) * 1e3
        w0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - w0) * 1e3
        return ms, ms
    return run


def _kernel_us(fn, reps: int = 21) -> float | None:
    """Median device time (µs) of the kernel ``fn`` launches, from the CUDA profiler: the kernel
    alone, without the host's submission time that the event-bracketed "launch only" includes."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
                torch.cuda.synchronize()
        times = [e.time_range.elapsed_us() for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and "place" in e.name.lower()]
    except Exception as exc:  # the profiler is optional here: report why it gave nothing
        print(f"kernel time from the profiler unavailable: {type(exc).__name__}: {exc}")
        return None
    kernels = [t for t in times if t > 0]
    return statistics.median(kernels) if kernels else None


def seed_case(device: torch.device, backends: list[str], layers: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    L, H, D, N = layers, 2, 64, 16
    rope = RopeSpec(D, D, 1e6, True, 32768, torch.bfloat16)
    children, segments, seg_tokens = 4, 4, 104
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=children * 32 + 8, block_size=N,
                                num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    cache = layout.allocate(device, fill=0)
    segs = [torch.randn(2, L, seg_tokens, H, D, generator=gen).to(torch.bfloat16).to(device) for _ in range(segments)]
    perm = torch.randperm(layout.num_slots, generator=gen)
    kvs, slots, olds, news = [], [], [], []
    used = 0
    for c in range(children):
        for s in range(segments):
            kvs.append(segs[s])
            slots.append(perm[used:used + seg_tokens].to(device))
            used += seg_tokens
            olds.append(torch.arange(seg_tokens, device=device) + 120 * s)
            news.append(torch.arange(seg_tokens, device=device) + 30 + 110 * ((s + c) % segments))
    moved = 2 * sum(k.numel() * k.element_size() for k in kvs)  # read + write
    run = _timer(device)
    res = {}
    for backend in backends:
        def batched():
            place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news, backend=backend)

        def serial():
            for i in range(len(kvs)):
                place(kvs[i], cache, layout, slots[i], rope=rope, old_positions=olds[i], new_positions=news[i],
                      backend=backend)

        launch = PlacementPlan(cache, layout, rope=rope, backend=backend).prepare(
            kvs, slots, old_positions=olds, new_positions=news)
        batched(), serial(), launch.run()  # compile + warm
        rows = {"batched": [], "serial": [], "launch": []}
        for pair in range(PAIRS):
            order = [("batched", batched), ("serial", serial), ("launch", launch.run)]
            if pair % 2:
                order.reverse()
            for name, fn in order:
                rows[name].append(run(fn))
        res[backend] = {
            "kernel_us": _kernel_us(launch.run) if device.type == "cuda" and backend != "torch" else None,
            "launch_only_ms": statistics.median(r[0] for r in rows["launch"]),
            "batched_kernel_ms": statistics.median(r[0] for r in rows["batched"]),
            "batched_call_ms": statistics.median(r[1] for r in rows["batched"]),
            "serial_call_ms": statistics.median(r[1] for r in rows["serial"]),
            "serial_over_batched": statistics.median(s[1] / b[1] for s, b in zip(rows["serial"], rows["batched"])),
            "launch_GBps": moved / (statistics.median(r[0] for r in rows["launch"]) * 1e-3) / 1e9,
        }
    return {"placements": len(kvs), "bytes_moved": moved, "layers": L, "backends": res}


def large_case(device: torch.device, backends: list[str], tokens: int, layers: int, layout_name: str = "LBHNC") -> dict:
    """``layout_name``: "LBHNC" (K|V packed per token, vLLM's named layouts) or "flash" (vLLM's GPU
    attention layout, per layer (2, B, N, H, D))."""
    gen = torch.Generator(device=device).manual_seed(1)
    L, H, D, N = layers, 2, 64, 16
    rope = RopeSpec(D, D, 1e6, True, 1 << 20, torch.bfloat16)
    if layout_name == "flash":
        layout = KVLayout.from_vllm_legacy("first", "NHD", num_layers=L, num_blocks=tokens // N + 64, block_size=N,
                                           num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    else:
        layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=tokens // N + 64, block_size=N,
                                    num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    kv = torch.randn(2, L, tokens, H, D, generator=gen, device=device).to(torch.bfloat16)
    cache = layout.allocate(device, fill=0)
    slots = (torch.randperm(layout.num_blocks, device=device)[: tokens // N].repeat_interleave(N) * N
             + torch.arange(N, device=device).repeat(tokens // N))
    old = torch.arange(tokens, device=device, dtype=torch.int64)
    new = old + 1000
    copy_src = kv.view(-1)
    copy_dst = torch.empty_like(copy_src)
    nbytes = kv.numel() * kv.element_size()
    run = _timer(device)
    fns = {"d2d_copy": lambda: copy_dst.copy_(copy_src)}
    for backend in backends:
        fns[f"place[{backend}]"] = (lambda b=backend: place(kv, cache, layout, slots, rope=rope, old_positions=old,
                                                            new_positions=new, backend=b))
        if backend != "torch":  # the launch alone, validation and tables prepared once
            fns[f"launch[{backend}]"] = PlacementPlan(cache, layout, rope=rope, backend=backend).prepare(
                [kv], [slots], old_positions=[old], new_positions=[new]).run
        if backend == "cupy":  # the per-token kernel the run kernel replaced, for comparison
            fns["launch[cupy, per-token kernel]"] = PlacementPlan(
                cache, layout, rope=rope, backend=backend, shape=KernelShape(run_kernel=False)).prepare(
                [kv], [slots], old_positions=[old], new_positions=[new]).run
    for fn in fns.values():
        fn()
    names = list(fns)
    times = {n: [] for n in names}
    for pair in range(PAIRS):
        order = names[pair % len(names):] + names[:pair % len(names)]  # rotate the order each pair
        if pair % 2:
            order.reverse()
        for n in order:
            times[n].append(run(fns[n]))
    out = {"tokens": tokens, "kv_bytes": nbytes, "layout": layout.name, "variants": {}}
    for n in names:
        ev = statistics.median(t[0] for t in times[n])
        out["variants"][n] = {
            "kernel_ms": ev, "call_ms": statistics.median(t[1] for t in times[n]),
            "GBps_read_plus_write": 2 * nbytes / (ev * 1e-3) / 1e9,
            "ratio_vs_d2d_copy": statistics.median(c[0] / t[0] for c, t in zip(times["d2d_copy"], times[n])),
        }
    if "place[torch]" in times:
        for n in names:
            out["variants"][n]["speedup_vs_torch"] = statistics.median(
                r[0] / t[0] for r, t in zip(times["place[torch]"], times[n]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--out", default="perf/out")
    ap.add_argument("--large-tokens", type=int, default=None, help="default: 98304 (1.13 GiB) on cuda, 2048 on cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    backends = [b for b in ("torch", "warp", "cupy") if _available(b, device)]
    cpu = device.type == "cpu"
    report = {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(device) if not cpu else platform.processor() or "cpu",
        "torch": torch.__version__, "command": f"PYTHONPATH=. python perf/bench_place.py --device {args.device}",
        "seed": seed_case(device, backends, layers=4 if cpu else 24),
        "large": large_case(device, backends, tokens=args.large_tokens or (2048 if cpu else 98304),
                            layers=4 if cpu else 24),
        "large_flash": large_case(device, [b for b in backends if b != "torch"] if not cpu else backends,
                                  tokens=args.large_tokens or (2048 if cpu else 98304), layers=4 if cpu else 24,
                                  layout_name="flash"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_place.json").write_text(json.dumps(report, indent=2))
    s = report["seed"]
    print(f"# bench_place on {report['device']} ({report['date']}, torch {report['torch']})")
    print(f"\nSeed size: {s['placements']} placements, {s['layers']} layers, {s['bytes_moved'] / 1e6:.1f} MB read+write")
    print("| backend | kernel, profiler (µs) | launch only, GPU (ms) | launch GB/s | batched call, GPU span (ms) | "
          "batched call, wall (ms) | 16 calls, wall (ms) | 16 calls / batched |")
    print("|---|---|---|---|---|---|---|---|")
    for b, r in s["backends"].items():
        k = f"{r['kernel_us']:.1f}" if r.get("kernel_us") else "-"
        print(f"| {b} | {k} | {r['launch_only_ms']:.4f} | {r['launch_GBps']:.0f} | {r['batched_kernel_ms']:.3f} | "
              f"{r['batched_call_ms']:.3f} | {r['serial_call_ms']:.3f} | {r['serial_over_batched']:.2f} |")
    for key in ("large", "large_flash"):
        g = report[key]
        print(f"\nLarge, {g['layout']}: {g['tokens']} tokens, {g['kv_bytes'] / 2**30:.2f} GiB of KV (read + write = 2x)")
        print("| variant | GPU span (ms) | GB/s (r+w) | fraction of D2D copy | speed-up vs torch |")
        print("|---|---|---|---|---|")
        for n, r in g["variants"].items():
            print(f"| {n} | {r['kernel_ms']:.3f} | {r['GBps_read_plus_write']:.0f} | {r['ratio_vs_d2d_copy']:.3f} | "
                  f"{r.get('speedup_vs_torch', float('nan')):.1f} |")
    print(f"\nJSON: {out / 'bench_place.json'}")


if __name__ == "__main__":
    main()
