"""The interleaved 1F1B order of virtual pipeline stages (schedule/interleaved.py): megatron's
order (its schedule table and warm-up counts, megatron-core's own functions as the reference),
its clock, and the stream with its Transfer instructions. That the transfers finish under
NCCL's rules is played in tests/training/test_stage_links_order.py."""

from types import SimpleNamespace

import pytest
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

from megatron_psrl.schedule import instructions as ins
from megatron_psrl.schedule.interleaved import forward_order, group_size, interleaved_1f1b, stage_iterations, ticks


def _steps(n):
    return [ins.LoweredStep(i, (ins.ForwardBackward(i),)) for i in range(n)]


def _megatron_warmup(micro_batches, chunks, stages, stage, group):
    """megatron's warm-up forwards of a stage (its ``get_pp_rank_microbatches``)."""
    group_of = SimpleNamespace(size=lambda: stages, rank=lambda: stage)
    p2p = SimpleNamespace(pp_group=group_of, virtual_pipeline_model_parallel_size=chunks)
    return get_pp_rank_microbatches(micro_batches, chunks, group, p2p_communicator=p2p)[2]


@pytest.mark.parametrize("stages,chunks", [(2, 2), (3, 2), (4, 3)])
def test_the_order_is_megatron_interleaved_order(stages, chunks):
    for micro_batches in range(stages, 3 * stages + 1):
        group = group_size(micro_batches, stages)
        rest = micro_batches % group
        assert group >= stages and (rest == 0 or rest >= stages)  # megatron's conditions
        order = forward_order(micro_batches, chunks, group)
        assert order == get_schedule_table(micro_batches, chunks, group)
        for stage in range(stages):
            iterations = stage_iterations(micro_batches, chunks, stages, stage)
            warmup = sum(1 for runs in iterations if len(runs) == 1 and not runs[0][0])
            assert warmup == _megatron_warmup(micro_batches, chunks, stages, stage, group)
            forwards = [(i, v) for runs in iterations for b, i, v in runs if not b]
            backwards = [(i, chunks - 1 - v) for runs in iterations for b, i, v in runs if b]
            assert forwards == backwards == order  # backwards: the same order, the chunks reversed


def test_megatron_schedule_table_example():
    """megatron's own example: PP 2, 5 micro-batches, 2 chunks, groups of 3."""
    assert group_size(5, 2) == 3
    assert forward_order(5, 2, 3) == list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))


def test_fewer_micro_batches_than_stages_go_as_one_group():
    assert group_size(3, 4) == 3
    assert forward_order(3, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize("stages,chunks,micro_batches", [(2, 2, 2), (3, 2, 6), (4, 2, 8), (4, 3, 8)])
def test_with_enough_micro_batches_each_stage_runs_one_tick_after_the_one_before(stages, chunks, micro_batches):
    """megatron's timing: iteration k of stage s at tick k + s (every input one tick old), when
    no stage runs every forward in its warm-up."""
    iterations = [stage_iterations(micro_batches, chunks, stages, s) for s in range(stages)]
    for s, times in enumerate(ticks(iterations, chunks)):
        assert times == list(range(s, s + len(iterations[s])))


def test_an_order_that_waits_for_itself_is_refused():
    # stage 0 runs micro-batch 0's backward before the forward stage 1 needs from it
    iterations = [[[(True, 0, 0)], [(False, 0, 0)]], [[(False, 0, 0), (True, 0, 0)]]]
    with pytest.raises(ValueError, match="cycle"):
        ticks(iterations, 1)


def _fmt(x):
    if isinstance(x, ins.Transfer):
        def name(m):
            return f"{m.micro_batch}@{m.boundary}" + (" grad" if m.gradient else "")
        return "T(" + ", ".join([f"send {name(m)}" for m in x.sends] + [f"recv {name(m)}" for m in x.receives]) + ")"
    return f"{'B' if isinstance(x, ins.Backward) else 'F'}({x.micro_batch}, c{x.chunk})"


def test_the_stream_of_two_stages_two_chunks():
    """The docstring's example: what a stage sends at a tick, its neighbour receives then."""
    stage0 = " ".join(_fmt(x) for x in interleaved_1f1b(_steps(2), 0, 2, 2))
    assert stage0 == ("F(0, c0) T(send 0@0) F(1, c0) T(send 1@0, recv 0@1) F(0, c1) T(send 0@2, recv 1@1) "
                      "F(1, c1) T(send 1@2, recv 0@2 grad) B(0, c1) T(send 0@1 grad, recv 1@2 grad) B(1, c1) "
                      "T(send 1@1 grad, recv 0@0 grad) B(0, c0) T(recv 1@0 grad) B(1, c0)")
    stage1 = " ".join(_fmt(x) for x in interleaved_1f1b(_steps(2), 1, 2, 2))
    assert stage1.startswith("T(recv 0@0) F(0, c0) T(send 0@1, recv 1@0) F(1, c0)")
    assert stage1.endswith("B(1, c0) T(send 1@0 grad)")  # a trailing send: last_backward passes it over
    stream = interleaved_1f1b(_steps(2), 1, 2, 2)
    assert ins.last_backward(stream) == len(stream) - 2


def test_the_stream_names_the_plan_micro_batches_and_their_chunks():
    steps = [ins.LoweredStep(i, (ins.ForwardBackward(i),)) for i in (4, 7, 5)]
    stream = interleaved_1f1b(steps, 0, 2, 2)
    runs = [(type(x).__name__, x.micro_batch, x.chunk) for x in stream if not isinstance(x, ins.Transfer)]
    assert sorted(runs) == sorted((kind, i, v) for kind in ("ForwardKeep", "Backward") for i in (4, 7, 5)
                                  for v in (0, 1))
    assert {m.micro_batch for x in stream if isinstance(x, ins.Transfer) for m in x.sends + x.receives} == {4, 7, 5}
    # a message's chunk on each end: boundary 1 lies between stage 1's chunk 0 and stage 0's chunk 1
    m = ins.StageMessage(4, 1)
    assert (m.sender_chunk(2), m.receiver_chunk(2)) == (0, 1)
    g = ins.StageMessage(4, 1, gradient=True)
    assert (g.sender_chunk(2), g.receiver_chunk(2)) == (1, 0)


def test_a_pipeline_without_micro_batches_runs_nothing():
    assert interleaved_1f1b([], 0, 2, 2) == []


def test_the_interleaved_order_refuses_a_plan_order_step():
    steps = [ins.LoweredStep(0, (ins.ForwardKeep(0),)), ins.LoweredStep(0, (ins.Backward(0),))]
    with pytest.raises(ValueError, match="independent"):
        interleaved_1f1b(steps, 0, 2, 2)
