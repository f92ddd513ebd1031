"""Wall time of one 12 MiB GPU tree digest after different idle periods (GPU clock/power ramp probe),
for the one-launch (fused) and the per-level CuPy paths.

Usage (GPU machine): PYTHONPATH=. python tools/sha256_idle_probe.py
"""
import time, statistics, hashlib, numpy as np, torch
from kmesh_gpu import sha256 as sha
dev = torch.device("cuda")
n, size = 4, 3 << 20
data = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device=dev)
offs = np.arange(n, dtype=np.int64) * size; lens = np.full(n, size, dtype=np.int64)
host = data.cpu().numpy().tobytes()
PATH = "fused"
def one():
    torch.cuda.synchronize(); t = time.perf_counter(); sha._tree_digests_path(data, offs, lens, path=PATH).cpu(); return (time.perf_counter() - t) * 1e3
for PATH in ("fused", "levels"):
  for _ in range(5): one()
  for name, before in [("back-to-back", lambda: None), ("after 10 ms sleep", lambda: time.sleep(0.01)),
                     ("after 10 ms CPU hashing", lambda: [hashlib.sha256(host[i*size:(i+1)*size]).digest() for i in range(4)]),
                     ("after 100 ms sleep", lambda: time.sleep(0.1)), ("after 1 s sleep", lambda: time.sleep(1.0))]:
    ts = []
    for _ in range(9 if "1 s" not in name else 4):
        before(); ts.append(one())
    print(f"{PATH:6s} {name:28s}: median {statistics.median(ts):.3f} ms  min {min(ts):.3f}  max {max(ts):.3f}")
