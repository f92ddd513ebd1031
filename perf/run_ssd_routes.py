"""SSD -> GPU routes: the seed's forced-read comparison, the read-once variant, the physical limits.

Workload (seed §24): four children, each restoring the same four shared segments (Qwen2.5-0.5B KV
shape: 24 layers, 2 KV heads, head 64, bf16; 256 tokens each = one padded 3 MiB object; 12 MiB per
child, 48 MiB for four) into its own paged cache slots at shifted positions (RoPE shift on).

1. **Forced read**: singleflight off, retention on, explicit eviction from the host tier before
   every child and the files' page-cache pages dropped (posix_fadvise DONTNEED) — and the host
   staging route reads with O_DIRECT, so its reads reach the disk (the report says if the
   filesystem refused O_DIRECT). Seven matched pairs alternate which route goes first; each pair
   runs the four children through each route one at a time; per pair we take the median of the
   four children per route and then the paired difference (direct - host_staging) and ratio
   (direct / host_staging); the table shows the medians of the seven. Intervals are nested, never
   added: read calls and verification lie inside restoration, restoration inside the outer
   interval (eviction + restore + placement + release + stream sync).
2. **Host tier**: the same children restored from retained pinned RAM (no eviction), against the
   same-run pinned H2D bandwidth; measured after the forced reads (the headline) and, trusted, once
   more before them (both are reported). On CUDA each timed child alternates with one pinned copy
   of the child's bytes timed next to it (first in even pairs, after in odd ones), and the target
   figure is the median of the per-pair fractions: the lent machine's virtual CPUs change speed
   within seconds, and a copy measured once, minutes away, can have run at another speed; the
   once-measured figure is still reported beside it. The retained objects were verified when they entered the tier
   (the device tree-root check of the forced read that loaded them, recorded on the tier entry),
   so the headline variant trusts that check (per child: one H2D per object + one placement launch);
   the ``device re-verify`` variant also recomputes every root on the device. Medians of
   ``--hit-children`` children (40) after ``--hit-warmup`` untimed ones (20).
3. **Read once**: retention and singleflight on, four children started together after one
   eviction: the shared source (the four objects, 12 MiB) is read from storage once for all four
   children — every key exactly one read, 12 MiB read in all (counted per key by the tier).
4. **Limits**: the disk's sequential O_DIRECT read bandwidth, measured in the same run with the
   route's queue depth and chunk size through each read engine (io_uring and the thread pool; the
   best is the disk figure), and each route's restore bandwidth as a fraction of it; plus, as a
   diagnostic, the same-shape raw read (the child's four payload ranges read concurrently through
   the route's engine, no GPU): the ceiling of the route's reads at this size.

Every child restores through a ``kmesh_host.InProcessRestorer`` made once per route and
configuration (``RouteConfig``) for the benchmark's cache, as a worker keeps one per destination.
Every timed child runs with Python's garbage collector off (as ``timeit`` does); it collects
between children.

Writes a table to stdout and ``ssd_routes.json`` + ``ssd_routes.png`` (when matplotlib is
installed) to ``--out``. ``--data-dir`` must lie on the SSD under test.

    python perf/run_ssd_routes.py --device cuda --data-dir /mnt/nvme/kmesh-bench
    python perf/run_ssd_routes.py --device cpu --pairs 2 --children 2 --bw-mib 64    # smoke, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tools"))
import cpu_speed_map  # noqa: E402  (the interpreter-speed probe, tools/)

from kmesh_gpu import KVLayout, RopeSpec  # noqa: E402
from kmesh_gpu.errors import BackendError, StorageError  # noqa: E402
from kmesh_host import (HostTier, HostTierConfig, InProcessRestorer, ModelFingerprint, RestoreItem,  # noqa: E402
                        RouteConfig, SegmentStore)
from kmesh_host.direct_io import ENGINES, DirectFile, HostBuffer, ReadEngine, file_o_direct_support  # noqa: E402
from kmesh_host.restore.direct import direct_facts  # noqa: E402

MIB = 1 << 20
L, H, D = 24, 2, 64
DTYPE = torch.bfloat16
METRICS = ("read_s", "verify_s", "prepare_s", "tail_s", "restore_s", "outer_s")
# read, verify, placement preparation and the tail (last object landed -> restore end) lie inside
# restore, restore inside outer (never added).
NESTED = (("read_s", "restore_s"), ("verify_s", "restore_s"), ("prepare_s", "restore_s"), ("tail_s", "restore_s"),
          ("restore_s", "outer_s"))
TARGETS = {"forced_read_fraction_of_disk_bw": 0.85, "host_tier_fraction_of_h2d_bw": 0.80}


def fingerprint() -> ModelFingerprint:
    return ModelFingerprint("Qwen2ForCausalLM", L, H, D, "bfloat16",
                            {"base": 1_000_000.0, "rotary_dim": D, "is_neox_style": True, "max_position": 32768})


def rope_spec() -> RopeSpec:
    return RopeSpec(head_size=D, rotary_dim=D, base=1_000_000.0, is_neox_style=True, max_position=32768, dtype=DTYPE)


def fs_type(path: str) -> str:
    """The filesystem type of ``path`` from /proc/mounts (longest mount-point prefix)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    except OSError:
        pass
    return kind


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------- limits
def write_file(path: str, nbytes: int, seed: int = 7) -> None:
    """``nbytes`` of random bytes (a 64 MiB block repeated) written to ``path`` and fsynced."""
    block = np.random.default_rng(seed).integers(0, 256, min(nbytes, 64 * MIB), dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def disk_bandwidth(data_dir: str, mib: int, threads: int, chunk: int, reps: int = 3, engine: str = "auto") -> dict:
    """Sequential O_DIRECT read bandwidth of a fresh ``mib`` MiB file (page cache dropped first)."""
    path = os.path.join(data_dir, "seqread.bin")
    write_file(path, mib * MIB)
    size = mib * MIB
    times, o_direct, note = [], None, None
    try:
        with ReadEngine(threads, chunk, engine=engine) as reader, HostBuffer(size) as buf:
            how = reader.description
            for _ in range(reps):
                with DirectFile(path) as f:
                    f.drop_cache()
                    t0 = time.perf_counter()
                    reader.read(f, 0, size, buf.view)
                    times.append(time.perf_counter() - t0)
                    o_direct, note = f.o_direct, f.fallback_reason
    finally:
        os.unlink(path)
    med = statistics.median(times)
    return {"bytes": size, "seconds_median": med, "GB_per_s": size / med / 1e9, "o_direct": o_direct,
            "fallback": note, "reps": reps, "threads": threads, "queue_depth": threads, "chunk_bytes": chunk,
            "reader": how}


class SameShapeRead:
    """The child's payload ranges read concurrently (O_DIRECT, cache dropped), as the route queues them:
    every chunk of every object at once, in object order, on one reader; buffers allocated once.

    ``engine``: a ReadEngine name, or an engine to share (not closed here); ``pin``: page-locked
    buffers; ``on_chunk(i, lo, hi)``: run on the engine's completion thread as each chunk of object
    ``i`` lands (tools time what such work does to the reads)."""

    def __init__(self, work: "Workload", threads: int, chunk: int, engine="auto", *, pin: bool = False,
                 on_chunk=None):
        self.work, self.threads, self.chunk, self.on_chunk = work, threads, chunk, on_chunk
        self._own = not isinstance(engine, ReadEngine)
        self.engine = ReadEngine(threads, chunk, engine=engine) if self._own else engine
        self.buffers = [HostBuffer(h.payload_offset % 4096 + h.padded_length, pin=pin) for h in work.headers]
        self.times, self.o_direct = [], set()

    def once(self) -> float:
        work = self.work
        work.drop_page_cache()
        files = [DirectFile(work.store.local_path(k)) for k in work.keys]
        left = threading.Semaphore(0)
        errors = []
        hook = self.on_chunk

        def landed(i, lo, hi, err):
            if err is not None:
                errors.append(err)
            elif hook is not None:
                hook(i, lo, hi)
            left.release()

        try:
            t0 = time.perf_counter()
            count = 0
            for i, (f, h, b, k) in enumerate(zip(files, work.headers, self.buffers, work.keys)):
                count += self.engine.start(f, h.payload_offset, h.padded_length, b.view,
                                           lambda lo, hi, err, i=i: landed(i, lo, hi, err), name=k)
            for _ in range(count):
                left.acquire()
            dt = time.perf_counter() - t0
            if errors:
                raise errors[0]
            self.o_direct |= {f.o_direct for f in files}
        finally:
            for f in files:
                f.close()
        self.times.append(dt)
        return dt

    def summary(self) -> dict:
        med = statistics.median(self.times)
        return {"bytes": self.work.child_bytes, "seconds_median": med, "GB_per_s": self.work.child_bytes / med / 1e9,
                "o_direct": self.o_direct == {True}, "reps": len(self.times), "threads": self.threads,
                "queue_depth": self.threads, "chunk_bytes": self.chunk,
                "interleaved": "measured inside the forced-read pairs, between the route runs"}

    def close(self) -> None:
        if self._own:
            self.engine.close()
        for b in self.buffers:
            b.close()


def h2d_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> dict | None:
    """Pinned host -> device copy bandwidth of ``nbytes`` (median of ``reps``)."""
    if device.type != "cuda":
        return None
    with HostBuffer(nbytes, pin=True) as host:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src = host.tensor[:nbytes]
        times = []
        for _ in range(reps + 2):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - t0)
        del dst
    med = statistics.median(times[2:])
    return {"bytes": nbytes, "seconds_median": med, "GB_per_s": nbytes / med / 1e9}


class PairedH2D:
    """One pinned host-to-device copy of ``nbytes`` timed as :func:`h2d_bandwidth` times it, for the
    host-tier children to alternate with: each child is compared with a copy measured next to it,
    on the same virtual CPU speed (which moves every host-bound figure 2x within seconds)."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device = device
        self.host = HostBuffer(nbytes, pin=True)
        self.src = self.host.tensor[:nbytes]
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def once(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        self.dst.copy_(self.src, non_blocking=True)
        sync(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.dst = self.src = None
        self.host.close()


HIT_CHILDREN = 40  # host-tier children timed (each well under a millisecond)
HIT_WARMUP = 20  # untimed ones first: the forced reads before leave the host mostly idle


@contextlib.contextmanager
def no_gc():
    """The collector off inside a timed child (as ``timeit`` does): a collection of the benchmark's
    own garbage landing inside one child is not the route's cost. It runs between children."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ----------------------------------------------------------------------------------- workload
class Workload:
    def __init__(self, args, device: torch.device):
        self.device = device
        self.fp = fingerprint()
        self.rope = rope_spec() if args.shift else None
        self.store = SegmentStore(os.path.join(args.data_dir, "store"))
        gen = torch.Generator().manual_seed(11)
        self.keys = []
        for i in range(args.objects):
            kv = torch.randn((2, L, args.tokens, H, D), generator=gen).to(DTYPE)
            pos = torch.arange(args.tokens) + i * args.tokens
            self.keys.append(self.store.put(kv, torch.arange(args.tokens) + 1000 * i, pos, model_fingerprint=self.fp))
        self.headers = [self.store.read_header(k) for k in self.keys]
        self.child_bytes = sum(h.padded_length for h in self.headers)
        per_child = args.objects * args.tokens
        block = 16
        self.layout = KVLayout.from_vllm("NHD", num_layers=L, num_blocks=-(-per_child * args.children // block) + 1,
                                         block_size=block, num_kv_heads=H, head_size=D, dtype=DTYPE)
        self.cache = self.layout.allocate(device, fill=0)
        self.items = []
        for c in range(args.children):
            prefix = 17 + 29 * c  # different preceding text per child
            ts = []
            for i in range(args.objects):
                start = c * per_child + i * args.tokens
                # slot mappings and positions as a scheduler holds them: host tensors
                slots = torch.arange(start, start + args.tokens, dtype=torch.int64)
                new = torch.arange(args.tokens, dtype=torch.int64) + prefix + i * (args.tokens + 5)
                ts.append(RestoreItem(self.keys[i], slots, new if self.rope is not None else None))
            self.items.append(ts)
        self._restorers: dict = {}  # (route, tier, verify, trust_verified) -> its InProcessRestorer

    def drop_page_cache(self):
        for k in self.keys:
            with DirectFile(self.store.local_path(k), direct=False) as f:
                f.drop_cache()

    def restorer(self, route: str, tier: HostTier, verify: str, trust_verified: bool = True) -> InProcessRestorer:
        """The restorer of this configuration for the benchmark's cache (made once; the direct route
        uses no tier)."""
        key = (route, tier if route == "host_staging" else None, verify, trust_verified)  # (the tier itself: kept alive)
        found = self._restorers.get(key)
        if found is None:
            found = self._restorers[key] = InProcessRestorer(
                self.store, self.cache, self.layout, model_fingerprint=self.fp, rope=self.rope,
                tier=tier if route == "host_staging" else None,
                config=RouteConfig(route=route, verify=verify, trust_verified=trust_verified))
        return found

    def close(self) -> None:
        for restorer in self._restorers.values():
            restorer.close()
        self._restorers.clear()

    def child(self, route: str, c: int, tier: HostTier, *, verify: str, evict: bool,
              trust_verified: bool = True) -> dict:
        restorer = self.restorer(route, tier, verify, trust_verified)
        with no_gc():
            return self._child(restorer, c, tier, evict=evict)

    def _child(self, restorer: InProcessRestorer, c: int, tier: HostTier, *, evict: bool) -> dict:
        t0 = time.perf_counter()
        if evict:
            tier.evict()
            self.drop_page_cache()
        result = restorer.restore(self.items[c])
        report = result.report
        del result
        sync(self.device)
        out = {m: report.timings.get(m, 0.0) for m in METRICS if m != "outer_s"}  # direct has no tail_s
        out["outer_s"] = time.perf_counter() - t0
        out["report"] = report
        out["nested"] = all(out[a] <= out[b] for a, b in NESTED)
        return out


def retained_child(data_dir: str, device: torch.device) -> tuple["Workload", HostTierConfig]:
    """The profiling tools' setup: this benchmark's 12 MiB child (4 objects of 256 tokens, RoPE shift,
    placed) stored under ``data_dir``, and the config of a host tier that retains it in pinned RAM."""
    wargs = argparse.Namespace(data_dir=data_dir, shift=True, objects=4, tokens=256, children=4)
    cfg = HostTierConfig(budget_bytes=64 * MIB, pin=device.type == "cuda", retain=True, singleflight=False,
                         verify="none", read_threads=16, chunk_bytes=MIB, parallel_loads=4)
    return Workload(wargs, device), cfg


def summarise_pairs(pairs: list[dict], routes: list[str]) -> dict:
    """Medians per route and medians of paired differences/ratios (direct - / host_staging)."""
    out = {}
    for m in METRICS:
        row = {r: statistics.median(p[r][m] for p in pairs) for r in routes}
        if len(routes) == 2:
            a, b = routes
            diffs = [p[b][m] - p[a][m] for p in pairs]
            ratios = [p[b][m] / p[a][m] if p[a][m] > 0 else float("nan") for p in pairs]
            row.update({"diff_median": statistics.median(diffs), "ratio_median": statistics.median(ratios),
                        f"{b}_faster_pairs": sum(d < 0 for d in diffs), "pairs": len(pairs)})
        out[m] = row
    return out


def forced_read(work: Workload, args, routes: list[str], tier: HostTier,
                raw: SameShapeRead) -> tuple[list[dict], dict]:
    pairs, mechanisms = [], {}
    for p in range(args.pairs):
        order = routes if p % 2 == 0 else routes[::-1]
        pair = {"raw_read_s": statistics.median(raw.once() for _ in range(args.children))}
        for route in order:
            runs = [work.child(route, c, tier, verify=args.verify, evict=True) for c in range(args.children)]
            mechanisms[route] = runs[-1]["report"].to_dict()
            pair[route] = {m: statistics.median(r[m] for r in runs) for m in METRICS}
            pair[route]["children"] = [{m: r[m] for m in METRICS} for r in runs]
            pair[route]["nested_violations"] = sum(not r["nested"] for r in runs)
        pair["first"] = order[0]
        pairs.append(pair)
    return pairs, mechanisms


def current_cpu() -> int | None:
    """The CPU the calling thread last ran on (Linux; ``None`` elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def host_tier_hits(work: Workload, args, tier: HostTier, *, trust_verified: bool) -> dict:
    """Children restored from retained pinned RAM; ``trust_verified=False`` re-verifies on the device.
    ``args.hit_children`` of them (children in turn), after ``args.hit_warmup`` untimed ones; medians."""
    tier.evict()
    # Load once: a forced read, verified on the device, which marks the tier entries verified.
    work.child("host_staging", 0, tier, verify=args.verify, evict=False)
    for c in range(args.hit_warmup):
        work.child("host_staging", c % args.children, tier, verify=args.verify, evict=False,
                   trust_verified=trust_verified)
    runs, cpus, refs = [], [], []
    ref = PairedH2D(work.device, work.child_bytes) if work.device.type == "cuda" else None
    try:
        for c in range(args.hit_children):
            if ref is not None and c % 2 == 0:  # the reference copy first in even pairs, after in odd ones
                refs.append(ref.once())
            runs.append(work.child("host_staging", c % args.children, tier, verify=args.verify, evict=False,
                                   trust_verified=trust_verified))
            cpus.append(current_cpu())
            if ref is not None and c % 2 == 1:
                refs.append(ref.once())
    finally:
        if ref is not None:
            ref.close()
    # the interpreter's speed on this thread's CPU right after the children (virtual CPUs of a
    # shared host can run at half speed for seconds at a time; tools/cpu_speed_map.py maps them)
    python_ns = cpu_speed_map.speed(5.0)
    assert all(r["report"].tier_sources == {"hit": args.objects} for r in runs)
    med = {m: statistics.median(r[m] for r in runs) for m in METRICS}
    med["mechanism"] = runs[-1]["report"].mechanism
    med["verified"] = runs[-1]["report"].verified
    med["trust_verified"] = trust_verified
    med["nested_violations"] = sum(not r["nested"] for r in runs)
    med["runs"] = len(runs)
    med["main_thread_cpus"] = sorted(set(cpus))  # where this thread ran (virtual CPUs may differ in speed)
    med["python_ns_per_iteration"] = python_ns  # tools/cpu_speed_map.py's unit, measured after the children
    if refs:
        # per pair: the child's bandwidth as a fraction of the copy timed next to it
        fractions = [h / r["restore_s"] for h, r in zip(refs, runs)]
        med["paired_h2d"] = {"seconds_median": statistics.median(refs),
                             "GB_per_s": work.child_bytes / statistics.median(refs) / 1e9,
                             "fraction_median": statistics.median(fractions),
                             "fraction_quartiles": statistics.quantiles(fractions, n=4)[::2]}
    return med


def read_once(work: Workload, args, device: torch.device) -> dict:
    cfg = HostTierConfig(budget_bytes=max(4 * work.child_bytes, 64 * MIB), pin=device.type == "cuda", retain=True,
                         singleflight=True, verify="none", read_threads=args.threads, chunk_bytes=args.chunk_kib * 1024,
                         parallel_loads=max(4, args.objects), io_engine=args.io_engine)
    with HostTier(work.store, cfg) as tier:
        work.drop_page_cache()
        barrier = threading.Barrier(args.children)
        results, errors = [None] * args.children, []
        work.restorer("host_staging", tier, args.verify)  # one restorer for the four children, made first

        def child(c):
            try:
                barrier.wait(timeout=60)
                results[c] = work.child("host_staging", c, tier, verify=args.verify, evict=False)
            except BaseException as exc:  # reported in the JSON
                errors.append(repr(exc))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=child, args=(c,)) for c in range(args.children)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        wall = time.perf_counter() - t0
        stats = dict(tier.stats)
        per_key = {k: tier.reads_by_key.get(k, 0) for k in work.keys}
    served_children = sum(r is not None for r in results)
    # Read once: every object of the shared source read from storage exactly once, so the bytes read
    # equal one child's (12 MiB), and every child was served in full.
    once = (not errors and served_children == args.children and all(v == 1 for v in per_key.values())
            and stats["bytes_read"] == work.child_bytes)
    return {"children": args.children, "errors": errors, "wall_s": wall, "tier_stats": stats,
            "bytes_served": work.child_bytes * served_children, "bytes_read": stats["bytes_read"],
            "source_bytes": work.child_bytes, "objects": len(work.keys), "object_reads": stats["reads"],
            "reads_per_object": per_key, "read_once": once,
            "sources": [r["report"].tier_sources if r else None for r in results]}


# ----------------------------------------------------------------------------------- output
def fmt_ms(s: float) -> str:
    return f"{s * 1e3:9.3f}"


def print_table(res: dict) -> None:
    routes = res["routes"]
    env = res["environment"]
    print(f"\nSSD routes — device {env['device_name']}, data on {env['filesystem']}, "
          f"O_DIRECT {'yes' if env['o_direct'] else 'NO: ' + str(env['o_direct_fallback'])}, "
          f"reads through {env['io_engine']}")
    for r, m in res["mechanisms"].items():
        print(f"  {r}: {m['mechanism']}")
    for r, why in res["skipped_routes"].items():
        print(f"  {r}: skipped ({why})")
    print(f"\nForced read: {res['pairs']} pairs x {res['children']} children, {res['child_bytes'] / MIB:.1f} MiB "
          f"per child; medians of per-pair child medians (ms); intervals nested, never added")
    head = f"{'interval':<12}" + "".join(f"{r:>16}" for r in routes)
    if len(routes) == 2:
        head += f"{'diff (d-h)':>14}{'ratio (d/h)':>13}{'direct faster':>15}"
    print(head)
    for m in METRICS:
        row = res["forced_read"]["summary"][m]
        line = f"{m:<12}" + "".join(f"{fmt_ms(row[r]):>16}" for r in routes)
        if len(routes) == 2:
            line += f"{fmt_ms(row['diff_median']):>14}{row['ratio_median']:>13.3f}" \
                    f"{str(row[routes[1] + '_faster_pairs']) + '/' + str(row['pairs']):>15}"
        print(line)
    lim = res["limits"]
    print(f"\nDisk sequential O_DIRECT read: {lim['disk']['GB_per_s']:.2f} GB/s "
          f"({lim['disk']['bytes'] / MIB:.0f} MiB, o_direct={lim['disk']['o_direct']})")
    if lim["h2d"]:
        print(f"Pinned H2D ({lim['h2d']['bytes'] / MIB:.0f} MiB): {lim['h2d']['GB_per_s']:.2f} GB/s")
    ss = lim["same_shape"]
    print(f"Same-shape raw read (the child's {res['objects']} payload ranges, same reader, no GPU): "
          f"{ss['GB_per_s']:.2f} GB/s")
    print(f"Reader settings (same-shape read and route alike): {env['io_engine']}, "
          f"{lim['disk']['chunk_bytes'] >> 10} KiB chunks, O_DIRECT; disk figure: the best of "
          + ", ".join(f"{d['reader']} {d['GB_per_s']:.2f} GB/s" for d in lim["disk_by_engine"]))
    for r, f in res["fractions"].items():
        print(f"  {r}: restore {f['restore_GB_per_s']:.2f} GB/s = {f['fraction_of_disk_bw']:.1%} of disk "
              f"(target {f['target']:.0%}), {f['fraction_of_same_shape_read']:.1%} of the same-shape raw read; "
              f"read calls {f['read_GB_per_s']:.2f} GB/s")
    for name, label in (("host_tier", "trusts the check made when it entered the tier"),
                        ("host_tier_device_verify", "device re-verify of every object"),
                        ("host_tier_before_forced_reads", "trusted, measured before the forced reads")):
        ht = res[name]
        extra = f" = {ht['fraction_of_h2d_bw']:.1%} of pinned H2D measured once" \
            if ht.get("fraction_of_h2d_bw") is not None else ""
        paired = ht.get("paired_h2d")
        if paired:
            lo, hi = paired["fraction_quartiles"]
            extra += (f"; {paired['fraction_median']:.1%} of the pinned H2D copy timed next to each child "
                      f"(median of {ht['runs']} pairs, quartiles {lo:.1%}..{hi:.1%}, copies "
                      f"{paired['GB_per_s']:.2f} GB/s; target {ht['target']:.0%})")
        print(f"Host tier (retained pinned RAM, {label}): restore {fmt_ms(ht['restore_s']).strip()} ms per child, "
              f"{ht['restore_GB_per_s']:.2f} GB/s{extra}; placement preparation "
              f"{fmt_ms(ht['prepare_s']).strip()} ms inside it")
        print(f"  main thread on CPU {ht.get('main_thread_cpus')}, Python speed there "
              f"{ht.get('python_ns_per_iteration', float('nan')):.0f} ns/iteration (tools/cpu_speed_map.py)")
    ro = res["read_once"]
    reads = sorted(set(ro["reads_per_object"].values()))
    print(f"Read once: {ro['children']} children served {ro['bytes_served'] / MIB:.0f} MiB; the shared source "
          f"({ro['objects']} objects, {ro['source_bytes'] / MIB:.0f} MiB) was read "
          f"{'once' if reads == [1] else f'{reads} times per object'}: {ro['object_reads']} object reads, "
          f"{ro['bytes_read'] / MIB:.0f} MiB read in all (read_once={ro['read_once']}, errors={len(ro['errors'])})")
    nv = res["nested_violations"]
    print(f"Nested intervals (read, verify, prepare within restore within outer) violated in {nv} child runs")


def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no PNG"
    routes = res["routes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(METRICS))
    width = 0.8 / len(routes)
    for i, r in enumerate(routes):
        vals = [res["forced_read"]["summary"][m][r] * 1e3 for m in METRICS]
        ax1.bar(x + i * width, vals, width, label=r)
    ax1.set_xticks(x + width * (len(routes) - 1) / 2, METRICS)
    ax1.set_ylabel("ms per child (median of pair medians)")
    ax1.set_title("Forced-read restoration (nested intervals)")
    ax1.legend()
    names = list(res["fractions"]) + ["host tier", "host tier\n(re-verify)"]
    bws = [res["fractions"][r]["restore_GB_per_s"] for r in res["fractions"]] + \
        [res["host_tier"]["restore_GB_per_s"], res["host_tier_device_verify"]["restore_GB_per_s"]]
    ax2.bar(names, bws, color="tab:gray")
    ax2.axhline(res["limits"]["disk"]["GB_per_s"], color="tab:red", ls="--", label="disk O_DIRECT seq. read")
    if res["limits"]["h2d"]:
        ax2.axhline(res["limits"]["h2d"]["GB_per_s"], color="tab:blue", ls=":", label="pinned H2D")
    ax2.set_ylabel("GB/s per child")
    ax2.set_title("Restore bandwidth vs same-run limits")
    ax2.legend()
    fig.suptitle(f"{res['environment']['device_name']} — {res['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="perf/out")
    ap.add_argument("--data-dir", default=None, help="where segment files go (on the SSD); default <out>/ssd_data")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per segment (256 -> a 3 MiB object)")
    ap.add_argument("--routes", default="host_staging,direct")
    ap.add_argument("--verify", choices=("device", "device-batched", "host", "none"), default="device")
    ap.add_argument("--threads", type=int, default=16, help="O_DIRECT reads in flight (queue depth; threads of the pool)")
    ap.add_argument("--io-engine", choices=ENGINES, default="auto", help="io_uring where available (auto), or threads")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="read chunk (16 x 1 MiB measured best of 4 settings on the virtio disk)")
    ap.add_argument("--bw-mib", type=int, default=1024, help="size of the sequential-read file")
    ap.add_argument("--no-shift", dest="shift", action="store_false", help="place without the RoPE shift")
    ap.add_argument("--hit-children", type=int, default=HIT_CHILDREN, help="host-tier children timed per variant")
    ap.add_argument("--hit-warmup", type=int, default=HIT_WARMUP, help="untimed host-tier children before them")
    ap.add_argument("--keep-data", action="store_true")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu for the host side alone)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.data_dir = os.path.abspath(args.data_dir or str(out / "ssd_data"))
    os.makedirs(args.data_dir, exist_ok=True)
    command = "python perf/run_ssd_routes.py " + " ".join(argv if argv is not None else sys.argv[1:])

    routes, skipped = [], {}
    for r in [r.strip() for r in args.routes.split(",") if r.strip()]:
        if r == "direct" and device.type != "cuda":
            skipped[r] = "needs CUDA (--device cpu runs the host side alone)"
            continue
        if r == "direct":
            try:
                direct_facts(device)
            except BackendError as exc:
                skipped[r] = str(exc)
                continue
        routes.append(r)
    if not routes:
        ap.error(f"no runnable route ({skipped})")

    work = Workload(args, device)
    o_direct, fallback = file_o_direct_support(work.store.local_path(work.keys[0]))
    env = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
           else platform.processor() or platform.machine(), "filesystem": fs_type(args.data_dir),
           "data_dir": args.data_dir, "o_direct": o_direct, "o_direct_fallback": fallback,
           "page_cache": "bypassed with O_DIRECT (host staging) and dropped with posix_fadvise(DONTNEED) "
                         "before every child (both routes)",
           "python": platform.python_version(), "torch": torch.__version__,
           "threads": args.threads, "chunk_bytes": args.chunk_kib * 1024, "verify": args.verify,
           "rope_shift": args.shift}
    if "direct" in routes:
        env["direct_facts"] = direct_facts(device)

    cfg = HostTierConfig(budget_bytes=max(2 * work.child_bytes, 64 * MIB), pin=device.type == "cuda", retain=True,
                         singleflight=False, verify="none", read_threads=args.threads,
                         chunk_bytes=args.chunk_kib * 1024, parallel_loads=max(4, args.objects),
                         io_engine=args.io_engine)
    with HostTier(work.store, cfg) as tier:
        env["io_engine"] = tier.io_engine.description
        # Warm-up (kernels compiled, buffers pinned) outside every timed interval.
        for r in routes:
            work.child(r, 0, tier, verify=args.verify, evict=True)
        # the same host-tier children once before the forced reads too: the phase a child runs in
        # changes the host's speed (reported beside the headline figure, which is measured after)
        hits_first = host_tier_hits(work, args, tier, trust_verified=True)
        raw = SameShapeRead(work, args.threads, args.chunk_kib * 1024, args.io_engine)
        try:
            raw.once()  # buffers touched once, outside the measurement
            raw.times.clear()
            pairs, mechanisms = forced_read(work, args, routes, tier, raw)
        finally:
            raw.close()
        hits = host_tier_hits(work, args, tier, trust_verified=True)
        hits_verified = host_tier_hits(work, args, tier, trust_verified=False)
    # the physical limit: the best sequential figure of every engine that works here
    disk_by_engine = []
    for engine in ("threads", "io_uring"):
        try:
            disk_by_engine.append(disk_bandwidth(args.data_dir, args.bw_mib, args.threads, args.chunk_kib * 1024,
                                                 engine=engine))
        except StorageError as exc:  # io_uring not usable here
            print(f"disk figure: {engine} skipped ({exc})")
    disk = max(disk_by_engine, key=lambda d: d["GB_per_s"])
    same_shape = raw.summary()
    h2d = h2d_bandwidth(device, work.child_bytes)
    once = read_once(work, args, device)
    work.close()

    summary = summarise_pairs(pairs, routes)
    fractions = {}
    for r in routes:
        restore_bw = work.child_bytes / summary["restore_s"][r] / 1e9
        read_bw = work.child_bytes / summary["read_s"][r] / 1e9 if summary["read_s"][r] > 0 else float("nan")
        fractions[r] = {"restore_GB_per_s": restore_bw, "read_GB_per_s": read_bw,
                        "fraction_of_disk_bw": restore_bw / disk["GB_per_s"],
                        "fraction_of_same_shape_read": restore_bw / same_shape["GB_per_s"],
                        "target": TARGETS["forced_read_fraction_of_disk_bw"]}
    for h in (hits, hits_verified, hits_first):
        h["restore_GB_per_s"] = work.child_bytes / h["restore_s"] / 1e9
        h["fraction_of_h2d_bw"] = h["restore_GB_per_s"] / h2d["GB_per_s"] if h2d else None
        h["target"] = TARGETS["host_tier_fraction_of_h2d_bw"]
    nested_violations = sum(p[r]["nested_violations"] for p in pairs for r in routes) + \
        hits["nested_violations"] + hits_verified["nested_violations"]

    res = {"command": command, "environment": env, "routes": routes, "skipped_routes": skipped,
           "pairs": args.pairs, "children": args.children, "objects": args.objects, "tokens": args.tokens,
           "child_bytes": work.child_bytes, "mechanisms": mechanisms,
           "forced_read": {"summary": summary, "pairs": pairs}, "host_tier": hits,
           "host_tier_device_verify": hits_verified, "host_tier_before_forced_reads": hits_first,
           "read_once": once,
           "limits": {"disk": disk, "disk_by_engine": disk_by_engine, "same_shape": same_shape, "h2d": h2d}, "fractions": fractions,
           "nested_violations": nested_violations, "targets": TARGETS}
    print_table(res)
    (out / "ssd_routes.json").write_text(json.dumps(res, indent=2, default=str))
    note = plot(res, out / "ssd_routes.png")
    print(f"\nwrote {out / 'ssd_routes.json'}" + (f" and {out / 'ssd_routes.png'}" if note is None else f" ({note})"))
    if not args.keep_data:
        shutil.rmtree(os.path.join(args.data_dir, "store"), ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
