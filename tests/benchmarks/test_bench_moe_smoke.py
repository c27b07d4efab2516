"""Smoke test of benchmarks/bench_moe.py on the debug-size Qwen3-MoE and one workload: it runs,
writes its table, and prefix sharing gives the baseline's loss. No timing assertions."""

import json
import os

import pytest
from helpers.launch_pool import run_python
from helpers.torchrun import script_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_moe.py")


@pytest.mark.slow  # a process of its own
def test_bench_moe_runs(tmp_path):
    proc = run_python(SCRIPT, ["--model", "debug-qwen3-moe", "--repeats", "1", "--workloads", "mixed", "--out-dir",
                              str(tmp_path)], env=script_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((tmp_path / "bench_moe.json").read_text())["rows"]
    assert row["workload"] == "mixed" and row["ideal_speedup"] > 1.5 and row["tree_tokens"] < row["tokens"]
    assert row["loss_rel_diff"] < 1e-5 and row["peak_mb_shared"] > 0 and row["expert_load_max_over_mean"] >= 1.0
    assert "| mixed |" in (tmp_path / "bench_moe.md").read_text()
