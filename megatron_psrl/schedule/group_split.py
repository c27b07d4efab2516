"""Placement across exchange groups: a tree larger than one group's fair share is split.

Trees are balanced whole over the exchange groups (consecutive blocks of data-parallel ranks
that exchange prefix K/V, one node of GPUs typically), and a group splits its trees between
its ranks. A batch that is one giant tree (step-wise trajectories under one system prompt, a
search tree per task) would then keep every other group idle: with groups of 8 on 1,024
GPUs, 128x the balanced step.

Here such a tree is split *between* groups: its samples are partitioned by subtree, and every
group that receives a part holds a copy of the part's path from the root. Inside a group the
parts it received are one tree again, shared as usual (whole-tree or cross-rank placement).
The shared path above the split points reaches each copy in one of two ways, chosen per copy
by the cost model (:func:`plan_transfers`):

- *recompute*: the copy computes it. Exact for the same reason ``--prefix-sharing tree-dup``
  is: loss claims belong to samples, every sample lands in exactly one group, so every claim
  is counted once; a duplicated prefix token gets, in each group, the gradient of that
  group's descendants, and the data-parallel gradient sum adds them.
- *transfer*: the first copy's group computes the head of the path once (its first rank, the
  *home*), and sends its K/V to the ranks that read another copy's head
  (:class:`~megatron_psrl.schedule.plan.HeadSend`); their dK/dV come back before the home's
  backward. The copy's loss claims on its head (and on the token after it, which its
  predecessor's hidden state predicts) move to the home copy's same tokens: the same tokens
  after the same prefix, so the same log-probs; each claim keeps its sample's advantage and
  weight. Sending costs the head's K/V and their gradients over the link between groups, times
  the ranks it goes to; recomputing costs the head's forward and backward in every copy.

    tree (one root, too big for a group)          after the split (2 groups)
        P ── a ── a1                              group 0:  P ── a ── a1
          │     └ a2                                              └ a2
          └ b ── b1                               group 1:  P' ── b ── b1
                                                  recompute: P' computed again in group 1;
                                                  transfer: P's K/V sent to group 1, dK/dV back

The split is taken only where the cost model predicts a shorter step (the largest group's
cost, recomputed or transferred prefixes included).
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from megatron_psrl.schedule.plan import HeadImport, HeadSend, token_aliases
from megatron_psrl.tree.prefix_tree import PrefixTree, node_level

Assign = Callable[[np.ndarray, int], np.ndarray]
"""Units' costs and a number of bins -> the bin of every unit (the planner's LPT)."""

SPLIT_GAIN = 0.97
"""Split only when the largest group's predicted cost falls below this fraction of the
unsplit one (noise in the cost model should not reshuffle a batch for a 1% gain)."""


def _unique(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values of an int64 array (``np.unique``, by sorting: numpy 2.4's hashing
    ``np.unique`` is ~20x slower on the hundreds of thousands of keys regrouping makes)."""
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if len(x) else x


def _group_loads(costs: np.ndarray, assignment: np.ndarray, num_groups: int) -> np.ndarray:
    return np.bincount(assignment, weights=costs, minlength=num_groups)


def split_units(tree: PrefixTree, node_cost: np.ndarray, subtree_cost: np.ndarray, num_groups: int,
                max_units: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Units of placement over ``num_groups`` groups: ``(nodes, prefix_cost)``, by node.

    Starts from the top-level nodes (whole trees) and, while the costliest unit exceeds a
    group's fair share, replaces it by its children's subtrees, each charged the cost of the
    path above it (``prefix_cost``, recomputed in the group that gets it). A unit without
    children (one long chain) stays whole. At most ``max_units`` units (default 4 per group).
    """
    roots = np.flatnonzero(tree.node_parent < 0)
    share = float(subtree_cost[roots].sum()) / max(num_groups, 1)
    max_units = max_units or 4 * num_groups
    heap = [(-float(subtree_cost[n]), int(n), 0.0) for n in roots]
    heapq.heapify(heap)
    final: List[Tuple[int, float]] = []
    while heap and len(heap) + len(final) < max_units:
        neg, node, prefix = heap[0]
        if -neg <= share * 1.0001:
            break
        heapq.heappop(heap)
        inside = np.arange(node + 1, tree.node_subtree_end[node])
        kids = inside[tree.node_parent[inside] == node]
        if not len(kids):
            final.append((node, prefix))
            continue
        below = prefix + float(node_cost[node])
        for kid in kids.tolist():
            heapq.heappush(heap, (-(float(subtree_cost[kid]) + below), kid, below))
    units = sorted(final + [(node, prefix) for _, node, prefix in heap])
    return (np.array([u[0] for u in units], dtype=np.int64), np.array([u[1] for u in units], dtype=np.float64))


def sample_groups(tree: PrefixTree, units: np.ndarray, unit_group: np.ndarray) -> np.ndarray:
    """int64 ``[S]``: the group of every sample: that of the unit its path runs through; a
    sample that ends above every unit (at a split node) goes with the first unit below it."""
    num_nodes = tree.num_nodes
    parent = tree.node_parent.astype(np.int64)
    group = np.full(num_nodes, -1, dtype=np.int64)
    group[units] = unit_group
    level = node_level(tree)
    by_level = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[by_level], np.arange(int(level.max(initial=0)) + 2))
    # Top-down: a node below a unit inherits the unit's group.
    for lvl in range(1, len(bounds) - 1):
        nodes = by_level[bounds[lvl]:bounds[lvl + 1]]
        nodes = nodes[group[nodes] < 0]
        group[nodes] = group[parent[nodes]]
    # Bottom-up, for split nodes above the units: the first child's (node + 1 in preorder).
    for lvl in range(len(bounds) - 3, -1, -1):
        nodes = by_level[bounds[lvl]:bounds[lvl + 1]]
        nodes = nodes[(group[nodes] < 0) & (nodes + 1 < num_nodes)]
        first_child = nodes + 1
        nodes = nodes[parent[first_child] == nodes]
        group[nodes] = group[nodes + 1]
    return group[tree.sample_node]


def regroup_tree(tree: PrefixTree, sample_group: np.ndarray, with_origin: bool = False):
    """The prefix tree in which samples of different groups share nothing: every group gets
    its own copy of the nodes its samples run through (the node structure is kept, so it holds
    for any tree, a route-keyed one included). Returns it and the group of every top-level
    node (and, ``with_origin``, the old tree token of every new one). Nodes are ordered by
    group, then in the old preorder (a preorder restricted to a set closed under ancestors is
    a preorder of that set)."""
    parent = tree.node_parent.astype(np.int64)
    copies = _NodeCopies(tree, _group_node_keys(tree, sample_group))
    node, group = copies.node, copies.group
    new_parent = np.where(parent[node] >= 0, copies.new_node(group, np.maximum(parent[node], 0)), -1)
    lens = tree.node_len[node]
    offset = np.zeros(len(node) + 1, dtype=np.int64)
    np.cumsum(lens, out=offset[1:])
    sample_new = copies.new_node(sample_group.astype(np.int64), tree.sample_node.astype(np.int64))
    size, samples = _subtree_sizes(node_level(tree)[node], new_parent, sample_new)
    token_node = tree.token_node()

    def new_token(g: np.ndarray, old_token: np.ndarray) -> np.ndarray:
        old_node = token_node[old_token]
        return offset[copies.new_node(g, old_node)] + old_token - tree.node_offset[old_node]

    batch = tree.batch
    sample_token_index = tree.sample_token_index
    if len(sample_token_index):
        sample_of_flat = np.repeat(np.arange(len(sample_group)), np.diff(batch.offsets))
        sample_token_index = new_token(sample_group[sample_of_flat].astype(np.int64), sample_token_index)
    claim_token = new_token(sample_group[tree.claim_sample].astype(np.int64), tree.claim_token)
    # Claims stay sorted by tree token, then sample: the claims of one new token all come from one
    # old token, where they were in sample order already, and a stable sort keeps it (a lexsort
    # over millions of claims costs seconds).
    order = np.argsort(claim_token, kind="stable")
    claim_offsets = np.zeros(int(offset[-1]) + 1, dtype=np.int64)
    np.cumsum(np.bincount(claim_token, minlength=int(offset[-1])), out=claim_offsets[1:])
    old_tokens = np.repeat(tree.node_offset[node] - offset[:-1], lens) + np.arange(int(offset[-1]), dtype=np.int64)
    regrouped = PrefixTree(
        batch=batch,
        tokens=tree.tokens[old_tokens],
        node_offset=offset,
        node_parent=new_parent.astype(np.int32),
        node_depth=tree.node_depth[node].astype(np.int64),
        node_subtree_end=np.arange(len(node), dtype=np.int64) + size,
        node_num_samples=samples,
        sample_node=sample_new.astype(np.int32),
        sample_token_index=sample_token_index.astype(np.int64),
        claim_token=claim_token[order].astype(np.int64, copy=False),
        claim_sample=tree.claim_sample[order],
        claim_flat=tree.claim_flat[order],
        claim_offsets=claim_offsets,
    )
    if with_origin:
        return regrouped, group[new_parent < 0], old_tokens
    return regrouped, group[new_parent < 0]


def _group_node_keys(tree: PrefixTree, sample_group: np.ndarray) -> np.ndarray:
    """Sorted ``group * M + node`` keys every group needs: its samples' end nodes and all their
    ancestors. Level by level from the deepest: the pairs at a level are its end-node pairs and
    the parents of the pairs one level down, deduplicated there, so every pair is handled once."""
    m = tree.num_nodes
    parent = tree.node_parent.astype(np.int64)
    level = node_level(tree)
    ends = _unique(sample_group.astype(np.int64) * m + tree.sample_node)
    end_level = level[ends % m]
    order = np.argsort(end_level, kind="stable")
    ends, end_level = ends[order], end_level[order]
    bounds = np.searchsorted(end_level, np.arange(int(level.max(initial=0)) + 2))
    collected, lifted = [], np.zeros(0, np.int64)
    for lvl in range(len(bounds) - 2, -1, -1):
        here = _unique(np.concatenate([ends[bounds[lvl]:bounds[lvl + 1]], lifted]))
        collected.append(here)
        if lvl:
            lifted = here // m * m + parent[here % m]
    return _unique(np.concatenate(collected)) if collected else np.zeros(0, np.int64)


class _NodeCopies:
    """The new nodes of a regrouped tree (one per ``(group, old node)`` key) and the copy a
    group's sample or node maps to. Most nodes have one copy (only the paths above split points
    are duplicated): their copy is a table lookup; the few duplicated ones are searched among
    the sorted keys."""

    def __init__(self, tree: PrefixTree, keys: np.ndarray):
        self.m, self.keys = tree.num_nodes, keys
        self.node = keys % self.m  # old node of every new node
        self.group = keys // self.m
        self.copies = np.bincount(self.node, minlength=self.m)
        self.copy_of = np.zeros(self.m, dtype=np.int64)
        self.copy_of[self.node] = np.arange(len(keys), dtype=np.int64)

    def new_node(self, g: np.ndarray, old: np.ndarray) -> np.ndarray:
        out = self.copy_of[old]
        shared = np.flatnonzero(self.copies[old] > 1)
        if len(shared):
            out[shared] = np.searchsorted(self.keys, g[shared] * self.m + old[shared])
        return out


def _subtree_sizes(level: np.ndarray, new_parent: np.ndarray, sample_new: np.ndarray):
    """``(nodes in every subtree, samples through every node)`` of the new tree, accumulated
    from the deepest level up (``level``: every new node's level)."""
    n = len(level)
    size = np.ones(n, dtype=np.int64)
    samples = np.bincount(sample_new, minlength=n).astype(np.int64)
    for lvl in range(int(level.max(initial=0)), 0, -1):
        at = np.flatnonzero(level == lvl)
        np.add.at(size, new_parent[at], size[at])
        np.add.at(samples, new_parent[at], samples[at])
    return size, samples


@dataclass
class TransferCosts:
    """What the choice between sending and recomputing a split tree's shared head weighs."""

    mode: str
    """``auto`` (per copy, the cheaper), ``transfer`` (every copy that can) or ``recompute``."""

    max_tokens: int
    """Longest head sent (the micro-batch budget: the home computes it in one micro-batch)."""

    head_cost: Callable[[int], float]
    """Cost of computing a root path's first n tokens (forward and backward)."""

    cost_per_token: float = 0.0
    """Cost of sending one token's K/V (all layers) to one rank and its dK/dV back."""

    cost_per_transfer: float = 0.0
    """Fixed cost of one transfer (latency of the sends and receives)."""

    ranks_per_copy: int = 1
    """Ranks of a copy's group that read its head (the group size when its ranks may split
    the copy between them, else 1): the home sends the head to each."""

    def cheaper(self, length: int, fan_out: int) -> bool:
        """Sending a head of ``length`` tokens to ``fan_out`` ranks costs less than recomputing it
        (``auto`` without a link cost, which only a measurement gives: recompute).

        What each side costs the step's critical path: the home's link sends the head to every
        importing rank in turn, so the last one waits for all of them; recomputing costs each
        rank of a copy its share of the head (the copy's ranks split it between them)."""
        if self.mode != "auto":
            return self.mode == "transfer"
        if self.cost_per_token <= 0 and self.cost_per_transfer <= 0:
            return False
        send = self.cost_per_transfer + self.cost_per_token * length * fan_out
        return send < self.head_cost(length) / self.ranks_per_copy


def _unbranched_chain(tree: PrefixTree, root: int) -> int:
    """Tokens of the chain from top-level node ``root`` down to its first branch point (or leaf),
    inclusive: nodes with a single child follow each other in preorder."""
    n = root
    end = int(tree.node_subtree_end[root])
    while n + 1 < end and int(tree.node_subtree_end[n + 1]) == end:  # node n + 1 is n's only child
        n += 1
    return int(tree.node_offset[n + 1] - tree.node_offset[root])


def plan_transfers(regrouped: PrefixTree, origin: np.ndarray, root_bin: np.ndarray, bins_per_group: int,
                   group_size: int, costs: TransferCosts) -> List[HeadSend]:
    """The heads sent between the copies of every split tree (module docstring), per copy the
    cheaper of sending and recomputing.

    ``origin``: the old tree token of every regrouped token; ``root_bin``: the bin of every
    top-level node, ``bins_per_group`` to a group (one per rank where groups place trees whole,
    each copy then on the rank of its bin). The home copy is the first copy of each tree; the
    export is computed by its rank, or by its group's first rank where the group may split
    trees between its ranks. A copy can import
    the part of its unbranched root chain that the home copy's holds too, but for the last
    token of that common chain: the token after the head must be in the home copy (its claims
    move there). Heads are at most ``costs.max_tokens`` long."""
    if costs.mode == "recompute":
        return []
    root_group = root_bin // bins_per_group
    roots = np.flatnonzero(regrouped.node_parent < 0)
    starts = regrouped.node_offset[roots]
    first_old = origin[starts]  # copies of one tree start at the same old token
    order = np.lexsort((np.arange(len(roots)), first_old))
    head_sends: List[HeadSend] = []
    bounds = np.flatnonzero(np.diff(first_old[order])) + 1
    for members in np.split(order, bounds):
        if len(members) < 2:
            continue
        home = int(members[0])  # the lowest group (roots are ordered by group)
        h_start = int(starts[home])
        h_chain = _unbranched_chain(regrouped, int(roots[home]))
        candidates = []
        for c in members[1:].tolist():
            c_start = int(starts[c])
            chain = min(_unbranched_chain(regrouped, int(roots[c])), h_chain)
            same = origin[c_start:c_start + chain] == origin[h_start:h_start + chain]
            common = int(np.argmin(same)) if not same.all() else chain
            length = min(common - 1, costs.max_tokens)
            if length >= 1:
                candidates.append((length, c_start, int(root_group[c])))
        candidates.sort(key=lambda x: (-x[0], x[1]))
        # The home sends to every importing rank: the longest heads gain the most from sending,
        # so take the most copies whose shortest head is still cheaper to send at that fan-out.
        home_group = int(root_group[home])
        chosen = 0
        for n in range(len(candidates), 0, -1):
            fan_out = n * costs.ranks_per_copy + (costs.ranks_per_copy - 1)  # (+ the home copy's other ranks)
            if costs.cheaper(candidates[n - 1][0], fan_out):
                chosen = n
                break
        if not chosen:
            continue
        picked = candidates[:chosen]
        length = max(x[0] for x in picked)
        imports = [HeadImport(group=home_group, start=h_start, length=length)]
        imports += [HeadImport(group=g, start=start, length=k) for k, start, g in sorted(picked, key=lambda x: x[1])]
        home_rank = int(root_bin[home]) if bins_per_group == group_size else home_group * group_size
        head_sends.append(HeadSend(home_rank=home_rank, start=h_start, length=length,
                                        imports=imports))
    return head_sends


def move_head_claims(tree: PrefixTree, head_sends: List[HeadSend]) -> PrefixTree:
    """``tree`` with the loss claims of every importing copy's head (and of the token after it)
    moved to the home copy's same tokens (:class:`~megatron_psrl.schedule.plan.HeadSend`);
    claims stay sorted by tree token, then sample."""
    copy_tokens, home_tokens = token_aliases(head_sends)
    if not len(copy_tokens):
        return tree
    target = np.arange(tree.num_tree_tokens, dtype=np.int64)
    target[copy_tokens] = home_tokens
    claim_token = target[tree.claim_token]
    moved = np.flatnonzero(claim_token != tree.claim_token)
    if not len(moved):
        return tree
    # Only the home tokens' claims change order: sort those by (token, sample), keep the rest.
    order = np.argsort(claim_token, kind="stable")
    touched = np.isin(claim_token[order], home_tokens)
    idx = order[touched]
    order[touched] = idx[np.lexsort((tree.claim_sample[idx], claim_token[idx]))]
    claim_offsets = np.zeros(tree.num_tree_tokens + 1, dtype=np.int64)
    np.cumsum(np.bincount(claim_token, minlength=tree.num_tree_tokens), out=claim_offsets[1:])
    return dataclasses.replace(tree, claim_token=claim_token[order], claim_sample=tree.claim_sample[order],
                               claim_flat=tree.claim_flat[order], claim_offsets=claim_offsets)


@dataclass
class GroupSplit:
    """A forest with its trees split between groups (:func:`split_across_groups`)."""

    tree: PrefixTree
    """The regrouped tree (claims of imported heads moved to their home copies)."""

    bin_of: np.ndarray
    """int64 ``[top-level nodes]``: the bin (group, or rank where groups place trees whole) of every tree."""

    head_sends: List[HeadSend]
    """Heads sent instead of recomputed."""


def split_across_groups(tree: PrefixTree, node_cost: np.ndarray, subtree_cost: np.ndarray, num_groups: int,
                        assign: Assign, transfer: Optional[TransferCosts] = None,
                        bins_per_group: int = 1, group_size: int = 1) -> Optional[GroupSplit]:
    """The forest with trees split across ``num_groups`` bins when that shortens the predicted
    step (module docstring), else None (plan as before). ``transfer``: may a copy receive its
    head instead of recomputing it (None: always recompute); bins are ``bins_per_group`` to a
    group of ``group_size`` ranks."""
    if num_groups < 2:
        return None
    roots = np.flatnonzero(tree.node_parent < 0)
    whole = subtree_cost[roots]
    if not len(whole) or whole.max() <= whole.sum() / num_groups * 1.0001:
        return None
    units, prefix = split_units(tree, node_cost, subtree_cost, num_groups)
    if len(units) == len(roots):
        return None
    if transfer is not None and transfer.mode != "recompute":
        prefix = _cheaper_prefix_costs(tree, units, prefix, transfer)
    cost = subtree_cost[units] + prefix
    unit_group = assign(cost, num_groups)
    # A group holding several parts of one tree computes the prefix they share once: the
    # prefix charged to each unit over-counts, so the estimate errs on the side of not splitting.
    split_span = _group_loads(cost, unit_group, num_groups).max()
    whole_span = _group_loads(whole, assign(whole, num_groups), num_groups).max()
    if split_span >= SPLIT_GAIN * whole_span:
        return None
    regrouped, bin_of, origin = regroup_tree(tree, sample_groups(tree, units, unit_group), with_origin=True)
    head_sends = []
    if transfer is not None:
        head_sends = plan_transfers(regrouped, origin, bin_of, bins_per_group, group_size, transfer)
        regrouped = move_head_claims(regrouped, head_sends)
    return GroupSplit(regrouped, bin_of, head_sends)


def _cheaper_prefix_costs(tree: PrefixTree, units: np.ndarray, prefix: np.ndarray,
                          transfer: TransferCosts) -> np.ndarray:
    """Every unit's path cost, with its head (up to ``transfer.max_tokens`` tokens, all of the
    path but its last token) sent instead of recomputed where that is cheaper, the home
    sending to every other unit of the tree's ranks (an estimate: :func:`plan_transfers`
    decides per copy once the units are placed)."""
    depth = tree.node_depth[units].astype(np.int64)  # tokens on the path above the unit
    _, tree_of, per_tree = np.unique(_top_level_of(tree, units), return_inverse=True, return_counts=True)
    copies = per_tree[tree_of]
    out = prefix.copy()
    for u in range(len(units)):
        head = int(min(depth[u] - 1, transfer.max_tokens))
        if head < 1:
            continue
        fan_out = int(copies[u]) * transfer.ranks_per_copy
        if transfer.cheaper(head, fan_out):
            send = transfer.cost_per_transfer + transfer.cost_per_token * head * fan_out
            out[u] = max(prefix[u] - transfer.head_cost(head), 0.0) + send
    return out


def _top_level_of(tree: PrefixTree, nodes: np.ndarray) -> np.ndarray:
    """The top-level node (tree root) above every node: the last root at or before it in preorder."""
    roots = np.flatnonzero(tree.node_parent < 0)
    return roots[np.searchsorted(roots, nodes, side="right") - 1]


@dataclass
class GroupHeads:
    """The head sends one exchange group takes part in (tree tokens of its copies)."""

    imports: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    """Top-level node of a copy the group holds -> ``(transfer, import)`` of its head."""

    exports: Dict[int, int] = field(default_factory=dict)
    """Transfer -> the group rank that computes and sends its head (the first, or the home
    copy's where the group places trees whole)."""


def group_heads(head_sends: List[HeadSend], roots: np.ndarray, node_offset: np.ndarray, group: int,
                group_size: int) -> GroupHeads:
    """What ``group`` sends and receives of the step's head sends."""
    heads = GroupHeads()
    starts = node_offset[roots]
    for t, transfer in enumerate(head_sends):
        if transfer.home_rank // group_size == group:
            heads.exports[t] = transfer.home_rank % group_size
        for j, h in enumerate(transfer.imports):
            if h.group == group:
                heads.imports[int(roots[np.searchsorted(starts, h.start)])] = (t, j)
    return heads
