"""Shape sweep of the run kernel (kmesh_place_runs): pair groups per lane (G) x heads per load batch
(HB) x K and V in one warp (KVF) x the warp target that sets layers per warp, against the per-token kernel and a D2D copy.

Cases: the large case (98,304 tokens, 24 layers, 2 heads, head 64, bf16, shuffled blocks, tokens in
order within a block) on LBHNC and on vLLM's flash layout (per layer (2, B, N, H, D)), and a seed-size
batch whose segments sit at random block-granular offsets (16 placements x 104 tokens). Every
variant's cache is compared bit for bit with the per-token kernel's. Launch-only times (CUDA events,
median of 7), copy measured right before each variant.

Usage (GPU machine): PYTHONPATH=. python tools/place_runs_tune.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
import statistics

import torch

from kmesh_gpu import KVLayout, RopeSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import timed  # noqa: E402

pm = importlib.import_module("kmesh_gpu.place")
L, H, D, N = 24, 2, 64, 16
SHAPES = [(1, 2, 0), (1, 2, 1), (2, 1, 0), (2, 1, 1), (1, 1, 1)]  # G, HB, KVF
UNITS = [2048, 4096, 16384]


def launch(kvs, cache, layout, slots, rope, olds, news, runs=True, shape=(1, 2, 0), units=4096):
    saved = pm._RUNS, pm._RUN_GROUPS, pm._RUN_HEADS, pm._RUN_KVF, pm._RUN_UNITS
    pm._RUNS, (pm._RUN_GROUPS, pm._RUN_HEADS, pm._RUN_KVF), pm._RUN_UNITS = runs, shape, units
    try:
        lz = pm.prepare_place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news,
                                   backend="cupy")
        used = lz.tables.get("runs") is not None
        lz.run()  # compile
        torch.cuda.synchronize()

        def go():
            pm._RUN_GROUPS, pm._RUN_HEADS, pm._RUN_KVF, pm._RUN_UNITS = shape[0], shape[1], shape[2], units
            lz.run()
        return go, used
    finally:
        pm._RUNS, pm._RUN_GROUPS, pm._RUN_HEADS, pm._RUN_KVF, pm._RUN_UNITS = saved


def sweep(title, kvs, cache, layout, slots, rope, olds, news, copy):
    tok_fn, _ = launch(kvs, cache, layout, slots, rope, olds, news, runs=False)
    cache.zero_()
    tok_fn()
    torch.cuda.synchronize()
    ref = cache.clone()
    rows = []
    for shape in SHAPES:
        for units in UNITS:
            fn, used = launch(kvs, cache, layout, slots, rope, olds, news, shape=shape, units=units)
            cache.zero_()
            fn()
            torch.cuda.synchronize()
            same = torch.equal(cache.view(torch.int16), ref.view(torch.int16))
            res = []
            for _ in range(3):
                c = timed(copy, 3) if copy else 1.0
                t = timed(fn, 5)
                res.append((c / t, t))
            rows.append((statistics.median(r[1] for r in res), statistics.median(r[0] for r in res), shape, units,
                         used, same))
    c = timed(copy) if copy else None
    t_tok = timed(tok_fn)
    print(f"\n{title}: per-token kernel {t_tok * 1e3:.1f} us" + (f" = {c / t_tok:.3f} of copy" if copy else ""))
    for t, r, shape, units, used, same in sorted(rows, key=lambda x: x[0]):
        frac = f" = {r:.3f} of copy" if copy else ""
        print(f"  G={shape[0]} HB={shape[1]} KVF={shape[2]} units={units:>10}: {t * 1e3:8.1f} us{frac}  runs used={used} "
              f"bit-identical={same}")


def main() -> None:
    dev = torch.device("cuda")
    rope = RopeSpec(D, D, 1e6, True, 1 << 20, torch.bfloat16)
    T = 98304
    kv = torch.randn(2, L, T, H, D, device=dev).to(torch.bfloat16)
    src, dst = kv.view(-1), torch.empty_like(kv.view(-1))
    old = torch.arange(T, dtype=torch.int64)
    for name in ("LBHNC", "flash"):
        if name == "LBHNC":
            layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=T // N + 64, block_size=N, num_kv_heads=H,
                                        head_size=D, dtype=torch.bfloat16)
        else:
            layout = KVLayout.from_vllm_legacy("first", "NHD", num_layers=L, num_blocks=T // N + 64, block_size=N,
                                               num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
        cache = layout.allocate(dev, fill=0)
        slots = torch.randperm(layout.num_blocks)[: T // N].repeat_interleave(N) * N + torch.arange(N).repeat(T // N)
        sweep(f"large {name}", [kv], cache, layout, [slots], rope, [old], [old + 1000], lambda: dst.copy_(src))
        del cache
    # seed size, segments at random block-granular offsets (children's prompts fill blocks in order)
    gen = torch.Generator().manual_seed(0)
    layout = KVLayout.from_vllm("LBHNC", num_layers=L, num_blocks=4 * 32 + 8, block_size=N, num_kv_heads=H,
                                head_size=D, dtype=torch.bfloat16)
    cache = layout.allocate(dev, fill=0)
    segs = [torch.randn(2, L, 104, H, D, generator=gen).to(torch.bfloat16).to(dev) for _ in range(4)]
    kvs, slots, olds, news = [], [], [], []
    blocks = torch.randperm(layout.num_blocks, generator=gen)
    used = 0
    for c in range(4):
        for s in range(4):
            start = 30 + 110 * ((s + c) % 4)  # the segment's position in the child prompt
            pos = torch.arange(start, start + 104)
            # child c's prompt occupies its own blocks; position p -> block (p // N) of the child's table
            table = blocks[c * 32:(c + 1) * 32]
            slots.append((table[pos // N] * N + pos % N).to(dev))
            kvs.append(segs[s])
            olds.append((torch.arange(104) + 120 * s).to(dev))
            news.append(pos.to(dev))
            used += 104
    sweep("seed size, block-granular slots", kvs, cache, layout, slots, rope, olds, news, None)


if __name__ == "__main__":
    main()
