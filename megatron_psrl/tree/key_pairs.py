"""Key-pair and claimed-token counts of a batch and of its prefix tree.

A token at position p (0-based) attends to p + 1 keys (causal, itself included). Without
sharing every sample of length n costs n tokens and n (n + 1) / 2 key pairs; with the prefix
tree every tree token is computed once and sees ``position + 1`` keys (its ancestors' tokens and
the earlier tokens of its node). The cost model (:mod:`megatron_psrl.schedule.cost`) turns
these counts into FLOPs.
"""

from __future__ import annotations

import numpy as np

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.tree.prefix_tree import PrefixTree


def unshared_key_pairs(lengths: np.ndarray) -> np.ndarray:
    """int64: key pairs of samples of the given lengths computed separately, n (n + 1) / 2."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths * (lengths + 1) // 2


def node_key_pairs(tree: PrefixTree) -> np.ndarray:
    """int64 ``[M]``: key pairs of every node's tokens: sum over p in [d, d + len) of p + 1."""
    lens = tree.node_len
    return lens * (tree.node_depth + 1) + lens * (lens - 1) // 2


def batch_key_pairs(batch: SampleBatch) -> int:
    """Key pairs of the whole batch without sharing."""
    return int(unshared_key_pairs(batch.lengths).sum())


def tree_key_pairs(tree: PrefixTree) -> int:
    """Key pairs of the whole batch with the prefix tree (each tree token once)."""
    return int(node_key_pairs(tree).sum())


def claimed_tokens(tree: PrefixTree) -> np.ndarray:
    """bool ``[T]``: tree tokens with at least one loss claim (their log-prob is computed)."""
    return tree.claim_offsets[1:] > tree.claim_offsets[:-1]


def claimed_tokens_per_node(tree: PrefixTree) -> np.ndarray:
    """int64 ``[M]``: claimed tokens of every node."""
    if tree.num_nodes == 0:
        return np.zeros(0, np.int64)
    return np.add.reduceat(claimed_tokens(tree).astype(np.int64), tree.node_offset[:-1])
