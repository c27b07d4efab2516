"""Cross-rank plans (one tree's fragments on several ranks): every tree token is computed once
on one rank, every log-prob target once; every fragment packs (so it sees exactly its
ancestors: local, cached, replicated or exchanged in the step); sends match receives; every
rank of a group runs the same schedule; fragments of a step cost about the same."""

import numpy as np
import pytest
from helpers.batches import random_tree_batch

from megatron_psrl.data import make_workload, samples_from_dicts
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.cross_rank import plan_group_cross_rank
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree
from megatron_psrl.tree.index import TreeIndex

COST = CostModel.named("tiny")


def _cost(index):
    return lambda tokens: COST.cost(1, index.position[tokens] + 1)


def _one_chain(length=400, vocab=256, seed=0):
    """One step-wise trajectory: every sample is a prefix of the next (a single long chain)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, length).tolist()
    cuts = [50, 120, 200, 290, 400]
    return samples_from_dicts([{"id": f"t{i}", "tokens": tokens[:c], "advantage": 1.0} for i, c in enumerate(cuts)])


def _check(tree, plans, budget):
    index = TreeIndex(tree)
    g = len(plans)
    steps = len(plans[0].micro_batches)
    assert all(len(p.micro_batches) == steps and p.schedule == plans[0].schedule for p in plans)
    seen = np.concatenate([mb.tokens[mb.owned] for p in plans for mb in p.micro_batches])
    assert np.array_equal(np.sort(seen), np.arange(tree.num_tree_tokens))  # each token once
    targets = []
    for p in plans:
        for m, mb in enumerate(p.micro_batches):
            assert 0 < mb.num_tokens <= budget
            pack = p.pack(index, m)  # raises unless every root segment sees exactly its ancestors
            targets.append(pack.logit_targets)
    targets = np.sort(np.concatenate(targets))
    assert np.array_equal(targets, np.flatnonzero(index.pred >= 0))  # every log-prob once
    for m in range(steps):
        for q in range(g):
            ex_q = plans[q].micro_batches[m].exchange
            for r in range(g):
                ex_r = plans[r].micro_batches[m].exchange
                sent = ex_q.send.get(r, []) if ex_q else []
                got = ex_r.recv.get(q, []) if ex_r else []
                assert [len(c) for c in sent] == [u.length for u in got]
                for chain, use in zip(sent, got):  # each received chain lands where it belongs
                    if use.replica is not None:
                        assert np.array_equal(plans[r].sources[use.replica].tokens, chain)
                    if use.peer is not None:
                        peer = plans[r].micro_batches[m].peer_reads[use.peer]
                        assert peer.src_rank == q and peer.last_token == chain[-1] and peer.length == len(chain)
                back = ex_r.grad_send.get(q, []) if ex_r else []
                into = ex_q.grad_recv.get(r, []) if ex_q else []
                # replica gradients go back to the very source they copy, in the same order
                assert [plans[r].sources[s].replica_of for s in back] == [(q, s) for s in into]
            peers = plans[q].micro_batches[m].peer_reads
            ex = plans[q].micro_batches[m].exchange
            used = sorted(u.peer for uses in (ex.recv.values() if ex else []) for u in uses if u.peer is not None)
            assert used == list(range(len(peers)))
    # A replica's producer step is its owner's step, and it is read only later.
    for p in plans:
        for src in p.sources.values():
            assert all(c > src.producer for c in src.consumers)
            if src.replica_of is not None:
                owner, sid = src.replica_of
                assert plans[owner].sources[sid].producer == src.producer
                assert np.array_equal(plans[owner].sources[sid].tokens, src.tokens)


@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_trees(g, seed):
    tree = build_prefix_tree(random_tree_batch(seed=seed, num_roots=1 + seed % 3))
    budget = 24 + 8 * seed
    index = TreeIndex(tree)
    roots = np.flatnonzero(tree.node_parent < 0)
    plans = plan_group_cross_rank(index, roots, budget, g, _cost(index))
    _check(tree, plans, budget)


@pytest.mark.parametrize("name", ["stepwise", "tree", "mixed"])
def test_synthetic_workloads(name):
    tree = build_prefix_tree(make_workload(name, seed=1))
    index = TreeIndex(tree)
    plans = plan_group_cross_rank(index, np.flatnonzero(tree.node_parent < 0), 256, 4, _cost(index))
    _check(tree, plans, 256)


def test_one_long_chain_runs_on_all_ranks_at_once():
    """A single 400-token trajectory on 4 ranks with a 128-token budget: one step of four
    fragments, each reading every earlier fragment of the step as peer chains."""
    tree = build_prefix_tree(_one_chain())
    index = TreeIndex(tree)
    plans = plan_group_cross_rank(index, np.flatnonzero(tree.node_parent < 0), 128, 4, _cost(index))
    _check(tree, plans, 128)
    assert len(plans[0].micro_batches) == 1 and plans[0].schedule == [("forward_backward", 0)]
    assert [len(p.micro_batches[0].peer_reads) > 0 for p in plans] == [False, True, True, True]
    costs = [float(_cost(index)(p.micro_batches[0].tokens).sum()) for p in plans]
    assert max(costs) / min(costs) < 1.05  # equal-cost cuts: later fragments get fewer tokens
    sizes = [p.micro_batches[0].num_tokens for p in plans]
    assert sizes == sorted(sizes, reverse=True)


def test_longer_chain_uses_replicas_and_defers_backward():
    """Two steps: the second step's fragments read the first step's prefixes from other ranks
    (replicas in their caches) and the first step's backward waits for them."""
    tree = build_prefix_tree(_one_chain(length=400))
    index = TreeIndex(tree)
    plans = plan_group_cross_rank(index, np.flatnonzero(tree.node_parent < 0), 64, 4, _cost(index))
    _check(tree, plans, 64)
    assert len(plans[0].micro_batches) == 2
    assert ("backward", 0) in plans[0].schedule
    assert any(s.replica_of is not None for p in plans for s in p.sources.values())
    assert plans[0].micro_batches[0].exchange.backward_collective


def test_plan_step_chooses_cross_rank_for_one_big_tree_and_whole_trees_for_many():
    big = build_prefix_tree(make_workload("tree", seed=3, num_roots=1))
    many = build_prefix_tree(make_workload("grpo", seed=3, num_prompts=64))
    # an exchange costs about as much as computing 100 tokens
    config = dict(micro_batch_tokens=256, data_parallel_size=4, exchange_group_size=4, cost_model=COST,
                  cost_per_exchange=100 * COST.linear_flops_per_token)
    one = plan_step(big, PlannerConfig(**config))
    assert one.placements == ["cross-rank"] and one.imbalance() < 1.15
    whole = plan_step(big, PlannerConfig(placement="whole-tree", split_trees_across_groups=False, **config))
    assert whole.imbalance() > 1.5  # the tree on one rank, the others idle
    # whole trees but split between the ranks, each part recomputing its shared prefix
    split = plan_step(big, PlannerConfig(placement="whole-tree", **config))
    assert split.imbalance() < 1.5 and split.split_tokens_recomputed > 0 and split.exchanged_tokens() == 0
    spread = plan_step(many, PlannerConfig(**config))
    assert spread.placements == ["whole-tree"] and spread.exchanged_tokens() == 0


def test_groups_balance_whole_trees_and_plan_inside():
    """8 ranks in 2 exchange groups of 4 (e.g. DP=2 x CP=4): trees are balanced over the groups,
    each group plans on its own; rank plans come in group order."""
    tree = build_prefix_tree(make_workload("mixed", seed=2))
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=128, data_parallel_size=8, exchange_group_size=4,
                                         cost_model=COST, placement="cross-rank"))
    assert len(plan.ranks) == 8 and len(plan.placements) == 2
    assert [p.group_rank for p in plan.ranks] == [0, 1, 2, 3] * 2
    seen = np.concatenate([mb.tokens[mb.owned] for p in plan.ranks for mb in p.micro_batches])
    assert np.array_equal(np.sort(seen), np.arange(tree.num_tree_tokens))
