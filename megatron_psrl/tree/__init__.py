"""The global prefix tree of an update batch, its statistics and the cost model."""

from megatron_psrl.tree.build import build_prefix_tree
from megatron_psrl.tree.cost import (
    NAMED_MODEL_DIMS,
    TINY_MODEL_DIMS,
    CostModel,
    ModelDims,
    batch_key_pairs,
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
    "NAMED_MODEL_DIMS",
    "TINY_MODEL_DIMS",
    "CostModel",
    "ModelDims",
    "PrefixTree",
    "TreeStats",
    "batch_key_pairs",
    "build_prefix_tree",
    "check_tree",
    "node_key_pairs",
    "node_level",
    "node_num_children",
    "sample_shared_fraction",
    "top_level_nodes",
    "tree_key_pairs",
    "tree_stats",
    "unshared_key_pairs",
]
