"""Profile the host side of place_many for the seed-size batch (16 segments x 104 tokens, 24 layers).

Prints the mean preparation time (validation + launch tables + upload) and the top functions by
internal time. Usage: PYTHONPATH=. python tools/profile_place_prepare.py [--device cuda] [--backend cupy]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kmesh_gpu import KVLayout, RopeSpec
from kmesh_gpu.place import prepare_place_many


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device(args.device)
    L, H, D, N = 24, 2, 64, 16
    rope = RopeSpec(D, D, 1e6, True, 32768, torch.bfloat16)
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=4 * 32 + 8, block_size=N, num_kv_heads=H,
                                head_size=D, dtype=torch.bfloat16)
    cache = layout.allocate(dev, fill=0)
    segs = [torch.randn(2, L, 104, H, D).to(torch.bfloat16).to(dev) for _ in range(4)]
    perm = torch.randperm(layout.num_slots)
    kvs, slots, olds, news = [], [], [], []
    for c in range(4):
        for s in range(4):
            i = 4 * c + s
            kvs.append(segs[s])
            slots.append(perm[i * 104:(i + 1) * 104].clone())
            olds.append(torch.arange(104) + 120 * s)
            news.append(torch.arange(104) + 30 + 110 * ((s + c) % 4))

    def prep():
        return prepare_place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news,
                                  backend=args.backend)

    prep().run()
    t0 = time.perf_counter()
    for _ in range(args.repeat):
        prep()
    print(f"prepare_place_many (16 items, host indices, {args.device}): "
          f"{(time.perf_counter() - t0) / args.repeat * 1e3:.3f} ms per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.repeat):
        prep()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
