"""tools/make_synthetic_trace.py and tools/analyze_trace.py, run in-process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_psrl.data import load_samples, make_workload

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"psrl_tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_trace = load_tool("make_synthetic_trace")
analyze = load_tool("analyze_trace")


def test_make_synthetic_trace_matches_the_library(tmp_path, capsys):
    out = tmp_path / "trace.parquet"
    rc = make_trace.main(["--workload", "tree", "--num-tokens", "20000", "--seed", "2",
                          "--branching", "2,3", "--depth", "2", "--segment-len", "16",
                          "--with-logprobs", "--out", str(out)])
    assert rc == 0 and "to " + str(out) in capsys.readouterr().out
    loaded = load_samples(out, vocab_size=1024, require_advantage=True, kl_required=True)
    expected = make_workload("tree", num_tokens_target=20000, seed=2, branching=(2, 3), depth=2,
                             segment_len=16, with_logprobs=True)
    assert loaded.ids == expected.ids
    assert (loaded.tokens == expected.tokens).all()
    assert loaded.num_tokens >= 20000


def test_make_synthetic_trace_rejects_foreign_parameters(tmp_path, capsys):
    rc = make_trace.main(["--workload", "grpo", "--turns", "3", "--out", str(tmp_path / "x.jsonl")])
    assert rc == 2 and "unexpected keyword argument 'turns'" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(SystemExit):
        make_trace.main(["--workload", "grpo", "--prompt-len", "1,2,3", "--out", "x.jsonl"])


def test_analyze_trace_writes_summary_and_plots(tmp_path, capsys):
    trace = tmp_path / "step.jsonl"
    assert make_trace.main(["--workload", "stepwise", "--out", str(trace)]) == 0
    summary_path, plots = tmp_path / "out" / "summary.json", tmp_path / "plots"
    rc = analyze.main(["--data", str(trace), "--model", "qwen2.5-7b", "--out-json",
                       str(summary_path), "--plots-dir", str(plots)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ideal_speedup" in printed and "ideal speedup vs context length" in printed
    summary = json.loads(summary_path.read_text())
    stats = summary["stats"]
    assert summary["model"] == "qwen2.5-7b" and stats["cost_model"]["name"] == "qwen2.5-7b"
    assert stats["ideal_speedup"] == pytest.approx(summary["ideal_speedup_by_model"]["qwen2.5-7b"])
    assert stats["ideal_speedup"] > 1.5  # step-wise histories share a lot
    curve = summary["speedup_vs_context"]
    assert curve[-1]["max_len"] == stats["max_sample_len"]
    assert curve[-1]["ideal_speedup"] == pytest.approx(stats["ideal_speedup"])
    assert [row["max_len"] for row in curve] == sorted(row["max_len"] for row in curve)
    assert 0 < summary["redundancy"]["mean"] <= 1
    for name in ("redundancy.png", "depth_branching.png", "speedup_vs_context.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyze_trace_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": [1]}\n')
    assert analyze.main(["--data", str(bad)]) == 2  # input errors exit 2, as in every tool
    assert "bad.jsonl line 1 (sample id 'a'): field 'tokens'" in capsys.readouterr().err


def test_context_lengths():
    assert analyze.context_lengths(100) == [32, 64, 100]
    assert analyze.context_lengths(128) == [32, 64, 128]
    assert analyze.context_lengths(10) == [10]


def test_analyze_trace_compares_placements_over_ranks(tmp_path, capsys):
    """--ranks plans the trace over simulated ranks: a step-wise batch sharing one system prompt
    is one tree, so whole-tree placement leaves ranks idle and cross-rank placement does not."""
    trace = tmp_path / "step.jsonl"
    assert make_trace.main(["--workload", "stepwise", "--out", str(trace)]) == 0
    summary_path, plots = tmp_path / "summary.json", tmp_path / "plots"
    rc = analyze.main(["--data", str(trace), "--model", "llama3-8b", "--ranks", "4", "--micro-batch-tokens", "256",
                       "--out-json", str(summary_path), "--plots-dir", str(plots)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "placement over 4 ranks" in printed and "whole-tree" in printed and "cross-rank" in printed
    placement = json.loads(summary_path.read_text())["placement"]
    assert len(placement["cross-rank"]["rank_cost"]) == 4
    assert placement["whole-tree"]["imbalance"] > 2.0 and placement["cross-rank"]["imbalance"] < 1.1
    assert placement["cross-rank"]["exchanged_bytes"] > 0 and placement["whole-tree"]["exchanged_bytes"] == 0
    assert (plots / "placement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
