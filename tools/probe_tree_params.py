"""Device latency of the kmesh-tree-sha256 digest by tree parameters, for the sizes a forced-read
child verifies (one 3 MiB object; four at once): a tree digest is latency-bound there (one thread
hashes a leaf's blocks one after another, then each level's nodes), so its span follows
``leaf_size / 64 + levels * fanout / 2`` SHA-256 compressions more than the byte count.

CUDA events around each call on an otherwise idle GPU, alternating the parameter sets per round;
medians. Usage: PYTHONPATH=. python tools/probe_tree_params.py [--rounds 31]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import kmesh_gpu
from kmesh_host.integrity import tree_digest

PARAMS = [(4096, 64), (2048, 32), (1024, 16), (1024, 8), (512, 8)]
MIB = 1 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=31)
    args = ap.parse_args(argv)
    data = torch.randint(0, 256, (12 * MIB,), dtype=torch.uint8, device="cuda")
    cases = {"1 x 3 MiB": ([0], [3 * MIB]), "4 x 3 MiB": ([0, 3 * MIB, 6 * MIB, 9 * MIB], [3 * MIB] * 4)}
    host = data[:3 * MIB].cpu().numpy()
    for leaf, fanout in PARAMS:  # warm-up and a check against the host digest
        got = kmesh_gpu.tree_digests(data, [0], [3 * MIB], leaf_size=leaf, fanout=fanout)
        assert bytes(got[0].cpu().numpy()) == tree_digest(host, leaf_size=leaf, fanout=fanout), (leaf, fanout)
    times = {(c, p): [] for c in cases for p in PARAMS}
    for r in range(args.rounds):
        order = PARAMS[r % len(PARAMS):] + PARAMS[:r % len(PARAMS)]
        for case, (offs, lens) in cases.items():
            for leaf, fanout in order:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                kmesh_gpu.tree_digests(data, offs, lens, leaf_size=leaf, fanout=fanout)
                b.record()
                b.synchronize()
                times[(case, (leaf, fanout))].append(a.elapsed_time(b))
    print(f"tree digest device span on {torch.cuda.get_device_name()}, {args.rounds} rounds, medians (ms)")
    print(f"{'leaf':>6}{'fanout':>8}" + "".join(f"{c:>12}" for c in cases))
    for p in PARAMS:
        print(f"{p[0]:>6}{p[1]:>8}" + "".join(f"{statistics.median(times[(c, p)]):>12.3f}" for c in cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
