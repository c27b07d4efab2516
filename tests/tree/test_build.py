"""Property tests of build_prefix_tree against a naive per-token trie (naive_trie_lib.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive_trie_lib import assert_matches_naive, batches, make_batch

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.tree import build as build_module
from megatron_psrl.tree import build_prefix_tree, node_level, tree_stats

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(batches())
def test_random_batches_match_naive_trie(batch):
    assert_matches_naive(batch)


@FAST
@given(batches(adversarial=True))
def test_adversarial_batches_match_naive_trie(batch):
    assert_matches_naive(batch)


@settings(max_examples=100, deadline=None)
@given(batches(max_samples=6, max_len=60, adversarial=True), st.integers(1, 9),
       st.integers(1, 4))
def test_chunked_galloping_lcp_gives_the_same_tree(batch, chunk, window):
    """Tiny LCP chunks and galloping windows (pairs split across chunks, many rounds, windows
    ending next to the end of a sample) give the naive trie too."""
    reference = build_prefix_tree(batch)
    saved = build_module.LCP_CHUNK_TOKENS, build_module.GALLOP_FIRST_WINDOW
    build_module.LCP_CHUNK_TOKENS, build_module.GALLOP_FIRST_WINDOW = chunk, window
    try:
        chunked = build_prefix_tree(batch)
        assert_matches_naive(batch)
    finally:
        build_module.LCP_CHUNK_TOKENS, build_module.GALLOP_FIRST_WINDOW = saved
    for name in ("tokens", "node_offset", "node_parent", "node_subtree_end",
                 "sample_token_index", "claim_flat"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(reference, name))


# ---------------------------------------------------------------------- explicit cases
def test_documented_example():
    samples = [[1, 2, 3, 4], [1, 2], [1, 2, 3, 4], [1, 2, 5], [0, 7], [1, 2, 3, 4, 9, 9]]
    tree = build_prefix_tree(make_batch(samples))
    # Preorder: [0 7] | [1 2] -> ([3 4] -> [9 9]), [5]
    assert tree.tokens.tolist() == [0, 7, 1, 2, 3, 4, 9, 9, 5]
    assert tree.node_offset.tolist() == [0, 2, 4, 6, 8, 9]
    assert tree.node_parent.tolist() == [-1, -1, 1, 2, 1]
    assert tree.node_depth.tolist() == [0, 0, 2, 4, 2]
    assert tree.node_subtree_end.tolist() == [1, 5, 4, 4, 5]
    assert tree.node_num_samples.tolist() == [1, 5, 3, 1, 1]
    assert tree.sample_node.tolist() == [2, 1, 2, 4, 0, 3]
    # Tree token 3 (the "2" of [1 2]) is claimed by the 5 samples that contain it.
    claims_of_3 = tree.claim_sample[tree.claim_offsets[3]:tree.claim_offsets[4]]
    assert claims_of_3.tolist() == [0, 1, 2, 3, 5]
    assert_matches_naive(make_batch(samples))


def test_empty_batch():
    batch = SampleBatch(ids=[], offsets=np.zeros(1, np.int64), tokens=np.zeros(0, np.int32),
                        loss_mask=np.zeros(0, bool))
    tree = build_prefix_tree(batch)
    assert tree.num_nodes == 0 and tree.num_tree_tokens == 0
    assert tree.claim_offsets.tolist() == [0]
    stats = tree_stats(tree, CostModel.named("tiny"))
    assert stats.num_nodes == 0 and stats.ideal_speedup == 1.0


def test_all_duplicates_share_one_node():
    tree = build_prefix_tree(make_batch([[5, 6, 7]] * 4))
    assert tree.num_nodes == 1 and tree.num_tree_tokens == 3
    assert tree.node_num_samples.tolist() == [4]
    assert tree.claim_offsets.tolist() == [0, 0, 4, 8]
    assert tree.claim_sample.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_disjoint_samples_share_nothing():
    batch = make_batch([[3, 1], [2, 9, 9], [1, 4]])
    tree = build_prefix_tree(batch)
    assert tree.num_tree_tokens == batch.num_tokens
    assert (tree.node_parent == -1).all()
    assert tree.tokens[tree.node_offset[:-1]].tolist() == [1, 2, 3]  # ascending first tokens
    assert tree_stats(tree, CostModel.named("tiny")).ideal_speedup == pytest.approx(1.0)


def test_rejects_bad_batches():
    with pytest.raises(ValueError, match="at least one token"):
        build_prefix_tree(SampleBatch(ids=[0, 1], offsets=np.array([0, 2, 2]),
                                      tokens=np.array([1, 2], np.int32),
                                      loss_mask=np.zeros(2, bool)))
    with pytest.raises(ValueError, match="non-negative"):
        build_prefix_tree(make_batch([[1, -3]]))


def test_long_step_wise_chain():
    """Sample t is a prefix of sample t + 1: one node per turn, a chain."""
    history = list(range(100, 140))
    samples = [history[: 5 * (t + 1)] for t in range(8)]
    tree = build_prefix_tree(make_batch(samples[::-1]))
    assert tree.num_nodes == 8 and tree.num_tree_tokens == 40
    assert tree.node_parent.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6]
    assert tree.node_num_samples.tolist() == [8, 7, 6, 5, 4, 3, 2, 1]
    assert node_level(tree).tolist() == list(range(8))
