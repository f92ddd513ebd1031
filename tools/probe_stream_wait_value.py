"""Could a forced read's device work be queued before its bytes land? A probe of device-side waits
on a host-written flag (``cuStreamWaitValue32``), for the forced-read tail.

After a forced read's chunks land, the route still issues from Python: each object's copy, the
digests, the gate and the placement (0.5-1 ms of host work on the lent machine, the device never
waited for). The alternative measured here: while the reads are in flight (the host idle), queue all
of that device work behind a stream wait on a page-locked flag; at landing the host only stores
the flag and the device proceeds at once.

Two ways, alternating per round, on the benchmark's shape (4 objects of 3 MiB in page-locked host
memory, one device staging buffer):

* ``at landing``: at the "landing" moment Python issues the four driver copies, the tree digest of
  the four objects (``kmesh_gpu.tree_digests``) and an event, then waits for the event;
* ``queued ahead``: the same copies, digest and event were queued 2 ms earlier behind
  ``cuStreamWaitValue32(flag >= round)``; at the landing moment the host stores the flag, then waits.

Per way: medians of landing-to-done (µs), the host time from landing to "all issued", and a check
that the roots equal the host's kmesh-tree-sha256 (the data arrived whole in both). A queued-ahead
wait whose flag is never stored would block its stream forever: every round stores it (a
``finally``), also when something raised.

Usage (GPU machine): PYTHONPATH=. python tools/probe_stream_wait_value.py [--rounds 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kmesh_gpu import _launch, tree_digests  # noqa: E402
from kmesh_host import tree_digest  # noqa: E402

MIB = 1 << 20
WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


def driver():
    lib = ctypes.CDLL("libcuda.so.1")
    wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    wait.restype = ctypes.c_int
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    devptr = lib.cuMemHostGetDevicePointer_v2
    devptr.restype = ctypes.c_int
    devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    attr = lib.cuDeviceGetAttribute
    attr.restype = ctypes.c_int
    attr.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    return wait, devptr, attr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--mib", type=int, default=3, help="MiB per object")
    ap.add_argument("--lead-ms", type=float, default=2.0, help="how long before the landing the queued way queues")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev = torch.device("cuda")
    torch.cuda.init()
    wait_value, host_devptr, dev_attr = driver()
    ok = ctypes.c_int(0)
    # CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92 (in CUDA 12 stream memory ops are always on)
    rc_attr = dev_attr(ctypes.byref(ok), 92, 0)
    nbytes = args.objects * args.mib * MIB
    gen = torch.Generator().manual_seed(5)
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flag = torch.zeros(1, dtype=torch.int32).pin_memory()
    flag_np = flag.numpy()
    dflag = ctypes.c_uint64(0)
    rc_ptr = host_devptr(ctypes.byref(dflag), ctypes.c_void_p(flag.data_ptr()), 0)
    if rc_ptr != 0:
        sys.exit(f"cuMemHostGetDevicePointer failed: {rc_ptr}")
    size = args.mib * MIB
    offsets = torch.arange(args.objects, dtype=torch.int64) * size
    lengths = torch.full((args.objects,), size, dtype=torch.int64)
    want = [tree_digest(host[i * size:(i + 1) * size].numpy().tobytes()) for i in range(args.objects)]
    stream = torch.cuda.Stream()
    raw = stream.cuda_stream

    def issue():
        for i in range(args.objects):
            if not _launch.copy_htod(dst.data_ptr() + i * size, host.data_ptr() + i * size, size, raw):
                raise RuntimeError("the driver refused a copy")
        with torch.cuda.stream(stream):
            roots = tree_digests(dst, offsets, lengths)
        ev = _launch.DriverEvent.recorded(raw)
        return roots, ev

    # warm-up: compile and cache the digest launch
    with torch.cuda.stream(stream):
        issue()[0].cpu()
    torch.cuda.synchronize()
    rows = {"at landing": [], "queued ahead": []}
    issued_us = {"at landing": [], "queued ahead": []}
    correct = {"at landing": True, "queued ahead": True}
    seq = 0
    for r in range(args.rounds):
        order = ("at landing", "queued ahead") if r % 2 == 0 else ("queued ahead", "at landing")
        for way in order:
            dst.zero_()
            torch.cuda.synchronize()
            if way == "queued ahead":
                seq += 1
                try:
                    if wait_value(ctypes.c_void_p(raw), dflag.value, seq, WAIT_GEQ) != 0:
                        raise RuntimeError("cuStreamWaitValue32 refused")
                    roots, ev = issue()
                    time.sleep(args.lead_ms / 1e3)
                    t0 = time.perf_counter()
                finally:
                    flag_np[0] = seq  # the landing: one store (always made: a wait left armed blocks the stream)
                t1 = time.perf_counter()
            else:
                time.sleep(args.lead_ms / 1e3)
                t0 = time.perf_counter()
                roots, ev = issue()
                t1 = time.perf_counter()
            ev.synchronize()
            t2 = time.perf_counter()
            if r:  # the first round warms both
                rows[way].append((t2 - t0) * 1e6)
                issued_us[way].append((t1 - t0) * 1e6)
            got = [bytes(x) for x in roots.cpu().numpy()]
            correct[way] &= got == want
    med = {w: statistics.median(v) for w, v in rows.items()}
    ratios = [a / b for a, b in zip(rows["queued ahead"], rows["at landing"])]
    lines = [f"{args.objects} objects x {args.mib} MiB, page-locked host -> device, then one tree-digest launch; "
             f"{args.rounds} rounds alternating; stream memory ops attribute {ok.value} (rc {rc_attr})",
             f"{'way':<14} {'landing->done us':>17} {'landing->issued us':>19}  roots correct"]
    for w in rows:
        lines.append(f"{w:<14} {med[w]:>17.1f} {statistics.median(issued_us[w]):>19.1f}  {correct[w]}")
    lines.append(f"queued ahead / at landing, per round: {statistics.median(ratios):.3f} "
                 f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}..{statistics.quantiles(ratios, n=4)[2]:.3f})")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe_stream_wait_value.txt").write_text(text + "\n")
        (out / "probe_stream_wait_value.json").write_text(json.dumps(
            {"rows_us": rows, "issued_us": issued_us, "medians_us": med, "correct": correct,
             "ratio_median": statistics.median(ratios)}, indent=1))


if __name__ == "__main__":
    main()
