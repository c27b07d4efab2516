"""Trees split between exchange groups (megatron_psrl.schedule.group_split): the regrouped tree
holds every sample and every claim exactly once, plans over it pass every invariant, a single
tree no longer leaves groups idle, and batches that balance already are planned as before."""

import numpy as np
import pytest
from helpers.batches import cross_rank_batch

from megatron_psrl.data.synthetic import make_stepwise
from megatron_psrl.schedule.check import check_plan
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.group_split import regroup_tree, sample_groups, split_units
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree.build import build_prefix_tree


def _one_tree():
    # 8 step-wise trajectories under one system prompt: one tree
    return make_stepwise(num_trajectories=8, turns=(3, 5), obs_len=(10, 30), action_len=(4, 8), system_len=40,
                         task_len=(5, 10), vocab_size=97, seed=3)


def _claims(tree):
    """(token id, sample, flat index) of every claim: what the loss sees."""
    return sorted(zip(tree.tokens[tree.claim_token].tolist(), tree.claim_sample.tolist(), tree.claim_flat.tolist()))


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_regrouped_tree_keeps_every_sample_and_claim_once(groups):
    batch = _one_tree()
    tree = build_prefix_tree(batch)
    label = np.arange(batch.num_samples) % groups
    regrouped, root_group = regroup_tree(tree, label)
    assert sorted(root_group.tolist()) == list(range(groups))  # one tree per group
    for s in range(batch.num_samples):
        path = regrouped.sample_token_index[batch.sample_slice(s)]
        np.testing.assert_array_equal(regrouped.tokens[path], batch.sample_tokens(s))
        # the sample's tokens lie in its group's tree
        root = np.flatnonzero(regrouped.node_parent < 0)[root_group == label[s]][0]
        assert regrouped.node_offset[root] <= path.min() and path.max() < regrouped.node_offset[
            regrouped.node_subtree_end[root]]
    assert _claims(regrouped) == _claims(tree)
    assert np.all(np.diff(regrouped.claim_token) >= 0)
    np.testing.assert_array_equal(np.diff(regrouped.claim_offsets), np.bincount(regrouped.claim_token,
                                                                                minlength=regrouped.num_tree_tokens))
    # every group recomputes only the shared prefix: unique tokens grow by its copies
    assert tree.num_tree_tokens < regrouped.num_tree_tokens < batch.num_tokens
    assert regrouped.node_num_samples[np.flatnonzero(regrouped.node_parent < 0)].sum() == batch.num_samples


def test_units_split_at_branches_and_samples_follow_them():
    tree = build_prefix_tree(_one_tree())
    cost = tree.node_len.astype(float)
    subtree = tree.subtree_tokens().astype(float)
    units, prefix = split_units(tree, cost, subtree, num_groups=4)
    assert len(units) > 1 and np.all(tree.node_parent[units] >= 0)
    assert np.all(prefix > 0)  # every unit recomputes the path above it
    # the units' subtrees are disjoint and cover every leaf
    covered = np.zeros(tree.num_nodes, bool)
    for u in units:
        assert not covered[u:tree.node_subtree_end[u]].any()
        covered[u:tree.node_subtree_end[u]] = True
    groups = sample_groups(tree, units, np.arange(len(units)))
    assert groups.min() >= 0


@pytest.mark.parametrize("group_size,placement", [(1, "auto"), (2, "auto"), (2, "whole-tree"), (4, "cross-rank")])
def test_one_tree_is_split_between_groups_and_the_plan_holds(group_size, placement):
    tree = build_prefix_tree(_one_tree())
    config = PlannerConfig(micro_batch_tokens=96, data_parallel_size=8, exchange_group_size=group_size,
                           placement=placement)
    plan = plan_step(tree, config)
    check_plan(plan)
    assert plan.split_tokens_recomputed > 0
    assert plan.split_tokens_recomputed == plan.tree.num_tree_tokens - tree.num_tree_tokens
    whole = plan_step(tree, PlannerConfig(micro_batch_tokens=96, data_parallel_size=8, exchange_group_size=group_size,
                                          placement=placement, split_trees_across_groups=False))
    assert whole.split_tokens_recomputed == 0 and whole.tree is tree
    assert max(plan.rank_costs()) < 0.75 * max(whole.rank_costs())
    # every rank has work: no idle group
    assert all(len(r.micro_batches) for r in plan.ranks)


@pytest.mark.parametrize("kind", ["mixed", "chain"])
def test_batches_that_balance_or_cannot_split_are_planned_as_before(kind):
    tree = build_prefix_tree(cross_rank_batch(kind))
    a = plan_step(tree, PlannerConfig(micro_batch_tokens=64, data_parallel_size=4, exchange_group_size=2))
    b = plan_step(tree, PlannerConfig(micro_batch_tokens=64, data_parallel_size=4, exchange_group_size=2,
                                      split_trees_across_groups=False))
    assert a.tree is tree and a.split_tokens_recomputed == 0
    assert [[mb.tokens.tolist() for mb in r.micro_batches] for r in a.ranks] == \
        [[mb.tokens.tolist() for mb in r.micro_batches] for r in b.ranks]


def test_the_switch_reaches_the_actor_config():
    from megatron_psrl.training.arguments import parse_args
    from megatron_psrl.training.trainer import actor_config_from_args

    base = ["--model", "debug-llama", "--data", "stepwise"]
    assert actor_config_from_args(parse_args(base), "float32").split_trees_across_groups is True
    off = actor_config_from_args(parse_args(base + ["--no-split-trees-across-groups"]), "float32")
    assert off.split_trees_across_groups is False
