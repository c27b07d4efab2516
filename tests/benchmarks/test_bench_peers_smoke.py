"""Smoke test of benchmarks/bench_peers.py --quick on tiny workloads: it runs, writes its tables,
every contender that ran computed the reference gradients, the timed steps are interleaved
(A B C ... A B C ...), every timed contender has a spread and a peak-memory figure, and the
guard (on a selected workload and on one it runs alone) and the baseline profile report their
rows. No timing is asserted (the optional peers are skipped when their packages are absent, as
in CI)."""

import json
import os

import pytest
from helpers.launch_pool import run_python

pytestmark = pytest.mark.slow  # a benchmark run in a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = ["grpo-64x4x16", "stepwise-4x32", "tree-small"]
REPEATS = 2


def test_bench_peers_quick(tmp_path):
    out = tmp_path / "out"
    proc = run_python(
        os.path.join(ROOT, "benchmarks", "bench_peers.py"),
        ["--quick", "--out-dir", str(out), "--workloads", ",".join(WORKLOADS), "--repeats", str(REPEATS),
         "--profile", "stepwise-4x32", "--guard", "tree-small,mixed-small", "--baseline-profile", "stepwise-4x32",
         "--baseline-repeats", "1"],
        cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_peers.json").read_text())
    assert result["meta"]["memory_mode"] in ("ops", "sampled")
    assert [w["workload"] for w in result["workloads"]] == WORKLOADS
    for w in result["workloads"]:
        rows = {r["contender"]: r for r in w["rows"]}
        for name in ("psrl", "psrl-one-pack", "psrl-no-sharing", "hf-per-sample"):
            assert rows[name]["status"] == "ok" and rows[name]["median_s"] > 0, (w["workload"], rows[name])
        timed = []
        for r in w["rows"]:
            assert r["status"] in ("ok", "skipped"), (w["workload"], r)
            if r["status"] == "ok":
                assert r["grad_rel_err"] <= 1e-4, (w["workload"], r)
                assert r["runs"] == REPEATS and len(r["times_s"]) == REPEATS, r
                sp = r["spread_wall"]
                assert sp["min"] <= sp["median"] <= sp["max"] and sp["q1"] <= sp["q3"], sp
                assert r["peak_mb"] is not None and r["peak_mb"] > 0, r  # one untimed memory run each
                assert r["kernels"], r
                timed.append(r["contender"])
        # interleaved: every round runs every timed contender once, in the same order
        assert w["timed_order"] == timed * REPEATS, w["timed_order"]
        # the floors: one causal pass on a chain (both), the prompt-once group (Hugging Face's only)
        chain, group = w["workload"].startswith("stepwise"), w["workload"].startswith("grpo")
        assert (rows["floor-psrl"]["status"] == "ok") == chain, rows["floor-psrl"]
        assert (rows["floor-hf"]["status"] == "ok") == (chain or group), rows["floor-hf"]
    # mixed-small is not among --workloads: its guard runs alone, and is reported as well
    assert set(result["guards"]) == {"tree-small", "mixed-small"}
    assert "mixed-small (mechanism 2's guard only)" in (out / "bench_peers.md").read_text()
    guard = result["guards"]["tree-small"]
    assert [r["variant"] for r in guard["rows"]] == ["one pack", "k=2", "k=4", "k=8", "unrelated, one pack",
                                                     "unrelated, k=8"]
    assert all(r["tokens_recomputed"] == 0 for r in guard["rows"]), guard["rows"]
    rows = {r["variant"]: r for r in guard["rows"]}
    assert rows["one pack"]["micro_batches"] == 1 and rows["k=8"]["micro_batches"] > 1, guard["rows"]
    # micro-batching alone: the k=8 packs as unrelated sequences, one pack against one per micro-batch
    assert rows["unrelated, one pack"]["micro_batches"] == 1
    assert rows["unrelated, k=8"]["micro_batches"] == rows["k=8"]["micro_batches"], guard["rows"]
    assert rows["unrelated, k=8"]["tokens_computed"] == rows["unrelated, one pack"]["tokens_computed"]
    assert guard["mechanism2_ratio"] == pytest.approx(rows["k=8"]["median_paired_ratio"] / guard["micro_batching_ratio"])
    assert set(result["profiles"]) == {"stepwise-4x32"}
    phases = result["profiles"]["stepwise-4x32"]["phases"]
    assert {"tree build", "plan", "backward (whole model)"} <= set(phases)
    base = result["baseline"]
    assert base["workload"] == "stepwise-4x32" and len(base["rows"]) == 5
    assert all(r["ms_per_token"] > 0 and set(r["op_split_s"]) == {"attention kernels", "GEMMs", "rest"}
               for r in base["rows"])
    md = (out / "bench_peers.md").read_text()
    assert "### stepwise-4x32" in md and "| contender | median s | min-max s | spread |" in md and "peak MB" in md
    assert "Timed order, round 1" in md and "Mechanism 2's guard on tree-small" in md
