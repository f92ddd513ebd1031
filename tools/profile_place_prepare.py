"""Profile the host side of place_many: validation, launch tables and their upload, without the launch.

Shapes (24 layers, 2 KV heads, head 64, bf16, host int64 index tensors, RoPE shift):

* ``seed``    — 16 segments x 104 tokens into a LBHNC cache with scattered slots (per-token kernel).
* ``restore`` — one host-tier child: 4 segments x 256 tokens, views of one uint8 buffer, into an
  NHD cache (block 16) with consecutive slots (the run kernel), as ``routes._Placement`` passes them.

Prints the mean preparation time, Python function calls per call, and the top functions by internal
time. ``--emulate-cupy`` builds the CUDA backend's tables on a CPU device (nothing is launched), so
the GPU path's host work can be measured on a machine without a GPU.

Usage: PYTHONPATH=. python tools/profile_place_prepare.py [--shape restore] [--device cuda] [--backend cupy]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kmesh_gpu import KVLayout, RopeSpec
from kmesh_gpu import _backend
from kmesh_gpu.place import prepare_place_many

L, H, D = 24, 2, 64


def seed_batch(dev):
    N = 16
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=4 * 32 + 8, block_size=N, num_kv_heads=H,
                                head_size=D, dtype=torch.bfloat16)
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
    return layout, kvs, slots, olds, news


def restore_batch(dev):
    """What routes._Placement passes for one host-tier child (perf/run_ssd_routes.py's workload)."""
    import numpy as np

    T, n, N, children = 256, 4, 16, 4
    layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=-(-n * T * children // N) + 1, block_size=N,
                                num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    nbytes = 2 * L * T * H * D * 2
    buffer = torch.empty(n * nbytes, dtype=torch.uint8, device=dev)
    kvs = [buffer[i * nbytes:(i + 1) * nbytes].view(torch.bfloat16).view(2, L, T, H, D) for i in range(n)]
    c = 1
    slots = [torch.arange(c * n * T + i * T, c * n * T + (i + 1) * T, dtype=torch.int64) for i in range(n)]
    news = [torch.arange(T, dtype=torch.int64) + 17 + 29 * c + i * (T + 5) for i in range(n)]
    flat = torch.from_numpy(np.concatenate([np.arange(T) + i * T for i in range(n)]).astype(np.int64))
    olds = list(torch.split(flat, [T] * n))
    return layout, kvs, slots, olds, news


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--shape", choices=("seed", "restore"), default="seed")
    ap.add_argument("--emulate-cupy", action="store_true",
                    help="build the cupy backend's tables on this device without launching (CPU measurement)")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device(args.device)
    rope = RopeSpec(D, D, 1e6, True, 32768, torch.bfloat16)
    layout, kvs, slots, olds, news = (seed_batch if args.shape == "seed" else restore_batch)(dev)
    cache = layout.allocate(dev, fill=0)
    backend = args.backend
    if args.emulate_cupy:
        _backend.choose = lambda b, d: "cupy"

    def prep():
        return prepare_place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news,
                                  backend=backend)

    first = prep()
    if not args.emulate_cupy:
        first.run()
    tables = first.tables or {}
    kernel = "torch" if first.backend == "torch" else \
        "runs" if tables.get("runs") is not None else "per-token"
    for _ in range(20):
        prep()
    t0 = time.perf_counter()
    for _ in range(args.repeat):
        prep()
    per = (time.perf_counter() - t0) / args.repeat
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.repeat):
        prep()
    prof.disable()
    stats = pstats.Stats(prof)
    calls = stats.total_calls / args.repeat
    print(f"prepare_place_many ({args.shape}: {len(kvs)} items x {kvs[0].shape[2]} tokens, host indices, "
          f"{args.device}, backend {first.backend}, {kernel} kernel): {per * 1e6:.1f} us per call, "
          f"{calls:.0f} Python calls per call")
    stats.sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
