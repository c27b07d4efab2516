#!/usr/bin/env python
"""Mechanism 2 (prefix K/V reuse across micro-batches) vs mechanism 1 with prefix duplication.

    python benchmarks/bench_kv_reuse.py [--model tiny-llama] [--repeats 2] [--out-dir runs/bench_kv_reuse]

Workload: step-wise RL over agent *search trees*: per task a system prompt and task, a shared
trunk of turns, then many branches of further turns; every turn of every branch is a sample
whose context is its whole history. The prefix tree of a task is many times the micro-batch
budget, while every single sample still fits one micro-batch (so that mechanism 1 with prefix
duplication can run at all). Variants, measured side by side in one process:

- ``none``: no sharing (samples packed back to back);
- ``tree-dup``: mechanism 1 only; an oversized tree is cut at nodes and every piece recomputes
  its ancestor path (the stopgap of the mechanism-1 issue);
- ``tree``: mechanisms 1 + 2, KV cache budget large enough to keep every prefix graph;
- ``tree (tight KV)``: mechanisms 1 + 2 under a budget that only holds the K/V blocks, so the
  cache manager recomputes prefix forwards instead of keeping their graphs.

Reported: median step time, speedup over ``none``, tokens computed and recomputed, measured
peak memory (separate untimed run), KV cache metrics.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from step_bench import Bench, write_results  # noqa: E402

from megatron_psrl.data import samples_from_dicts  # noqa: E402
from megatron_psrl.data.samples import SampleBatch  # noqa: E402
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import activation_bytes_per_token, simulated_peak_bytes
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree  # noqa: E402


def stepwise_search_trees(num_tasks: int, trunk_turns: int, branches: int, branch_turns: int, vocab: int,
                          seed: int = 0, prompt_len: int = 600, obs=(80, 200), action=(10, 30)) -> SampleBatch:
    """Every turn of every branch of an agent search tree is a sample (history + its action)."""
    rng = np.random.default_rng(seed)

    def turn():
        a = rng.integers(0, vocab, int(rng.integers(*action))).tolist()
        o = rng.integers(0, vocab, int(rng.integers(*obs))).tolist()
        return a, o

    records: List[dict] = []

    def emit(history, act, name):
        toks = history + act
        records.append({"id": name, "tokens": toks, "loss_mask": [0] * len(history) + [1] * len(act),
                        "advantage": float(rng.normal())})

    for task in range(num_tasks):
        history = rng.integers(0, vocab, prompt_len).tolist()
        for t in range(trunk_turns):
            a, o = turn()
            emit(history, a, f"task{task}-trunk{t}")
            history = history + a + o
        for b in range(branches):
            h = list(history)
            for t in range(branch_turns):
                a, o = turn()
                emit(h, a, f"task{task}-branch{b}-turn{t}")
                h = h + a + o
    return samples_from_dicts(records, source="stepwise-search-trees")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--micro-batch-tokens", type=int, default=2560)
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--branches", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out-dir", default="runs/bench_kv_reuse")
    args = p.parse_args()

    bench = Bench(args.model, args.micro_batch_tokens, torch.device(args.device))
    batch = stepwise_search_trees(args.tasks, trunk_turns=6, branches=args.branches, branch_turns=4,
                                  vocab=bench.arch.vocab_size)
    tree = build_prefix_tree(batch)
    roots = np.flatnonzero(tree.node_parent < 0)
    biggest_tree = int(tree.subtree_tokens()[roots].max())
    # Tight budget: just the K/V blocks of the schedule, no room for retained prefix graphs.
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=args.micro_batch_tokens, sharing="tree"))
    rank = plan.ranks[0]
    drop_all = {s.producer: False for s in rank.sources.values()}
    act = activation_bytes_per_token(bench.arch, 1, 4)
    tight = simulated_peak_bytes(rank, bench.geometry, drop_all, act)
    ample = 4 << 30
    variants = {"none": ("none", ample), "tree-dup": ("tree-dup", ample), "tree": ("tree", ample),
                "tree (tight KV)": ("tree", tight)}
    print(f"{batch.num_samples} samples, {batch.num_tokens} tokens, {tree.num_tree_tokens} tree tokens; "
          f"largest tree {biggest_tree} tokens = {biggest_tree / args.micro_batch_tokens:.1f}x the micro-batch "
          f"budget of {args.micro_batch_tokens}; longest sample {int(batch.lengths.max())} tokens; "
          f"tight KV budget {tight / 2**20:.1f} MB", flush=True)
    peaks, results = {}, {v: [] for v in variants}
    for name, (mode, kv) in variants.items():
        peaks[name] = bench.step(batch, mode, measure_memory=True, kv_budget=kv)["peak_bytes"]
    for _ in range(args.repeats):
        for name, (mode, kv) in variants.items():
            results[name].append(bench.step(batch, mode, kv_budget=kv))
    rows = []
    base = statistics.median(r["seconds"] for r in results["none"])
    for name in variants:
        r0 = results[name][0]
        sec = statistics.median(r["seconds"] for r in results[name])
        rows.append({
            "variant": name, "step_s": sec, "speedup": base / sec, "tokens_computed": r0["tokens_computed"],
            "tokens_recomputed": r0["tokens_recomputed"], "micro_batches": r0["micro_batches"],
            "peak_mb": peaks[name] / 2**20, "loss": r0["loss"], **{k: v for k, v in r0["kv"].items()},
        })
        print(f"{name:>16}: {sec:7.3f} s  speedup {base / sec:5.2f}x  computed {r0['tokens_computed']:7d}  "
              f"recomputed {r0['tokens_recomputed']:6d}  micro-batches {r0['micro_batches']:3d}  "
              f"peak {peaks[name] / 2**20:7.1f} MB  {r0['kv']}", flush=True)
    meta = {"model": args.model, "micro_batch_tokens": args.micro_batch_tokens, "samples": batch.num_samples,
            "tokens": batch.num_tokens, "tree_tokens": tree.num_tree_tokens, "largest_tree": biggest_tree,
            "longest_sample": int(batch.lengths.max()), "tight_kv_budget": tight, "repeats": args.repeats,
            "ideal_speedup": bench.cost.ideal_speedup(tree)}
    lines = [
        f"{meta['samples']} samples / {meta['tokens']} tokens / {meta['tree_tokens']} tree tokens; largest tree "
        f"{biggest_tree} tokens = {biggest_tree / args.micro_batch_tokens:.1f}x the {args.micro_batch_tokens}-token "
        f"micro-batch budget; ideal speedup {meta['ideal_speedup']:.2f}x; model `{args.model}`, fp32, "
        f"median of {args.repeats} steps.",
        "",
        "| variant | step s | speedup vs none | tokens computed | tokens recomputed | micro-batches | peak MB | "
        "KV block | KV peak util | KV hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kv = (f"{r['kv_block_size']} | {r['kv_peak_utilisation']:.2f} | {r['kv_hit_rate']:.2f}"
              if "kv_block_size" in r else "- | - | -")
        lines.append(f"| {r['variant']} | {r['step_s']:.3f} | {r['speedup']:.2f}x | {r['tokens_computed']} | "
                     f"{r['tokens_recomputed']} | {r['micro_batches']} | {r['peak_mb']:.0f} | {kv} |")
    md = "\n".join(lines) + "\n"
    write_results(args.out_dir, "bench_kv_reuse", {"meta": meta, "rows": rows}, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
