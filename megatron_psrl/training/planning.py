"""Plan a step and its KV memory together, cutting differently when the cache cannot hold it."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

from megatron_psrl.kvcache import CacheBudgetError, MemoryPlan
from megatron_psrl.tree.planner import PlannerConfig, PlanningError, RankPlan, StepPlan, plan_step
from megatron_psrl.tree.prefix_tree import PrefixTree


def plan_with_memory(
    tree: PrefixTree, config: PlannerConfig, rank_memory: Callable[[RankPlan], MemoryPlan]
) -> Tuple[StepPlan, List[Optional[MemoryPlan]], str]:
    """The step plan, every rank's memory plan, and the sharing mode finally used.

    Every rank plans every rank, so the decision (and any error) is the same everywhere and
    collectives stay matched. When the cached prefixes of some rank do not fit the KV budget,
    the step is planned again with prefix duplication (no cache); if that cannot split the
    trees either (a sample longer than a micro-batch), the error names both reasons.
    """
    plan = plan_step(tree, config)
    try:
        return plan, [rank_memory(r) if r.sources else None for r in plan.ranks], config.sharing
    except CacheBudgetError as exc:
        try:
            plan = plan_step(tree, dataclasses.replace(config, sharing="tree-dup"))
        except PlanningError as dup_exc:
            raise CacheBudgetError(f"{exc}; and without caching: {dup_exc}") from None
        return plan, [None] * len(plan.ranks), "tree-dup"
