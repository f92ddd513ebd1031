"""Why a forced-read child's reads run slower inside the route than the same ranges read raw.

``perf/run_ssd_routes.py`` reports the route's read calls at ~75–80% of the speed of the same four
ranges read raw with the same engine (io_uring, queue depth 16, 1 MiB chunks, O_DIRECT, page cache
dropped). The route differs from the raw read in three ways: its buffers are page-locked (the host
tier's pool), each chunk's completion runs a callback that queues the chunk's host-to-device copy
(through torch, under a stream context), and the rest of the restore (digests, placement) runs in
the same process meanwhile. This probe reads the benchmark's child (4 x 3 MiB objects) in turn, round
by round, as:

* ``raw``: into plain page-aligned buffers, a callback that only counts (the benchmark's raw read);
* ``pinned``: the same into page-locked buffers;
* ``torch copy``: page-locked, each chunk copied to the GPU from its callback as the route did
  (``torch.cuda.stream`` context, ``Tensor.copy_``);
* ``driver copy``: page-locked, each chunk copied with one ``cuMemcpyHtoDAsync`` from its callback;
* ``route``: ``restore_host_staging`` itself (tier evicted, verification on the device, placed),
  its read interval (``read_s``) and whole restore; ``earlier route`` the same with the completion
  thread's work as it was before this probe (``routes.CHUNK_DRIVER_COPIES``, ``routes.FAST_DIGESTS``
  and ``_Streams.DRIVER_EVENTS`` off: each chunk's copy, each object's copy event and digest
  through torch);
  ``unchecked route`` with ``verify="none"`` (no digest launched from the completion thread);
  ``unplaced route`` without a cache (no placement prepared on the calling thread meanwhile).

Reports per variant the median time from the first read queued to the last chunk's callback done,
as GB/s of the child's bytes, and each variant's ratio to ``raw`` per round.

Usage (GPU machine): PYTHONPATH=. python tools/probe_read_factors.py [--rounds 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import run_ssd_routes as rs  # noqa: E402

from kmesh_gpu import _launch  # noqa: E402
from kmesh_host import HostTier  # noqa: E402
from kmesh_host import routes as routes_mod  # noqa: E402
from kmesh_host._streams import _Streams  # noqa: E402
from kmesh_host.direct_io import ReadEngine  # noqa: E402

RAW = ("raw", "pinned", "torch copy", "driver copy")


class Reader(rs.SameShapeRead):
    """The benchmark's raw read, into plain or page-locked buffers, each chunk optionally copied to
    the GPU from its callback (``copy``: ``None``, ``"torch"`` or ``"driver"``)."""

    def __init__(self, work, engine: ReadEngine, pin: bool, copy: str | None, device):
        super().__init__(work, engine.threads, engine.chunk_bytes, engine, pin=pin,
                         on_chunk=None if copy is None else self._copy)
        self.copy = copy
        self.offsets, at = [], 0
        for b in self.buffers:
            self.offsets.append(at)
            at += b.nbytes
        self.dst = torch.empty(at, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device)
        self.raw_stream = self.stream.cuda_stream

    def _copy(self, i, lo, hi):
        at = self.offsets[i]
        if self.copy == "torch":
            with torch.cuda.stream(self.stream):
                self.dst[at + lo: at + hi].copy_(self.buffers[i].tensor[lo:hi], non_blocking=True)
        else:
            _launch.copy_htod(self.dst.data_ptr() + at + lo, self.buffers[i].address + lo, hi - lo, self.raw_stream)

    def once(self) -> float:
        dt = super().once()
        self.stream.synchronize()
        return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        work, cfg = rs.retained_child(tmp, device)
        engine = ReadEngine(16, 1 << 20)
        readers = {"raw": Reader(work, engine, False, None, device), "pinned": Reader(work, engine, True, None, device),
                   "torch copy": Reader(work, engine, True, "torch", device),
                   "driver copy": Reader(work, engine, True, "driver", device)}
        routes = ("route", "earlier route", "unchecked route", "unplaced route")
        times = {name: [] for name in (*RAW, *(f"{r} {m}" for r in routes for m in ("read", "restore")))}
        with HostTier(work.store, cfg) as tier:
            for r in range(args.rounds + 1):
                names = list(RAW) + list(routes)
                if r % 2:
                    names.reverse()
                row = {}
                for name in names:
                    if name.endswith("route"):
                        earlier = name == "earlier route"
                        routes_mod.CHUNK_DRIVER_COPIES = routes_mod.FAST_DIGESTS = not earlier
                        _Streams.DRIVER_EVENTS = not earlier
                        cache = work.cache
                        if name == "unplaced route":
                            work.cache = None
                        try:
                            got = work.child("host_staging", r % 4, tier, evict=True,
                                             verify="none" if name == "unchecked route" else "device")
                        finally:
                            work.cache = cache
                            routes_mod.CHUNK_DRIVER_COPIES = routes_mod.FAST_DIGESTS = True
                            _Streams.DRIVER_EVENTS = True
                        row[f"{name} read"], row[f"{name} restore"] = got["read_s"], got["restore_s"]
                    else:
                        row[name] = readers[name].once()
                if r:  # the first round warms every path
                    for k, v in row.items():
                        times[k].append(v)
        for rd in readers.values():
            rd.close()
        engine.close()
    nbytes = work.child_bytes
    out = {"rounds": args.rounds, "engine": engine.description, "child_bytes": nbytes, "variants": {}}
    lines = [f"child of {nbytes / 2**20:.0f} MiB (4 objects), {engine.description}, 1 MiB chunks, O_DIRECT, page cache "
             f"dropped before each; {args.rounds} rounds, order alternating; medians"]
    for name, vals in times.items():
        ratios = [v / b for v, b in zip(vals, times["raw"])]
        med = statistics.median(vals)
        out["variants"][name] = {"seconds_median": med, "GB_per_s": nbytes / med / 1e9,
                                 "ratio_to_raw_median": statistics.median(ratios)}
        lines.append(f"  {name:<24} {med * 1e3:7.3f} ms  {nbytes / med / 1e9:5.2f} GB/s  "
                     f"time / raw (per round) {statistics.median(ratios):.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_read_factors.txt").write_text(text + "\n")
        (Path(args.out) / "probe_read_factors.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
