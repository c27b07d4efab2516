#!/usr/bin/env python
"""The smallest --kv-cache-budget a step runs with, against the floor of its deepest chain.

    python benchmarks/bench_kv_budget.py [--micro-batch-tokens 128] [--workloads mixed stepwise tree]

No model runs: for each synthetic workload (tiny Llama geometry, fp32, one rank) the step is
planned with prefix sharing and mechanism 2, and the memory planner is asked for every budget
of a bisection until the smallest feasible one is found. Printed beside it:

- ``floor``: K, V, dK and dV of the longest chain of cached prefixes any one micro-batch reads
  (those must be alive together while it runs, whatever the schedule);
- ``keep all``: the planner's peak when every producer keeps its graph (what a budget must
  hold for no recomputation at all);
- ``tokens recomputed`` at the minimal budget.

The ratio minimal / floor is the headroom the planner leaves above the unavoidable. The main
columns are the ``torch`` backend's, whose readers gather cached K/V again in their backward
pass; the last two are for kernels that keep their gathered copies in the graph (GPU
backends), where a kept reader holds a private copy of its whole prefix chain. The last column
plans micro-batches cut at branch switches (``cut_at_branch_switches``), what the trainer
falls back to when the default cut does not fit the budget.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import torch  # noqa: E402

from megatron_psrl.data import make_workload  # noqa: E402
from megatron_psrl.kvcache import CacheBudgetError, KVGeometry
from megatron_psrl.model import ModelArchitecture, tiny_config  # noqa: E402
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree  # noqa: E402


def minimal_budget(rank, geometry, act_bytes, high: int, gathers: bool) -> int:
    lo, hi = 0, high  # lo infeasible, hi feasible
    while hi - lo > max(1024, hi // 1000):
        mid = (lo + hi) // 2
        try:
            plan_memory(rank, geometry, mid, act_bytes, gathers_in_backward=gathers)
            hi = mid
        except CacheBudgetError:
            lo = mid
    return hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--micro-batch-tokens", type=int, default=128)
    p.add_argument("--workloads", nargs="+", default=["mixed", "stepwise", "tree"])
    p.add_argument("--tokens", type=int, default=20000, help="tokens per workload batch")
    args = p.parse_args()
    arch = ModelArchitecture.from_hf_config(tiny_config("tiny-llama"))
    geometry = KVGeometry.for_model(arch, 1, 1, torch.float32, torch.device("cpu"))
    act = activation_bytes_per_token(arch, 1, 4)
    print(f"tiny-llama geometry ({geometry.bytes_per_token} bytes per token per kind over {geometry.num_layers} "
          f"layers), fp32, micro-batches of {args.micro_batch_tokens} tokens, one rank")
    print("| workload | tokens | micro-batches | floor | minimal budget | minimal / floor | keep all | "
          "recomputed at minimal | minimal, copies kept | keep all, copies kept | minimal, cut at branch switches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.workloads:
        batch = make_workload(name, num_tokens_target=args.tokens, vocab_size=arch.vocab_size, seed=1)
        tree = build_prefix_tree(batch)
        plan = plan_step(tree, PlannerConfig(micro_batch_tokens=args.micro_batch_tokens, sharing="tree"))
        cut = plan_step(tree, PlannerConfig(micro_batch_tokens=args.micro_batch_tokens, sharing="tree",
                                            cut_at_branch_switches=True)).ranks[0]
        rank = plan.ranks[0]
        if not rank.sources:
            print(f"| {name} | {batch.num_tokens} | {len(rank.micro_batches)} | - | (no cached prefixes) | | | | | | |")
            continue
        chain = max(sum(rank.sources[s].length for s in mb.reads) for mb in rank.micro_batches)
        floor = 4 * chain * geometry.bytes_per_token
        keep_all = {g: plan_memory(rank, geometry, 1 << 50, act, gathers_in_backward=g).peak_bytes for g in (True, False)}
        minimal = {g: minimal_budget(rank, geometry, act, keep_all[g], g) for g in (True, False)}
        recomputed = plan_memory(rank, geometry, minimal[True], act, gathers_in_backward=True).recompute_tokens
        # what the trainer falls back to when the default cut does not fit (planning.plan_with_memory)
        cut_keep_all = plan_memory(cut, geometry, 1 << 50, act, gathers_in_backward=True).peak_bytes
        cut_minimal = minimal_budget(cut, geometry, act, cut_keep_all, True)
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        print(f"| {name} | {batch.num_tokens} | {len(rank.micro_batches)} | {mib(floor)} | {mib(minimal[True])} | "
              f"{minimal[True] / floor:.2f} | {mib(keep_all[True])} | {recomputed} | {mib(minimal[False])} "
              f"({minimal[False] / floor:.2f}) | {mib(keep_all[False])} | {mib(cut_minimal)} "
              f"({cut_minimal / floor:.2f}), {len(cut.micro_batches)} micro-batches |", flush=True)


if __name__ == "__main__":
    main()
