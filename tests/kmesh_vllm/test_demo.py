"""The main job (`kmesh demo`) end to end on CPU: the report's fields and what it claims."""

from __future__ import annotations

import json

import pytest

from kmesh_vllm.cli import main
from kmesh_vllm.demo import run_demo


def test_demo_report_matches_across_paths(tmp_path):
    report = run_demo(device="cpu", preset="tiny", children=2, segments=4, seed=3, store_root=str(tmp_path))
    c = report["comparisons"]
    assert report["children"] == 2 and report["layers"] == 4 and report["placements"] == 8
    assert report["shared_tokens"] == 416
    assert c["kv_bits_equal_across_paths"] and c["kv_max_abs_diff"] == 0.0
    # the cache service (a spawned process reading the same store) is one of the paths compared
    assert set(c["paths_compared"]) >= {"torch/serial", "torch/batched", "warp/serial", "warp/batched",
                                        "service/store", "service/per-layer"}
    assert report["timings"]["service_restore_ms[per_layer]"] > 0
    assert c["values_bit_exact"] and c["untouched_slots_unchanged"]
    # the shift is not bit-identical to a fresh rotation at the new position, but within bf16 rounding
    assert 0.0 < c["shift_vs_direct_max_abs_diff"] < 0.1
    fc = report["failure_controls"]
    assert fc["total"] == 6 and fc["passed"] == fc["total"], fc["checks"]
    assert list(tmp_path.iterdir()), "the leader's segments were saved under the store root"


def test_demo_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--device", "cpu", "--children", "1", "--segments", "2", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("children", "layers", "comparisons", "failure_controls", "timings", "quality"):
        assert key in report
    for key in ("kv_max_abs_diff", "logits_max_abs_diff", "tokens_equal", "recompute_choices_equal",
                "recompute_choices_total"):
        assert key in report["comparisons"]
    assert "identical bits across paths : True" in capsys.readouterr().out


def test_demo_cli_refuses_cuda_without_a_device(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["demo", "--device", "cuda"]) == 2
