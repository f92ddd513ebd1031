"""Which O_DIRECT read pattern brings a forced-read child (four 3 MiB segment payloads, 12 MiB) closest
to the disk's sequential read bandwidth, measured in one run on one disk. Stdlib + numpy only.

perf/run_ssd_routes.py compares a child's restore read (the 3 MiB payloads of 4 segment files, read
with O_DIRECT in 1 MiB chunks on a pool of 16 threads) with the disk's sequential O_DIRECT figure
(a 1 GiB file in 1 MiB chunks on 16 threads). Here, in every round:

- ``seq_<req>_q<Q>``: a big file (--seq-mib) read once through in <req> requests at queue depth Q
  (a pool of Q threads, every request queued at once); the round's best is the "disk figure",
  ``seq_1M_q16`` is run_ssd_routes's way of measuring it;
- ``files4_c<chunk>_t<T>``: the child: the payloads of 4 files (a 4 KiB head, --file-mib payload,
  a 4 KiB tail each) read in <chunk> pieces (``3M`` = the whole payload in one request) on a pool of
  T threads, every chunk queued at once in file order, timed from the first submit to the last
  completion; ``_iov<size>`` reads each payload with one os.preadv into buffers of <size>;
  ``_open`` also opens the 4 files inside the timing; ``_idle<N>ms`` sleeps N ms first (the disk
  path and the pool go idle, as between restores), ``_poke`` then reads 4 KiB untimed just before;
- ``one<N>M_c<chunk>_t<T>``: N MiB from ONE file (the big file, a random 1 MiB-aligned offset each
  time): 12 MiB separates the "4 files" effect from the "12 MiB in all" effect, 48 MiB shows how
  the fixed cost of a short read fades;
- ``lat_4K`` / ``lat_1M``: one read at queue depth 1 from the calling thread (the fixed cost),
  ``lat_4K_idle50ms`` after 50 ms idle.

Rounds interleave every pattern: the sequential reads are spread between passes of the others, and
the order is rotated every round and reversed every other round, so disk drift reaches each alike.
Each child read uses the next of --file-sets sets of 4 files and each one-file read a fresh random
offset, so no read repeats the data read just before it. Reads never go through the page cache:
files are opened with O_DIRECT and the probe stops (exit 2) where that is refused; it never falls
back. Ratios are per round (the pattern's median in the round / the round's best sequential figure),
then the median over the rounds. Writes ``read_pattern_probe.json`` to --out.

Usage: python tools/read_pattern_probe.py [--dir DIR] [--out perf/out] [--rounds 7] [--passes 7]
           [--seq-mib 512] [--file-mib 3] [--file-sets 16] [--quick]
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

KIB = 1 << 10
MIB = 1 << 20
ALIGN = 4096
HEAD = 4096  # bytes before each payload (the segment's Arrow head); the tail after it is as long
BLOCK = 16 * MIB  # the big file is written (and checked) in blocks of this size
SEED = 20261130
SEQ = [(4 * MIB, 1), (4 * MIB, 4), (4 * MIB, 16), (1 * MIB, 16)]  # (request, queue depth)
ROUTES_SEQ = "seq_1M_q16"
CHUNKS = [256 * KIB, 512 * KIB, 1 * MIB, None]  # None: the whole payload in one request
THREADS = [4, 8, 16, 32]
NO_CACHE_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


class Refused(Exception):
    """The filesystem refused O_DIRECT."""


def size_name(n: int) -> str:
    return f"{n // MIB}M" if n % MIB == 0 else f"{n // KIB}K"


def rotate(items: list, k: int) -> list:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def mount_of(path: str) -> dict:
    """The /proc/mounts entry holding ``path`` (longest mount-point prefix)."""
    best = {"type": "unknown", "source": "?", "mount": ""}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                source, mnt, kind = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mount"]):
                    best = {"type": kind, "source": source, "mount": mnt}
    except OSError:
        pass
    return best


def block_queue(path: str) -> dict:
    """The block device under ``path`` and its queue settings, where sysfs shows them."""
    st = os.stat(path)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not os.path.exists(base):
        return {"note": f"no {base} (not a plain block device: overlay, network or device-mapper fs?)"}
    real = os.path.realpath(base)
    dev = real if os.path.isdir(os.path.join(real, "queue")) else os.path.dirname(real)  # a partition's disk
    out = {"device": os.path.basename(dev), "partition": os.path.basename(real) if dev != real else None}
    for key in ("scheduler", "max_sectors_kb", "max_hw_sectors_kb", "nr_requests", "rotational", "read_ahead_kb",
                "logical_block_size", "nomerges", "rq_affinity"):
        try:
            with open(os.path.join(dev, "queue", key)) as f:
                out[key] = f.read().strip()
        except OSError:
            pass
    try:
        out["hw_queues"] = len(os.listdir(os.path.join(dev, "mq")))
    except OSError:
        pass
    return out


class Buffer:
    """``nbytes`` of page-aligned anonymous memory, every page touched once (no faults inside timings)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = np.frombuffer(self.map, dtype=np.uint8)
        arr[:] = 1
        del arr
        self.view = memoryview(self.map)

    def close(self) -> None:
        try:
            self.view.release()
            self.map.close()
        except BufferError:  # slices still held (an interrupted read): the mapping goes with them
            pass


def open_direct(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise Refused(f"open({path}, O_DIRECT) failed: {exc.strerror}") from exc
        raise


def pread_full(fd: int, view: memoryview, offset: int) -> float:
    """Read ``len(view)`` bytes at ``offset``; returns the completion time (perf_counter)."""
    done, want = 0, len(view)
    while done < want:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise Refused(f"an O_DIRECT read of {want} bytes at {offset} failed: {exc.strerror}") from exc
            raise
        if n <= 0:
            raise OSError(f"short read: {done} of {want} bytes at {offset}")
        done += n
    return time.perf_counter()


def preadv_iov(fd: int, views: list[memoryview], offset: int) -> float:
    """One os.preadv into several buffers (no retry: a short read is an error here)."""
    want = sum(len(v) for v in views)
    n = os.preadv(fd, views, offset)
    if n != want:
        raise OSError(f"short preadv: {n} of {want} bytes at {offset}")
    return time.perf_counter()


def run_jobs(pool: ThreadPoolExecutor, jobs: list) -> list[float]:
    """Queue every job at once, wait for all; returns their completion times."""
    futs = [pool.submit(fn, *a) for fn, a in jobs]
    wait(futs)
    return [f.result() for f in futs]


def warm_pool(pool: ThreadPoolExecutor, n: int) -> None:
    """Make the pool start all ``n`` threads now, not inside the first timing."""
    barrier = threading.Barrier(n + 1)
    futs = [pool.submit(barrier.wait) for _ in range(n)]
    barrier.wait()
    wait(futs)


class Probe:
    def __init__(self, args, root: str):
        self.args = args
        self.root = root
        self.rng = random.Random(SEED)
        self.file_bytes = args.file_mib * MIB
        self.seq_bytes = args.seq_mib * MIB
        self.big = os.path.join(root, "seq.bin")
        self.sets = [[os.path.join(root, f"set{s:02d}_obj{i}.seg") for i in range(4)] for s in range(args.file_sets)]
        self.next_set = 0
        self.pools: dict[int, ThreadPoolExecutor] = {}
        self.buffers: list[Buffer] = []
        self.patterns = self.make_patterns()

    # ------------------------------------------------------------------ setup
    def write_files(self) -> float:
        t0 = time.perf_counter()
        with open(self.big, "wb", buffering=0) as f:
            for k in range(-(-self.seq_bytes // BLOCK)):
                f.write(self.block(k)[: min(BLOCK, self.seq_bytes - k * BLOCK)])
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        for s, paths in enumerate(self.sets):
            for i, path in enumerate(paths):
                with open(path, "wb", buffering=0) as f:
                    f.write(self.segment(s, i))
                    os.fsync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return time.perf_counter() - t0

    def block(self, k: int) -> bytes:
        return np.random.default_rng([SEED, 1, k]).bytes(BLOCK)

    def segment(self, s: int, i: int) -> bytes:
        return np.random.default_rng([SEED, 2, s, i]).bytes(HEAD + self.file_bytes + HEAD)

    def allocate(self) -> None:
        self.seq_buf = self.buffer(self.seq_bytes)
        one = [p["bytes"] for p in self.patterns if p["kind"] == "one"]
        self.child_buf = self.buffer(max([4 * self.file_bytes] + one))
        for n in sorted({p["threads"] for p in self.patterns if p.get("threads")}):
            pool = ThreadPoolExecutor(n, thread_name_prefix=f"probe{n}")
            warm_pool(pool, n)
            self.pools[n] = pool

    def buffer(self, n: int) -> Buffer:
        b = Buffer(n)
        self.buffers.append(b)
        return b

    def check_data(self) -> str:
        """Read back one file set and one block of the big file the timed way and compare the bytes."""
        self.files4(MIB, 16, set_index=0)
        for i in range(4):
            got = self.child_buf.view[i * self.file_bytes:(i + 1) * self.file_bytes]
            if got != self.segment(0, i)[HEAD:HEAD + self.file_bytes]:
                raise SystemExit(f"data check failed: set 0 file {i} reads back different bytes")
        k = self.seq_bytes // BLOCK // 2
        n = min(BLOCK, self.seq_bytes - k * BLOCK)
        fd = open_direct(self.big)
        try:
            pread_full(fd, self.child_buf.view[:n], k * BLOCK)
        finally:
            os.close(fd)
        if self.child_buf.view[:n] != self.block(k)[:n]:
            raise SystemExit(f"data check failed: block {k} of the big file reads back different bytes")
        return f"ok (set 0: 4 x {size_name(self.file_bytes)}, big file block {k}: {size_name(n)})"

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        for b in self.buffers:
            b.close()

    # --------------------------------------------------------------- patterns
    def make_patterns(self) -> list[dict]:
        fb = self.file_bytes
        ps = []
        for req, q in SEQ:
            ps.append({"name": f"seq_{size_name(req)}_q{q}", "kind": "seq", "bytes": self.seq_bytes, "threads": q,
                       "run": lambda req=req, q=q: self.seq(req, q)})
        for n in (4 * KIB, 1 * MIB):
            ps.append({"name": f"lat_{size_name(n)}", "kind": "lat", "bytes": n, "run": lambda n=n: self.latency(n)})
        ps.append({"name": "lat_4K_idle50ms", "kind": "lat", "bytes": 4 * KIB,
                   "run": lambda: self.latency(4 * KIB, idle=0.05)})
        for c in CHUNKS:
            for t in THREADS:
                ps.append({"name": f"files4_c{size_name(c or fb)}_t{t}", "kind": "files4", "bytes": 4 * fb,
                           "threads": t, "run": lambda c=c, t=t: self.files4(c or fb, t)})
        for iov in (MIB, 256 * KIB):
            if fb % iov == 0:
                ps.append({"name": f"files4_iov{size_name(iov)}_t4", "kind": "files4", "bytes": 4 * fb, "threads": 4,
                           "run": lambda iov=iov: self.files4(fb, 4, iov=iov)})
        ps.append({"name": "files4_c1M_t16_open", "kind": "files4", "bytes": 4 * fb, "threads": 16,
                   "run": lambda: self.files4(MIB, 16, open_inside=True)})
        for ms in (5, 50):
            ps.append({"name": f"files4_c1M_t16_idle{ms}ms", "kind": "files4", "bytes": 4 * fb, "threads": 16,
                       "run": lambda ms=ms: self.files4(MIB, 16, idle=ms / 1e3)})
        ps.append({"name": "files4_c1M_t16_idle50ms_poke", "kind": "files4", "bytes": 4 * fb, "threads": 16,
                   "run": lambda: self.files4(MIB, 16, idle=0.05, poke=True)})
        for total, c, t in ((4 * fb, 256 * KIB, 16), (4 * fb, MIB, 16), (4 * fb, fb, 4), (48 * MIB, MIB, 16)):
            if total + MIB <= self.seq_bytes:
                ps.append({"name": f"one{size_name(total)}_c{size_name(c)}_t{t}", "kind": "one", "bytes": total,
                           "threads": t, "run": lambda total=total, c=c, t=t: self.one_file(total, c, t)})
        return ps

    def _timed_read(self, path: str, view: memoryview, offset: int, total: int, chunk: int,
                    pool: ThreadPoolExecutor) -> tuple[float, float]:
        """``total`` bytes of ``path`` from ``offset`` into ``view`` in ``chunk`` requests, all queued at
        once on ``pool``: (seconds until the pool is done, seconds until the last read completed)."""
        fd = open_direct(path)
        try:
            jobs = [(pread_full, (fd, view[a:a + min(chunk, total - a)], offset + a)) for a in range(0, total, chunk)]
            t0 = time.perf_counter()
            ends = run_jobs(pool, jobs)
            t1 = time.perf_counter()
        finally:
            os.close(fd)
        return t1 - t0, max(ends) - t0

    def seq(self, req: int, q: int) -> tuple[float, float]:
        return self._timed_read(self.big, self.seq_buf.view, 0, self.seq_bytes, req, self.pools[q])

    def latency(self, n: int, idle: float = 0.0) -> tuple[float, float]:
        fd = open_direct(self.big)
        try:
            offset = self.rng.randrange(0, (self.seq_bytes - n) // ALIGN) * ALIGN
            if idle:
                time.sleep(idle)
            t0 = time.perf_counter()
            t1 = pread_full(fd, self.child_buf.view[:n], offset)
        finally:
            os.close(fd)
        return t1 - t0, t1 - t0

    def files4(self, chunk: int, threads: int, *, iov: int | None = None, open_inside: bool = False,
               idle: float = 0.0, poke: bool = False, set_index: int | None = None) -> tuple[float, float]:
        if set_index is None:
            set_index, self.next_set = self.next_set, (self.next_set + 1) % len(self.sets)
        paths = self.sets[set_index]
        fb, view = self.file_bytes, self.child_buf.view

        def jobs_of(fds):
            jobs = []
            for i, fd in enumerate(fds):
                base = i * fb
                if iov:
                    jobs.append((preadv_iov, (fd, [view[base + a:base + a + iov] for a in range(0, fb, iov)], HEAD)))
                else:
                    jobs += [(pread_full, (fd, view[base + a:base + min(fb, a + chunk)], HEAD + a))
                             for a in range(0, fb, chunk)]
            return jobs

        fds = [] if open_inside else [open_direct(p) for p in paths]
        try:
            jobs = jobs_of(fds)
            if idle:
                time.sleep(idle)
            if poke:  # one untimed 4 KiB read of the first file's head, just before the timed reads
                pread_full(fds[0], view[:ALIGN], 0)
            t0 = time.perf_counter()
            if open_inside:
                fds = [open_direct(p) for p in paths]
                jobs = jobs_of(fds)
            ends = run_jobs(self.pools[threads], jobs)
            t1 = time.perf_counter()
        finally:
            for fd in fds:
                os.close(fd)
        return t1 - t0, max(ends) - t0

    def one_file(self, total: int, chunk: int, threads: int) -> tuple[float, float]:
        offset = self.rng.randrange(0, (self.seq_bytes - total) // MIB + 1) * MIB
        return self._timed_read(self.big, self.child_buf.view, offset, total, chunk, self.pools[threads])

    # ------------------------------------------------------------------ rounds
    def round_order(self, r: int) -> list[tuple[int, dict]]:
        """(pass, pattern) in the order run in round ``r``: every sequential pattern once, spread between
        ``passes`` passes over the others; rotated every round, reversed every other round."""
        seq = rotate([p for p in self.patterns if p["kind"] == "seq"], r)
        rest = rotate([p for p in self.patterns if p["kind"] != "seq"], 3 * r)
        if r % 2:
            seq.reverse()
            rest.reverse()
        passes = self.args.passes
        order = []
        for k in range(passes):
            order += [(k, p) for i, p in enumerate(seq) if i * passes // len(seq) == k]
            order += [(k, p) for p in rotate(rest, k)]
        return order


def median_or_none(xs: list[float]):
    return statistics.median(xs) if xs else None


def summarise(probe: Probe, samples: dict[str, list[dict]], rounds: int) -> dict:
    """Per pattern: medians over all samples, per-round medians and their ratio to the round's seq figures."""
    seq_names = [p["name"] for p in probe.patterns if p["kind"] == "seq"]
    round_gbs = {name: {} for name in samples}
    for name, rows in samples.items():
        for r in range(rounds):
            vals = [s["GB_per_s"] for s in rows if s["round"] == r]
            if vals:
                round_gbs[name][r] = statistics.median(vals)
    best_seq = {r: max(round_gbs[n][r] for n in seq_names if r in round_gbs[n]) for r in range(rounds)}
    routes_seq = {r: round_gbs.get(ROUTES_SEQ, {}).get(r) for r in range(rounds)}
    out = {}
    for p in probe.patterns:
        rows = samples[p["name"]]
        gbs = [s["GB_per_s"] for s in rows]
        last = [p["bytes"] / s["last_s"] / 1e9 for s in rows]
        per_round = round_gbs[p["name"]]
        out[p["name"]] = {
            "kind": p["kind"], "bytes": p["bytes"], "threads": p.get("threads"), "n": len(rows),
            "seconds_median": statistics.median(s["seconds"] for s in rows),
            "GB_per_s_median": statistics.median(gbs), "GB_per_s_min": min(gbs), "GB_per_s_max": max(gbs),
            "GB_per_s_median_to_last_completion": statistics.median(last),
            "GB_per_s_per_round": [per_round.get(r) for r in range(rounds)],
            "fraction_of_best_seq": median_or_none([per_round[r] / best_seq[r] for r in per_round]),
            "fraction_of_" + ROUTES_SEQ: median_or_none([per_round[r] / routes_seq[r] for r in per_round
                                                         if routes_seq[r]]),
        }
    return {"patterns": out, "best_seq_GB_per_s_per_round": [best_seq[r] for r in range(rounds)],
            "best_seq_pattern_per_round": [max(seq_names, key=lambda n: round_gbs[n].get(r, 0.0))
                                           for r in range(rounds)]}


def print_table(summary: dict) -> None:
    pats = summary["patterns"]
    print(f"\n{'pattern':<30} {'MiB':>6} {'med ms':>8} {'med GB/s':>9} {'min':>6} {'max':>6} "
          f"{'% best seq':>10} {'% ' + ROUTES_SEQ:>14}")
    for name, s in pats.items():
        if s["kind"] == "lat":
            print(f"{name:<30} {s['bytes'] / MIB:>6.3g} {s['seconds_median'] * 1e3:>8.3f}   "
                  f"(latency at queue depth 1, from the calling thread)")
            continue
        frac = s["fraction_of_best_seq"]
        frac2 = s["fraction_of_" + ROUTES_SEQ]
        print(f"{name:<30} {s['bytes'] / MIB:>6.4g} {s['seconds_median'] * 1e3:>8.2f} {s['GB_per_s_median']:>9.2f} "
              f"{s['GB_per_s_min']:>6.2f} {s['GB_per_s_max']:>6.2f} "
              f"{'-' if frac is None else f'{frac:.0%}':>10} {'-' if frac2 is None else f'{frac2:.0%}':>14}")
    rounds = summary["best_seq_GB_per_s_per_round"]
    print("\nbest seq per round (GB/s): " + ", ".join(f"{g:.2f} ({n})" for g, n in
                                                     zip(rounds, summary["best_seq_pattern_per_round"])))
    child = {n: s for n, s in pats.items()
             if s["kind"] == "files4" and not any(w in n for w in ("_open", "_idle", "_poke"))}
    best = max(child, key=lambda n: child[n]["fraction_of_best_seq"])
    frac = child[best]["fraction_of_best_seq"]
    print(f"best 4-file child pattern (back to back, opens outside the timing): {best}: {child[best]['GB_per_s_median']:.2f} GB/s, {frac:.0%} of the best "
          f"sequential figure, {child[best]['fraction_of_' + ROUTES_SEQ]:.0%} of {ROUTES_SEQ} "
          f"({'meets' if frac >= 0.85 else 'misses'} the 85% target)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the test files go (a temporary folder made inside it, removed "
                    "at exit); must be on the disk under test; default: the current directory")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "perf" / "out"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=7, help="passes over the non-sequential patterns per round")
    ap.add_argument("--seq-mib", type=int, default=512, help="size of the sequential-read file")
    ap.add_argument("--file-mib", type=int, default=3, help="payload of each of the 4 segment files")
    ap.add_argument("--file-sets", type=int, default=16, help="sets of 4 files, used in turn")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (128 MiB file, 3 rounds, 3 passes, 4 file sets)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq_mib, args.rounds, args.passes, args.file_sets = 128, 3, 3, 4
    if args.seq_mib < 16 or args.file_mib < 1 or args.rounds < 1 or args.passes < 1 or args.file_sets < 1:
        ap.error("--seq-mib >= 16, --file-mib >= 1, --rounds/--passes/--file-sets >= 1")
    if not hasattr(os, "O_DIRECT"):
        print("O_DIRECT: not available on this platform", file=sys.stderr)
        return 2

    start = time.perf_counter()
    parent = os.path.abspath(args.dir or os.getcwd())
    made_parent = not os.path.exists(parent)
    os.makedirs(parent, exist_ok=True)
    mount = mount_of(os.path.realpath(parent))
    print(f"dir {parent}: {mount['type']} ({mount['source']} on {mount['mount']})")
    if mount["type"] in NO_CACHE_FS:
        print(f"{mount['type']} is memory, not the disk under test: pass --dir on the disk", file=sys.stderr)
        if made_parent:
            os.rmdir(parent)
        return 2
    root = tempfile.mkdtemp(prefix="read_pattern_probe.", dir=parent)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    probe = Probe(args, root)
    try:
        vfs = os.statvfs(root)
        need = (args.seq_mib + args.file_sets * 4 * (args.file_mib + 1)) * MIB
        free = vfs.f_bavail * vfs.f_frsize
        if free < need + 256 * MIB:
            print(f"not enough space in {root}: {free / MIB:.0f} MiB free, {need / MIB:.0f} MiB needed", file=sys.stderr)
            return 2
        queue = block_queue(root)
        print("block device: " + ", ".join(f"{k}={v}" for k, v in queue.items()))
        print(f"cpus {os.cpu_count()}, python {platform.python_version()}, kernel {platform.release()}")
        print(f"writing {args.seq_mib} MiB + {args.file_sets} x 4 x {args.file_mib} MiB (random bytes, fsynced) ...")
        write_s = probe.write_files()
        print(f"  written in {write_s:.1f} s")
        probe.allocate()
        print("data check: " + probe.check_data())
        for p in probe.patterns:  # warm-up pass, not recorded
            if p["kind"] != "seq":
                p["run"]()
        samples = {p["name"]: [] for p in probe.patterns}
        t_measure = time.perf_counter()
        for r in range(args.rounds):
            t_round = time.perf_counter()
            for k, p in probe.round_order(r):
                wall, last = p["run"]()
                samples[p["name"]].append({"round": r, "pass": k, "seconds": wall, "last_s": last,
                                           "GB_per_s": p["bytes"] / wall / 1e9})
            seq_r = {n: statistics.median(s["GB_per_s"] for s in v if s["round"] == r)
                     for n, v in samples.items() if n.startswith("seq_")}
            child_r = statistics.median(s["GB_per_s"] for s in samples["files4_c1M_t16"] if s["round"] == r)
            print(f"round {r + 1}/{args.rounds}: best seq {max(seq_r.values()):.2f} GB/s "
                  f"({max(seq_r, key=seq_r.get)}), {ROUTES_SEQ} {seq_r[ROUTES_SEQ]:.2f}, "
                  f"files4_c1M_t16 {child_r:.2f} GB/s ({time.perf_counter() - t_round:.1f} s)")
        measure_s = time.perf_counter() - t_measure
        summary = summarise(probe, samples, args.rounds)
        print_table(summary)
        elapsed = time.perf_counter() - start
        print(f"\nelapsed {elapsed:.1f} s (writing {write_s:.1f} s, measuring {measure_s:.1f} s)")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "tool": "tools/read_pattern_probe.py", "command": " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
            "args": vars(args), "dir": root, "filesystem": mount, "block_queue": queue, "o_direct": True,
            "io_engine": "os.preadv on a ThreadPoolExecutor per thread count (started before timing)",
            "cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "elapsed_s": elapsed, "write_s": write_s, "measure_s": measure_s,
            "layout": {"head_bytes": HEAD, "payload_bytes": probe.file_bytes, "tail_bytes": HEAD,
                       "child_bytes": 4 * probe.file_bytes},
            "timing": "seconds: first submit to the main thread seeing the last completion (GB_per_s uses it); "
                      "last_s: first submit to the last read returning on its thread",
            **summary,
            "samples": samples,
        }
        path = out / "read_pattern_probe.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
        return 0
    except Refused as exc:
        print(f"O_DIRECT refused on {mount['type']} ({root}): {exc}; no page-cache fallback, stopping", file=sys.stderr)
        return 2
    finally:
        try:
            probe.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
            if made_parent:
                try:
                    os.rmdir(parent)
                except OSError:
                    pass


if __name__ == "__main__":
    sys.exit(main())
