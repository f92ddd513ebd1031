"""The README's cache-service example runs as written (in a subprocess: the service is spawned, so
the example has a ``__main__`` guard), with its socket moved into a fresh private directory.

:data:`EXAMPLE` is the example's text as the README's section "Cache service in one example"
carries it (the test runs this copy).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.kmesh_host.service.helpers import socket_dir

ROOT = Path(__file__).resolve().parent.parent

EXAMPLE = '''\
import torch
from kmesh_gpu import KVLayout, RopeSpec
from kmesh_host import ModelFingerprint, RestoreItem, ServiceRestorer
from kmesh_host.service import CacheClient, CacheService, ServiceConfig, SharedCache

if __name__ == "__main__":  # the service is a spawned process
    layout = KVLayout.from_vllm("NHD", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2,
                                head_size=8, dtype=torch.bfloat16)
    rope = RopeSpec(head_size=8, rotary_dim=8, base=1e6, is_neox_style=True, max_position=64,
                    dtype=torch.bfloat16)
    model = ModelFingerprint("LlamaForCausalLM", num_layers=2, num_kv_heads=2, head_size=8,
                             dtype="bfloat16", rope=rope.to_dict())
    with CacheService(ServiceConfig(socket_path="/tmp/kmesh-example/kmesh.sock")) as svc, \\
            CacheClient(svc.socket_path) as client, SharedCache(layout, fill=0) as cache:
        kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)   # (2, L, T, H, D), keys post-RoPE at 0..3
        key = client.put(kv, torch.tensor([11, 12, 13, 14]), torch.arange(4),  # token ids, positions
                         model_fingerprint=model)            # a shared original, in the service's store
        with ServiceRestorer(client, cache, layout, model_fingerprint=model, rope=rope) as restorer:
            result = restorer.restore([RestoreItem(key, slots=torch.arange(8, 12),
                                                   new_positions=torch.arange(20, 24))])  # once copied
            assert result.report.route == "socket"            # ("channel" for a CUDA cache)
        # the block's end closed the registration: nothing can still write the cache
'''


def test_cache_service_example_runs(tmp_path):
    code = EXAMPLE
    assert "/tmp/kmesh-example/kmesh.sock" in code
    with socket_dir() as d:
        code = code.replace("/tmp/kmesh-example/kmesh.sock", os.path.join(d, "svc", "kmesh.sock"))
        code += "\n    print('example ok')\n"  # inside the __main__ block, after the with
        script = tmp_path / "service_example.py"
        script.write_text(code)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                             cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "example ok" in run.stdout
