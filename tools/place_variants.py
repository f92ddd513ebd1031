"""Launch-only timings of the CUDA placement kernel on the large case (1.1 GiB of KV) for a few
variants, against a device-to-device copy of the same bytes: where does placement lose bandwidth?

Usage (GPU machine): PYTHONPATH=. python tools/place_variants.py
"""

from __future__ import annotations

import statistics

import torch

from kmesh_gpu import KVLayout, RopeSpec
from kmesh_gpu.place import prepare_place_many


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
    nbytes = kv.numel() * 2
    src, dst = kv.view(-1), torch.empty_like(kv.view(-1))
    copy_ms = timed(lambda: dst.copy_(src))
    print(f"d2d copy: {copy_ms:.3f} ms, {2 * nbytes / copy_ms / 1e6:.0f} GB/s")
    for name in ("LBHNC", "LBNHC", "BLHNC"):
        layout = KVLayout.from_vllm(name, num_layers=L, num_blocks=T // N + 64, block_size=N, num_kv_heads=H,
                                    head_size=D, dtype=torch.bfloat16)
        cache = layout.allocate(dev, fill=0)
        for order in ("sequential", "shuffled-blocks"):
            if order == "sequential":
                slots = torch.arange(T, dtype=torch.int64)
            else:
                slots = (torch.randperm(layout.num_blocks)[: T // N].repeat_interleave(N) * N
                         + torch.arange(N).repeat(T // N))
            old = torch.arange(T, dtype=torch.int64)
            for shift in (False, True):
                kw = dict(rope=rope, old_positions=[old], new_positions=[old + 1000]) if shift else {}
                launch = prepare_place_many([kv], cache, layout, [slots], backend="cupy", **kw)
                launch.run()
                ms = timed(launch.run)
                print(f"{name} {order:15s} shift={shift!s:5s}: {ms:.3f} ms, {2 * nbytes / ms / 1e6:.0f} GB/s, "
                      f"{copy_ms / ms:.2f} of copy")
        del cache


if __name__ == "__main__":
    main()
