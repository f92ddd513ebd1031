"""The README's examples run as written: each ``python`` block of the sections named below, in a
subprocess (the cache service is spawned, so its example has a ``__main__`` guard), with the service's
socket moved into a fresh private directory. (The placement example needs CUDA and the caller's own
segments: it is not run here; ``tests/kmesh_gpu`` covers the same calls.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kmesh_host.service.helpers import socket_dir

ROOT = Path(__file__).resolve().parent.parent
RUN = ("Restore in process", "Cache service", "Blending children on the real model")


def example(section: str) -> str:
    """The first ``python`` block under the README's ``## section``."""
    text = (ROOT / "README.md").read_text()
    part = text.split(f"\n## {section}\n", 1)
    assert len(part) == 2, f"README: no section {section!r}"
    block = re.search(r"```python\n(.*?)```", part[1].split("\n## ", 1)[0], re.S)
    assert block, f"README: no python block under {section!r}"
    return block.group(1)


@pytest.mark.parametrize("section", RUN)
def test_readme_example_runs(section, tmp_path):
    code = example(section)
    with socket_dir() as d:
        if "/tmp/kmesh-example/kmesh.sock" in code:
            code = code.replace("/tmp/kmesh-example/kmesh.sock", os.path.join(d, "svc", "kmesh.sock"))
        code += "\nprint('example ok')\n"
        script = tmp_path / "example.py"
        script.write_text(code)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                             cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "example ok" in run.stdout
