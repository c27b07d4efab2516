"""Plan a step and its KV memory together, cutting differently when the cache cannot hold it."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

from megatron_psrl.kvcache import CacheBudgetError
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import MemoryPlan, add_segment_shapes
from megatron_psrl.schedule.plan import PlanningError, RankPlan, StepPlan
from megatron_psrl.schedule.planner import assign_groups, plan_step
from megatron_psrl.schedule.step_charge import add_row_counts
from megatron_psrl.tree.prefix_tree import PrefixTree

GroupMemory = Callable[[List[RankPlan]], List[MemoryPlan]]
"""Memory plans of ranks planned together (one rank, or a cross-rank group in lockstep)."""


FIXED_STATES_REASON = "fixed-size prefix states (linear-attention layers)"
"""Why a model whose layers keep a recurrent state (``KVGeometry.fixed_bytes_per_source``)
recomputes prefixes shared between groups (head sends move per-token rows only,
``source_row_shape``) and keeps its trees whole unless ``--placement cross-rank`` asks for
them to be split (the per-layer exchange then moves one state per chain,
``distributed/state_exchange.py``; ``auto`` would weigh a calibration that measures K/V
transfers only)."""


def whole_tree_reasons(pipeline_parallel_size: int, recompute: bool, placement: str = "auto",
                       fixed_states: bool = False) -> List[str]:
    """Why trees must be placed whole on the ranks of an exchange group (empty: they may be
    split). With pipeline stages one pipeline is one placement rank, and a tree is spread over
    pipelines (each stage exchanging its layers' K/V with the same stage of the others) only
    with ``placement="cross-rank"``: ``auto`` weighs costs that the start-up calibration
    measures by running the whole model on one rank. With activation recomputation a
    recomputed layer would repeat its K/V exchange inside the backward pass. A model with
    ``fixed_states`` (:data:`FIXED_STATES_REASON`) splits trees only with
    ``placement="cross-rank"`` too, and not over pipelines (untested there)."""
    by_request, pp = placement != "cross-rank", pipeline_parallel_size > 1
    return [why for why, on in (("pipeline parallelism", pp and by_request), ("activation recomputation", recompute),
                                (FIXED_STATES_REASON, fixed_states and by_request),
                                (f"{FIXED_STATES_REASON} under pipeline parallelism", fixed_states and pp and not by_request))
            if on]


def transfer_reasons(pipeline_parallel_size: int, recompute: bool, moe: bool, fixed_states: bool = False) -> List[str]:
    """Why the parts of a tree split between exchange groups recompute the prefix they share
    instead of receiving it (empty: they may receive it). The pipeline runner does not run
    transfers (each stage would send its layers'); a recomputed layer would run its forward
    again without the received K/V in place; an MoE model weighs its router losses by the
    samples through each token of a part, which a received head would miss; a head send moves
    per-token rows only (:data:`FIXED_STATES_REASON`)."""
    return [why for why, on in (("pipeline parallelism", pipeline_parallel_size > 1),
                                ("activation recomputation", recompute), ("MoE models", moe),
                                (FIXED_STATES_REASON, fixed_states)) if on]


def memory_plans(plan: StepPlan, group_memory: GroupMemory) -> List[Optional[MemoryPlan]]:
    """Every rank's memory plan: None for a rank that caches nothing and needs no decisions."""
    memories: List[Optional[MemoryPlan]] = [None] * len(plan.ranks)
    for group in plan.groups:
        ranks = [plan.ranks[r] for r in group]
        if getattr(group_memory, "varlen", None) is not None:  # (a varlen backend's charges follow the segments)
            for rank in ranks:
                add_segment_shapes(plan.index, rank)
        if getattr(group_memory, "step", None) is not None:  # (the step charged by its rows)
            for rank in ranks:
                add_row_counts(plan.index, rank)
        lockstep = len(group) > 1
        if lockstep or ranks[0].sources:
            for r, memory in zip(group, group_memory(ranks)):
                memories[r] = memory
    return memories


def plan_with_memory(
    tree: PrefixTree, config: PlannerConfig, group_memory: GroupMemory
) -> Tuple[StepPlan, List[Optional[MemoryPlan]], str]:
    """The step plan, every rank's memory plan, and the sharing mode finally used.

    Every rank of an exchange group plans the group's ranks alike (other groups, with
    ``config.local_rank``, only as placeholders), so the decision (and any error) is the same
    on every rank of the group and its collectives stay matched. When the cached prefixes do
    not fit the KV budget, the step is planned again: with every tree on one rank (cross-rank replicas hold more), then also with
    micro-batches cut at branch switches (one chain's prefixes alive at a time), then with
    prefix duplication (no cache); if that cannot split the trees either (a sample longer than
    a micro-batch), the error names both reasons.
    """
    # One assignment of trees to groups for every retry: with local planning each group
    # retries on its own, and every tree must still be computed by exactly one group.
    assignment = assign_groups(tree, config)
    plan = plan_step(tree, config, assignment)
    try:
        return plan, memory_plans(plan, group_memory), config.sharing
    except CacheBudgetError as exc:
        retries = []
        if "cross-rank" in plan.placements:
            retries.append(dataclasses.replace(config, placement="whole-tree"))
        if not config.cut_at_branch_switches:
            retries.append(dataclasses.replace(config, placement="whole-tree" if retries else config.placement,
                                               cut_at_branch_switches=True))
        for retry in retries:
            try:
                plan = plan_step(tree, retry, assignment)
                return plan, memory_plans(plan, group_memory), config.sharing
            except CacheBudgetError:
                pass
        try:
            plan = plan_step(tree, dataclasses.replace(config, sharing="tree-dup", placement="whole-tree"), assignment)
        except PlanningError as dup_exc:
            raise CacheBudgetError(f"{exc}; and without caching: {dup_exc}") from None
        # (a home rank still sends the heads other groups receive: their K/V pass through its cache)
        return plan, memory_plans(plan, group_memory) if plan.head_sends else [None] * len(plan.ranks), "tree-dup"
