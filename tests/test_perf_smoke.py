"""The benchmarks' CPU modes run end to end (the host side of each; the figures are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, out: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "perf" / script), "--device", "cpu", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_ssd_routes_cpu_mode(tmp_path):
    stdout = _run("run_ssd_routes.py", "--pairs", "1", "--children", "2", "--bw-mib", "16", "--hit-children", "4",
                  "--hit-warmup", "1", out=tmp_path)
    res = json.loads((tmp_path / "ssd_routes.json").read_text())
    assert res["routes"] == ["host_staging"] and "direct" in res["skipped_routes"]
    assert res["nested_violations"] == 0
    assert res["read_once"]["read_once"] and not res["read_once"]["errors"]
    for name in ("host_tier", "host_tier_device_verify", "host_tier_before_forced_reads"):
        assert res[name]["runs"] == 4 and res[name]["restore_s"] > 0 and res[name]["main_thread_cpus"]
    assert res["limits"]["disk"]["GB_per_s"] > 0
    assert "Read once" in stdout


def test_bench_service_cpu_mode(tmp_path):
    _run("bench_service.py", "--pairs", "2", "--timing-runs", "3", "--clients", "2", "--rounds", "3",
         "--back-to-back", "2", "--shapes", "7b", "--shape-pairs", "2", "--per-layer-pairs", "2", "--floor-rounds", "5", out=tmp_path)
    res = json.loads((tmp_path / "bench_service_cpu.json").read_text())
    layers, larger = res["larger_children"]
    assert layers["per_layer"] and layers["bit_identical"] and layers["in_process_median_ms"] > 0
    assert larger["shape"]["name"] == "7b" and larger["bit_identical"] and larger["child_mib"] > 20
    floor = res["transport_floor"]
    assert floor["rounds"] == 5 and floor["median_us"] > 0 and floor["share_of_in_process_back_to_back"] > 0
    assert res["paired"]["bit_identical"]
    assert len(res["paired"]["paired_ratio_quartiles"]) == 2
    assert res["paired"]["median_block_ratio"] > 0  # two pairs: one balanced block
    steady = res["back_to_back"]["median_us"]
    assert steady["in_process"] > 0 and steady["ratios"]["service_default_stream"] > 0
    c = res["concurrent"]
    assert c["errors"] == 0 and c["restores"] == 6 and c["memory_back_to_baseline"]
    # every item of the child shifted: one prepare of the registration's plan from the body's arrays each
    placed = res["service_placements"]
    assert placed["placements_one_prepare"] > 0 and placed["placements_two_prepares"] == 0
