"""The no-sharing layout (the baseline): every sample its own root node.

``--no-prefix-sharing`` runs the *same* planner, packer, model, kernels and loss as prefix
sharing on this degenerate tree, so the comparison isolates sharing itself: samples are packed
back to back (THD-style), every copy of a shared prefix is computed again.
"""

from __future__ import annotations

import numpy as np

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.tree.prefix_tree import PrefixTree


def build_unshared_tree(batch: SampleBatch) -> PrefixTree:
    """A PrefixTree with one top-level node per sample, in input order (no deduplication).

    Unlike a built prefix tree, top-level nodes keep the input order instead of ascending
    first token (so ``check_tree`` would reject it); every other invariant holds, and the
    planner and packer only rely on those (each node is its own contiguous subtree).
    """
    num_samples = batch.num_samples
    flat = np.flatnonzero(batch.loss_mask).astype(np.int64)
    per_sample = np.add.reduceat(batch.loss_mask, batch.offsets[:-1], dtype=np.int64) if num_samples else np.zeros(0, np.int64)
    claim_offsets = np.zeros(batch.num_tokens + 1, dtype=np.int64)
    np.cumsum(batch.loss_mask, out=claim_offsets[1:])
    return PrefixTree(
        batch=batch,
        tokens=batch.tokens.copy(),
        node_offset=batch.offsets.copy(),
        node_parent=np.full(num_samples, -1, dtype=np.int32),
        node_depth=np.zeros(num_samples, dtype=np.int64),
        node_subtree_end=np.arange(1, num_samples + 1, dtype=np.int64),
        node_num_samples=np.ones(num_samples, dtype=np.int64),
        sample_node=np.arange(num_samples, dtype=np.int32),
        sample_token_index=np.arange(batch.num_tokens, dtype=np.int64),
        claim_token=flat,
        claim_sample=np.repeat(np.arange(num_samples, dtype=np.int32), per_sample),
        claim_flat=flat.copy(),
        claim_offsets=claim_offsets,
    )
