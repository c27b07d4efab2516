"""benchmarks/bench_causal_split.py: it measures both ways on the same inputs, says which the
backend runs, and the two outputs agree to fp32 rounding (timings are the benchmark's to print,
not asserted here)."""

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_causal_split  # noqa: E402

from megatron_psrl.attention import partial  # noqa: E402


def test_rows_measure_both_ways_and_name_the_backends_choice(capsys):
    rows = bench_causal_split.main(["--lengths", "200,400,800", "--repeats", "1", "--threads", "1"])
    assert partial.CAUSAL_SPLIT_ROWS == (384, 576)  # restored
    by_n = {}
    for r in rows:
        by_n.setdefault(r["n"], []).append(r)
    assert sorted(by_n) == [200, 400, 800] and all(len(v) == len(bench_causal_split.SHAPES) for v in by_n.values())
    assert [by_n[n][0]["split"] for n in (200, 400, 800)] == [False, True, False]
    for r in by_n[200]:  # one piece only: nothing to compare
        assert math.isnan(r["pieces_ms"]) and r["one_ms"] > 0
    for r in by_n[400] + by_n[800]:
        assert r["one_ms"] > 0 and r["pieces_ms"] > 0 and r["ratio"] == r["pieces_ms"] / r["one_ms"]
        assert r["max_diff"] < 1e-5
    assert "| 400 | 8/4x32 |" in capsys.readouterr().out


def test_step_rows_time_both_ways_at_both_budgets(capsys):
    rows = bench_causal_split.main(["--step", "grpo-64x4x16", "--rounds", "1", "--threads", "1"])
    assert partial.CAUSAL_SPLIT_ROWS == (384, 576)  # restored
    assert [r["budget"] for r in rows] == [512, 4096] and all(r["micro_batches"] >= 1 for r in rows)
    for r in rows:
        assert r["pieces_s"] > 0 and r["one_s"] > 0 and r["ratio"] == r["pieces_s"] / r["one_s"]
    assert "| 512 |" in capsys.readouterr().out
