"""Per-token arrays of a prefix tree (node, position, predecessor, subtree end) and the
chains inside a set of its tokens: what packing, chunking and planning read of the tree."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from megatron_psrl.tree.prefix_tree import PrefixTree


class TreeIndex:
    """Per-token arrays of a PrefixTree that packing needs, computed once per tree.

    ``subtrees``: top-level nodes whose tokens are the only ones read (local planning: a rank
    plans its own exchange group's trees); the arrays are allocated for the whole tree but
    filled only there, so the work and the memory touched follow the group, not the batch.
    None: every token."""

    def __init__(self, tree: PrefixTree, subtrees: Optional[np.ndarray] = None):
        self.tree = tree
        t = tree.num_tree_tokens
        parent = tree.node_parent.astype(np.int64)
        if subtrees is None:
            node_ranges = [(0, tree.num_nodes)]
        else:  # a subtree's nodes (and tokens) are one range in preorder
            node_ranges = [(int(n), int(tree.node_subtree_end[n])) for n in np.sort(subtrees)]
        self.token_node = np.empty(t, dtype=np.int32)
        self.position = np.empty(t, dtype=np.int64)
        self.pred = np.empty(t, dtype=np.int64)
        """int64 ``[T]``: tree index of every token's predecessor in its samples (-1 at position 0)."""
        self.subtree_end = np.empty(t, dtype=np.int64)
        """int64 ``[T]``: tokens ``(x, subtree_end[x])`` are exactly the descendants of x."""
        offset = tree.node_offset
        for a, b in node_ranges:
            lo, hi = int(offset[a]), int(offset[b])
            lens = offset[a + 1:b + 1] - offset[a:b]
            nodes = np.arange(a, b, dtype=np.int32)
            self.token_node[lo:hi] = np.repeat(nodes, lens)
            self.position[lo:hi] = np.repeat(tree.node_depth[a:b] - offset[a:b], lens) + np.arange(lo, hi)
            pred = np.arange(lo - 1, hi - 1, dtype=np.int64)
            # The first token of a node follows the last token of its parent node.
            par = parent[a:b]
            pred[offset[a:b] - lo] = np.where(par >= 0, offset[np.maximum(par, 0) + 1] - 1, -1)
            self.pred[lo:hi] = pred
            self.subtree_end[lo:hi] = np.repeat(offset[tree.node_subtree_end[a:b]], lens)


def chain_structure(
    index: TreeIndex, tokens: np.ndarray, break_after: Optional[np.ndarray] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Chains inside a sorted set of tree tokens.

    Returns ``(pred_pos, continues)``: the position of every token's predecessor in the set
    (-1 if absent), and whether the token continues the previous token's chain: it is that
    token's successor, that token has no other successor in the set (else it is a branch
    point), and ``break_after`` (bool per token, optional) is not set for that token.
    """
    n = len(tokens)
    pred = index.pred[tokens]
    pos = np.searchsorted(tokens, pred)
    present = (pred >= 0) & (pos < n)
    present[present] &= tokens[pos[present]] == pred[present]
    pred_pos = np.where(present, pos, -1)
    successors = np.bincount(pred_pos[present], minlength=n)
    continues = present & (pred_pos == np.arange(n) - 1)
    continues[1:] &= successors[:-1] == 1
    if break_after is not None:
        continues[1:] &= ~break_after[:-1]
    return pred_pos, continues
