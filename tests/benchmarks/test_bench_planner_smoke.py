"""Smoke test of benchmarks/bench_planner.py --quick: the at-scale simulation runs at small rank
counts, prints its table with the expected columns, and every plan it makes passes check_plan
(--quick checks them). No timing assertions."""

import importlib.util
import os
import sys

import pytest
from helpers.launch_pool import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_planner.py")

COLUMNS = ["model", "workload", "ranks", "trajectories", "unique tokens / rank", "micro-batches / rank",
           "cross-rank groups", "planned makespan s", "perfect s", "imbalance",
           "exchanged GiB / rank (mean, max)", "exchange s (max rank)", "recomputed", "sent heads (home send s)",
           "plan CPU s (all groups)",
           "plan CPU s (one rank)"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_planner", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    module = sys.modules[spec.name]
    return module


@pytest.mark.slow
def test_bench_planner_quick():
    proc = run_python(
        SCRIPT, ["--quick", "--models", "qwen3-235b-a22b", "--workloads", "stepwise", "search-tree", "grpo", "mixed",
                 "stepwise-one-tree"], cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert len(rows) == 5 * 2  # workloads x rank counts (16, 64)
    for row in rows:
        assert len(row) == len(COLUMNS)
        assert float(row[COLUMNS.index("imbalance")]) >= 0.999
        assert float(row[COLUMNS.index("planned makespan s")]) > 0


def test_synthetic_plans_pass_check_plan():
    """In-process: every workload's plan at 16 ranks in groups of 8 is exact (check_plan), and
    the trees' trajectories and token counts are what the generators say."""
    bench = _bench()
    from megatron_psrl.schedule.check import check_plan

    args = bench.parse_args(["--quick"])
    for workload in bench.WORKLOADS:
        tree, made = bench.synthetic_tree(workload, 8, 512, seed=3)
        assert made >= 8 and len(tree.sample_node) >= made  # leaves: at least one per trajectory
        res = bench.simulate(tree, workload, made, bench.SIM_MODELS["qwen3-32b"], 16, 512, args, keep_plan=True)
        check_plan(res.plan)
        assert res.makespan_s >= res.perfect_s * 0.999
    one, _ = bench.synthetic_tree("stepwise-one-tree", 8, 512)
    assert (one.node_parent < 0).sum() == 1  # one shared system prompt: the batch is one tree


def test_moe_cost_counts_active_experts_only():
    bench = _bench()
    moe = bench.SIM_MODELS["qwen3-235b-a22b"]
    d = moe.dims
    cost = moe.cost_model()
    attn = d.hidden_size * d.num_heads * d.head_dim * 2 + 2 * d.hidden_size * d.num_kv_heads * d.head_dim
    mlp = moe.top_k * 3 * d.hidden_size * moe.expert_ffn
    router = d.hidden_size * moe.num_experts
    assert cost.linear_flops_per_token == pytest.approx(3 * 2 * d.num_layers * (attn + mlp + router))
    # about 22B active parameters (with the embedding) next to 32B for the dense model
    active = d.num_layers * (attn + mlp + router) + 2 * d.hidden_size * d.vocab_size
    assert 20e9 < active < 24e9
    scaled = bench.scaled_cost_model(cost, 4)
    assert scaled.attention_flops_per_key == pytest.approx(16 * cost.attention_flops_per_key)
