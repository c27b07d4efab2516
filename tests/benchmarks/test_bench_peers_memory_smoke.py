"""Smoke test of bench_peers' memory modes on a tiny workload: ``--memory-breakdown`` accounts
the measured peak by holder (every part non-negative, the parts summing to the peak, saved
activations seen by the hooks), beside the memory plan's prediction; ``--memory-curve`` runs the
project's points (budget 512, KV budget at its floor, recomputation, and ``--memory-budget`` at the
per-sample loop's measured peak) through bench_peers' protocol with gradients checked, a peak per
point, a table and a PNG. No timing is asserted."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POINTS = ["psrl-mb512", "psrl-kv-floor", "psrl-recompute", "psrl-at-hf-per-sample"]


@pytest.mark.slow  # a benchmark run in a subprocess
def test_bench_peers_memory_modes(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--quick", "--out-dir", str(out),
         "--workloads", "stepwise-4x32", "--repeats", "1", "--memory-breakdown", "--memory-curve",
         "--contenders", ",".join(POINTS)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_peers_memory.json").read_text())
    (row,) = result["breakdown"]
    m = row["measured"]
    parts = (sum(m["saved_running"].values()) + sum(m["saved_kept"].values()) + m["kv_cache"] + m["param_grads"]
             + m["other"])
    assert parts == m["peak_bytes"] > 0, m
    assert min(m["kv_cache"], m["param_grads"], m["other"], *m["saved_running"].values()) >= 0, m
    assert row["predicted"]["step_peak"] > 0 and row["predicted"]["micro_batches"] >= 1, row["predicted"]
    (curve,) = result["curves"]
    rows = {r["contender"]: r for r in curve["rows"]}
    for name in ["hf-per-sample"] + POINTS:
        assert rows[name]["status"] == "ok" and rows[name]["grad_rel_err"] <= 1e-4, rows[name]
        assert rows[name]["peak_mb"] > 0 and rows[name]["median_s"] > 0, rows[name]
    assert rows["psrl-mb512"]["micro_batches"] >= 1
    at = rows["psrl-at-hf-per-sample"]  # --memory-budget = static + the per-sample loop's measured peak
    assert at["predicted_mb"] * 1.05 <= at["target_mb"] and at["micro_batch_tokens"] >= 256, at
    assert at["peak_mb"] <= rows["hf-per-sample"]["peak_mb"], (at, rows["hf-per-sample"])
    assert os.path.isfile(curve["png"]) and os.path.getsize(curve["png"]) > 0
    md = (out / "bench_peers_memory.md").read_text()
    assert "faster and leaner than every peer" in md and "saved: attention core" in md
    assert "at each peer's memory" in md and "| hf-per-sample |" in md.split("at each peer's memory")[1]


def _summary(clock):
    """bench_peers' summary of two contenders whose wall and CPU clocks differ (CPU = 2 x wall:
    2 threads), timed in three rounds, with ``clock`` as ``--clock``."""
    from types import SimpleNamespace

    import bench_peers

    def result(name, wall):
        times = [wall - 0.1, wall, wall + 0.1]
        r = bench_peers.Result(name, times=times, cpu_times=[2 * t for t in times], clock=clock)
        r.peak_bytes = 100 * 2**20
        return r

    work = SimpleNamespace(name="w", batch=SimpleNamespace(num_samples=1, num_tokens=10), tree_tokens=10,
                           num_claims=1, ideal_speedup=1.0)
    results = {r.name: r for r in (result("psrl-mb512", 1.0), result("trl-tree", 2.0))}
    return bench_peers.summarise(work, results, list(results))


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_curve_range_is_on_the_clock_of_its_median(clock):
    """The table's min-max is the rounds' range on ``--clock``, the clock of the median beside it
    (it once showed the wall range beside a CPU median)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import memory_curve

    scale = 2.0 if clock == "cpu" else 1.0
    summary = _summary(clock)
    for r in memory_curve.curve_rows(summary):
        assert r["spread"]["min"] <= r["median_s"] <= r["spread"]["max"], r
    lines = memory_curve.curve_md(summary, None, clock)
    assert f"| psrl-mb512 | - | {scale:.3f} | {scale * 0.9:.3f}-{scale * 1.1:.3f} | 100 |" in "\n".join(lines)
