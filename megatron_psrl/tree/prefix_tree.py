"""The global prefix tree of an update batch: a compressed radix tree over token ids.

Every sample of the batch is a root-to-node path. A node is a maximal run of tokens shared by
the same set of samples; nodes are split wherever two samples diverge and wherever a sample
ends, so every sample ends exactly at the end of a node. Nodes are stored in depth-first
preorder (children in ascending order of their first token), which makes every subtree a
contiguous range of node indices and of tree tokens: the planner cuts subtrees with slices.

All fields are flat numpy arrays (no Python object per node or token), see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from megatron_psrl.data.samples import SampleBatch


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
