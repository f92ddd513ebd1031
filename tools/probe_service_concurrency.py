"""Steady-state throughput of the cache service with N concurrent client processes, per setting.

Runs perf/bench_service.py's concurrency part (each client registers its own cache, restores the
seed-size child once, then ``--rounds`` times from a common start line) for every combination of
``--clients`` counts and polling settings, alternating their order over ``--repeats`` rounds, one
fresh service per run. Prints restores/s, latency median and p90 per run and the medians per
setting; writes JSON to ``--out``.

Usage (GPU machine): PYTHONPATH=. python tools/probe_service_concurrency.py [--clients 1 4 16]
    [--reply-spin auto 0] [--receive-spin auto 0] [--rounds 100] [--repeats 2]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import bench_service as bs  # noqa: E402

from kmesh_host.service import CacheClient, CacheService, RestoreItem, ServiceConfig  # noqa: E402


def _spin(value: str):
    return None if value == "auto" else float(value)


def thread_cpu(pid: int) -> dict:
    """thread id -> (name with digits folded, user + system CPU seconds) of process ``pid``, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:  # ended meanwhile
            continue
        name = re.sub(r"\d+", "N", raw[raw.index("(") + 1:raw.rindex(")")])
        fields = raw.rsplit(")", 1)[1].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


class ThreadSampler:
    """CPU time per thread of a process, sampled every ``period_s`` between :meth:`start` and
    :meth:`stop` (a thread that ends counts up to its last sample)."""

    def __init__(self, pid: int, period_s: float = 0.02):
        self.pid, self.period_s = pid, period_s
        self.first: dict = {}
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for tid, v in thread_cpu(self.pid).items():
            self.first.setdefault(tid, v)
            self.last[tid] = v

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def cpu_by_name(self) -> collections.Counter:
        per = collections.Counter()
        for tid, (name, sec) in self.last.items():
            per[name] += sec - self.first[tid][1]
        return per


def warm_up(client, device: str) -> None:
    """One restore from this process, so that what a service makes once (its device copies of the
    originals, launch-table memory) exists before the baseline the clients' run is compared to."""
    layout = bs.child_layout()
    shared, registrable, _ = bs._alloc(layout, device)
    reg = client.register(registrable, layout, rope=bs.child_rope())
    client.restore(reg, [RestoreItem(k, s, p) for k, s, p in bs.child_plan()])
    client.close_registration(reg, timeout=60)
    if shared is not None:
        registrable = None
        shared.close()


def run_one(device: str, clients: int, rounds: int, reply_spin, receive_spin, driver_gil: str,
            completion_spin, switch_interval) -> dict:
    os.environ["KMESH_DRIVER_GIL"] = driver_gil  # read by kmesh_gpu._launch in the processes spawned next
    d = tempfile.mkdtemp(prefix="kmsc-")
    path = os.path.join(d, "svc", "kmesh.sock")
    try:
        extra = {} if completion_spin is None else {"completion_spin_s": completion_spin}
        if switch_interval is not None:
            extra["switch_interval_s"] = switch_interval
        cfg = ServiceConfig(socket_path=path, host_budget_bytes=1 << 30, receive_spin_s=receive_spin, **extra)
        with CacheService(cfg) as svc, CacheClient(path, timeout=300, fast_lane=False) as client:
            for key, kv, pos in bs.originals():
                client.put(key, kv, pos)
            warm_up(client, device)
            args = argparse.Namespace(device=device, clients=clients, rounds=rounds, reply_spin_s=reply_spin,
                                      inputs="tensors")
            sampler = ThreadSampler(svc.pid)
            res = bs.concurrent(args, client, path, on_start=sampler.start, on_end=sampler.stop)
            # the service's CPU time per thread from the clients' start line until every client
            # reported (the timed loops, and their closing at the end)
            per = sampler.cpu_by_name()
            res["service_cpu_s"] = sum(per.values())
            res["service_cpu_by_thread"] = dict(per.most_common(6))
            res["service_threads"] = len(sampler.first)
            return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reply-spin", nargs="+", default=["auto", "0"])
    ap.add_argument("--receive-spin", nargs="+", default=["auto"])
    ap.add_argument("--driver-gil", nargs="+", default=["hold"], choices=("hold", "release"),
                    help="KMESH_DRIVER_GIL of the service (and clients): quick driver calls keep or release the GIL")
    ap.add_argument("--completion-spin", nargs="+", default=["auto"],
                    help="ServiceConfig.completion_spin_s (auto: its default)")
    ap.add_argument("--switch-interval", nargs="+", default=["auto"],
                    help="ServiceConfig.switch_interval_s (auto: Python's default)")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = list(itertools.product(args.clients, args.reply_spin, args.receive_spin, args.driver_gil,
                                         args.completion_spin, args.switch_interval))
    runs = {s: [] for s in settings}
    for r in range(args.repeats):
        order = settings if r % 2 == 0 else settings[::-1]
        for s in order:
            n, reply, receive, gil, done, switch = s
            res = run_one(args.device, n, args.rounds, _spin(reply), _spin(receive), gil, _spin(done), _spin(switch))
            runs[s].append(res)
            print(f"clients {n:>2} reply_spin {reply:>4} receive_spin {receive:>4} driver_gil {gil:>7} completion_spin {done:>4} "
                  f"switch {switch:>6}: {res['restores_per_s'] or 0:8.1f} restores/s, latency median {res['latency_median_ms']:.3f} ms "
                  f"p90 {res['latency_p90_ms']:.3f} ms, first {res['first_restore_median_ms']:.2f} ms, "
                  f"errors {res['errors']}, baseline {res['memory_back_to_baseline']}, service CPU "
                  f"{res['service_cpu_s']:.2f} s over {res['wall_s']:.2f} s ({res['service_threads']} threads; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in res["service_cpu_by_thread"].items()) + ")", flush=True)
    print("medians per setting:")
    summary = []
    for s in settings:
        n, reply, receive, gil, done, switch = s
        rates = [x["restores_per_s"] or 0.0 for x in runs[s]]
        lats = [x["latency_median_ms"] for x in runs[s]]
        summary.append({"clients": n, "reply_spin": reply, "receive_spin": receive, "driver_gil": gil, "completion_spin": done, "switch_interval": switch,
                        "restores_per_s": statistics.median(rates), "latency_median_ms": statistics.median(lats),
                        "errors": sum(x["errors"] for x in runs[s]),
                        "memory_back_to_baseline": all(x["memory_back_to_baseline"] for x in runs[s])})
        print(f"  clients {n:>2} reply_spin {reply:>4} receive_spin {receive:>4} driver_gil {gil:>7} "
              f"completion_spin {done:>4} switch {switch:>6}: "
              f"{summary[-1]['restores_per_s']:8.1f} restores/s, latency {summary[-1]['latency_median_ms']:.3f} ms")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"probe_service_concurrency_{args.device}.json"), "w") as f:
            json.dump({"settings": summary, "runs": {str(k): v for k, v in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
