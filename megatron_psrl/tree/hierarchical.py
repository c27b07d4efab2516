"""Placement across exchange groups: a tree larger than one group's fair share is split.

Trees are balanced whole over the exchange groups (consecutive blocks of data-parallel ranks
that exchange prefix K/V, one node of GPUs typically), and a group splits its trees between
its ranks. A batch that is one giant tree (step-wise trajectories under one system prompt, a
search tree per task) would then keep every other group idle: with groups of 8 on 1,024
GPUs, 128x the balanced step.

Here such a tree is split *between* groups by duplicating its shared prefix: its samples are
partitioned by subtree, and every group that receives a part computes the part's path from
the root itself (recompute instead of transfer). Inside a group the parts it received are one
tree again, shared as usual (whole-tree or cross-rank placement). This stays exact for the
same reason ``--prefix-sharing tree-dup`` is exact: loss claims belong to samples, every
sample lands in exactly one group, so every claim is counted once; a duplicated prefix token
gets, in each group, the gradient of that group's descendants, and the data-parallel gradient
sum adds them.

What it costs is the duplicated prefix: the path from the root down to each split point, once
per extra group that holds a part. The split is taken only where the cost model predicts a
shorter step (the largest group's cost, duplicates included). Sending the prefix K/V between
groups instead (over the inter-node links) is not offered: for the batches agentic RL
produces the shared prefix is a small part of the tree (a 512-token system prompt under
trajectories of 32k-128k tokens), so recomputing it is cheaper than one round trip of its K/V
and their gradients over InfiniBand would be, and it needs no exchange schedule between groups.

    tree (one root, too big for a group)          after the split (2 groups)
        P ── a ── a1                              group 0:  P ── a ── a1
          │     └ a2                                              └ a2
          └ b ── b1                               group 1:  P' ── b ── b1     (P' = P recomputed)
"""

from __future__ import annotations

import heapq
from typing import Callable, List, Optional, Tuple

import numpy as np

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


def regroup_tree(tree: PrefixTree, sample_group: np.ndarray) -> Tuple[PrefixTree, np.ndarray]:
    """The prefix tree in which samples of different groups share nothing: every group gets
    its own copy of the nodes its samples run through (the node structure is kept, so it holds
    for any tree, a route-keyed one included). Returns it and the group of every top-level
    node. Nodes are ordered by group, then in the old preorder (a preorder restricted to a set
    closed under ancestors is a preorder of that set)."""
    m = tree.num_nodes
    parent = tree.node_parent.astype(np.int64)
    # (group, node) keys every group needs: its samples' end nodes and all their ancestors.
    # Level by level from the deepest: the pairs at a level are its end-node pairs and the
    # parents of the pairs one level down, deduplicated there, so every pair is handled once.
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
    keys = _unique(np.concatenate(collected)) if collected else np.zeros(0, np.int64)
    node = keys % m  # old node of every new node
    group = keys // m
    # Most nodes have one copy (only the paths above split points are duplicated): their copy
    # is a table lookup; the few duplicated ones are searched among the sorted keys.
    copies = np.bincount(node, minlength=m)
    copy_of = np.zeros(m, dtype=np.int64)
    copy_of[node] = np.arange(len(keys), dtype=np.int64)

    def new_node(g: np.ndarray, old: np.ndarray) -> np.ndarray:
        out = copy_of[old]
        shared = np.flatnonzero(copies[old] > 1)
        if len(shared):
            out[shared] = np.searchsorted(keys, g[shared] * m + old[shared])
        return out

    new_parent = np.where(parent[node] >= 0, new_node(group, np.maximum(parent[node], 0)), -1)
    lens = tree.node_len[node]
    offset = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(lens, out=offset[1:])
    sample_new = new_node(sample_group.astype(np.int64), tree.sample_node.astype(np.int64))
    # Subtree sizes and sample counts, accumulated from the deepest level up.
    level = level[node]
    size = np.ones(len(keys), dtype=np.int64)
    samples = np.bincount(sample_new, minlength=len(keys)).astype(np.int64)
    for lvl in range(int(level.max(initial=0)), 0, -1):
        at = np.flatnonzero(level == lvl)
        np.add.at(size, new_parent[at], size[at])
        np.add.at(samples, new_parent[at], samples[at])

    token_node = tree.token_node()

    def new_token(g: np.ndarray, old_token: np.ndarray) -> np.ndarray:
        old_node = token_node[old_token]
        copy = new_node(g, old_node)
        return offset[copy] + old_token - tree.node_offset[old_node]

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
        node_subtree_end=np.arange(len(keys), dtype=np.int64) + size,
        node_num_samples=samples,
        sample_node=sample_new.astype(np.int32),
        sample_token_index=sample_token_index.astype(np.int64),
        claim_token=claim_token[order].astype(np.int64, copy=False),
        claim_sample=tree.claim_sample[order],
        claim_flat=tree.claim_flat[order],
        claim_offsets=claim_offsets,
    )
    return regrouped, group[new_parent < 0]


def split_across_groups(tree: PrefixTree, node_cost: np.ndarray, subtree_cost: np.ndarray, num_groups: int,
                        assign: Assign) -> Optional[Tuple[PrefixTree, np.ndarray]]:
    """``(regrouped tree, group of every top-level node)`` when splitting trees across the
    groups shortens the predicted step (module docstring), else None (plan as before)."""
    if num_groups < 2:
        return None
    roots = np.flatnonzero(tree.node_parent < 0)
    whole = subtree_cost[roots]
    if not len(whole) or whole.max() <= whole.sum() / num_groups * 1.0001:
        return None
    units, prefix = split_units(tree, node_cost, subtree_cost, num_groups)
    if len(units) == len(roots):
        return None
    cost = subtree_cost[units] + prefix
    unit_group = assign(cost, num_groups)
    # A group holding several parts of one tree computes the prefix they share once: the
    # prefix charged to each unit over-counts, so the estimate errs on the side of not splitting.
    split_span = _group_loads(cost, unit_group, num_groups).max()
    whole_span = _group_loads(whole, assign(whole, num_groups), num_groups).max()
    if split_span >= SPLIT_GAIN * whole_span:
        return None
    return regroup_tree(tree, sample_groups(tree, units, unit_group))
