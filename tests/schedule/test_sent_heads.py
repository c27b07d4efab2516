"""Heads of trees split between exchange groups sent instead of recomputed
(``PlannerConfig.cross_group_prefix``, :class:`megatron_psrl.schedule.plan.HeadSend`): plans with
transfers pass every invariant in every layout, compute fewer tokens than recomputing, keep every
claim (moved to the home copy's same token), plan locally what full planning plans, survive the
duplication fallback, and ``auto`` sends only where the link is cheaper than the compute."""

import dataclasses

import numpy as np
import pytest

from megatron_psrl.data.synthetic import make_stepwise, make_tree_rollouts
from megatron_psrl.engine.logprobs import per_sample_values
from megatron_psrl.schedule.check import check_plan
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.plan import token_aliases
from megatron_psrl.schedule.planner import assign_groups, plan_step
from megatron_psrl.tree.build import build_prefix_tree

LAYOUTS = [(8, 1, "auto"), (8, 2, "whole-tree"), (8, 4, "cross-rank"), (4, 2, "cross-rank"), (4, 2, "auto"),
           (4, 4, "whole-tree")]


def _stepwise():  # 8 step-wise trajectories under one system prompt: one tree
    return build_prefix_tree(make_stepwise(num_trajectories=8, turns=(3, 5), obs_len=(10, 30), action_len=(4, 8),
                                           system_len=40, task_len=(5, 10), vocab_size=97, seed=3))


def _search_tree():  # one rollout tree: a long prompt, then branches
    return build_prefix_tree(make_tree_rollouts(num_roots=1, branching=2, depth=3, segment_len=(6, 16),
                                                prompt_len=(40, 60), obs_len=(8, 20), vocab_size=97, seed=5))


def _config(ranks, group_size, placement, mode, **kw):
    return PlannerConfig(micro_batch_tokens=96, data_parallel_size=ranks, exchange_group_size=group_size,
                         placement=placement, cross_group_prefix=mode, **kw)


def _claims(tree):
    """(token id, sample, flat index) of every claim: what the loss sees."""
    return sorted(zip(tree.tokens[tree.claim_token].tolist(), tree.claim_sample.tolist(), tree.claim_flat.tolist()))


@pytest.mark.parametrize("make_tree", [_stepwise, _search_tree], ids=["stepwise", "search-tree"])
@pytest.mark.parametrize("ranks,group_size,placement", LAYOUTS)
def test_sent_heads_plan_exactly_and_compute_less(make_tree, ranks, group_size, placement):
    tree = make_tree()
    sent = plan_step(tree, _config(ranks, group_size, placement, "transfer"))
    recomputed = plan_step(tree, _config(ranks, group_size, placement, "recompute"))
    check_plan(sent)
    assert sent.head_sends and sent.transferred_tokens() > 0 and not recomputed.head_sends
    # every token of the regrouped tree computed once, but the heads received (a copy placed on
    # its home rank computes its head: the split's count of recomputed tokens is an upper bound)
    assert sent.tokens_computed() == sent.tree.num_tree_tokens - sent.transferred_tokens()
    assert sent.split_tokens_recomputed <= sent.tree.num_tree_tokens - tree.num_tree_tokens - sent.transferred_tokens()
    assert sent.tokens_computed() < recomputed.tokens_computed()
    # every claim is kept, on a token with its sample's token id at its position
    assert _claims(sent.tree) == _claims(tree)
    np.testing.assert_array_equal(sent.tree.tokens[sent.tree.claim_token], tree.batch.tokens[sent.tree.claim_flat])
    assert np.all(np.diff(sent.tree.claim_token) >= 0)
    # the home rank exports every head; each is read by some rank of another copy
    for t in sent.head_sends:
        assert any(s.exported is not None for s in sent.ranks[t.home_rank].sources.values())
        assert t.length <= 96 and all(0 < h.length <= t.length for h in t.imports)
    importers = [r for r, p in enumerate(sent.ranks) if any(mb.role == "import" for mb in p.micro_batches)]
    assert importers


def test_a_copy_imports_the_root_chain_it_shares_with_the_home_copy():
    sent = plan_step(_stepwise(), _config(4, 1, "auto", "transfer"))
    tree, index = sent.tree, sent.index
    for t in sent.head_sends:
        for h in t.imports[1:]:
            copy = np.arange(h.start, h.start + h.length + 1)  # the head and the token after it
            home = np.arange(t.start, t.start + h.length + 1)
            np.testing.assert_array_equal(tree.tokens[copy], tree.tokens[home])
            np.testing.assert_array_equal(index.position[copy], np.arange(h.length + 1))
            # their claims (and log-probs) now belong to the home copy
            assert not np.any(np.diff(tree.claim_offsets)[copy[1:]])
    copy_tokens, home_tokens = token_aliases(sent.head_sends)
    assert len(copy_tokens) == sum(h.length for t in sent.head_sends for h in t.imports[1:])


@pytest.mark.parametrize("ranks,group_size,placement", [(8, 2, "cross-rank"), (8, 2, "whole-tree"), (8, 1, "auto")])
def test_a_local_plan_is_its_group_of_the_full_plan(ranks, group_size, placement):
    tree = _search_tree()
    config = _config(ranks, group_size, placement, "transfer")
    full = plan_step(tree, config)
    assert full.head_sends
    for rank in range(ranks):
        local = plan_step(tree, dataclasses.replace(config, local_rank=rank))
        assert [dataclasses.astuple(t) for t in local.head_sends] == [dataclasses.astuple(t) for t in full.head_sends]
        for r in range(rank // group_size * group_size, (rank // group_size + 1) * group_size):
            a, b = local.ranks[r], full.ranks[r]
            assert a.schedule == b.schedule
            assert [(mb.role, mb.tokens.tolist(), mb.owned.tolist(), mb.remote_targets.tolist()) for mb in a.micro_batches] \
                == [(mb.role, mb.tokens.tolist(), mb.owned.tolist(), mb.remote_targets.tolist()) for mb in b.micro_batches]
            assert sorted((s, x.tokens.tolist(), x.imported, x.exported) for s, x in a.sources.items()) == \
                sorted((s, x.tokens.tolist(), x.imported, x.exported) for s, x in b.sources.items())


@pytest.mark.parametrize("ranks,group_size", [(8, 1), (4, 2)])
def test_the_duplication_fallback_keeps_the_exports(ranks, group_size):
    """A group that cannot cache (the KV-budget fallback plans it with duplication) recomputes
    the heads it would import, but its home rank still sends the heads other groups import."""
    tree = _search_tree()
    config = dataclasses.replace(_config(ranks, group_size, "whole-tree", "transfer"), micro_batch_tokens=128)
    assignment = assign_groups(tree, config)
    assert assignment.head_sends
    dup = plan_step(tree, dataclasses.replace(config, sharing="tree-dup"), assignment)
    check_plan(dup)
    for t in dup.head_sends:
        assert any(s.exported is not None for s in dup.ranks[t.home_rank].sources.values())
    assert not any(mb.role == "import" for p in dup.ranks for mb in p.micro_batches)


def test_auto_sends_only_where_the_link_is_cheaper_than_the_compute():
    tree = _search_tree()
    flops = CostModel.from_dims(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                ffn_hidden_size=128, vocab_size=97)
    unmeasured = plan_step(tree, _config(8, 1, "auto", "auto", cost_model=flops))
    assert not unmeasured.head_sends  # no link measurement: recompute
    per_token = float(flops.cost(1, 1, 0))
    fast = plan_step(tree, _config(8, 1, "auto", "auto", cost_model=flops, kv_bytes_per_token=1024.0,
                                   cost_per_exchanged_byte=per_token * 1e-6))
    slow = plan_step(tree, _config(8, 1, "auto", "auto", cost_model=flops, kv_bytes_per_token=1024.0,
                                   cost_per_exchanged_byte=per_token * 10.0))
    assert fast.head_sends and fast.transferred_tokens() > 0
    assert not slow.head_sends and slow.split_tokens_recomputed > 0


def test_log_probs_of_an_imported_head_are_read_from_the_home_copy():
    sent = plan_step(_stepwise(), _config(4, 1, "auto", "transfer"))
    tree = sent.tree
    copy_tokens, home_tokens = token_aliases(sent.head_sends)
    values = np.arange(tree.num_tree_tokens, dtype=np.float32) + 1.0
    computed = np.setdiff1d(np.arange(tree.num_tree_tokens), copy_tokens)  # nobody computes the copies' heads
    rows = per_sample_values(tree, computed, values[computed], fill=np.nan, aliases=(copy_tokens, home_tokens))
    for s, row in enumerate(rows):
        assert not np.isnan(row).any()
        # every sample reads, position by position, the value of a token with its own token id there
        path = tree.sample_token_index[tree.batch.sample_slice(s)]
        ids = tree.tokens[(row[1:] - 1).astype(np.int64)]
        np.testing.assert_array_equal(ids, tree.tokens[path[1:]])
