"""A rank's plan lowered into typed instructions (``schedule/instructions.py``): every micro-batch
the schedule runs appears exactly as the schedule and the memory plan say (kept or dropped
graphs, the expert lockstep's passes), cached K/V are allocated before they are produced or
received and released exactly once, heads are sent after their forward and their gradients
collected before their backward, and the executor has one method for every kind."""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_psrl.data.synthetic import make_stepwise, make_tree_rollouts
from megatron_psrl.engine.step import EXECUTE
from megatron_psrl.kvcache import KVGeometry
from megatron_psrl.kvcache.prefix_state import GRADS, GRADS_ONLY, VALUES
from megatron_psrl.schedule import instructions as ins
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import plan_forward_memory, plan_memory_group, simulated_peak_bytes
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree.build import build_prefix_tree

GEOM = KVGeometry(num_layers=2, num_groups=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
ACT = 4096
"""Activation bytes per token of a kept graph (large next to the K/V: dropping graphs saves)."""


def _stepwise():
    return build_prefix_tree(make_stepwise(num_trajectories=8, turns=(3, 5), obs_len=(10, 30), action_len=(4, 8),
                                           system_len=40, task_len=(5, 10), vocab_size=97, seed=3))


def _search_tree():
    return build_prefix_tree(make_tree_rollouts(num_roots=2, branching=2, depth=3, segment_len=(6, 16),
                                                prompt_len=(40, 60), obs_len=(8, 20), vocab_size=97, seed=5))


# (ranks, exchange group size, placement, cross-group prefix): mechanism 2 on one rank, whole
# trees over ranks, cross-rank fragments, heads sent between groups
LAYOUTS = [(1, 1, "whole-tree", "recompute"), (2, 1, "whole-tree", "recompute"), (4, 4, "cross-rank", "recompute"),
           (4, 2, "cross-rank", "transfer"), (4, 2, "whole-tree", "transfer")]


def _plans(make_tree, ranks, group_size, placement, mode, tight=False):
    """The step plan and every rank's memory plan; ``tight``: under the smallest KV budget the
    group's timelines reach with every graph dropped (so the memory plan drops graphs)."""
    config = PlannerConfig(micro_batch_tokens=64, data_parallel_size=ranks, exchange_group_size=group_size,
                           placement=placement, cross_group_prefix=mode)
    plan = plan_step(make_tree(), config)
    memories = [None] * ranks
    for group in plan.groups:
        rank_plans = [plan.ranks[r] for r in group]
        if not any(rp.sources for rp in rank_plans):
            continue
        budget = 1 << 40
        if tight:
            roomy = plan_memory_group(rank_plans, GEOM, budget, ACT)
            budget = max(simulated_peak_bytes(rp, GEOM, {p: False for p in m.keep_graph}, ACT)
                         for rp, m in zip(rank_plans, roomy))
        for r, memory in zip(group, plan_memory_group(rank_plans, GEOM, budget, ACT)):
            memories[r] = memory
    return plan, memories


def _generous_and_tight(make_tree, layout):
    return [_plans(make_tree, *layout), _plans(make_tree, *layout, tight=True)]


@pytest.mark.parametrize("make_tree", [_stepwise, _search_tree], ids=["stepwise", "search-tree"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_training_stream_follows_the_schedule_and_the_memory_plan(make_tree, layout):
    for plan, memories in _generous_and_tight(make_tree, layout):
        for rank_plan, memory in zip(plan.ranks, memories):
            stream = ins.training_instructions(rank_plan, memory)
            _check_training_stream(rank_plan, memory, stream)


def _check_training_stream(rank_plan, memory, stream):
    keep = memory.keep_graph if memory is not None else {}
    expected_runs = []
    for op, i in rank_plan.schedule:
        mb = rank_plan.micro_batches[i]
        if not mb.computes:
            continue
        if op == "forward_backward":
            expected_runs.append(("P", i))
        elif op == "forward":
            expected_runs.append(("K" if keep.get(i, True) else "N", i))
        else:
            expected_runs.append(("B" if keep.get(i, True) else "P", i))
    # the expert lockstep counts exactly the passes the schedule and the memory plan imply
    assert ins.lockstep_passes(stream) == expected_runs
    allocated, released, forwarded, roles = set(), {}, set(), set()
    exported = {s.producer for s in rank_plan.sources.values() if s.exported is not None}
    for x in stream:
        if isinstance(x, ins.ForwardBackward):
            mb = rank_plan.micro_batches[x.micro_batch]
            grads = {(s, GRADS) for s in mb.reads if GRADS in rank_plan.sources[s].kinds}
            assert grads <= roles, "a reader's gradients written into blocks nobody allocated"
        if isinstance(x, ins.AllocateKV):
            kinds = {(s, role) for s in x.sources for role in (x.kinds or rank_plan.sources[s].kinds)}
            assert not roles & kinds, "a source's blocks of one role allocated twice"
            roles |= kinds
            allocated |= set(x.sources)
        elif isinstance(x, ins.ReleaseKV):
            for s in x.sources:
                assert s in allocated, f"source {s} released before it was allocated"
                assert x.kinds not in released.setdefault(s, set()), f"source {s} released twice"
                released[s].add(x.kinds)
        elif isinstance(x, (ins.ForwardKeep, ins.ForwardDrop, ins.ImportHead)):
            produces = rank_plan.micro_batches[x.micro_batch].produces
            written = {(s, VALUES) for s in produces if VALUES in rank_plan.sources[s].kinds}
            assert written <= roles, "a micro-batch produces into blocks nobody allocated"
            forwarded.add(x.micro_batch)
        elif isinstance(x, ins.SendHeads):
            assert x.micro_batch in exported and x.micro_batch in forwarded
        elif isinstance(x, (ins.CollectHeadGrads, ins.ReturnHeadGrads, ins.Backward, ins.ReturnReplicaGrads)):
            assert x.micro_batch in forwarded, "a backward-side instruction before its forward"
            mb = rank_plan.micro_batches[x.micro_batch]
            grads = {(s, GRADS) for s in tuple(mb.reads) + tuple(mb.produces) if GRADS in rank_plan.sources[s].kinds}
            assert grads <= roles, "gradients written into blocks nobody allocated"
            if isinstance(x, ins.CollectHeadGrads):
                assert x.micro_batch in exported
    # every source this rank produces or receives is allocated, and everything goes by the end
    assert allocated == set(rank_plan.sources)
    assert roles == {(s, role) for s, src in rank_plan.sources.items() for role in src.kinds}
    for s in allocated:
        assert ins.ALL_KINDS in released.get(s, set()), f"source {s} keeps blocks past the step"
    # a replica's gradients go back right before the backward of the step that made it
    for k, x in enumerate(stream):
        if isinstance(x, ins.ReturnReplicaGrads):
            assert isinstance(stream[k + 1], ins.Backward) and stream[k + 1].micro_batch == x.micro_batch


@pytest.mark.parametrize("make_tree", [_stepwise, _search_tree], ids=["stepwise", "search-tree"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_gradient_blocks_come_with_the_first_step_that_writes_them(make_tree, layout):
    """A source's fp32 dK/dV blocks are allocated by the step whose work writes them first (the
    backward of its first reader here, else its producer's backward, where other ranks'
    gradients are added), not by its producer's forward; no backward before that step reads it."""
    deferred = 0
    for plan, memories in _generous_and_tight(make_tree, layout):
        for rank_plan, memory in zip(plan.ranks, memories):
            keep, release = (memory.keep_graph, memory.kv_release_step) if memory is not None else ({}, {})
            for t, step in enumerate(ins.lower_training(rank_plan, keep, release)):
                op, i = rank_plan.schedule[t]
                mb = rank_plan.micro_batches[i]
                for x in step.instructions:
                    if not (isinstance(x, ins.AllocateKV) and x.kinds == GRADS_ONLY):
                        continue
                    assert op != "forward", "gradient blocks allocated by a forward"
                    for s in x.sources:
                        assert s in mb.reads or (op == "backward" and s in mb.produces), (t, s)
                        assert not any(o != "forward" and s in rank_plan.micro_batches[j].reads
                                       for o, j in rank_plan.schedule[:t]), f"source {s}: a reader's backward came first"
                        deferred += rank_plan.sources[s].producer != i
    assert deferred > 0


def test_last_backward_is_the_last_model_backward_with_only_local_work_after_it():
    """The pass during which the data-parallel gradient reduce may start: the last backward of
    the stream, unless something after it communicates (a head's dK/dV returned to its home)."""
    B, FB, K = ins.Backward, ins.ForwardBackward, ins.ForwardKeep
    local = [ins.ReleaseKV((0,), ins.ALL_KINDS), ins.AllocateKV((1,))]
    assert ins.last_backward([K(0), FB(1), B(0)] + local) == 2
    assert ins.last_backward([K(0), B(0, recompute=True), FB(1)]) == 2
    assert ins.last_backward([K(0), B(0), ins.ReturnHeadGrads(0)] + local) is None
    assert ins.last_backward([ins.Forward(0)]) is None and ins.last_backward([]) is None
    # a forward-backward that certainly runs no backward (nothing claimed) is passed over
    assert ins.last_backward([K(0), B(0), FB(1)] + local, empty=lambda x: x.micro_batch == 1) == 1
    assert ins.last_backward([FB(1)], empty=lambda x: True) is None
    armed = 0
    for make_tree in (_stepwise, _search_tree):
        for layout in LAYOUTS:
            for plan, memories in _generous_and_tight(make_tree, layout):
                for rank_plan, memory in zip(plan.ranks, memories):
                    stream = ins.training_instructions(rank_plan, memory)
                    k = ins.last_backward(stream)
                    runs = [j for j, x in enumerate(stream) if isinstance(x, (B, FB))]
                    if k is None:
                        assert not runs or any(not isinstance(x, ins.LOCAL_INSTRUCTIONS)
                                               for x in stream[runs[-1] + 1:])
                    else:
                        armed += 1
                        assert k == runs[-1]
    assert armed, "no layout arms a backward"


def test_the_layouts_exercise_every_instruction_kind():
    """The layouts above reach every kind the executor knows (a guard on the test's coverage)."""
    kinds = set()
    for make_tree in (_stepwise, _search_tree):
        for layout in LAYOUTS:
            for plan, memories in _generous_and_tight(make_tree, layout):
                for rank_plan, memory in zip(plan.ranks, memories):
                    kinds |= {type(x) for x in ins.training_instructions(rank_plan, memory)}
    # (Transfer: virtual pipeline stages, test_interleaved.py; Residency: host offload, test_memory_budget.py)
    trained = set(EXECUTE) - {ins.Forward, ins.Transfer, ins.Residency}
    assert kinds == trained, f"not reached: {sorted(k.__name__ for k in trained - kinds)}"


@pytest.mark.parametrize("make_tree", [_stepwise, _search_tree], ids=["stepwise", "search-tree"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_forward_stream_runs_every_computing_micro_batch_once_in_order(make_tree, layout):
    plan, _ = _plans(make_tree, *layout)
    for rank_plan in plan.ranks:
        memory = plan_forward_memory(rank_plan, GEOM, 1 << 40) if rank_plan.sources else None
        stream = ins.forward_instructions(rank_plan, memory)
        runs = [x.micro_batch for x in stream if isinstance(x, ins.Forward)]
        assert runs == [i for i, mb in enumerate(rank_plan.micro_batches) if mb.computes]
        assert ins.lockstep_passes(stream) == [("N", i) for i in runs]
        assert not any(isinstance(x, (ins.Backward, ins.ForwardKeep, ins.ForwardDrop, ins.ReturnHeadGrads,
                                      ins.CollectHeadGrads, ins.ReturnReplicaGrads)) for x in stream)
        # a source's K/V are allocated only if read here, and released after its last reader
        allocated = [s for x in stream if isinstance(x, ins.AllocateKV) for s in x.sources]
        released = [s for x in stream if isinstance(x, ins.ReleaseKV) for s in x.sources]
        assert sorted(allocated) == sorted(released) == sorted(set(allocated))
        assert set(allocated) == set(memory.kv_release_step) if memory is not None else not allocated


def test_executor_has_one_method_per_instruction_kind():
    from megatron_psrl.engine.step import StepRunner

    kinds = {c for c in vars(ins).values() if isinstance(c, type) and issubclass(c, ins.Instruction)
             and dataclasses.is_dataclass(c) and c not in (ins.Instruction, ins.MicroBatchInstruction)}
    assert set(EXECUTE) == kinds
    assert all(callable(getattr(StepRunner, name)) for name in EXECUTE.values())
    assert len(set(EXECUTE.values())) == len(EXECUTE)


def test_instructions_are_frozen_values():
    a, b = ins.Backward(3, recompute=True), ins.Backward(3, recompute=True)
    assert a == b and hash(a) == hash(b) and a.pass_kind == "P" and ins.Backward(3).pass_kind == "B"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.micro_batch = 4
    assert np.all([x.pass_kind is None for x in (ins.AllocateKV((1,)), ins.ReleaseKV((1,)), ins.SendHeads(0))])


def _independent_steps(n):
    return [ins.LoweredStep(i, (ins.ForwardBackward(i),)) for i in range(n)]


def _order(steps):
    return " ".join(("F" if isinstance(x, ins.ForwardKeep) else "B") + str(x.micro_batch)
                    for x in ins.flatten(steps))


def test_one_f_one_b_warms_up_by_the_stages_after_it():
    assert _order(ins.one_f_one_b(_independent_steps(4), 0, 2)) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _order(ins.one_f_one_b(_independent_steps(4), 1, 2)) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert _order(ins.one_f_one_b(_independent_steps(4), 0, 4)) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert _order(ins.one_f_one_b(_independent_steps(2), 0, 4)) == "F0 F1 B0 B1"  # fewer micro-batches than stages
    assert ins.one_f_one_b([], 0, 2) == []


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_one_f_one_b_runs_each_forward_before_its_backward_and_holds_at_most_the_stages_after_it(stages, n):
    for stage in range(stages):
        stream = ins.flatten(ins.one_f_one_b(_independent_steps(n), stage, stages))
        assert sorted(x.micro_batch for x in stream if isinstance(x, ins.ForwardKeep)) == list(range(n))
        assert [x.micro_batch for x in stream if isinstance(x, ins.Backward)] == list(range(n))  # first in, first out
        held, peak = set(), 0
        for x in stream:
            if isinstance(x, ins.ForwardKeep):
                held.add(x.micro_batch)
            else:
                assert x.micro_batch in held and not x.recompute
                held.remove(x.micro_batch)
            peak = max(peak, len(held))
        assert peak == min(stages - stage, n)


def test_one_f_one_b_refuses_a_plan_order_step():
    steps = [ins.LoweredStep(0, (ins.ForwardKeep(0),)), ins.LoweredStep(0, (ins.Backward(0),))]
    with pytest.raises(ValueError, match="independent"):
        ins.one_f_one_b(steps, 0, 2)
