"""``check_plan`` (megatron_psrl/schedule/plan.py): every plan the planners make passes it, for every
workload, budget, sharing mode and data-parallel / exchange-group layout; and every invariant it
checks is real: a plan corrupted in one way (a claim dropped or duplicated, a reader before its
producer, a producer's backward before its reader's, a schedule step lost, an exchange on one
side only, a replica's gradients not returned) fails it with a message naming what is wrong."""

import copy

import numpy as np
import pytest
from helpers.batches import cross_rank_batch, random_tree_batch

from megatron_psrl.data import make_workload
from megatron_psrl.schedule import check as plan_module
from megatron_psrl.schedule.check import check_plan, maybe_check_plan
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.plan import PlanInvariantError, PlanningError
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree
from megatron_psrl.tree.index import TreeIndex

COST = CostModel.named("tiny")
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (3, 3)]  # (data_parallel_size, exchange_group_size)


def _plan(tree, budget, sharing="tree", dp=1, g=1, placement="auto", **kw):
    return plan_step(tree, PlannerConfig(micro_batch_tokens=budget, sharing=sharing, data_parallel_size=dp,
                                         exchange_group_size=g, placement=placement,
                                         cost_model=COST if dp > 1 else None, **kw))


def _targets(index, mb):
    """Tree tokens whose log-prob micro-batch ``mb`` computes (as ``pack_tokens`` does)."""
    tok = mb.tokens
    local = mb.owned & np.isin(index.pred[tok], tok)
    return np.concatenate([tok[local], mb.remote_targets])


# ---------------------------------------------------------------------- every plan passes
@pytest.mark.parametrize("workload", ["grpo", "stepwise", "tree", "mixed"])
@pytest.mark.parametrize("sharing", ["tree", "tree-dup", "none"])
def test_workload_plans_pass(workload, sharing):
    tree = build_prefix_tree(make_workload(workload, vocab_size=512, seed=3))
    n = tree.num_tree_tokens
    checked = 0
    for budget in sorted({64, 256, max(64, n // 10), n + 1}):
        for dp, g in LAYOUTS:
            for placement in (["auto", "cross-rank"] if g > 1 else ["auto"]):
                for cut in (False, True):
                    try:
                        plan = _plan(tree, budget, sharing, dp, g, placement, cut_at_branch_switches=cut)
                    except PlanningError:
                        assert sharing != "tree"  # only a sample longer than the budget cannot be planned
                        continue
                    check_plan(plan)
                    checked += 1
    assert checked >= 10


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [5, 17, 40, 1000])
def test_random_batch_plans_pass(seed, budget):
    tree = build_prefix_tree(random_tree_batch(seed))
    for dp, g in LAYOUTS:
        for placement in (["whole-tree", "cross-rank"] if g > 1 else ["auto"]):
            check_plan(_plan(tree, budget, "tree", dp, g, placement))


@pytest.mark.parametrize("kind", ["one-tree", "chain", "stepwise", "mixed"])
@pytest.mark.parametrize("dp,g", [(2, 2), (4, 4), (4, 2)])
def test_cross_rank_plans_pass(kind, dp, g):
    tree = build_prefix_tree(cross_rank_batch(kind))
    for budget in (16, 48, 128):
        plan = _plan(tree, budget, "tree", dp, g, "cross-rank")
        assert "cross-rank" in plan.placements
        check_plan(plan)


def test_plan_step_checks_when_asked(monkeypatch):
    """``PSRL_CHECK_PLANS=1`` makes ``plan_step`` check the plan it returns; anything else does not."""
    calls = []
    monkeypatch.setattr(plan_module, "check_plan", lambda plan: calls.append(plan))
    tree = build_prefix_tree(random_tree_batch(0))
    monkeypatch.setenv("PSRL_CHECK_PLANS", "1")
    plan = _plan(tree, 17)
    assert calls == [plan]
    monkeypatch.setenv("PSRL_CHECK_PLANS", "0")
    _plan(tree, 17)
    monkeypatch.delenv("PSRL_CHECK_PLANS")
    assert maybe_check_plan(plan) is plan
    assert len(calls) == 1


# ---------------------------------------------------------------------- corrupted plans fail
def _stream_plan():
    """One rank, mechanism 2: a stream of chunks with cached sources and remote targets."""
    tree = build_prefix_tree(make_workload("stepwise", vocab_size=512, seed=1))
    plan = copy.deepcopy(_plan(tree, 128))
    assert plan.ranks[0].sources
    return plan


def _cross_plan():
    """A cross-rank group of 4 with peer chains and replicas."""
    tree = build_prefix_tree(cross_rank_batch("chain"))
    plan = copy.deepcopy(_plan(tree, 48, "tree", 4, 4, "cross-rank"))
    assert plan.placements == ["cross-rank"]
    assert any(s.replica_of is not None for r in plan.ranks for s in r.sources.values())
    return plan


def test_a_dropped_claim_fails():
    plan = _stream_plan()
    tree, index = plan.tree, plan.index
    claimed = np.diff(tree.claim_offsets) > 0
    mb = next(mb for mb in plan.ranks[0].micro_batches
              if len(mb.remote_targets) and claimed[mb.remote_targets].any())
    t = int(mb.remote_targets[claimed[mb.remote_targets]][0])
    mb.remote_targets = mb.remote_targets[mb.remote_targets != t]
    with pytest.raises(PlanInvariantError, match=rf"loss claims of tree token {t} .* computed 0 times"):
        check_plan(plan)
    # the same for a claim of a token inside a micro-batch, no longer owned there
    plan = _stream_plan()
    mb = plan.ranks[0].micro_batches[1]
    t = int(next(x for x in _targets(index, mb) if claimed[x] and x in mb.tokens))
    mb.owned[np.searchsorted(mb.tokens, t)] = False
    with pytest.raises(PlanInvariantError, match=rf"loss claims of tree token {t} .* computed 0 times"):
        check_plan(plan)


def test_a_duplicated_claim_fails():
    """A micro-batch of rank 0 computed on rank 1 too (a tree placed twice)."""
    tree = build_prefix_tree(make_workload("grpo", vocab_size=512, seed=3))
    plan = copy.deepcopy(_plan(tree, 1024, dp=2))
    i, mb = next((i, mb) for i, mb in enumerate(plan.ranks[0].micro_batches) if not mb.reads and not mb.produces)
    t = int(next(x for x in _targets(plan.index, mb) if plan.tree.claim_offsets[x + 1] > plan.tree.claim_offsets[x]))
    rank1 = plan.ranks[1]
    copied = copy.deepcopy(mb)
    copied.index = j = len(rank1.micro_batches)
    rank1.micro_batches.append(copied)
    rank1.schedule.append(("forward_backward", j))
    with pytest.raises(PlanInvariantError, match=rf"loss claims of tree token {t} .* computed 2 times, not once "
                                                 rf"\(rank 0 micro-batch {i}, rank 1 micro-batch {j}\)"):
        check_plan(plan)


def test_duplicated_context_owned_twice_fails():
    """Duplication mode: a context copy of a claimed ancestor marked owned computes its claims twice."""
    tree = build_prefix_tree(random_tree_batch(1))
    plan = copy.deepcopy(_plan(tree, 40, "tree-dup"))
    index, claimed = plan.index, np.diff(plan.tree.claim_offsets) > 0
    for mb in plan.ranks[0].micro_batches:
        ctx = np.flatnonzero(~mb.owned & claimed[mb.tokens] & np.isin(index.pred[mb.tokens], mb.tokens))
        if len(ctx):
            mb.owned[ctx[0]] = True
            t = int(mb.tokens[ctx[0]])
            break
    else:
        pytest.fail("no claimed context token in the duplication plan")
    with pytest.raises(PlanInvariantError,
                       match=rf"loss claims of tree token {t} .* computed 2 times, not once \(rank 0 "):
        check_plan(plan)


def test_a_reader_before_its_producer_fails():
    plan = _stream_plan()
    rank = plan.ranks[0]
    src = next(s for s in rank.sources.values() if s.consumers)
    p, c = src.producer, src.consumers[0]
    step = ("forward", p)
    rank.schedule.remove(step)
    at = next(t for t, (op, i) in enumerate(rank.schedule) if i == c and op in ("forward", "forward_backward"))
    rank.schedule.insert(at + 1, step)
    with pytest.raises(PlanInvariantError, match=rf"micro-batch {c} reads source {src.source_id} .* before its "
                                                 rf"producer micro-batch {p} runs forward"):
        check_plan(plan)


def test_a_producer_backward_before_its_reader_fails():
    plan = _stream_plan()
    rank = plan.ranks[0]
    src = next(s for s in rank.sources.values() if s.consumers)
    p, c = src.producer, src.consumers[-1]
    step = ("backward", p)
    rank.schedule.remove(step)
    at = next(t for t, (op, i) in enumerate(rank.schedule) if i == c and op in ("backward", "forward_backward"))
    rank.schedule.insert(at, step)
    with pytest.raises(PlanInvariantError, match=rf"the backward of micro-batch {p} .* runs before that of "
                                                 r"micro-batch \d+ .*, which reads its source"):
        check_plan(plan)


def test_a_lost_or_repeated_schedule_step_fails():
    plan = _stream_plan()
    rank = plan.ranks[0]
    op, i = rank.schedule.pop()
    with pytest.raises(PlanInvariantError, match=rf"micro-batches \[{i}\] never run backward"):
        check_plan(plan)
    plan = _stream_plan()
    plan.ranks[0].schedule.append(("forward_backward", 0))
    with pytest.raises(PlanInvariantError, match="micro-batch 0 runs forward twice"):
        check_plan(plan)


def test_an_unreadable_micro_batch_fails():
    """A chunk that no longer reads one of its cached ancestors sees too few keys."""
    plan = _stream_plan()
    rank = plan.ranks[0]
    src = next(s for s in rank.sources.values() if s.consumers)
    c = src.consumers[0]
    rank.micro_batches[c].reads.remove(src.source_id)
    src.consumers.remove(c)
    with pytest.raises(PlanInvariantError, match=rf"rank 0 micro-batch {c}: tree token \d+ .* sees \d+ ancestor keys"):
        check_plan(plan)


def test_an_exchange_on_one_side_fails():
    # the receiver does not expect what the sender sends
    plan = _cross_plan()
    m, q, r = next((m, q, r) for m in range(len(plan.ranks[0].micro_batches)) for q, rank in enumerate(plan.ranks)
                   if rank.micro_batches[m].exchange is not None
                   for r in rank.micro_batches[m].exchange.send if rank.micro_batches[m].exchange.send[r])
    del plan.ranks[r].micro_batches[m].exchange.recv[q]
    with pytest.raises(PlanInvariantError, match=rf"step {m}: rank {q} -> rank {r}: the sender sends chains of "
                                                 r"\[\d+(, \d+)*\] tokens, the receiver expects \[\]"):
        check_plan(plan)
    # the sender does not send what the receiver expects
    plan = _cross_plan()
    del plan.ranks[q].micro_batches[m].exchange.send[r]
    with pytest.raises(PlanInvariantError, match=rf"step {m}: rank {q} -> rank {r}: the sender sends chains of \[\] "
                                                 r"tokens, the receiver expects \[\d+"):
        check_plan(plan)


def test_replica_gradients_on_one_side_fail():
    plan = _cross_plan()
    r, s, src = next((r, s, src) for r, rank in enumerate(plan.ranks) for s, src in rank.sources.items()
                     if src.replica_of is not None)
    q, _ = src.replica_of
    ex = plan.ranks[q].micro_batches[src.producer].exchange
    del ex.grad_recv[r]
    with pytest.raises(PlanInvariantError, match=rf"step {src.producer}: rank {r} returns the gradients of replicas "
                                                 rf"\[.*\] to rank {q}, which expects those of its sources \[\]"):
        check_plan(plan)


def test_a_cross_rank_group_out_of_lockstep_fails():
    """Rank 1 alone splits a forward_backward into forward, backward: a valid schedule for the
    rank, but its collectives would no longer match the group's."""
    plan = _cross_plan()
    schedule = plan.ranks[1].schedule
    t = schedule.index(next(step for step in schedule if step[0] == "forward_backward"))
    i = schedule[t][1]
    schedule[t:t + 1] = [("forward", i), ("backward", i)]
    with pytest.raises(PlanInvariantError, match="rank 1 does not run the same steps and schedule as rank 0"):
        check_plan(plan)


def test_checker_sees_the_plans_tokens():
    """The checker reads the plan's own index: a plan whose index is over another tree fails."""
    plan = _stream_plan()
    plan.index = TreeIndex(build_prefix_tree(random_tree_batch(0)))
    with pytest.raises(PlanInvariantError, match="index is not over the plan's tree"):
        check_plan(plan)
