"""Try shapes of the vectorised CUDA placement kernel (chunks per lane x layers per lane) on the
large case and print each one's launch time as a fraction of a same-run device-to-device copy.

Tuning only: it sets kmesh_gpu.place's private kernel-shape constants for the duration of the run.
Usage (GPU machine): PYTHONPATH=. python tools/place_tune.py
"""

from __future__ import annotations

import statistics

import torch

from kmesh_gpu import KVLayout, RopeSpec
import importlib

place_mod = importlib.import_module("kmesh_gpu.place")  # the module (the package exports the function `place`)

SHAPES = [(2, 4), (2, 8), (4, 4), (1, 8), (2, 6), (4, 2), (1, 12)]


def timed(fn, reps=7):
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    dev = torch.device("cuda")
    T, L, H, D, N = 98304, 24, 2, 64, 16
    rope = RopeSpec(D, D, 1e6, True, 1 << 20, torch.bfloat16)
    kv = torch.randn(2, L, T, H, D, device=dev).to(torch.bfloat16)
    src, dst = kv.view(-1), torch.empty_like(kv.view(-1))
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=T // N + 64, block_size=N, num_kv_heads=H,
                                head_size=D, dtype=torch.bfloat16)
    cache = layout.allocate(dev, fill=0)
    slots = torch.randperm(layout.num_blocks)[: T // N].repeat_interleave(N) * N + torch.arange(N).repeat(T // N)
    old = torch.arange(T, dtype=torch.int64)
    saved = place_mod._VEC_PER, place_mod._VEC_LPT
    try:
        for per, lpt in SHAPES:
            place_mod._VEC_PER, place_mod._VEC_LPT = per, lpt
            row = []
            for shift in (False, True):
                kw = dict(rope=rope, old_positions=[old], new_positions=[old + 1000]) if shift else {}
                launch = place_mod.prepare_place_many([kv], cache, layout, [slots], backend="cupy", **kw)
                launch.run()
                copy_ms = timed(lambda: dst.copy_(src))
                ms = timed(launch.run)
                row.append(f"shift={shift!s:5s} {ms:.3f} ms = {copy_ms / ms:.3f} of copy")
            print(f"PER={per} LPT={lpt:2d}: " + " | ".join(row))
    finally:
        place_mod._VEC_PER, place_mod._VEC_LPT = saved


if __name__ == "__main__":
    main()
