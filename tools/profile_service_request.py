"""Where a cache-service restore's host time goes, function by function, on both sides of the socket:
perf/bench_service.py's seed-size child restored ``--requests`` times back to back, the client's
``restore`` calls under cProfile in this process and the service's handling of each binary frame
(``_Service._serve_binary``: decoding, checks, holds, the placement, the wait for its completion
and the reply) under cProfile in the service process. cProfile inflates small calls; read the
tables for where the time is spread, and the stage timings of perf/bench_service.py for absolute
figures.

Usage: PYTHONPATH=. python tools/profile_service_request.py [--device cuda|cpu] [--requests 500] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

from kmesh_host.service import CacheClient, RestoreItem, ServiceConfig  # noqa: E402


def _service_main(config, ready, stop, out_path: str, top: int, skip: int) -> None:
    from kmesh_host.service.server import _Service

    prof = cProfile.Profile()
    serve = _Service._serve_binary
    seen = [0]

    def profiled(self, *args):
        seen[0] += 1
        if seen[0] <= skip:  # the warm-up's (compilation, first uploads) stay out of the table
            return serve(self, *args)
        prof.enable()
        try:
            return serve(self, *args)
        finally:
            prof.disable()

    _Service._serve_binary = profiled
    service = _Service(config)
    service.start()
    ready.set()
    stop.wait()
    service.stop()
    with open(out_path, "w") as f:
        f.write(_table(prof, top))


WARMUP = 20  # restores before the profiled ones, on both sides


def _table(prof, top: int) -> str:
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumtime").print_stats(top)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="kmspr-")
    path = os.path.join(d, "svc", "kmesh.sock")
    out_path = os.path.join(d, "service_profile.txt")
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_service_main, args=(ServiceConfig(socket_path=path, host_budget_bytes=1 << 30),
                                                   ready, stop, out_path, args.top, WARMUP))
    proc.start()
    try:
        if not ready.wait(120):
            raise SystemExit("the service did not start")
        layout, rope, plan, _ = bs.child_setup(args.device)
        items = [RestoreItem(k, s, p) for k, s, p in plan]
        shared, registrable, _ = bs._alloc(layout, args.device)
        prof = cProfile.Profile()
        with CacheClient(path, timeout=120, fast_lane=False) as client:
            for key, kv, pos in bs.originals():
                client.put(key, kv, pos)
            reg = client.register(registrable, layout, rope=rope)
            for _ in range(WARMUP):
                client.restore(reg, items)
            prof.enable()
            for _ in range(args.requests):
                client.restore(reg, items)
            prof.disable()
            client.close_registration(reg, timeout=60)
        if shared is not None:
            registrable = None
            shared.close()
        stop.set()
        proc.join(120)
        print(f"=== client side: {args.requests} restores of the seed child ({args.device})")
        print(_table(prof, args.top))
        print(f"=== service side (_Service._serve_binary of the same {args.requests} requests)")
        with open(out_path) as f:
            print(f.read())
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
