#!/usr/bin/env python
"""How long the global planner takes next to the step it plans.

    python benchmarks/bench_planner.py [--tokens 1000000] [--dp 8] [--micro-batch-tokens 8192]

For each synthetic workload of about ``--tokens`` tokens: the prefix-tree build, the plan over
``--dp`` data-parallel ranks (sharing and no-sharing), and packing every micro-batch (segments,
attention plans, logit rows), each timed once after a warm-up, on one core.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.data import make_workload  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402
from megatron_psrl.tree.planner import PlannerConfig, plan_step  # noqa: E402


def timed(fn):
    fn()  # warm-up
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    args = p.parse_args()
    print("| workload | samples | tokens | mode | tree build ms | plan ms | pack ms | micro-batches |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("grpo", "stepwise", "tree", "mixed"):
        batch = make_workload(name, vocab_size=1024, seed=0, num_tokens_target=args.tokens)
        tree, t_build = timed(lambda: build_prefix_tree(batch))
        for mode in ("tree", "none"):
            cfg = PlannerConfig(micro_batch_tokens=args.micro_batch_tokens, sharing=mode, data_parallel_size=args.dp)
            plan, t_plan = timed(lambda: plan_step(tree, cfg))
            _, t_pack = timed(lambda: [r.pack(plan.index, i) for r in plan.ranks for i in range(len(r.micro_batches))])
            print(f"| {name} | {batch.num_samples} | {batch.num_tokens} | {mode} | {1e3 * t_build:.0f} | "
                  f"{1e3 * t_plan:.0f} | {1e3 * t_pack:.0f} | {plan.num_micro_batches()} |")


if __name__ == "__main__":
    main()
