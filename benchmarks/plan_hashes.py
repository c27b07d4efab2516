"""Fingerprints of step plans and their memory plans, to show that a refactor changes no plan.

For every workload x layout x budget, plans the step with its KV memory
(:func:`megatron_psrl.schedule.with_memory.plan_with_memory`, as the engine does) and prints a
SHA-256 of everything the executor acts on: every rank's micro-batches (tokens, owned, reads,
produces, peer reads, exchanges, roles), cached sources (producer, tokens, consumers, replica,
kinds, head sends), the schedule, the head sends, and every memory plan's decisions (block size,
pool blocks, keep/recompute, release steps, peak, timeline). Run it on two commits and compare:

    python benchmarks/plan_hashes.py > after.txt
    git stash; python benchmarks/plan_hashes.py > before.txt; git stash pop
    diff before.txt after.txt && echo identical

Block kinds are hashed by role (values, gradients), whatever names a version gives them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np
import torch

from megatron_psrl.data import make_workload
from megatron_psrl.kvcache import CacheBudgetError, KVGeometry
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.tiny import tiny_config
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.memory import MemorySettings, activation_bytes_per_token
from megatron_psrl.schedule.plan import PlanningError
from megatron_psrl.schedule.with_memory import plan_with_memory
from megatron_psrl.tree import build_prefix_tree

WORKLOADS = ("grpo", "stepwise", "tree", "mixed")
LAYOUTS = {  # name -> (data-parallel ranks, exchange group size, placement)
    "dp1": (1, 1, "auto"),
    "dp2": (2, 1, "auto"),
    "dp2-cross": (2, 2, "cross-rank"),
    "dp4-groups2": (4, 2, "auto"),
    "dp4-cross": (4, 4, "cross-rank"),
}
BUDGETS = {  # name -> (micro-batch tokens, KV budget: bytes, or a fraction of the roomy plan's peak)
    "roomy": (512, 1 << 40),
    "mid": (512, 0.85),
    "tight": (512, 0.6),
    "mb256": (256, 1 << 40),
    "mb1024-tight": (1024, 0.6),
    "none": (512, None),
}


def _role(kind: str) -> str:
    return "grads" if kind.startswith("g") else "values"


def _canon(x):
    """JSON-able, deterministic form of plan objects."""
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, dict):
        return {str(k): _canon(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):
        out = {}
        for name in sorted(x.__dataclass_fields__):
            if name in ("pool_sizes", "segment_shapes", "row_counts", "step_timeline_bytes", "offloaded_bytes"):
                continue  # (later additions, derived)
            value = getattr(x, name)
            if name == "kinds" and value is not None:
                value = sorted({_role(k) if k not in ("values", "grads") else k for k in value})
            out[name] = _canon(value)
        return out
    return x


def fingerprint(plan, memories) -> str:
    body = {"ranks": [_canon(r) for r in plan.ranks], "head_sends": _canon(getattr(plan, "head_sends", [])),
            "memories": [_canon(m) for m in memories]}
    for r in body["ranks"]:
        r.pop("tree", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model dtype the plans assume (bfloat16: gradient blocks twice as wide)")
    args = parser.parse_args(argv)
    arch = ModelArchitecture.from_hf_config(tiny_config("tiny-llama"))
    dtype = getattr(torch, args.dtype)
    geometry = KVGeometry.for_model(arch, 1, 1, dtype, torch.device("cpu"))
    act = activation_bytes_per_token(arch, 1, torch.tensor([], dtype=dtype).element_size())
    cost = CostModel.named("tiny")
    for workload in WORKLOADS:
        tree = build_prefix_tree(make_workload(workload, seed=args.seed))
        for layout, (dp, group, placement) in LAYOUTS.items():
            roomy_peak = {}
            for budget_name, (mb_tokens, kv_budget) in BUDGETS.items():
                if isinstance(kv_budget, float):
                    kv_budget = int(kv_budget * roomy_peak.get(mb_tokens, roomy_peak[512]))
                config = PlannerConfig(micro_batch_tokens=mb_tokens, data_parallel_size=dp,
                                       sharing="tree" if kv_budget else "none", exchange_group_size=group,
                                       placement=placement, cost_model=cost,
                                       kv_bytes_per_token=geometry.row_bytes_per_token
                                       if hasattr(geometry, "row_bytes_per_token") else 2 * geometry.bytes_per_token)
                settings = MemorySettings(geometry, kv_budget or 1 << 40, act)
                try:
                    plan, memories, mode = plan_with_memory(tree, config, settings)
                    line = f"{fingerprint(plan, memories)} {mode}"
                    if kv_budget == 1 << 40:
                        roomy_peak[mb_tokens] = max((m.peak_bytes for m in memories if m is not None), default=0)
                        if mb_tokens == 512:
                            roomy_peak[1024] = roomy_peak[512]
                    recomputed = sum(m.recompute_tokens for m in memories if m is not None)
                    line += f" recompute {recomputed}"
                except (PlanningError, CacheBudgetError) as e:
                    line = f"refused {type(e).__name__}"
                print(f"{workload:9s} {layout:12s} {budget_name:13s} {line}", flush=True)
    # trees split between exchange groups, their heads sent (micro-batches of 96 tokens)
    from megatron_psrl.data.synthetic import make_stepwise, make_tree_rollouts

    heads = {"heads-stepwise": make_stepwise(num_trajectories=8, turns=(3, 5), obs_len=(10, 30), action_len=(4, 8),
                                             system_len=40, task_len=(5, 10), vocab_size=97, seed=3),
             "heads-tree": make_tree_rollouts(num_roots=1, branching=2, depth=3, segment_len=(6, 16),
                                              prompt_len=(40, 60), obs_len=(8, 20), vocab_size=97, seed=5)}
    for workload, batch in heads.items():
        tree = build_prefix_tree(batch)
        for ranks, group, placement in ((8, 1, "auto"), (8, 2, "whole-tree"), (8, 4, "cross-rank"),
                                        (4, 2, "cross-rank"), (4, 2, "auto")):
            roomy = None
            for budget_name in ("roomy", "mid", "tight"):
                kv_budget = 1 << 40 if roomy is None else int({"mid": 0.85, "tight": 0.6}[budget_name] * roomy)
                config = PlannerConfig(micro_batch_tokens=96, data_parallel_size=ranks, exchange_group_size=group,
                                       placement=placement, cross_group_prefix="transfer")
                try:
                    plan, memories, mode = plan_with_memory(tree, config, MemorySettings(geometry, kv_budget, act))
                    if roomy is None:
                        roomy = max((m.peak_bytes for m in memories if m is not None), default=0)
                    recomputed = sum(m.recompute_tokens for m in memories if m is not None)
                    line = f"{fingerprint(plan, memories)} {mode} heads {len(plan.head_sends)} recompute {recomputed}"
                except (PlanningError, CacheBudgetError) as e:
                    line = f"refused {type(e).__name__}"
                layout = f"dp{ranks}-g{group}-{placement}"
                print(f"{workload:9s} {layout:12s} {budget_name:13s} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
