"""The global planner: which tree tokens every rank computes, in which micro-batches and order.

Input: the global prefix tree of the update batch. Output: a :class:`StepPlan`
(:mod:`megatron_psrl.tree.plan`), for every data-parallel rank an ordered list of micro-batches
(sets of tree tokens), the cached prefix sources between them, and a forward/backward schedule.
The plan is deterministic, so every rank computes the same plan from the same tree (no
communication); with ``local_rank`` a rank plans only its own exchange group in full (the
same group plan, in time independent of the number of groups).

1. **Placement over ranks.** The independent trees of the forest (top-level subtrees) are
   assigned to data-parallel ranks largest-cost-first to the least-loaded rank (LPT), with
   the cost model ``linear * tokens + attention * key_pairs`` (docs/prefix-tree.md). A tree
   larger than one exchange group's fair share is first split between groups, each part
   recomputing the prefix it shares with the others (:mod:`megatron_psrl.tree.hierarchical`),
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

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import CROSS_GROUP_PREFIX, PLACEMENTS, SHARING_MODES
from megatron_psrl.tree.chunks import chunk_dependencies, split_chains
from megatron_psrl.tree.cost import CostModel, claimed_tokens
from megatron_psrl.tree.cross_rank import CrossRankHeads, plan_group_cross_rank
from megatron_psrl.tree.hierarchical import TransferCosts, split_across_groups
from megatron_psrl.tree.packing import TreeIndex
from megatron_psrl.tree.plan import (
    CachedSource,
    MicroBatchSpec,
    PlanningError,
    PrefixTransfer,
    RankPlan,
    StepPlan,
    build_schedule,
    export_head,
    maybe_check_plan,
)
from megatron_psrl.tree.prefix_tree import PrefixTree
from megatron_psrl.tree.unshared import build_unshared_tree


@dataclass
class PlannerConfig:
    """Knobs of the planner."""

    micro_batch_tokens: int
    """Token budget of one micro-batch (``--micro-batch-tokens``)."""

    data_parallel_size: int = 1
    """Number of data-parallel ranks to spread the trees over."""

    sharing: str = "tree"
    """``tree`` (mechanisms 1 + 2), ``tree-dup`` (mechanism 1, oversized trees split by
    duplicating their prefix) or ``none`` (baseline, no sharing)."""

    cost_model: Optional[CostModel] = None
    """Cost model for balancing and the mechanism choice; None balances by tokens."""

    max_trees_per_micro_batch: Optional[int] = None
    """At most this many small trees packed into one micro-batch (None: as many as fit). With
    ``sharing="none"`` and 1, every sample runs alone (the per-sample reference point)."""

    snap_fraction: float = 0.85
    """Mechanism-2 chunks end at a node boundary instead of mid-node when that keeps them at
    least this full (fewer cached sources)."""

    cut_at_branch_switches: bool = False
    """Mechanism-2 chunks also end wherever the depth-first stream moves on to a sibling
    subtree, so no micro-batch both finishes one branch and starts the next. Such a
    micro-batch reads the first branch's prefixes and produces the second's, so its deferred
    backward would keep the first branch's dK/dV (and K/V) alive while the second runs. Cut
    there, only one chain's prefixes are alive at a time, at the price of more, less full
    micro-batches (small trees fill their free space). The trainer plans with it when the
    default cut does not fit ``--kv-cache-budget``."""

    exchange_group_size: int = 1
    """Ranks that may split one tree between them and exchange its prefix K/V (consecutive
    blocks of ``data_parallel_size``; 1: every tree stays on one rank). Trees are balanced
    whole over the groups; inside a group the placement is chosen per step."""

    placement: str = "auto"
    """Inside an exchange group: ``whole-tree`` (every tree on one rank), ``cross-rank``
    (equal-cost fragments of the depth-first stream in lockstep steps,
    :mod:`megatron_psrl.tree.cross_rank`) or ``auto`` (the smaller predicted makespan)."""

    kv_bytes_per_token: float = 0.0
    """Bytes of one token's K and V over all layers of a rank (what an exchange moves)."""

    cost_per_exchanged_byte: float = 0.0
    """Cost-model units of moving one byte between ranks (link bandwidth against compute)."""

    cost_per_exchange: float = 0.0
    """Cost-model units of one exchange step (per-layer collective latency, summed)."""

    cost_per_micro_batch: float = 0.0
    """Cost-model units of the fixed overhead of one micro-batch (or cross-rank step)."""

    local_rank: Optional[int] = None
    """Plan in full only the exchange group that holds this placement rank (what the rank
    runs); every other group gets empty rank plans carrying its cost from the assignment of
    trees to groups. Planning time then stays that of one group at any cluster size. Each
    group's plan is exactly the one full planning makes (groups are planned independently
    once trees are assigned to them). None: every group (simulations, checks)."""

    split_trees_across_groups: bool = True
    """A tree larger than one exchange group's fair share of the step is split between
    groups when the cost model predicts a shorter step (:mod:`megatron_psrl.tree.hierarchical`);
    False keeps every tree in one group."""

    cross_group_prefix: str = "auto"
    """How the copies of a tree split between groups get the shared head of their path:
    ``recompute`` (each copy computes it), ``transfer`` (the home rank computes it once and
    sends its K/V; every copy that can imports it) or ``auto`` (per copy, the cheaper by the
    cost model). Only with ``sharing="tree"``; the caller passes ``recompute`` where the step
    runner cannot send heads (pipeline stages, MoE models, activation recomputation)."""

    cost_per_transferred_byte: Optional[float] = None
    """Cost-model units of sending one byte of a head between groups (None: the exchange's,
    ``cost_per_exchanged_byte``)."""

    cost_per_transfer: Optional[float] = None
    """Cost-model units of the fixed cost of one head transfer (None: ``cost_per_exchange``)."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ConfigurationError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.data_parallel_size < 1:
            raise ConfigurationError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.sharing not in SHARING_MODES:
            raise ConfigurationError(f"sharing must be one of {SHARING_MODES}, got {self.sharing!r}")
        if not 0.0 < self.snap_fraction <= 1.0:
            raise ValueError(f"snap_fraction must be in (0, 1], got {self.snap_fraction}")
        if self.exchange_group_size < 1 or self.data_parallel_size % self.exchange_group_size:
            raise ConfigurationError(f"exchange_group_size {self.exchange_group_size} must divide the "
                                     f"{self.data_parallel_size} ranks that share the batch")
        if self.local_rank is not None and not 0 <= self.local_rank < self.data_parallel_size:
            raise ConfigurationError(f"local_rank {self.local_rank} is not one of the {self.data_parallel_size} ranks")
        if self.placement not in PLACEMENTS:
            raise ConfigurationError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.cross_group_prefix not in CROSS_GROUP_PREFIX:
            raise ConfigurationError(f"cross_group_prefix must be one of {CROSS_GROUP_PREFIX}, "
                                     f"got {self.cross_group_prefix!r}")

    @property
    def transfer_cost_per_byte(self) -> float:
        """Cost-model units of sending one byte of a head between groups."""
        return self.cost_per_exchanged_byte if self.cost_per_transferred_byte is None else self.cost_per_transferred_byte

    @property
    def transfer_fixed_cost(self) -> float:
        """Cost-model units of the fixed cost of one head transfer."""
        return self.cost_per_exchange if self.cost_per_transfer is None else self.cost_per_transfer


# ====================================================================== entry point
@dataclass
class GroupAssignment:
    """Which exchange group computes which tree (step 1 of the module docstring)."""

    tree: PrefixTree
    """The tree planned: the input tree, the unshared one (``none``), or the input with trees
    split between groups (:mod:`megatron_psrl.tree.hierarchical`)."""

    group_of: np.ndarray
    """int64 ``[top-level nodes of tree]``: the group of every tree."""

    unit_cost: np.ndarray
    """float64 ``[top-level nodes of tree]``: every tree's cost (what the groups were balanced on;
    the retries plan with the same cost model), without a head it imports."""

    recomputed: int = 0
    """Tree tokens added by splitting trees between groups that no copy imports."""

    transfers: List[PrefixTransfer] = field(default_factory=list)
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
            for t in split.transfers:
                for j, h in enumerate(t.imports):  # every copy's head is the home rank's work (its export)
                    unit_cost[np.searchsorted(regrouped.node_offset[roots], h.start)] -= transfer.head_cost(h.length)
                    imported += h.length if j else 0
            return GroupAssignment(regrouped, split.bin_of // bins_per_group, unit_cost,
                                   regrouped.num_tree_tokens - tree.num_tree_tokens - imported, split.transfers,
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


@dataclass
class GroupHeads:
    """The prefix transfers one exchange group takes part in (tree tokens of its copies)."""

    imports: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    """Top-level node of a copy the group holds -> ``(transfer, import)`` of its head."""

    exports: Dict[int, int] = field(default_factory=dict)
    """Transfer -> the group rank that computes and sends its head (the first, or the home
    copy's where the group places trees whole)."""


def group_heads(transfers: List[PrefixTransfer], roots: np.ndarray, node_offset: np.ndarray, group: int,
                group_size: int) -> GroupHeads:
    """What ``group`` sends and receives of the step's transfers."""
    heads = GroupHeads()
    starts = node_offset[roots]
    for t, transfer in enumerate(transfers):
        if transfer.home_rank // group_size == group:
            heads.exports[t] = transfer.home_rank % group_size
        for j, h in enumerate(transfer.imports):
            if h.group == group:
                heads.imports[int(roots[np.searchsorted(starts, h.start)])] = (t, j)
    return heads


def plan_step(tree: PrefixTree, config: PlannerConfig, assignment: Optional[GroupAssignment] = None) -> StepPlan:
    """Plan an update step (see the module docstring); checked (:func:`~megatron_psrl.tree.plan.check_plan`)
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
                    planned_groups=None if local_group is None else [local_group], transfers=assignment.transfers)
    token_cost = token_cost_function(index, config.cost_model)
    by_group = np.argsort(group_of, kind="stable")  # every group's units, in ascending order
    group_bounds = np.searchsorted(group_of[by_group], np.arange(num_groups + 1))
    for group in range(num_groups):
        members = by_group[group_bounds[group]:group_bounds[group + 1]]
        units, costs = roots[members], unit_cost[members]
        if local_group is not None and group != local_group:
            _add_unplanned_group(plan, group, g, float(costs.sum()))
            continue
        heads = group_heads(plan.transfers, roots, tree.node_offset, group, g) if plan.transfers else GroupHeads()
        ranks_of = assignment.rank_of[members] if assignment.rank_of is not None else None
        whole_layouts, whole_costs = _layout_whole_trees(index, units, costs, g, config, heads, plan.transfers,
                                                         ranks_of)
        whole_span = max(whole_costs)
        cross = None
        if g > 1 and config.sharing == "tree" and config.placement != "whole-tree":
            cross = plan_group_cross_rank(index, units, config.micro_batch_tokens, g, token_cost,
                                          micro_batch_cost=config.cost_per_micro_batch,
                                          heads=_cross_rank_heads(heads, plan.transfers))
        cross_span = _cross_rank_makespan(cross, token_cost, config) if cross is not None else math.inf
        use_cross = cross is not None and (config.placement == "cross-rank" or cross_span < 0.97 * whole_span)
        ranks = cross if use_cross else _materialize_whole_trees(index, whole_layouts, whole_costs)
        plan.groups += [[group * g + r] for r in range(g)] if not use_cross else [list(range(group * g, group * g + g))]
        plan.placements.append("cross-rank" if use_cross else "whole-tree")
        plan.predicted_makespan.append(cross_span if use_cross else whole_span)
        plan.alternative_makespan.append(whole_span if use_cross else cross_span)
        for r, rank_plan in enumerate(ranks):
            rank_plan.group_rank = r
        plan.ranks += ranks
    return maybe_check_plan(plan)


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
                        heads: Optional[GroupHeads] = None, transfers: Sequence[PrefixTransfer] = (),
                        ranks_of: Optional[np.ndarray] = None) -> Tuple[list, List[float]]:
    """Every tree on one rank of the group, LPT by cost (or on ``ranks_of``, where the split of
    trees between ranks placed them): the layout of every rank's micro-batches
    (:func:`_layout_rank`) and its planned cost, without building the rank plans (planning
    keeps them only when the group uses them). ``heads``: the group's prefix transfers."""
    heads = heads or GroupHeads()
    exports = [[] for _ in range(g)]
    for t, r in sorted(heads.exports.items()):
        exports[r].append((t, transfers[t].start, transfers[t].length))
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
            layouts.append(_layout_rank(index, mine, config, rank_heads))
            planned.append(float(costs[assignment == r].sum() + config.cost_per_micro_batch * len(layouts[-1][0])
                                 + export_cost[r]))
            continue
        for u in mine.tolist():
            if u in heads.imports:
                t, j = heads.imports[u]
                h = transfers[t].imports[j]
                if heads.exports.get(t) == r:
                    if j == 0:  # the home copy on the home rank: its head is the export itself
                        rank_heads.local[u] = (t, h.length)
                    continue  # (another copy on the home rank computes its head: no rank imports from itself)
                rank_heads.imports[u] = (t, j, h.length)
        layouts.append(_layout_rank(index, mine, config, rank_heads))
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


def _cross_rank_heads(heads: GroupHeads, transfers: Sequence[PrefixTransfer]) -> Optional["CrossRankHeads"]:
    """The group's transfers as the cross-rank planner takes them (None: no transfer)."""
    if not heads.imports and not heads.exports:
        return None
    if any(r != 0 for r in heads.exports.values()):  # (only groups placing trees whole export from other ranks)
        raise AssertionError("a cross-rank group exports heads from its first rank only")
    return CrossRankHeads(
        imports={u: (t, j, transfers[t].imports[j].length) for u, (t, j) in heads.imports.items()},
        exports=[(t, transfers[t].start, transfers[t].length) for t in sorted(heads.exports)])


def _materialize_whole_trees(index: TreeIndex, layouts: list, planned: List[float]) -> List[RankPlan]:
    ranks = []
    for layout, cost in zip(layouts, planned):
        ranks.append(_materialize_rank(index, layout))
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


# ====================================================================== one rank
@dataclass
class _Bin:
    """A micro-batch under construction."""

    ranges: List[Tuple[int, int]] = field(default_factory=list)  # owned tree-token ranges
    context: List[np.ndarray] = field(default_factory=list)  # duplicated tokens (not owned)
    size: int = 0
    small_trees: int = 0  # whole small trees packed in
    role: Optional[str] = None  # "import" (receives heads: ranges not owned) or "export" (computes them)
    heads: List[Tuple[int, int, int, int]] = field(default_factory=list)  # (transfer, import, start, length)


@dataclass
class RankHeads:
    """One rank's part in the group's prefix transfers (:class:`GroupHeads`)."""

    imports: Dict[int, Tuple[int, int, int]] = field(default_factory=dict)
    """Top-level node of a copy on this rank -> ``(transfer, import, head length)`` it receives."""

    local: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    """The home copy on its home rank -> ``(transfer, head length)``: its head is the export."""

    exports: List[Tuple[int, int, int]] = field(default_factory=list)
    """``(transfer, start, length)`` of every head this rank computes and sends."""

    computed_elsewhere: List[Tuple[int, int]] = field(default_factory=list)
    """Token ranges of the group's exported heads that this rank's micro-batches hold as
    context only (duplication, ``tree-dup``: the export computes and owns them)."""


def _layout_rank(index: TreeIndex, units: np.ndarray, config: PlannerConfig, heads: Optional[RankHeads] = None):
    """The micro-batches of one rank as token ranges (bins) and its mechanism-2 streams: all
    the whole-tree placement's predicted cost needs (the number of micro-batches).

    A copy whose head this rank receives (or, on the home rank, exports) is a stream whose
    first chunk is the head, in the import bin (or its export bin): its pieces become sources
    the rest reads."""
    tree = index.tree
    heads = heads or RankHeads()
    budget = config.micro_batch_tokens
    unit_start = tree.node_offset[units]
    unit_end = tree.node_offset[tree.node_subtree_end[units]]
    unit_size = unit_end - unit_start
    bins: List[_Bin] = []
    export_bin: Dict[int, int] = {}
    for t, start, length in heads.exports:  # the exported heads, first-fit into export micro-batches
        target = next((i for i, b in enumerate(bins) if b.size + length <= budget), None)
        if target is None:
            bins.append(_Bin(role="export"))
            target = len(bins) - 1
        bins[target].ranges.append((start, start + length))
        bins[target].size += length
        bins[target].heads.append((t, 0, start, length))
        export_bin[t] = target
    import_bin: Optional[int] = None
    with_head = np.array([int(u) in heads.imports or int(u) in heads.local for u in units], dtype=bool)
    small = (unit_size <= budget) & ~with_head
    streams: List[List[int]] = []  # chunk boundaries of every mechanism-2 stream
    stream_bins: List[List[int]] = []
    for u in np.flatnonzero(~small):
        root = int(units[u])
        a, z = int(unit_start[u]), int(unit_end[u])
        if with_head[u]:
            if root in heads.local:
                t, length = heads.local[root]
                head_bin = export_bin[t]
            else:
                t, j, length = heads.imports[root]
                if import_bin is None:
                    bins.append(_Bin(role="import"))
                    import_bin = len(bins) - 1
                bins[import_bin].ranges.append((a, a + length))
                bins[import_bin].heads.append((t, j, a, length))
                head_bin = import_bin
            bounds = [a] + _stream_chunks(index, a + length, z, budget, config.snap_fraction,
                                          config.cut_at_branch_switches)
            ids = [head_bin]
            for lo, hi in zip(bounds[1:-1], bounds[2:]):
                bins.append(_Bin(ranges=[(lo, hi)], size=hi - lo))
                ids.append(len(bins) - 1)
            streams.append(bounds)
            stream_bins.append(ids)
            continue
        mechanism = _choose_mechanism(index, root, config)
        if mechanism == "stream":
            bounds = _stream_chunks(index, a, z, budget, config.snap_fraction, config.cut_at_branch_switches)
            ids = []
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                bins.append(_Bin(ranges=[(lo, hi)], size=hi - lo))
                ids.append(len(bins) - 1)
            streams.append(bounds)
            stream_bins.append(ids)
        else:
            bins.extend(_duplication_bins(index, root, budget))
    # First-fit decreasing of the small trees into the free space of all micro-batches.
    max_trees = config.max_trees_per_micro_batch or len(units) + 1
    for u in sorted(np.flatnonzero(small), key=lambda u: (-unit_size[u], u)):
        size = int(unit_size[u])
        target = next((b for b in bins if b.role is None and b.size + size <= budget and b.small_trees < max_trees),
                      None)
        if target is None:
            target = _Bin()
            bins.append(target)
        target.ranges.append((int(unit_start[u]), int(unit_end[u])))
        target.size += size
        target.small_trees += 1
    for lo, hi in heads.computed_elsewhere:
        for b in bins:
            if b.role is None:
                _disown(b, lo, hi)
    return bins, streams, stream_bins, bool(heads.computed_elsewhere)


def _disown(b: _Bin, lo: int, hi: int) -> None:
    """Tokens ``lo .. hi - 1`` of the bin's owned ranges become context (computed, owned elsewhere)."""
    kept = []
    for a, z in b.ranges:
        if z <= lo or a >= hi:
            kept.append((a, z))
            continue
        b.context.append(np.arange(max(a, lo), min(z, hi), dtype=np.int64))
        kept += [r for r in ((a, lo), (hi, z)) if r[1] > r[0]]
    b.ranges = kept


def _materialize_rank(index: TreeIndex, layout) -> RankPlan:
    """The rank plan of a layout (:func:`_layout_rank`): specs, cached sources, order, schedule."""
    bins, streams, stream_bins, duplicating = layout
    micro_batches = [_bin_to_spec(i, b) for i, b in enumerate(bins)]
    sources: Dict[int, CachedSource] = {}
    for bounds, ids in zip(streams, stream_bins):
        _link_stream(index, bounds, ids, micro_batches, sources)
    _mark_transfers(bins, micro_batches, sources, predicts_next=not duplicating)
    order = _forward_order(bins)
    micro_batches, sources = _renumber(micro_batches, sources, order)
    exports = [i for i, mb in enumerate(micro_batches) if any(sources[s].exported is not None for s in mb.produces)]
    return RankPlan(micro_batches=micro_batches, sources=sources,
                    schedule=build_schedule(micro_batches, sources, last=exports))


def _mark_transfers(bins: List[_Bin], mbs: List[MicroBatchSpec], sources: Dict[int, CachedSource],
                    predicts_next: bool = True) -> None:
    """Sources of an import bin are imported (each from the head it lies in; an import computes
    no log-prob), and every export bin produces one exported source per head it computes and
    (``predicts_next``, unless its home copy is duplicated) the log-prob of the token after it."""
    for i, b in enumerate(bins):
        if b.role == "import":
            mbs[i].remote_targets = np.zeros(0, np.int64)  # the home copy predicts the token after a head
            for s in mbs[i].produces:
                first = int(sources[s].tokens[0])
                t, j, _, _ = next(h for h in b.heads if h[2] <= first < h[2] + h[3])
                sources[s].imported = (t, j)
        elif b.role == "export":
            for t, _, start, length in b.heads:
                export_head(mbs[i], sources, max(sources, default=-1) + 1, i, t, start, length, predicts_next)


def _bin_to_spec(i: int, b: _Bin) -> MicroBatchSpec:
    owned_tokens = np.concatenate([np.arange(a, z, dtype=np.int64) for a, z in b.ranges]) if b.ranges else np.zeros(0, np.int64)
    if b.role == "import":
        tokens = np.sort(owned_tokens)
        return MicroBatchSpec(index=i, tokens=tokens, owned=np.zeros(len(tokens), bool), role="import")
    if b.context:
        ctx = np.setdiff1d(np.concatenate(b.context), owned_tokens)
        tokens = np.concatenate([owned_tokens, ctx])
        owned = np.concatenate([np.ones(len(owned_tokens), bool), np.zeros(len(ctx), bool)])
        order = np.argsort(tokens, kind="stable")
        return MicroBatchSpec(index=i, tokens=tokens[order], owned=owned[order])
    order = np.argsort(owned_tokens, kind="stable")
    return MicroBatchSpec(index=i, tokens=owned_tokens[order], owned=np.ones(len(owned_tokens), bool))


# ---------------------------------------------------------------------- mechanism choice
def _path_length_max(index: TreeIndex, root: int) -> int:
    """Longest sample through the tree of ``root`` (= deepest position + 1)."""
    tree = index.tree
    end = int(tree.node_subtree_end[root])
    offset = tree.node_offset
    return int((tree.node_depth[root:end] + offset[root + 1:end + 1] - offset[root:end]).max())


def _choose_mechanism(index: TreeIndex, root: int, config: PlannerConfig) -> str:
    """``stream`` (mechanism 2) or ``dup`` (duplicate the prefix) for an oversized tree.

    Mechanism 2 computes every token exactly once; duplication recomputes the ancestor path
    of every piece. So in ``tree`` mode mechanism 2 is always at least as cheap in FLOPs; the
    KV cache manager may still turn a cached prefix into a recomputation when memory is short.
    """
    longest = _path_length_max(index, root)
    if config.sharing == "none":
        raise PlanningError(
            f"a sample of {longest} tokens does not fit --micro-batch-tokens {config.micro_batch_tokens} "
            "(without prefix sharing every sample must fit one micro-batch)"
        )
    if config.sharing == "tree-dup":
        if longest > config.micro_batch_tokens:
            raise PlanningError(
                f"a sample of {longest} tokens does not fit --micro-batch-tokens {config.micro_batch_tokens}; "
                "mechanism 1 alone cannot split a sample (use --prefix-sharing tree)"
            )
        return "dup"
    return "stream"


# ---------------------------------------------------------------------- mechanism 2: streams
def _stream_chunks(index: TreeIndex, start: int, end: int, budget: int, snap: float,
                   branch_switch_cuts: bool = False) -> List[int]:
    """Chunk boundaries of the depth-first token range [start, end): at most ``budget`` tokens
    each, ending at a node boundary when one keeps the chunk >= ``snap * budget`` full, and
    (``branch_switch_cuts``) at every node that does not continue the node before it."""
    tree = index.tree
    node_starts = tree.node_offset[:-1]
    lo_node = np.searchsorted(node_starts, start)
    hi_node = np.searchsorted(node_starts, end)
    boundaries = node_starts[lo_node:hi_node]
    switches = np.zeros(0, dtype=node_starts.dtype)
    if branch_switch_cuts:
        nodes = np.arange(lo_node, hi_node)
        # nodes are numbered in depth-first order: node n continues the stream's branch when
        # its parent is node n - 1; otherwise it starts a sibling subtree
        switches = node_starts[nodes[(nodes > lo_node) & (tree.node_parent[nodes] != nodes - 1)]]
    bounds = [start]
    while True:
        a = bounds[-1]
        j = np.searchsorted(switches, a, side="right")
        if j < len(switches) and switches[j] - a <= budget:
            bounds.append(int(switches[j]))
            continue
        if end - a <= budget:
            break
        limit = a + budget
        i = np.searchsorted(boundaries, limit, side="right") - 1
        cut = int(boundaries[i]) if i >= 0 and boundaries[i] > a and boundaries[i] - a >= snap * budget else limit
        bounds.append(cut)
    bounds.append(end)
    return bounds


def _ancestor_path(index: TreeIndex, token: int) -> np.ndarray:
    """Tree tokens on the path from the root to ``token`` (inclusive), ascending."""
    tree = index.tree
    m = int(index.token_node[token])
    pieces = [np.arange(tree.node_offset[m], token + 1, dtype=np.int64)]
    m = int(tree.node_parent[m])
    while m >= 0:
        pieces.append(np.arange(tree.node_offset[m], tree.node_offset[m + 1], dtype=np.int64))
        m = int(tree.node_parent[m])
    return np.concatenate(pieces[::-1])


def _link_stream(
    index: TreeIndex, bounds: List[int], bin_ids: List[int], mbs: List[MicroBatchSpec], sources: Dict[int, CachedSource]
) -> None:
    """Create the cached sources of a chunked tree and record reads / remote targets."""
    n = len(bounds) - 1
    deps = chunk_dependencies(index, [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])])
    for j in range(n):
        mb = mbs[bin_ids[j]]
        if j in deps.remote:
            mb.remote_targets = np.concatenate([mb.remote_targets, deps.remote[j]])
        if j not in deps.needed:
            continue
        for piece in split_chains(index, deps.needed[j], deps.attach[j]):
            sid = len(sources)
            src = CachedSource(source_id=sid, producer=bin_ids[j], tokens=piece)
            last = src.last_token
            # Consumers: chunks whose first token descends from the piece's last token.
            firsts = np.asarray(bounds[j + 1 : n], dtype=np.int64)
            hit = (firsts > last) & (firsts < index.subtree_end[last])
            src.consumers = [bin_ids[j + 1 + k] for k in np.flatnonzero(hit)]
            sources[sid] = src
            mb.produces.append(sid)
            for c in src.consumers:
                mbs[c].reads.append(sid)


# ---------------------------------------------------------------------- duplication
def _duplication_bins(index: TreeIndex, root: int, budget: int) -> List[_Bin]:
    """Cut a tree at nodes; every piece carries its ancestor path as duplicated context."""
    tree = index.tree
    sub_tokens = tree.subtree_tokens()
    children = _children_lists(tree)
    pieces: List[Tuple[List[Tuple[int, int]], np.ndarray]] = []

    def place(m: int, s: int, context: np.ndarray) -> None:
        avail = budget - len(context)
        start = int(tree.node_offset[m]) + s
        end = int(tree.node_offset[tree.node_subtree_end[m]])
        if end - start <= avail:
            pieces.append(([(start, end)], context))
            return
        if avail <= 0:
            raise PlanningError(f"a path of {len(context)} tokens does not fit --micro-batch-tokens {budget}")
        node_end = int(tree.node_offset[m + 1])
        if node_end - start > avail:  # a node longer than the room: chunk it
            pieces.append(([(start, start + avail)], context))
            place(m, s + avail, np.concatenate([context, np.arange(start, start + avail)]))
            return
        room = avail - (node_end - start)
        ranges = [(start, node_end)]
        rest = []
        for c in sorted(children[m], key=lambda c: (-sub_tokens[c], c)):
            size = int(sub_tokens[c])
            if size <= room:
                ranges.append((int(tree.node_offset[c]), int(tree.node_offset[c]) + size))
                room -= size
            else:
                rest.append(c)
        pieces.append((ranges, context))
        inner = np.concatenate([context, np.arange(start, node_end)])
        for c in sorted(rest):
            place(c, 0, inner)

    place(root, 0, np.zeros(0, np.int64))
    # Next-fit in depth-first order: neighbouring pieces share most of their context.
    bins: List[_Bin] = []
    for ranges, context in pieces:
        owned = sum(b - a for a, b in ranges)
        cur = bins[-1] if bins else None
        if cur is not None:
            have = np.concatenate([np.arange(a, b) for a, b in cur.ranges] + cur.context)
            extra_ctx = len(np.setdiff1d(context, have))
            if cur.size + owned + extra_ctx <= budget:
                cur.ranges.extend(ranges)
                cur.context.append(context)
                cur.size += owned + extra_ctx
                continue
        bins.append(_Bin(ranges=list(ranges), context=[context], size=owned + len(context)))
    return bins


def _children_lists(tree: PrefixTree) -> List[List[int]]:
    cache = tree.__dict__.get("_children_cache")
    if cache is None:
        cache = [[] for _ in range(tree.num_nodes)]
        for c in np.flatnonzero(tree.node_parent >= 0):
            cache[int(tree.node_parent[c])].append(int(c))
        tree.__dict__["_children_cache"] = cache
    return cache


# ---------------------------------------------------------------------- order and schedule
def _forward_order(bins: List[_Bin]) -> List[int]:
    """Depth-first order of the micro-batches' primary content (a chunk, or the first tree
    packed), so producers come before readers; small trees added later do not reorder.
    Exported heads first (other ranks wait for them), an import before the heads it receives."""
    def key(i: int):
        b = bins[i]
        first = min(a for a, _ in b.ranges) if b.role == "import" else (b.ranges[0][0] if b.ranges else math.inf)
        return (b.role != "export", first, i)

    return sorted(range(len(bins)), key=key)


def _renumber(mbs, sources, order):
    new_of = {old: new for new, old in enumerate(order)}
    out = []
    for new, old in enumerate(order):
        mb = mbs[old]
        mb.index = new
        out.append(mb)
    for src in sources.values():
        src.producer = new_of[src.producer]
        src.consumers = sorted(new_of[c] for c in src.consumers)
    for mb in out:
        mb.reads = sorted(mb.reads, key=lambda s: sources[s].last_token)
    return out, sources
