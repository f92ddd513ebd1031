"""Cost of each host step of the placement fast path (``place._fast_prepare`` with the compiled run
builder), timed one by one in loops on the restore shape of tools/profile_place_prepare.py (4 items
x 256 tokens, host int64 indices, RoPE shift, NHD cache): where a prepare's microseconds go on this
machine, CUDA calls included.

Usage: PYTHONPATH=. python tools/profile_prepare_steps.py [--device cuda] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import importlib
import sys
from pathlib import Path

from kmesh_gpu import RopeSpec, _host_tables

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_place_prepare as ppp  # noqa: E402

place_mod = importlib.import_module("kmesh_gpu.place")


def timed(fn, repeat: int) -> float:
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if not cuda:
        from kmesh_gpu import _backend

        _backend.choose = lambda b, d: "cupy"
    rope = RopeSpec(ppp.D, ppp.D, 1e6, True, 32768, torch.bfloat16)
    layout, kvs, slots, olds, news = ppp.restore_batch(dev)
    cache = layout.allocate(dev, fill=0)
    T = sum(k.shape[2] for k in kvs)
    L = layout.num_layers
    f = place_mod._facts(cache, layout, rope, "cache")
    host = torch.empty(L + 2 * T + 7 * T, dtype=torch.int64, pin_memory=cuda)
    h = host.numpy()
    sl = torch.cat(slots).numpy()
    counts = tuple(k.shape[2] for k in kvs)
    ptrs = [k.data_ptr() for k in kvs]
    build = _host_tables.builder()
    starts = place_mod._token_index(counts, f.row)[0]
    params = np.array([f.row, f.N, f.cap[1], f.S, f.P, f.st[1], f.st[3], layout.k_offset, f.vt[1], f.vt[3],
                       layout.v_offset], dtype=np.int64)
    pos = h[L:L + 2 * T]
    torch.cat(list(olds) + list(news), out=host[L:L + 2 * T])
    out = h[L + 2 * T:].reshape(T, 7)
    R = build(sl, starts, place_mod._i64(ptrs), params, True, pos, out)
    n_up = L + 2 * T + 7 * R
    steps = {
        "whole prepare_place_many": lambda: place_mod.prepare_place_many(
            kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news),
        "_check_args": lambda: place_mod._check_args(layout, rope, olds, news),
        "_facts lookup": lambda: place_mod._facts(cache, layout, rope, "cache"),
        "_backend.choose": lambda: place_mod._backend.choose("auto", f.device),
        "kv checks (4 items)": lambda: [(k.shape, k.dtype, k.device != f.device, k.is_contiguous(), k.data_ptr())
                                        for k in kvs],
        "_host_ints x3": lambda: (place_mod._host_ints(slots, list(counts)), place_mod._host_ints(olds, list(counts)),
                                  place_mod._host_ints(news, list(counts))),
        "torch.cat(slots).numpy()": lambda: torch.cat(slots).numpy(),
        "torch.empty pinned": lambda: torch.empty(L + 9 * T, dtype=torch.int64, pin_memory=cuda),
        "host.numpy()": lambda: host.numpy(),
        "h[:L] = layer_base": lambda: h.__setitem__(slice(0, L), f.layer_base),
        "torch.cat(positions, out=)": lambda: torch.cat(list(olds) + list(news), out=host[L:L + 2 * T]),
        "_i64(ptrs)": lambda: place_mod._i64(ptrs),
        "compiled build": lambda: build(sl, starts, place_mod._i64(ptrs), params, True, pos, out),
        "upload .to(device)": lambda: host[:n_up].to(dev, non_blocking=True),
    }
    if cuda:
        steps.update(_driver_steps(place_mod, f, layout, rope, kvs, cache, slots, olds, news, counts, ptrs, starts,
                                   params, dev))
    print(f"placement fast-path steps on {args.device} ({len(kvs)} items x {kvs[0].shape[2]} tokens, R={R} runs), "
          f"us per call, {args.repeat} calls each:")
    for name, fn in steps.items():
        fn, repeat = fn if isinstance(fn, tuple) else (fn, args.repeat)
        print(f"  {name:<30} {timed(fn, repeat):8.2f}")
        if cuda:
            torch.cuda.synchronize()


def _driver_steps(place_mod, f, layout, rope, kvs, cache, slots, olds, news, counts, ptrs, starts, params, dev):
    """The compiled-driver path's steps (``kmesh_gpu._place_driver``), beside the whole preparation
    and launch with that path on and off."""
    from kmesh_gpu import _launch, _place_driver

    jit, fns = _launch.driver_jit()
    L, T = layout.num_layers, sum(counts)
    kw = dict(rope=rope, old_positions=olds, new_positions=news)
    on = place_mod.prepare_place_many(kvs, cache, layout, slots, **kw)
    _place_driver.ENABLED = False
    off = place_mod.prepare_place_many(kvs, cache, layout, slots, **kw)
    _place_driver.ENABLED = True
    ring = f.ring
    n64 = L + 10 * T
    offset, event = ring.reserve(8 * n64)
    h = ring.a64[offset // 8:offset // 8 + n64]
    dev_table = torch.empty(n64, dtype=torch.int64, device=dev)
    stream = _launch.current_stream(dev.index or 0)

    def no_driver():
        _place_driver.ENABLED = False
        try:
            return place_mod.prepare_place_many(kvs, cache, layout, slots, **kw)
        finally:
            _place_driver.ENABLED = True

    def reserve_cancel():
        got = ring.reserve(8 * n64)
        if got is not None:
            ring.cancel(got[0])

    return {
        "whole prepare (torch/CuPy path)": no_driver,
        "_place_driver.prepare_runs": lambda: _place_driver.prepare_runs(
            f, layout, rope, slots, olds, news, counts, ptrs, starts, params, f.cap[1], False, f.consts),
        "ring.reserve + cancel": reserve_cancel,
        "ring.t64 slice": lambda: ring.t64[offset // 8 + L:offset // 8 + L + 3 * T],
        "torch.cat(12, out=ring slice)": lambda: torch.cat(
            (*olds, *news, *slots), out=ring.t64[offset // 8 + L:offset // 8 + L + 3 * T]),
        "torch.empty table on the GPU": lambda: torch.empty(n64, dtype=torch.int64, device=dev),
        "current_stream": lambda: _launch.current_stream(dev.index or 0),
        "build_upload (compiled)": lambda: jit.build_upload(
            fns, h[L + 2 * T:L + 3 * T], starts, place_mod._i64(ptrs), params, False, h[L:L + 2 * T],
            h[L + 3 * T:].reshape(T, 7), L + 3 * T, ring.base + offset, dev_table.data_ptr(), stream,
            event.cuda_event),
        "launch plan (template)": lambda: _place_driver._launch_plan(
            _place_driver._STATE[0][3], f, layout, rope, f.consts, dev.index or 0, lambda: 0, dev_table.data_ptr(), L + 3 * T, L, T, 128),
        # few calls: each queues a kernel, and a full launch queue would time the GPU instead
        "run() driver (100 calls)": (on.run, 100),
        "run() CuPy path (100 calls)": (off.run, 100),
    }


if __name__ == "__main__":
    main()
