"""Planner + packer invariants against brute force, for every sharing mode and many budgets.

For every micro-batch of every rank, each query token must attend to exactly the tokens of
its own sample before it (its ancestors in the tree, computed here by walking predecessors),
whether they are in the pack or in cached sources; every tree token must be owned exactly
once; every log-prob target exactly once; schedules must respect producer/reader order.
"""

import numpy as np
import pytest
from helpers.batches import random_tree_batch

from megatron_psrl.data import make_workload
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.plan import PlanningError
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree


def _ancestors(index, x):
    out = []
    x = int(index.pred[x])
    while x >= 0:
        out.append(x)
        x = int(index.pred[x])
    return set(out)


def check_plan(plan, budget):
    index, tree = plan.index, plan.tree
    owned = np.zeros(tree.num_tree_tokens, dtype=np.int64)
    targets = np.zeros(tree.num_tree_tokens, dtype=np.int64)
    for rank in plan.ranks:
        forward_at, backward_at = {}, {}
        for t, (op, i) in enumerate(rank.schedule):
            if op in ("forward", "forward_backward"):
                assert i not in forward_at
                forward_at[i] = t
            if op in ("backward", "forward_backward"):
                assert i not in backward_at
                backward_at[i] = t
        assert set(forward_at) == set(backward_at) == set(range(len(rank.micro_batches)))
        for src in rank.sources.values():
            toks = src.tokens
            assert np.all(index.pred[toks[1:]] == toks[:-1]), "a source must be a chain"
            assert np.isin(toks, rank.micro_batches[src.producer].tokens).all()
            for c in src.consumers:
                assert forward_at[src.producer] < forward_at[c]
                assert backward_at[c] < backward_at[src.producer]
        for i, mb in enumerate(rank.micro_batches):
            assert mb.num_tokens <= budget
            owned[mb.tokens[mb.owned]] += 1
            pack = rank.pack(index, i)
            assert np.array_equal(pack.position_ids, index.position[pack.tree_tokens])
            np.add.at(targets, pack.logit_targets, 1)
            # logit row = predecessor of the target
            assert np.all(pack.tree_tokens[pack.logit_rows] == index.pred[pack.logit_targets])
            mask = pack.plan.dense_mask()
            ext_tokens = [rank.sources[s].tokens for s in mb.reads]
            key_tokens = np.concatenate([pack.tree_tokens] + ext_tokens)
            for q in range(pack.num_tokens):
                x = int(pack.tree_tokens[q])
                seen = key_tokens[mask[q]]
                assert len(seen) == len(set(seen.tolist())), "a key seen twice"
                assert set(seen.tolist()) == _ancestors(index, x) | {x}, f"query {x} sees the wrong keys"
    assert np.all(owned == 1), "every tree token owned exactly once"
    pos = index.position
    assert np.all(targets[pos > 0] == 1) and np.all(targets[pos == 0] == 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode,budget", [("tree", 1000), ("tree", 40), ("tree", 17), ("tree", 5),
                                          ("tree-dup", 70), ("none", 70)])
def test_random_batches(seed, mode, budget):
    tree = build_prefix_tree(random_tree_batch(seed))
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=budget, sharing=mode, data_parallel_size=1 + seed % 3))
    check_plan(plan, budget)
    if mode == "tree":
        assert plan.tokens_computed() == tree.num_tree_tokens  # every token computed once
    if mode == "none":
        assert plan.tokens_computed() == tree.batch.num_tokens


@pytest.mark.parametrize("workload", ["grpo", "stepwise", "tree", "mixed"])
def test_synthetic_workloads_stream(workload):
    batch = make_workload(workload, vocab_size=512, seed=3)
    tree = build_prefix_tree(batch)
    budget = max(64, tree.num_tree_tokens // 10)  # trees many times the budget
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=budget, sharing="tree"))
    check_plan(plan, budget)
    assert plan.num_micro_batches() >= tree.num_tree_tokens // budget


def test_mechanism_one_keeps_fitting_trees_whole():
    tree = build_prefix_tree(make_workload("grpo", vocab_size=512, seed=0))
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=tree.num_tree_tokens, sharing="tree"))
    assert plan.num_micro_batches() == 1 and not plan.ranks[0].sources


def test_data_parallel_balances_cost():
    tree = build_prefix_tree(make_workload("grpo", vocab_size=512, seed=0, num_tokens_target=20000))
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=4096, sharing="tree", data_parallel_size=4))
    costs = [r.planned_cost for r in plan.ranks]
    assert max(costs) <= 1.35 * (sum(costs) / len(costs))


def test_errors_name_the_budget():
    tree = build_prefix_tree(random_tree_batch(0))
    with pytest.raises(PlanningError, match="micro-batch-tokens 10"):
        plan_step(tree, PlannerConfig(micro_batch_tokens=10, sharing="none"))
    with pytest.raises(PlanningError, match="mechanism 1 alone"):
        plan_step(tree, PlannerConfig(micro_batch_tokens=10, sharing="tree-dup"))
    with pytest.raises(ValueError, match="sharing"):
        PlannerConfig(micro_batch_tokens=10, sharing="bogus")


def test_one_tree_per_micro_batch():
    batch = make_workload("grpo", vocab_size=512, seed=0)
    plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=1 << 20, sharing="none",
                                                             max_trees_per_micro_batch=1))
    assert plan.num_micro_batches() == batch.num_samples
    check_plan(plan, 1 << 20)


def test_cutting_at_branch_switches_keeps_one_chain_alive():
    """``cut_at_branch_switches``: no micro-batch continues the stream into a sibling subtree,
    the plan still computes every token once with the right keys, and because a micro-batch
    that finishes a branch no longer starts the next one, far fewer prefixes are alive at the
    peak of a step-wise tree (all graphs dropped, torch backend's re-gathering)."""
    import torch

    from megatron_psrl.kvcache import KVGeometry
    from megatron_psrl.schedule.memory import simulated_peak_bytes

    batch = make_workload("stepwise", vocab_size=512, seed=1, num_tokens_target=20000)
    tree = build_prefix_tree(batch)
    assert (tree.node_parent < 0).sum() == 1  # one tree, many times the budget: all of it streams
    plans = {cut: plan_step(tree, PlannerConfig(micro_batch_tokens=128, sharing="tree", cut_at_branch_switches=cut))
             for cut in (False, True)}
    cut = plans[True]
    check_plan(cut, 128)
    assert cut.tokens_computed() == tree.num_tree_tokens
    starts = {int(tree.node_offset[n]): n for n in range(tree.num_nodes)}
    for mb in cut.ranks[0].micro_batches:
        toks = mb.tokens
        for t in toks[1:][np.diff(toks) == 1]:  # t and t - 1 in the same micro-batch
            n = starts.get(int(t))
            assert n is None or tree.node_parent[n] == n - 1, f"micro-batch {mb.index} switches branch at node {n}"
    geometry = KVGeometry(num_layers=4, num_groups=2, head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    peaks = {c: simulated_peak_bytes(p.ranks[0], geometry, {i: False for i in range(len(p.ranks[0].micro_batches))},
                                     0, gathers_in_backward=True) for c, p in plans.items()}
    # (dK/dV blocks appear at their first write, so the uncut stream's extra live prefixes hold
    # values only: 0.66 of its peak here; 0.43 when gradients lived from the producer's forward)
    assert peaks[True] < 0.7 * peaks[False]


@pytest.mark.parametrize("kind", ["grpo", "stepwise", "tree"])
def test_cutting_after_shared_prefixes_ends_a_micro_batch_at_every_branching_prefix(kind):
    """``cut_after_shared_prefixes``: a valid plan computing every token once, in which every
    node with several children of a tree streamed over micro-batches is the last node of its
    micro-batch's stretch of the stream (the first child starts the next micro-batch)."""
    batch = make_workload(kind, vocab_size=512, seed=2, num_tokens_target=6000)
    tree = build_prefix_tree(batch)
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=256, sharing="tree", cut_after_shared_prefixes=True))
    check_plan(plan, 256)
    assert plan.tokens_computed() == tree.num_tree_tokens
    owner = np.empty(tree.num_tree_tokens, dtype=np.int64)
    for mb in plan.ranks[0].micro_batches:
        owner[mb.tokens] = mb.index
    children = np.bincount(tree.node_parent[tree.node_parent >= 0], minlength=tree.num_nodes)
    roots = np.flatnonzero(tree.node_parent < 0)
    sizes = tree.node_offset[tree.node_subtree_end[roots]] - tree.node_offset[roots]
    streamed = np.zeros(tree.num_nodes, dtype=bool)  # (a tree within the budget is packed whole: not cut)
    for r in roots[sizes > 256]:
        streamed[r:tree.node_subtree_end[r]] = True
    branching = [n for n in np.flatnonzero((children > 1) & streamed)]
    assert branching
    for n in branching:  # (node n + 1 is its first child, in depth-first order)
        last, first_child = int(tree.node_offset[n + 1]) - 1, int(tree.node_offset[n + 1])
        assert owner[last] != owner[first_child], f"node {n}'s first child shares its micro-batch"
