"""Cost model and tree statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive_trie_lib import batches, make_batch

from megatron_psrl.schedule.cost import NAMED_MODEL_DIMS, TINY_MODEL_DIMS, CostModel
from megatron_psrl.tree import build_prefix_tree, sample_shared_fraction, tree_stats


def linear_weights(model: CostModel) -> float:
    """GEMM weights touched by a token whose log-prob is computed (layers + output layer)."""
    return (model.linear_flops_per_token + model.head_flops_per_row) / 6.0  # fwd+bwd (3x) of a multiply-add


def test_tiny_model_by_hand():
    d = TINY_MODEL_DIMS
    assert (d.hidden_size, d.num_layers, d.num_heads, d.num_kv_heads, d.head_dim,
            d.ffn_hidden_size, d.vocab_size) == (256, 4, 4, 2, 64, 512, 1024)
    model = CostModel.named("tiny")
    per_layer = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 512
    assert linear_weights(model) == 4 * per_layer + 256 * 1024
    assert model.attention_flops_per_key == 3 * 4 * (2 * 2 * 4 * 64)
    assert model == CostModel.from_dims(256, 4, 4, 2, 64, 512, 1024)


def test_named_models_reproduce_public_parameter_counts():
    """GEMM weights + embeddings + norms (+ Qwen2's q/k/v biases) = the published totals,
    which pins the dims to the public configs."""
    llama8 = NAMED_MODEL_DIMS["llama3-8b"]
    norms = llama8.num_layers * 2 * llama8.hidden_size + llama8.hidden_size
    embedding = llama8.vocab_size * llama8.hidden_size
    assert linear_weights(CostModel.named("llama3-8b")) + embedding + norms == 8_030_261_248

    qwen7 = NAMED_MODEL_DIMS["qwen2.5-7b"]
    norms = qwen7.num_layers * 2 * qwen7.hidden_size + qwen7.hidden_size
    biases = qwen7.num_layers * (qwen7.num_heads + 2 * qwen7.num_kv_heads) * qwen7.head_dim
    embedding = qwen7.vocab_size * qwen7.hidden_size  # untied: the LM head is in the GEMMs
    total = linear_weights(CostModel.named("qwen2.5-7b")) + embedding + norms + biases
    assert total == 7_615_616_512

    llama70 = NAMED_MODEL_DIMS["llama3-70b"]
    norms = llama70.num_layers * 2 * llama70.hidden_size + llama70.hidden_size
    embedding = llama70.vocab_size * llama70.hidden_size
    assert linear_weights(CostModel.named("llama3-70b")) + embedding + norms == 70_553_706_496

    # Qwen3-32B: 32.8B parameters (q/k norms of head_dim per layer on top).
    qwen32 = NAMED_MODEL_DIMS["qwen3-32b"]
    embedding = qwen32.vocab_size * qwen32.hidden_size
    total = linear_weights(CostModel.named("qwen3-32b")) + embedding
    assert total == pytest.approx(32.76e9, rel=1e-3)


def test_attention_term_and_validation():
    model = CostModel.named("llama3-8b")
    assert model.attention_flops_per_key == 3 * 32 * 2 * 2 * 32 * 128
    with pytest.raises(ValueError, match="unknown model size"):
        CostModel.named("gpt-5")
    with pytest.raises(ValueError, match="finite and >= 0"):
        CostModel(-1.0, 1.0)
    with pytest.raises(ValueError, match="non-zero"):
        CostModel(0.0, 0.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        CostModel.from_dims(64, 1, 3, 2, 16, 64, 10)


def test_grpo_and_stepwise_closed_forms():
    prompt, responses = list(range(10, 60)), [[1000 + g] * 20 for g in range(4)]
    batch = make_batch([prompt + r for r in responses])
    tree = build_prefix_tree(batch)
    linear_only = CostModel(1.0, 0.0)
    assert linear_only.ideal_speedup(tree) == pytest.approx(4 * 70 / (50 + 4 * 20))
    # Step-wise with T equal turns: token redundancy (T + 1) / 2 (docs/prefix-tree.md).
    turns, turn_len = 8, 32
    history = list(range(turns * turn_len))
    tree = build_prefix_tree(make_batch([history[: turn_len * (t + 1)] for t in range(turns)]))
    stats = tree_stats(tree)
    assert stats.token_dedup_ratio == pytest.approx((turns + 1) / 2)
    assert stats.ideal_speedup is None
    attention_only = CostModel(0.0, 1.0)
    n = np.arange(1, turns + 1) * turn_len
    expected = (n * (n + 1) // 2).sum() / (turns * turn_len * (turns * turn_len + 1) // 2)
    assert attention_only.ideal_speedup(tree) == pytest.approx(expected)


@settings(max_examples=80, deadline=None)
@given(batches(adversarial=True), st.floats(0.0, 10.0), st.floats(0.01, 10.0))
def test_node_and_subtree_costs_match_per_token_sums(batch, linear, attention):
    tree = build_prefix_tree(batch)
    model = CostModel(linear, attention)
    positions = tree.token_position()
    token_cost = linear + attention * (positions + 1)
    node_of = tree.token_node()
    naive_nodes = np.zeros(tree.num_nodes)
    np.add.at(naive_nodes, node_of, token_cost)
    np.testing.assert_allclose(model.node_costs(tree), naive_nodes, rtol=1e-12)
    subtree = model.subtree_costs(tree)
    for m in range(tree.num_nodes):
        # Naive subtree: every node whose ancestor chain reaches m.
        members = [k for k in range(tree.num_nodes) if _is_descendant(tree, k, m)]
        assert subtree[m] == pytest.approx(naive_nodes[members].sum(), rel=1e-12)
    roots = tree.node_parent < 0
    assert subtree[roots].sum() == pytest.approx(model.tree_cost(tree), rel=1e-12)
    baseline = sum(linear * n + attention * n * (n + 1) / 2 for n in batch.lengths.tolist())
    assert model.baseline_cost(batch) == pytest.approx(baseline, rel=1e-12)
    np.testing.assert_allclose(model.sample_costs(batch).sum(), baseline, rtol=1e-12)


def _is_descendant(tree, k: int, m: int) -> bool:
    while k >= 0:
        if k == m:
            return True
        k = int(tree.node_parent[k])
    return False


def test_stats_to_dict_is_json_and_shared_fraction():
    batch = make_batch([[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]])
    tree = build_prefix_tree(batch)
    stats = tree_stats(tree, CostModel.named("tiny"))
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["tokens_total"] == 10 and data["tokens_in_tree"] == 8
    assert data["num_nodes"] == 4 and data["num_top_level_nodes"] == 2
    assert data["max_branching"] == 2 and data["mean_branching"] == 2.0
    assert data["cost_model"]["name"] == "tiny"
    tiny = CostModel.named("tiny")
    # Key pairs: unshared 10 + 10 + 3; tree [1 2] 3, [3 4] 7, [5 6] 7, [7 8] 3. Logit rows (the
    # default mask trains every token but the first): unshared 3 + 3 + 1; tree: 2 3 4 5 6 8 -> 6.
    assert data["ideal_speedup"] == pytest.approx(tiny.cost(10, 23, 7) / tiny.cost(8, 20, 6))
    np.testing.assert_allclose(sample_shared_fraction(tree), [0.5, 0.5, 0.0])
