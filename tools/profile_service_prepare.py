"""Why the cache service's placement preparation of the seed child takes longer than the same
preparation in the client's process: ``prepare_place_many`` timed in one process with the index
inputs as each path hands them over (the in-process benchmark's int64 tensors; the service's views
of a request body split in one call, with ``_slots_checked``), on the current stream and on a side
stream made current with the service's raw setter, and the service's own steps around it; last,
the service's placement (``prepare_flat(...).run()``) against the same placement in one compiled
call (``place_now`` from per-item views of the body), alternating call by call.

Usage (GPU machine): PYTHONPATH=. python tools/profile_service_prepare.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

from kmesh_host._streams import _ids, on_stream  # noqa: E402

place_mod = importlib.import_module("kmesh_gpu.place")


def timed(fn, repeat: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):  # five batches, synchronised between them (the launch queue never fills)
        t = time.perf_counter()
        for _ in range(repeat // 5):
            fn()
        best.append((time.perf_counter() - t) / (repeat // 5) * 1e6)
        torch.cuda.synchronize()
    return float(np.median(best))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    layout, rope, plan, resident = bs.child_setup("cuda")
    cache = layout.allocate("cuda", fill=0)
    kvs = [kv for _, kv, _ in resident]
    olds = [p for _, _, p in resident]
    slots = [s for _, s, _ in plan]
    news = [p for _, _, p in plan]
    # the service's inputs: one body (every item's slots, then the new positions) as bytes, viewed
    body = np.concatenate([s.numpy() for s in slots] + [p.numpy() for p in news]).tobytes()
    values = np.frombuffer(body, dtype=np.int64)
    sizes = [s.numel() for s in slots] + [p.numel() for p in news]
    n = len(slots)

    def service_inputs():
        index = torch.from_numpy(values).split_with_sizes(sizes)
        return list(index[:n]), list(index[n:])

    s_slots, s_news = service_inputs()

    def split_and_prepare():
        sl, nw = service_inputs()
        return place_mod.prepare_place_many(kvs, cache, layout, sl, rope=rope, old_positions=olds, new_positions=nw,
                                            _slots_checked=True)
    side = torch.cuda.Stream()
    ids = _ids(side)

    def on_side(fn):
        def run():
            switch = on_stream(side, ids)
            switch.__enter__()
            try:
                return fn()
            finally:
                switch.__exit__(None, None, None)
        return run

    rows = {
        "in-process inputs": lambda: place_mod.prepare_place_many(kvs, cache, layout, slots, rope=rope,
                                                                  old_positions=olds, new_positions=news),
        "in-process inputs, _slots_checked": lambda: place_mod.prepare_place_many(
            kvs, cache, layout, slots, rope=rope, old_positions=olds, new_positions=news, _slots_checked=True),
        "service inputs (views of the body)": lambda: place_mod.prepare_place_many(
            kvs, cache, layout, s_slots, rope=rope, old_positions=olds, new_positions=s_news, _slots_checked=True),
        "service inputs, split included": split_and_prepare,
        "the split alone": service_inputs,
        "service inputs on a side stream": on_side(lambda: place_mod.prepare_place_many(
            kvs, cache, layout, s_slots, rope=rope, old_positions=olds, new_positions=s_news, _slots_checked=True)),
        "side-stream switch alone": on_side(lambda: None),
    }
    launch = place_mod.prepare_place_many(kvs, cache, layout, slots, rope=rope, old_positions=olds,
                                          new_positions=news)
    from kmesh_gpu import _place_driver

    counts = tuple(s.numel() for s in slots)
    old_flat = torch.cat(olds).numpy()
    T = sum(counts)
    flat = _place_driver.prepare_flat(kvs, cache, layout, counts, values[:T], rope=rope, old_positions=old_flat,
                                      new_positions=values[T:])
    print(f"the service's one-array preparation (prepare_flat) {'applies' if flat is not None else 'DECLINES'}")
    rows["prepare_flat (the body's arrays as they are)"] = lambda: _place_driver.prepare_flat(
        kvs, cache, layout, counts, values[:T], rope=rope, old_positions=old_flat, new_positions=values[T:])
    rows["prepare_flat on a side stream"] = on_side(rows["prepare_flat (the body's arrays as they are)"])
    rows.update(_stream_rows(on_side, cache, layout, rope, kvs, olds, s_slots, s_news))  # after: facts are made
    print(f"seed child (4 x {bs.SEG_TOKENS} tokens, {bs.LAYERS} layers) on {torch.cuda.get_device_name()}: "
          f"run table {'with' if launch.tables.get('driver_launch') else 'without'} the driver path, "
          f"{launch.tables.get('runs')} runs; us per call (median of 5 batches of {args.repeat // 5})")
    for name, fn in rows.items():
        print(f"  {name:<40} {timed(fn, args.repeat):8.2f}")
    _one_call_against_prepared(kvs, cache, layout, rope, counts, values, sizes, old_flat, olds, args.repeat)


def _one_call_against_prepared(kvs, cache, layout, rope, counts, values, sizes, old_flat, olds, rounds: int) -> None:
    """The service's two compiled placements of the same restore, alternating call by call (the
    service's ``one_call_placement`` setting): ``prepare_flat(...).run()`` against ``place_now``
    from per-item views of the body (the split included, as the service does it)."""
    from kmesh_gpu import _place_driver

    T, n = sum(counts), len(kvs)
    addresses, shapes = [k.data_ptr() for k in kvs], [k.shape for k in kvs]

    def prepared():
        _place_driver.prepare_flat(kvs, cache, layout, counts, values[:T], rope=rope, old_positions=old_flat,
                                   new_positions=values[T:]).run()
        return True

    def one_call():
        index = torch.from_numpy(values).split_with_sizes(sizes)
        return _place_driver.place_now(addresses, shapes, kvs[0].dtype, cache, layout, index[:n], rope=rope,
                                       old_positions=olds, new_positions=index[n:])

    out = {"prepared": [], "one call": []}
    for i in range(rounds + 50):
        for name, fn in ((("prepared", prepared), ("one call", one_call)) if i % 2 == 0
                         else (("one call", one_call), ("prepared", prepared))):
            t = time.perf_counter()
            ok = fn()
            dt = (time.perf_counter() - t) * 1e6
            assert ok, f"{name} declined"
            if i >= 50:
                out[name].append(dt)
        if i % 20 == 19:
            torch.cuda.synchronize()
    ratios = sorted(a / b for a, b in zip(out["one call"], out["prepared"]))
    q = np.quantile(ratios, [0.25, 0.5, 0.75])
    print(f"  the service's placement, alternating call by call ({rounds} rounds): one call (place_now) "
          f"{np.median(out['one call']):.1f} us, prepared then launched {np.median(out['prepared']):.1f} us, "
          f"median per-round ratio {q[1]:.3f} (quartiles {q[0]:.3f}..{q[2]:.3f})")


def _stream_rows(on_side, cache, layout, rope, kvs, olds, slots, news) -> dict:
    """The driver path's stream-dependent steps, on the default stream and on the side stream."""
    from kmesh_gpu import _launch, _place_driver

    f = place_mod._facts(cache, layout, rope, "cache")
    counts = tuple(k.shape[2] for k in kvs)
    starts = place_mod._token_index(counts, f.row)[0]
    ptrs = [k.data_ptr() for k in kvs]
    params = next(iter(f.params.values()))
    L, T = layout.num_layers, sum(counts)
    n64 = L + 10 * T
    jit, fns = _launch.driver_jit()
    ring = f.ring
    offset, event = ring.reserve(8 * n64)
    h = ring.a64[offset // 8:offset // 8 + n64]
    table = torch.empty(n64, dtype=torch.int64, device=cache.device)
    h[L:L + 3 * T] = torch.cat((*olds, *news, *slots)).numpy()

    def build_upload():
        stream = _launch.current_stream(cache.device.index)
        return jit.build_upload(fns, h[L + 2 * T:L + 3 * T], starts, place_mod._i64(ptrs), params, False,
                                h[L:L + 2 * T], h[L + 3 * T:].reshape(T, 7), L + 3 * T, ring.base + offset,
                                table.data_ptr(), stream, event.cuda_event)

    def prepare_runs():
        return _place_driver.prepare_runs(f, layout, rope, slots, olds, news, counts, ptrs, starts, params,
                                          int(params[2]), True, f.consts)

    def empty():
        return torch.empty(n64, dtype=torch.int64, device=cache.device)

    def record():
        return _launch.record_event(event.cuda_event, _launch.current_stream(cache.device.index))

    out = {}
    for name, fn in (("torch.empty table", empty), ("build_upload", build_upload), ("event record", record),
                     ("_place_driver.prepare_runs", prepare_runs)):
        out[f"{name}, default stream"] = fn
        out[f"{name}, side stream"] = on_side(fn)
    return out


if __name__ == "__main__":
    main()
