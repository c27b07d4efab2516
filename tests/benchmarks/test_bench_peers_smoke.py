"""Smoke test of benchmarks/bench_peers.py --quick: it runs, writes its table, and every
contender that ran computed the reference gradients (the optional peers are skipped when their
packages are absent, as in CI)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a benchmark run in a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_peers_quick(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--quick", "--out-dir", str(out),
         "--profile", "stepwise-4x32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_peers.json").read_text())
    assert [w["workload"] for w in result["workloads"]] == ["grpo-64x4x16", "stepwise-4x32", "tree-small", "mixed-small"]
    for w in result["workloads"]:
        rows = {r["contender"]: r for r in w["rows"]}
        for name in ("psrl", "psrl-no-sharing", "hf-per-sample"):
            assert rows[name]["status"] == "ok" and rows[name]["median_s"] > 0, (w["workload"], rows[name])
        for r in w["rows"]:
            assert r["status"] in ("ok", "skipped"), (w["workload"], r)
            if r["status"] == "ok":
                assert r["grad_rel_err"] <= 1e-4, (w["workload"], r)
        # the floor applies to the chain and the one-prompt group, not to trees and mixed batches
        assert (rows["floor"]["status"] == "ok") == w["workload"].startswith(("grpo", "stepwise")), rows["floor"]
    assert set(result["profiles"]) == {"stepwise-4x32"}
    phases = result["profiles"]["stepwise-4x32"]["phases"]
    assert {"tree build", "plan", "backward (whole model)"} <= set(phases)
    assert "### stepwise-4x32" in (out / "bench_peers.md").read_text()
