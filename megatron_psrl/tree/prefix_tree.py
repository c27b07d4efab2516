"""The global prefix tree of an update batch: a compressed radix tree over token ids.

Every sample of the batch is a root-to-node path. A node is a maximal run of tokens shared by
the same set of samples; nodes are split wherever two samples diverge and wherever a sample
ends, so every sample ends exactly at the end of a node. Nodes are stored in depth-first
preorder (children in ascending order of their first token; with router replay, of their first
(token, route) key: samples routed differently split where their routes differ), which makes every subtree a
contiguous range of node indices and of tree tokens: the planner cuts subtrees with slices.

All fields are flat numpy arrays (no Python object per node or token), see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.tree.keys import token_keys


@dataclass
class PrefixTree:
    """A forest of compressed radix trees (one per distinct first token) over a SampleBatch.

    M = number of nodes, T = number of tree tokens (tokens after deduplication),
    S = number of samples, N = total sample tokens, C = number of loss claims.
    """

    batch: SampleBatch
    """The samples the tree was built from."""

    tokens: np.ndarray
    """int32 ``[T]``: token ids of all nodes, concatenated in node (preorder) order."""

    node_offset: np.ndarray
    """int64 ``[M + 1]``: node m owns tree tokens ``node_offset[m]:node_offset[m + 1]``."""

    node_parent: np.ndarray
    """int32 ``[M]``: parent node, -1 for top-level nodes."""

    node_depth: np.ndarray
    """int64 ``[M]``: position (0-based, in every sample through the node) of its first token;
    a tree token's position id is ``node_depth[m] + (t - node_offset[m])``."""

    node_subtree_end: np.ndarray
    """int64 ``[M]``: one past the last preorder index of node m's subtree; the subtree of m is
    nodes ``m:node_subtree_end[m]`` and tree tokens
    ``node_offset[m]:node_offset[node_subtree_end[m]]``."""

    node_num_samples: np.ndarray
    """int64 ``[M]``: number of samples whose path contains node m."""

    sample_node: np.ndarray
    """int32 ``[S]``: the node at whose last token sample s ends."""

    sample_token_index: np.ndarray
    """int64 ``[N]``: for every token of the batch (flat index into the batch's per-token
    arrays), its tree token index. Sample s is recovered as
    ``tokens[sample_token_index[batch.offsets[s]:batch.offsets[s + 1]]]``."""

    claim_token: np.ndarray
    """int64 ``[C]``: tree token index of every loss claim (a (token, sample) pair with
    loss_mask 1), sorted by tree token, then by sample."""

    claim_sample: np.ndarray
    """int32 ``[C]``: the sample of every claim."""

    claim_flat: np.ndarray
    """int64 ``[C]``: index of the claim's token in the batch's flat per-token arrays, which
    is where its advantage, old/ref log-probs and loss mask live."""

    claim_offsets: np.ndarray
    """int64 ``[T + 1]``: claims of tree token t are ``claim_offsets[t]:claim_offsets[t + 1]``
    (CSR), so the claims of any tree-token range are one slice."""

    # ------------------------------------------------------------------ derived
    @property
    def num_nodes(self) -> int:
        return int(self.node_parent.shape[0])

    @property
    def num_tree_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def node_len(self) -> np.ndarray:
        """int64 ``[M]``: tokens per node."""
        return np.diff(self.node_offset)

    def token_node(self) -> np.ndarray:
        """int32 ``[T]``: the node of every tree token."""
        return np.repeat(np.arange(self.num_nodes, dtype=np.int32), self.node_len)

    def token_position(self) -> np.ndarray:
        """int64 ``[T]``: position id (depth in its samples) of every tree token."""
        lens = self.node_len
        return np.repeat(self.node_depth - self.node_offset[:-1], lens) + np.arange(
            self.num_tree_tokens, dtype=np.int64
        )

    def subtree_tokens(self) -> np.ndarray:
        """int64 ``[M]``: tree tokens in the subtree of every node (itself included)."""
        return self.node_offset[self.node_subtree_end] - self.node_offset[:-1]

    def sample_path(self, s: int) -> np.ndarray:
        """Nodes from the top level down to the node where sample s ends."""
        path = []
        m = int(self.sample_node[s])
        while m >= 0:
            path.append(m)
            m = int(self.node_parent[m])
        return np.asarray(path[::-1], dtype=np.int64)

    def sample_tokens(self, s: int) -> np.ndarray:
        """Sample s reconstructed from the tree."""
        b = self.batch
        return self.tokens[self.sample_token_index[b.offsets[s] : b.offsets[s + 1]]]


def top_level_nodes(tree: PrefixTree) -> np.ndarray:
    """Preorder indices of the top-level nodes (roots of the independent trees)."""
    return np.flatnonzero(tree.node_parent < 0)


def node_num_children(tree: PrefixTree) -> np.ndarray:
    """int64 ``[M]``: number of children of every node."""
    parents = tree.node_parent[tree.node_parent >= 0]
    return np.bincount(parents, minlength=tree.num_nodes).astype(np.int64)


def node_level(tree: PrefixTree) -> np.ndarray:
    """int64 ``[M]``: number of ancestors of every node (0 for top-level nodes).

    Node k is an ancestor of m iff ``k < m < node_subtree_end[k]`` (preorder), so the level is
    the number of open subtree intervals at m: a difference array and one cumsum.
    """
    m = tree.num_nodes
    # Interval of k opens at k + 1 (+1) and closes at node_subtree_end[k] (-1).
    diff = np.ones(m + 1, dtype=np.int64)
    diff[0] = 0
    diff -= np.bincount(tree.node_subtree_end, minlength=m + 1)
    return np.cumsum(diff)[:m]


def check_tree(tree: PrefixTree) -> None:
    """Verify every structural invariant documented on :class:`PrefixTree` (vectorised).

    Raises ``AssertionError`` naming the first violated invariant. Meant for tests and for
    debugging planners; cost is linear in tokens and claims.
    """
    b = tree.batch
    m, t = tree.num_nodes, tree.num_tree_tokens
    lens = tree.node_len
    assert tree.node_offset.shape == (m + 1,) and tree.node_offset[0] == 0, "node_offset shape"
    assert tree.node_offset[-1] == t, "node_offset[-1] == number of tree tokens"
    assert (lens >= 1).all(), "every node holds at least one token"
    parent = tree.node_parent.astype(np.int64)
    idx = np.arange(m)
    has_parent = parent >= 0
    assert (parent < idx).all(), "parents precede children (preorder)"
    # A child starts where its parent ends.
    pend = tree.node_depth[parent[has_parent]] + lens[parent[has_parent]]
    assert (tree.node_depth[has_parent] == pend).all(), "child depth == parent end depth"
    assert (tree.node_depth[~has_parent] == 0).all(), "top-level nodes start at depth 0"
    # Subtree ranges: contiguous, nested, and consistent with the parents.
    end = tree.node_subtree_end
    assert ((end > idx) & (end <= m)).all(), "subtree_end in (m, M]"
    assert (end[parent[has_parent]] >= end[has_parent]).all(), "subtrees nest"
    assert (idx[has_parent] < end[parent[has_parent]]).all(), "child inside parent's subtree"
    # In preorder, the node after the end of m's subtree is never a descendant of m: a node's
    # subtree ends exactly where the next node with depth <= its own depth starts.
    inside = end < m
    assert (tree.node_depth[end[inside]] <= tree.node_depth[inside]).all(), (
        "subtree_end is the first non-descendant"
    )
    # Children: distinct first tokens (with routes: first (token, route) keys), in ascending
    # order, under every parent.
    sti = tree.sample_token_index
    if b.routed_experts is None:
        first_tok = tree.tokens[tree.node_offset[:-1]]
    else:
        keys = token_keys(b)
        source = np.empty(t, dtype=np.int64)  # a batch token of every tree token
        source[sti] = np.arange(b.num_tokens)
        assert (keys[source][sti] == keys).all(), "samples share tree tokens only where their routes agree"
        first_tok = keys[source[tree.node_offset[:-1]]]
    order = np.lexsort((idx, parent))
    same = parent[order][1:] == parent[order][:-1]
    assert (first_tok[order][1:][same] > first_tok[order][:-1][same]).all(), (
        "siblings have strictly ascending first tokens"
    )
    # Samples: reconstructed exactly, ending at their node.
    assert sti.shape == (b.num_tokens,), "sample_token_index shape"
    assert (tree.tokens[sti] == b.tokens).all(), "every sample is reconstructed from the tree"
    ends = b.offsets[1:] - 1
    node_of_token = tree.token_node()
    assert (node_of_token[sti[ends]] == tree.sample_node).all(), "sample_node holds its end"
    assert (sti[ends] == tree.node_offset[tree.sample_node.astype(np.int64) + 1] - 1).all(), (
        "samples end at the last token of a node"
    )
    assert (tree.token_position()[sti] == np.arange(b.num_tokens) - np.repeat(
        b.offsets[:-1], b.lengths)).all(), "tree token positions are sample positions"
    # Sample counts: samples ending in the subtree.
    ending = np.bincount(tree.sample_node, minlength=m)
    cum = np.concatenate([[0], np.cumsum(ending)])
    assert (tree.node_num_samples == cum[end] - cum[idx]).all(), "node_num_samples"
    # Claims: exactly the masked tokens, sorted by (tree token, sample), CSR offsets.
    flat = np.flatnonzero(b.loss_mask)
    c = flat.shape[0]
    assert tree.claim_flat.shape == (c,), "one claim per masked token"
    assert (np.sort(tree.claim_flat) == flat).all(), "claims are the masked tokens"
    assert (tree.claim_token == sti[tree.claim_flat]).all(), "claim_token"
    sample_of = np.searchsorted(b.offsets, tree.claim_flat, side="right") - 1
    assert (tree.claim_sample == sample_of).all(), "claim_sample"
    key_ok = (np.diff(tree.claim_token) > 0) | (
        (np.diff(tree.claim_token) == 0) & (np.diff(tree.claim_sample.astype(np.int64)) > 0)
    )
    assert key_ok.all(), "claims sorted by (tree token, sample)"
    expected = np.concatenate([[0], np.cumsum(np.bincount(tree.claim_token, minlength=t))])
    assert (tree.claim_offsets == expected).all(), "claim_offsets is the CSR of claim_token"
