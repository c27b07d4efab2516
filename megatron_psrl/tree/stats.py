"""Statistics of a prefix tree: how much an update batch shares, and what it could save.

    stats = tree_stats(build_prefix_tree(batch), CostModel.named("llama3-8b"))  # schedule.cost
    print(stats.ideal_speedup, stats.to_dict())
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np

from megatron_psrl.tree.key_pairs import batch_key_pairs, tree_key_pairs
from megatron_psrl.tree.prefix_tree import PrefixTree, node_level, node_num_children


@dataclass
class TreeStats:
    """Sharing statistics of one batch's prefix tree (all counts exact)."""

    num_samples: int
    """Samples in the batch."""
    tokens_total: int
    """Sum of sample lengths (tokens computed without sharing)."""
    tokens_in_tree: int
    """Tree tokens (tokens computed once each with sharing)."""
    token_dedup_ratio: float
    """tokens_total / tokens_in_tree (1.0: nothing shared)."""
    num_nodes: int
    """Nodes of the compressed tree."""
    num_top_level_nodes: int
    """Independent trees (distinct first tokens)."""
    num_leaf_nodes: int
    """Nodes without children."""
    num_claims: int
    """Loss claims: (token, sample) pairs with loss_mask 1 (the batch's trained tokens)."""
    max_sample_len: int
    """Longest sample."""
    mean_sample_len: float
    """Mean sample length."""
    max_node_depth: int
    """Largest start position of a node (tokens above it on its path)."""
    mean_node_depth: float
    """Mean start position of the nodes."""
    max_node_level: int
    """Most ancestors of a node (path length in nodes, minus one)."""
    mean_node_level: float
    """Mean number of ancestors of the nodes."""
    mean_node_len: float
    """Mean tokens per node."""
    num_branching_nodes: int
    """Nodes with at least one child (inner nodes)."""
    max_branching: int
    """Most children of a node (0 if no node has children)."""
    mean_branching: float
    """Mean children per inner node (0.0 if there is none)."""
    attention_pairs_unshared: int
    """Keys seen by all query tokens without sharing: sum over samples of n (n + 1) / 2."""
    attention_pairs_shared: int
    """Keys seen with the tree: sum over tree tokens of position + 1."""
    cost_model: Optional[dict] = None
    """The cost model used for the fields below (None: they are None too)."""
    flops_unshared: Optional[float] = None
    """Forward + backward FLOPs without sharing."""
    flops_shared: Optional[float] = None
    """Forward + backward FLOPs with the tree."""
    ideal_speedup: Optional[float] = None
    """flops_unshared / flops_shared (docs/prefix-tree.md, "Ideal speedup")."""

    def to_dict(self) -> dict:
        """JSON-ready dict (plain Python numbers)."""
        return asdict(self)


def tree_stats(tree: PrefixTree, cost_model: Optional[Any] = None) -> TreeStats:
    """Statistics of ``tree``; with ``cost_model`` (a :class:`megatron_psrl.schedule.cost.CostModel`,
    taken as it comes: the tree sits below the schedule) also its FLOPs and ideal speedup."""
    batch = tree.batch
    lengths = batch.lengths
    children = node_num_children(tree)
    levels = node_level(tree)
    inner = children > 0
    num_nodes = tree.num_nodes
    empty = num_nodes == 0

    stats = TreeStats(
        num_samples=batch.num_samples,
        tokens_total=batch.num_tokens,
        tokens_in_tree=tree.num_tree_tokens,
        token_dedup_ratio=batch.num_tokens / tree.num_tree_tokens if tree.num_tree_tokens else 1.0,
        num_nodes=num_nodes,
        num_top_level_nodes=int((tree.node_parent < 0).sum()),
        num_leaf_nodes=int((~inner).sum()),
        num_claims=int(tree.claim_token.shape[0]),
        max_sample_len=int(lengths.max()) if lengths.size else 0,
        mean_sample_len=float(lengths.mean()) if lengths.size else 0.0,
        max_node_depth=0 if empty else int(tree.node_depth.max()),
        mean_node_depth=0.0 if empty else float(tree.node_depth.mean()),
        max_node_level=0 if empty else int(levels.max()),
        mean_node_level=0.0 if empty else float(levels.mean()),
        mean_node_len=0.0 if empty else float(tree.node_len.mean()),
        num_branching_nodes=int(inner.sum()),
        max_branching=int(children.max()) if num_nodes else 0,
        mean_branching=float(children[inner].mean()) if inner.any() else 0.0,
        attention_pairs_unshared=batch_key_pairs(batch),
        attention_pairs_shared=tree_key_pairs(tree),
    )
    if cost_model is not None:
        stats.cost_model = cost_model.to_dict()
        stats.flops_unshared = float(cost_model.baseline_cost(batch))
        stats.flops_shared = float(cost_model.tree_cost(tree))
        stats.ideal_speedup = float(cost_model.ideal_speedup(tree))
    return stats


def sample_shared_fraction(tree: PrefixTree) -> np.ndarray:
    """float64 ``[S]``: fraction of every sample's tokens that lie in nodes shared with at
    least one other sample (its redundancy: the part sharing saves)."""
    batch = tree.batch
    shared_token = np.repeat(tree.node_num_samples > 1, tree.node_len)
    per_token = shared_token[tree.sample_token_index]
    shared = np.add.reduceat(per_token, batch.offsets[:-1], dtype=np.int64) if per_token.size else (
        np.zeros(batch.num_samples, dtype=np.int64)
    )
    return shared / np.maximum(batch.lengths, 1)
