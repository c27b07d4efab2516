"""Local planning (``PlannerConfig.local_rank``): a rank plans only its own exchange group, and
that group's plan is exactly the one full planning makes; other groups are empty placeholders
carrying their cost."""

import dataclasses

import numpy as np
import pytest
from helpers.batches import cross_rank_batch

from megatron_psrl.data.synthetic import make_stepwise
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree.build import build_prefix_tree
from megatron_psrl.tree.index import TreeIndex


def _rank_view(rank_plan):
    """Everything a rank runs, as plain data."""
    mbs = []
    for mb in rank_plan.micro_batches:
        ex = mb.exchange
        mbs.append((mb.tokens.tolist(), mb.owned.tolist(), sorted(mb.reads), sorted(mb.produces),
                    mb.remote_targets.tolist(), [(p.src_rank, p.length, p.last_token) for p in mb.peer_reads],
                    None if ex is None else (sorted((k, [c.tolist() for c in v]) for k, v in ex.send.items()),
                                             sorted((k, [(u.length, u.peer, u.replica) for u in v])
                                                    for k, v in ex.recv.items()),
                                             sorted(ex.grad_send.items()), sorted(ex.grad_recv.items()),
                                             ex.forward_collective, ex.backward_collective)))
    sources = sorted((i, s.producer, s.tokens.tolist(), list(s.consumers), s.replica_of)
                     for i, s in rank_plan.sources.items())
    return mbs, sources, list(rank_plan.schedule), rank_plan.planned_cost, rank_plan.group_rank, rank_plan.cross_rank


def _pack_view(pack):
    return {f.name: (v.tolist() if isinstance(v, np.ndarray) else v)
            for f in dataclasses.fields(pack) for v in [getattr(pack, f.name)]
            if isinstance(v, (np.ndarray, int, float, bool))}


def test_a_partial_tree_index_equals_the_full_one_on_its_subtrees():
    tree = build_prefix_tree(_batches()["mixed"])
    full = TreeIndex(tree)
    roots = np.flatnonzero(tree.node_parent < 0)
    chosen = roots[[0, 2, len(roots) - 1]]
    part = TreeIndex(tree, chosen)
    tokens = np.concatenate([np.arange(tree.node_offset[n], tree.node_offset[tree.node_subtree_end[n]]) for n in chosen])
    assert len(tokens) < tree.num_tree_tokens
    for name in ("token_node", "position", "pred", "subtree_end"):
        np.testing.assert_array_equal(getattr(part, name)[tokens], getattr(full, name)[tokens], err_msg=name)


def _batches():
    return {
        "mixed": cross_rank_batch("mixed"),
        "one-tree": make_stepwise(num_trajectories=8, turns=(3, 5), obs_len=(10, 30), action_len=(4, 8),
                                  system_len=40, task_len=(5, 10), vocab_size=97, seed=3),
        "stepwise": cross_rank_batch("stepwise"),
    }


@pytest.mark.parametrize("kind", ["mixed", "one-tree", "stepwise"])
@pytest.mark.parametrize("ranks,group_size,placement", [(4, 2, "auto"), (8, 2, "cross-rank"), (6, 3, "whole-tree"),
                                                        (4, 1, "auto")])
def test_a_local_plan_is_its_group_of_the_full_plan(kind, ranks, group_size, placement):
    tree = build_prefix_tree(_batches()[kind])
    full_config = PlannerConfig(micro_batch_tokens=48, data_parallel_size=ranks, exchange_group_size=group_size,
                                placement=placement)
    full = plan_step(tree, full_config)
    assert full.planned_groups is None
    for rank in range(ranks):
        local = plan_step(tree, dataclasses.replace(full_config, local_rank=rank))
        group = rank // group_size
        assert local.planned_groups == [group] and len(local.ranks) == ranks
        assert local.placements[group] == full.placements[group]
        assert local.predicted_makespan[group] == full.predicted_makespan[group]
        for r in range(ranks):
            if r // group_size == group:
                assert _rank_view(local.ranks[r]) == _rank_view(full.ranks[r]), (rank, r)
                for i in range(len(full.ranks[r].micro_batches)):  # packed from the group's part of the index
                    assert _pack_view(local.ranks[r].pack(local.index, i)) == _pack_view(full.ranks[r].pack(full.index, i))
            else:  # another group: nothing to run, an even share of that group's cost
                assert not local.ranks[r].micro_batches and local.placements[r // group_size] == "unplanned"
        members = range(group * group_size, (group + 1) * group_size)
        assert local.tokens_computed() == sum(full.tokens_computed(r) for r in members)
        other = [r for r in range(ranks) if r // group_size != group]
        if other:  # the other groups' cost is kept (the imbalance stays meaningful)
            np.testing.assert_allclose(local.rank_costs()[other].sum(), full.rank_costs()[other].sum(), rtol=1e-9)


def test_local_rank_must_be_a_rank():
    with pytest.raises(ConfigurationError, match="local_rank 4 is not one of the 4 ranks"):
        PlannerConfig(micro_batch_tokens=8, data_parallel_size=4, local_rank=4)
