"""Launch-only timings of the CUDA placement kernel on the large case (1.1 GiB of KV) against a
device-to-device copy of the same bytes: where does placement lose bandwidth?

Default: three layouts x sequential/shuffled blocks x with/without the shift. ``--shapes`` instead
sweeps the per-token vectorised kernel's shape (chunks per lane x layers per lane) on LBHNC with
shuffled blocks, the run kernel switched off; it sets kmesh_gpu.place's private constants for the
duration of the run. (tools/place_runs_tune.py sweeps the run kernel.)

Usage (GPU machine): PYTHONPATH=. python tools/place_variants.py [--shapes]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from kmesh_gpu import KVLayout, RopeSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import timed  # noqa: E402

place_mod = importlib.import_module("kmesh_gpu.place")  # the module (the package exports the function `place`)
T, L, H, D, N = 98304, 24, 2, 64, 16
SHAPES = [(2, 4), (2, 8), (4, 4), (1, 8), (2, 6), (4, 2), (1, 12)]


def slot_mapping(layout, order):
    if order == "sequential":
        return torch.arange(T, dtype=torch.int64)
    return torch.randperm(layout.num_blocks)[: T // N].repeat_interleave(N) * N + torch.arange(N).repeat(T // N)


def one_row(kv, cache, layout, slots, rope, copy):
    old = torch.arange(T, dtype=torch.int64)
    row = []
    for shift in (False, True):
        kw = dict(rope=rope, old_positions=[old], new_positions=[old + 1000]) if shift else {}
        launch = place_mod.prepare_place_many([kv], cache, layout, [slots], backend="cupy", **kw)
        launch.run()
        copy_ms = timed(copy)
        ms = timed(launch.run)
        row.append(f"shift={shift!s:5s} {ms:.3f} ms, {2 * kv.numel() * 2 / ms / 1e6:.0f} GB/s, {copy_ms / ms:.3f} of copy")
    return " | ".join(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", action="store_true", help="sweep the vectorised kernel's shape instead")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rope = RopeSpec(D, D, 1e6, True, 1 << 20, torch.bfloat16)
    kv = torch.randn(2, L, T, H, D, device=dev).to(torch.bfloat16)
    src, dst = kv.view(-1), torch.empty_like(kv.view(-1))
    print(f"d2d copy: {timed(lambda: dst.copy_(src)):.3f} ms")
    if args.shapes:
        layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=T // N + 64, block_size=N, num_kv_heads=H,
                                    head_size=D, dtype=torch.bfloat16)
        cache = layout.allocate(dev, fill=0)
        slots = slot_mapping(layout, "shuffled-blocks")
        saved = place_mod._VEC_PER, place_mod._VEC_LPT
        runs_saved, place_mod._RUNS = place_mod._RUNS, False  # the shapes are the per-token kernel's
        try:
            for per, lpt in SHAPES:
                place_mod._VEC_PER, place_mod._VEC_LPT = per, lpt
                print(f"PER={per} LPT={lpt:2d}: " + one_row(kv, cache, layout, slots, rope, lambda: dst.copy_(src)))
        finally:
            place_mod._VEC_PER, place_mod._VEC_LPT = saved
            place_mod._RUNS = runs_saved
        return
    for name in ("LBHNC", "LBNHC", "BLHNC"):
        layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=T // N + 64, block_size=N, num_kv_heads=H,
                                    head_size=D, dtype=torch.bfloat16)
        cache = layout.allocate(dev, fill=0)
        for order in ("sequential", "shuffled-blocks"):
            print(f"{name} {order:15s}: " + one_row(kv, cache, layout, slot_mapping(layout, order), rope,
                                                     lambda: dst.copy_(src)))
        del cache


if __name__ == "__main__":
    main()
