"""The global planner: which tree tokens every rank computes, in which micro-batches and order.

Input: the global prefix tree of the update batch. Output: a :class:`StepPlan`
(:mod:`megatron_psrl.schedule.plan`), for every data-parallel rank an ordered list of micro-batches
(sets of tree tokens), the cached prefix sources between them, and a forward/backward schedule.
The plan is deterministic, so every rank computes the same plan from the same tree (no
communication); with ``local_rank`` a rank plans only its own exchange group in full (the
same group plan, in time independent of the number of groups).

1. **Placement over ranks.** The independent trees of the forest (top-level subtrees) are
   assigned to data-parallel ranks largest-cost-first to the least-loaded rank (LPT), with
   the cost model ``linear * tokens + attention * key_pairs`` (docs/prefix-tree.md). A tree
   larger than one exchange group's fair share is first split between groups, each part
   recomputing the prefix it shares with the others (:mod:`megatron_psrl.schedule.group_split`),
   when the cost model predicts a shorter step.
2. **Micro-batches within a rank.** A tree that fits the token budget is packed whole
   (mechanism 1). A larger tree is handled by one of two mechanisms, chosen per tree by cost:

   - *mechanism 2* (``tree`` mode): its depth-first token stream is cut into budget-sized
     chunks. Because depth-first order puts ancestors first, every chunk's outside ancestors
     lie on the path to its first token, in earlier chunks; those path pieces become cached
     sources (their K/V stay in the KV cache; their gradients are accumulated and injected
     into the producer's backward). Every token is computed exactly once.
   - *duplication* (``tree-dup`` mode, and the fallback when caching is not possible): the
     tree is cut at nodes and every piece carries a copy of its ancestor path as context
     (computed again, claimed once).

   Small trees are then packed first-fit-decreasing into the free space of the micro-batches.
3. **Schedule.** Micro-batches run in depth-first order; one without dependents runs forward
   and backward at once; a producer's backward runs as soon as all micro-batches reading its
   sources have finished theirs.

``none`` mode plans the same way over the unshared tree (one node per sample): the baseline.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_psrl.schedule.check import maybe_check_plan
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.cross_rank import CrossRankHeads, plan_group_cross_rank
from megatron_psrl.schedule.group_split import GroupHeads, TransferCosts, group_heads, split_across_groups
from megatron_psrl.schedule.plan import (
    HeadSend,
    RankPlan,
    StepPlan,
    note_exchange_depths,
    note_reader_depths,
)
from megatron_psrl.schedule.rank_layout import RankHeads, layout_rank, materialize_rank
from megatron_psrl.tree.index import TreeIndex
from megatron_psrl.tree.key_pairs import claimed_tokens
from megatron_psrl.tree.prefix_tree import PrefixTree
from megatron_psrl.tree.unshared import build_unshared_tree


@dataclass
class GroupAssignment:
    """Which exchange group computes which tree (step 1 of the module docstring)."""

    tree: PrefixTree
    """The tree planned: the input tree, the unshared one (``none``), or the input with trees
    split between groups (:mod:`megatron_psrl.schedule.group_split`)."""

    group_of: np.ndarray
    """int64 ``[top-level nodes of tree]``: the group of every tree."""

    unit_cost: np.ndarray
    """float64 ``[top-level nodes of tree]``: every tree's cost (what the groups were balanced on;
    the retries plan with the same cost model), without a head it imports."""

    recomputed: int = 0
    """Tree tokens added by splitting trees between groups that no copy imports."""

    head_sends: List[HeadSend] = field(default_factory=list)
    """Heads of split trees sent between ranks instead of recomputed."""

    rank_of: Optional[np.ndarray] = None
    """int64 ``[top-level nodes]``: the rank in its group of every tree, where trees were split
    down to single ranks of groups that place them whole (the split's balance; a transfer's
    home is its home copy's rank); None: each group places its trees."""


def assign_groups(tree: PrefixTree, config: PlannerConfig) -> GroupAssignment:
    """Trees to exchange groups. Plans made again with another placement or sharing mode (the
    KV-budget fallbacks, decided per group) keep this assignment, so groups deciding
    differently still compute every tree exactly once between them."""
    if config.sharing == "none":
        tree = build_unshared_tree(tree.batch)
    g = config.exchange_group_size
    num_groups = config.data_parallel_size // g
    # Trees too big for one group are split between groups (or, where a group places trees
    # whole on its ranks, between ranks), recomputing or receiving the prefix each part shares.
    bins_per_group = 1 if (config.sharing == "tree" and config.placement != "whole-tree") else g
    if config.split_trees_across_groups and config.sharing != "none" and num_groups * bins_per_group > 1:
        transfer = _transfer_costs(config, bins_per_group) if config.sharing == "tree" else None
        split = split_across_groups(tree, *_node_and_subtree_costs(tree, config.cost_model),
                                    num_groups * bins_per_group, _assign_lpt, transfer, bins_per_group, g)
        if split is not None:
            regrouped = split.tree
            roots = np.flatnonzero(regrouped.node_parent < 0)
            unit_cost = _unit_costs(regrouped, roots, config.cost_model)
            imported = 0
            for t in split.head_sends:
                for j, h in enumerate(t.imports):  # every copy's head is the home rank's work (its export)
                    unit_cost[np.searchsorted(regrouped.node_offset[roots], h.start)] -= transfer.head_cost(h.length)
                    imported += h.length if j else 0
            return GroupAssignment(regrouped, split.bin_of // bins_per_group, unit_cost,
                                   regrouped.num_tree_tokens - tree.num_tree_tokens - imported, split.head_sends,
                                   rank_of=split.bin_of % g if bins_per_group == g > 1 else None)
    unit_cost = _unit_costs(tree, np.flatnonzero(tree.node_parent < 0), config.cost_model)
    return GroupAssignment(tree, _assign_lpt(unit_cost, num_groups), unit_cost)


def _transfer_costs(config: PlannerConfig, bins_per_group: int) -> TransferCosts:
    """The cost model's view of sending a split tree's head (:class:`TransferCosts`)."""
    cost_model = config.cost_model

    def head_cost(n: int) -> float:
        return float(n) if cost_model is None else float(cost_model.cost(n, n * (n + 1) // 2, 0))

    g = config.exchange_group_size
    return TransferCosts(mode=config.cross_group_prefix, max_tokens=config.micro_batch_tokens, head_cost=head_cost,
                         cost_per_token=2 * config.kv_bytes_per_token * config.transfer_cost_per_byte,
                         cost_per_transfer=config.transfer_fixed_cost,
                         ranks_per_copy=g if bins_per_group == 1 else 1)


def plan_step(tree: PrefixTree, config: PlannerConfig, assignment: Optional[GroupAssignment] = None) -> StepPlan:
    """Plan an update step (see the module docstring); checked (:func:`~megatron_psrl.schedule.check.check_plan`)
    when ``PSRL_CHECK_PLANS=1``. ``assignment``: trees already assigned to groups
    (:func:`assign_groups`, default: made from ``config``)."""
    assignment = assignment or assign_groups(tree, config)
    tree, group_of, unit_cost = assignment.tree, assignment.group_of, assignment.unit_cost
    g = config.exchange_group_size
    num_groups = config.data_parallel_size // g
    roots = np.flatnonzero(tree.node_parent < 0)
    local_group = None if config.local_rank is None else config.local_rank // g
    # A local plan reads the per-token arrays of its own group's trees only.
    index = TreeIndex(tree, None if local_group is None else roots[group_of == local_group])
    plan = StepPlan(config=config, tree=tree, index=index, ranks=[], split_tokens_recomputed=assignment.recomputed,
                    planned_groups=None if local_group is None else [local_group], head_sends=assignment.head_sends)
    token_cost = token_cost_function(index, config.cost_model)
    by_group = np.argsort(group_of, kind="stable")  # every group's units, in ascending order
    group_bounds = np.searchsorted(group_of[by_group], np.arange(num_groups + 1))
    for group in range(num_groups):
        members = by_group[group_bounds[group]:group_bounds[group + 1]]
        units, costs = roots[members], unit_cost[members]
        if local_group is not None and group != local_group:
            _add_unplanned_group(plan, group, g, float(costs.sum()))
            continue
        heads = group_heads(plan.head_sends, roots, tree.node_offset, group, g) if plan.head_sends else GroupHeads()
        ranks_of = assignment.rank_of[members] if assignment.rank_of is not None else None
        whole_layouts, whole_costs = _layout_whole_trees(index, units, costs, g, config, heads, plan.head_sends,
                                                         ranks_of)
        whole_span = max(whole_costs)
        cross = None
        if g > 1 and config.sharing == "tree" and config.placement != "whole-tree":
            cross = plan_group_cross_rank(index, units, config.micro_batch_tokens, g, token_cost,
                                          micro_batch_cost=config.cost_per_micro_batch,
                                          heads=_cross_rank_heads(heads, plan.head_sends))
        cross_span = _cross_rank_makespan(cross, token_cost, config) if cross is not None else math.inf
        use_cross = cross is not None and (config.placement == "cross-rank" or cross_span < 0.97 * whole_span)
        ranks = cross if use_cross else _materialize_whole_trees(index, whole_layouts, whole_costs)
        plan.groups += [[group * g + r] for r in range(g)] if not use_cross else [list(range(group * g, group * g + g))]
        plan.placements.append("cross-rank" if use_cross else "whole-tree")
        plan.predicted_makespan.append(cross_span if use_cross else whole_span)
        plan.alternative_makespan.append(whole_span if use_cross else cross_span)
        for r, rank_plan in enumerate(ranks):
            rank_plan.group_rank = r
            rank_plan.planned_cost += _read_cost(rank_plan, config.cost_model)
        plan.ranks += ranks
    for rank_plan in plan.ranks:  # (what a sliding window's cache keeps of each source, and sends)
        note_reader_depths(index, rank_plan)
    for group in plan.groups:
        if len(group) > 1:
            note_exchange_depths(index, [plan.ranks[r] for r in group])
    return maybe_check_plan(plan)


def _read_cost(rank: RankPlan, cost_model: Optional[CostModel]) -> float:
    """What a rank's readers derive from the cached and peer rows they read
    (:meth:`CostModel.read_cost`: latent attention's up-projection; 0 for other models)."""
    if cost_model is None or not cost_model.read_flops_per_token:
        return 0.0
    rows = sum(rank.sources[s].length for mb in rank.micro_batches for s in mb.reads)
    rows += sum(p.length for mb in rank.micro_batches for p in mb.peer_reads)
    return cost_model.read_cost(rows)


def _add_unplanned_group(plan: StepPlan, group: int, g: int, cost: float) -> None:
    """Another rank's group in a local plan: an empty rank plan with an even share of its cost,
    one object for the group's ranks (thousands of groups: nothing runs or reads them)."""
    plan.groups += [[group * g + r] for r in range(g)]
    plan.placements.append("unplanned")
    plan.predicted_makespan.append(cost / g)
    plan.alternative_makespan.append(math.inf)
    plan.ranks += [RankPlan(micro_batches=[], sources={}, schedule=[], planned_cost=cost / g)] * g


def compare_placements(tree, cost_model, ranks: int, micro_batch_tokens: int, group_size: Optional[int] = None,
                       kv_bytes_per_token: float = 0.0) -> Dict[str, dict]:
    """Whole-tree vs cross-rank placement of one batch over ``ranks`` simulated ranks (no
    model): per-rank planned cost, imbalance (max / mean), predicted makespan (cost units),
    micro-batches, bytes exchanged, tokens duplicated, planning time. ``group_size``: ranks per
    exchange group (default: all)."""
    report = {}
    for placement in ("whole-tree", "cross-rank"):
        config = PlannerConfig(micro_batch_tokens=micro_batch_tokens, data_parallel_size=ranks,
                               exchange_group_size=group_size or ranks, placement=placement, cost_model=cost_model,
                               kv_bytes_per_token=kv_bytes_per_token)
        t0 = time.perf_counter()
        plan = plan_step(tree, config)
        seconds = time.perf_counter() - t0
        costs = plan.rank_costs()
        report[placement] = {
            "rank_cost": costs.tolist(),
            "imbalance": plan.imbalance(),
            "makespan": float(max(plan.predicted_makespan)),
            "perfect": float(costs.sum() / len(costs)),
            "micro_batches": plan.num_micro_batches(),
            "exchanged_bytes": plan.exchanged_bytes(kv_bytes_per_token),
            "tokens_duplicated": plan.mechanism_counts()["duplicated_tokens"],
            "plan_seconds": seconds,
        }
    return report


def token_cost_function(index: TreeIndex, cost_model: Optional[CostModel]):
    """Cost of computing given tree tokens once: linear + attention over their keys + the
    logits of claimed tokens (the same cost the whole-tree placement balances)."""
    position = index.position
    claimed = claimed_tokens(index.tree)

    def cost(tokens: np.ndarray) -> np.ndarray:
        if cost_model is None:
            return np.ones(len(tokens))
        return cost_model.cost(1, position[tokens] + 1, claimed[tokens])

    return cost


def _layout_whole_trees(index: TreeIndex, units: np.ndarray, costs: np.ndarray, g: int, config: PlannerConfig,
                        heads: Optional[GroupHeads] = None, head_sends: Sequence[HeadSend] = (),
                        ranks_of: Optional[np.ndarray] = None) -> Tuple[list, List[float]]:
    """Every tree on one rank of the group, LPT by cost (or on ``ranks_of``, where the split of
    trees between ranks placed them): the layout of every rank's micro-batches
    (:func:`layout_rank`) and its planned cost, without building the rank plans (planning
    keeps them only when the group uses them). ``heads``: the group's head sends."""
    heads = heads or GroupHeads()
    exports = [[] for _ in range(g)]
    for t, r in sorted(heads.exports.items()):
        exports[r].append((t, head_sends[t].start, head_sends[t].length))
    export_cost = [float(sum(_head_cost(index, start, length, config) for _, start, length in e)) for e in exports]
    assignment = ranks_of if ranks_of is not None else _assign_lpt(costs, g, initial=export_cost)
    # Duplication (the KV-budget fallback) caches nothing: every copy computes its head itself,
    # but the home rank still sends its heads to the other groups' ranks, and the home copy's
    # micro-batches hold the exported head as context (the export owns it).
    duplicating = config.sharing != "tree"
    layouts, planned = [], []
    for r in range(g):
        mine = units[assignment == r]
        rank_heads = RankHeads(exports=exports[r])
        if duplicating:
            rank_heads.computed_elsewhere = [(start, start + length) for e in exports for _, start, length in e]
            layouts.append(layout_rank(index, mine, config, rank_heads))
            planned.append(float(costs[assignment == r].sum() + config.cost_per_micro_batch * len(layouts[-1][0])
                                 + export_cost[r]))
            continue
        for u in mine.tolist():
            if u in heads.imports:
                t, j = heads.imports[u]
                h = head_sends[t].imports[j]
                if heads.exports.get(t) == r:
                    if j == 0:  # the home copy on the home rank: its head is the export itself
                        rank_heads.local[u] = (t, h.length)
                    continue  # (another copy on the home rank computes its head: no rank imports from itself)
                rank_heads.imports[u] = (t, j, h.length)
        layouts.append(layout_rank(index, mine, config, rank_heads))
        computing = sum(b.role != "import" for b in layouts[-1][0])
        received = sum(_receive_cost(config, length) for _, _, length in rank_heads.imports.values())
        planned.append(float(costs[assignment == r].sum() + config.cost_per_micro_batch * computing
                             + export_cost[r] + received))
    return layouts, planned


def _receive_cost(config: PlannerConfig, length: int) -> float:
    """Cost-model units of receiving a head of ``length`` tokens and returning its gradients
    (the link time; not the wait for the home's forward, which runs at the start of its step)."""
    return config.transfer_fixed_cost + 2 * length * config.kv_bytes_per_token * config.transfer_cost_per_byte


def _head_cost(index: TreeIndex, start: int, length: int, config: PlannerConfig) -> float:
    """Cost of computing a copy's head (the tokens ``start .. start + length - 1``)."""
    tree = index.tree
    if config.cost_model is None:
        return float(length)
    claimed = np.diff(tree.claim_offsets[start:start + length + 1]) > 0
    return float(config.cost_model.cost(length, length * (length + 1) // 2, int(claimed.sum())))


def _cross_rank_heads(heads: GroupHeads, head_sends: Sequence[HeadSend]) -> Optional["CrossRankHeads"]:
    """The group's head sends as the cross-rank planner takes them (None: none)."""
    if not heads.imports and not heads.exports:
        return None
    if any(r != 0 for r in heads.exports.values()):  # (only groups placing trees whole export from other ranks)
        raise AssertionError("a cross-rank group exports heads from its first rank only")
    return CrossRankHeads(
        imports={u: (t, j, head_sends[t].imports[j].length) for u, (t, j) in heads.imports.items()},
        exports=[(t, head_sends[t].start, head_sends[t].length) for t in sorted(heads.exports)])


def _materialize_whole_trees(index: TreeIndex, layouts: list, planned: List[float]) -> List[RankPlan]:
    ranks = []
    for layout, cost in zip(layouts, planned):
        ranks.append(materialize_rank(index, layout))
        ranks[-1].planned_cost = cost
    return ranks


def _cross_rank_makespan(ranks: List[RankPlan], token_cost, config: PlannerConfig) -> float:
    """Predicted time of a cross-rank group in cost units: every step lasts as long as its
    slowest fragment, plus the exposed exchange (forward K/V, their gradients back)."""
    span = 0.0
    for m in range(len(ranks[0].micro_batches)):
        compute = max(float(token_cost(r.micro_batches[m].computed_tokens).sum())
                      + (_receive_cost(config, len(r.micro_batches[m].tokens)) if r.micro_batches[m].role == "import"
                         else 0.0) for r in ranks)
        ex = ranks[0].micro_batches[m].exchange
        moved = 0
        if ex is not None:
            moved = max(sum(len(c) for chains in r.micro_batches[m].exchange.send.values() for c in chains)
                        for r in ranks)
        span += compute + config.cost_per_micro_batch
        if moved or (ex is not None and ex.forward_collective):
            span += 2 * (moved * config.kv_bytes_per_token * config.cost_per_exchanged_byte) + config.cost_per_exchange
    return span


def _node_and_subtree_costs(tree: PrefixTree, cost_model: Optional[CostModel]) -> Tuple[np.ndarray, np.ndarray]:
    if cost_model is None:
        return tree.node_len.astype(np.float64), tree.subtree_tokens().astype(np.float64)
    return cost_model.node_costs(tree), cost_model.subtree_costs(tree)


def _unit_costs(tree: PrefixTree, roots: np.ndarray, cost_model: Optional[CostModel]) -> np.ndarray:
    if cost_model is None:
        return tree.subtree_tokens()[roots].astype(np.float64)
    return cost_model.subtree_costs(tree)[roots]


def _assign_lpt(costs: np.ndarray, num_ranks: int, initial: Optional[Sequence[float]] = None) -> np.ndarray:
    """Longest-processing-time-first assignment of units to ranks (starting from the loads
    ``initial``, default none); deterministic."""
    assignment = np.zeros(len(costs), dtype=np.int64)
    # (load, rank) min-heap: the least-loaded rank, the lowest index among equal loads (as
    # ``np.argmin`` over the loads would pick), in O(log ranks) per unit.
    heap = [(float(initial[r]) if initial is not None else 0.0, r) for r in range(num_ranks)]
    heapq.heapify(heap)
    values = costs.tolist()
    for u in np.argsort(-costs, kind="stable").tolist():
        load, r = heap[0]
        assignment[u] = r
        heapq.heapreplace(heap, (load + values[u], r))
    return assignment
