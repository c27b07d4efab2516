"""The global prefix tree of an update batch: build, keys, per-token index, statistics, chunks.

This package knows the tree only: how a step is planned over it (cost model, placement,
micro-batches, memory) lives in :mod:`megatron_psrl.schedule`, above it.
"""

from megatron_psrl.tree.build import build_prefix_tree
from megatron_psrl.tree.index import TreeIndex, chain_structure
from megatron_psrl.tree.key_pairs import (
    batch_key_pairs,
    claimed_tokens,
    node_key_pairs,
    tree_key_pairs,
    unshared_key_pairs,
)
from megatron_psrl.tree.prefix_tree import (
    PrefixTree,
    check_tree,
    node_level,
    node_num_children,
    top_level_nodes,
)
from megatron_psrl.tree.stats import TreeStats, sample_shared_fraction, tree_stats

__all__ = [
    "PrefixTree",
    "TreeIndex",
    "TreeStats",
    "batch_key_pairs",
    "build_prefix_tree",
    "chain_structure",
    "check_tree",
    "claimed_tokens",
    "node_key_pairs",
    "node_level",
    "node_num_children",
    "sample_shared_fraction",
    "top_level_nodes",
    "tree_key_pairs",
    "tree_stats",
    "unshared_key_pairs",
]
