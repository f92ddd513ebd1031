"""Where the host time of ``_place_driver.place_now`` goes (the host-tier child's placement in one
compiled call), on the GPU machine: the whole call, then its pieces one by one in loops of the same
inputs (the cache's facts, the index tensors' checks, a ring reservation, the compiled call alone,
and the table upload alone), then place_now against ``place._prepare_at(...).run()`` (the same
placement prepared and launched in steps), alternating. The inputs are the 12 MiB child of
``perf/run_ssd_routes.py`` (4 objects of 256 tokens, RoPE shift) staged in one device buffer.

Usage (GPU machine): PYTHONPATH=. taskset -c 4 python tools/profile_place_now.py
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

from kmesh_gpu import _launch, _place_driver  # noqa: E402
from kmesh_gpu._place_tables import _i64  # noqa: E402


def timed(fn, n: int = 400, sync_every: int = 20) -> float:
    """Median µs of ``fn()`` over ``n`` calls (the device synchronised every ``sync_every``, untimed)."""
    out = []
    for i in range(n):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def alternating(name_a: str, a, name_b: str, b, rounds: int = 400) -> list:
    """``a`` and ``b`` in turn (which goes first alternating): medians µs and the median per-round ratio."""
    ta, tb = [], []
    for i in range(rounds):
        if i % 10 == 0:
            torch.cuda.synchronize()
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    ratio = statistics.median(x / y for x, y in zip(ta, tb))
    return [(f"A/B {name_a}", statistics.median(ta) * 1e6), (f"A/B {name_b}", statistics.median(tb) * 1e6),
            (f"A/B ratio {name_a} / {name_b} (median per round)", ratio)]


def main() -> None:
    argparse.ArgumentParser().parse_args()
    P = importlib.import_module("kmesh_gpu.place")
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        wargs = argparse.Namespace(data_dir=tmp, shift=True, objects=4, tokens=256, place=True, children=4)
        work = rs.Workload(wargs, device)
        kvs = [work.store.get(k, model_fingerprint=work.fp).kv for k in work.keys]
        staging = torch.cat([kv.reshape(-1).view(torch.uint8) for kv in kvs]).cuda()
        addresses, at = [], staging.data_ptr()
        for kv in kvs:
            addresses.append(at)
            at += kv.numel() * kv.element_size()
        shapes = [tuple(kv.shape) for kv in kvs]
        t = work.targets[0]
        slots = [x.slots for x in t]
        news = [x.new_positions for x in t]
        olds = [work.store.read_header(k).positions_int64 for k in work.keys]
        cache, layout, rope = work.cache, work.layout, work.rope
        dtype = kvs[0].dtype

        def whole():
            assert _place_driver.place_now(addresses, shapes, dtype, cache, layout, slots, rope=rope,
                                           old_positions=olds, new_positions=news)

        rows = [("place_now, whole", timed(whole))]
        rows.append(("  _check_args", timed(lambda: P._check_args(layout, rope, olds, news))))
        rows.append(("  _facts", timed(lambda: P._facts(cache, layout, rope, "cache"))))
        f = P._facts(cache, layout, rope, "cache")
        seqs = (*olds, *news, *slots)

        def sources():
            out = []
            for x in seqs:
                if type(x) is not torch.Tensor or x.dtype is not torch.int64 or not x.is_cpu or x.dim() != 1 \
                        or not x.is_contiguous():
                    return None
                out.append(x.data_ptr())
            return out

        rows.append(("  index tensors checked", timed(sources)))
        _, dev_id, want, kernel, template, params, ring, mirror = f.lane
        jit, fns = _place_driver._STATE[0][0], _place_driver._STATE[0][1]
        T = sum(s[2] for s in shapes)
        L = f.kv_shape[0]

        def reserve():
            off, _ = ring.reserve(8 * (L + 10 * T))
            ring.cancel(off)

        rows.append(("  ring reserve + cancel", timed(reserve)))
        rows.append(("  current stream", timed(lambda: _launch.current_stream(dev_id))))
        srcs, ptrs = _i64(sources()), _i64(addresses)
        starts = P._token_index(tuple(s[2] for s in shapes), f.row)[0]
        stream = _launch.current_stream(dev_id)

        def compiled():
            off, ev = ring.reserve(8 * (L + 10 * T))
            R = jit.place_now(fns, srcs, f.layer_base, starts, ptrs, params, True, ring.a64, off // 8, ring.base + off,
                              mirror + off, stream, ev.cuda_event, kernel, template)
            assert R > 0

        rows.append(("  reserve + compiled call", timed(compiled)))
        host = ring.base
        rows.append(("  driver: table upload alone (ctypes)", timed(lambda: _launch.copy_htod(mirror, host, 8 * (L + 10 * T),
                                                                                          stream))))

        def in_steps():
            P._prepare_at(addresses, shapes, dtype, staging.device, cache, layout, slots, rope=rope, old_positions=olds,
                          new_positions=news).run()

        rows += alternating("place_now", whole, "_prepare_at(...).run()", in_steps)
    print(f"place_now of the 12 MiB child (4 x 256 tokens, RoPE), medians of 400 calls (µs), T={T}, L={L}")
    for name, us in rows:
        print(f"{name:<44} {us:8.1f}")


if __name__ == "__main__":
    main()
