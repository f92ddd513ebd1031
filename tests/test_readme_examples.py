"""The README's cache-service example runs as written (in a subprocess: the service is spawned, so
the example has a ``__main__`` guard), with its socket moved into a fresh private directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.service import socket_dir

ROOT = Path(__file__).resolve().parent.parent


def _example(section: str) -> str:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 1, f"README section {section!r}: expected one python block"
    return blocks[0]


def test_cache_service_example_runs(tmp_path):
    code = _example("Cache service in one example")
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
