"""Virtual pipeline stages: a step of independent micro-batches in the interleaved 1F1B order,
its transfers written into the stream.

With ``V`` model chunks per rank on ``P`` stages the model is ``V * P`` parts (virtual stages,
part ``chunk * P + stage``): a micro-batch's forward runs parts ``0, 1, ...`` (the last stage's
chunk ``v`` hands over to the first stage's chunk ``v + 1``), its backward the reverse, and at
each boundary between two parts its activation travels forward and its gradient back
(:class:`~megatron_psrl.schedule.instructions.StageMessage`).

**Each stage's order** is megatron's interleaved 1F1B (megatron-core's
``forward_backward_pipelining_with_interleaving``, whose schedule table describes it): the
micro-batches go through the chunks in groups of :func:`group_size` (``>= P``): the group's
forwards in chunk 0, then in chunk 1, and so on; the backwards in the same order, the chunks
reversed. A stage runs ``2 (P - stage - 1) + (V - 1) * group`` warm-up forwards, then one
forward and one backward per iteration, then the remaining backwards.

**The transfers** (:func:`interleaved_1f1b`). Every stage's iterations are placed on one clock,
each at the first tick its inputs allow: after the stage's previous iteration, after every
input's producer (:func:`ticks`). What a stage produces at tick ``t`` goes in round ``t``: one
:class:`~megatron_psrl.schedule.instructions.Transfer` per stage and tick, right after that
tick's model runs, with the sends of what the stage has just produced and the receives of what
its neighbours produced at the same tick. Both ends of a message post it in the same round in
one order, so round ``t`` completes on every stage once every stage has run its ticks up to
``t``, which needs only the rounds before ``t``: no stage waits for a message that is not on its
way, under NCCL's rules too (between two ranks the n-th send is the n-th receive, a send
completes when its receive is posted, a batch's operations do not wait for each other; played
for every stage, chunk and micro-batch count in tests/training/test_stage_links_order.py).
When no stage's warm-up is every forward this is megatron's own timing and pairing: each stage
runs one tick after the stage before it, and a steady-state iteration sends its forward's
output and its backward's input gradient and receives the next forward's input and the next
backward's output gradient, four operations in one batch. (A send held until the stage's next receive, as in 1F1B
(``engine/stage_links.py``), deadlocks on this order: a stage receives one iteration ahead.)
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from megatron_psrl.schedule.instructions import (
    Backward,
    ForwardBackward,
    ForwardKeep,
    Instruction,
    LoweredStep,
    StageMessage,
    Transfer,
)

Run = Tuple[bool, int, int]
"""One model run of a stage: ``(backward, micro-batch position, chunk)``."""


def group_size(num_micro_batches: int, num_stages: int) -> int:
    """Micro-batches that go through the chunks together: the smallest group of at least
    ``num_stages`` whose last group is whole or at least ``num_stages`` too (megatron's
    conditions: a smaller group would wait for itself around the ring), or every micro-batch
    when there are fewer than ``num_stages``."""
    for g in range(num_stages, num_micro_batches + 1):
        rest = num_micro_batches % g
        if rest == 0 or rest >= num_stages:
            return g
    return num_micro_batches


def forward_order(num_micro_batches: int, num_chunks: int, group: int) -> List[Tuple[int, int]]:
    """``(micro-batch position, chunk)`` of a stage's forwards, in order: each group of
    ``group`` micro-batches (the last: the rest) through chunk 0, chunk 1, ..."""
    out = []
    for start in range(0, num_micro_batches, group):
        members = range(start, min(start + group, num_micro_batches))
        out += [(i, v) for v in range(num_chunks) for i in members]
    return out


def stage_iterations(num_micro_batches: int, num_chunks: int, num_stages: int, stage: int) -> List[List[Run]]:
    """The stage's model runs, in iterations: warm-up forwards, then a forward and a backward
    each, then the remaining backwards (the module docstring)."""
    group = group_size(num_micro_batches, num_stages)
    order = forward_order(num_micro_batches, num_chunks, group)
    forwards = [(False, i, v) for i, v in order]
    backwards = [(True, i, num_chunks - 1 - v) for i, v in order]
    total = len(order)
    warmup = min(total, 2 * (num_stages - stage - 1) + (num_chunks - 1) * group)
    out = [[f] for f in forwards[:warmup]]
    out += [[forwards[warmup + k], backwards[k]] for k in range(total - warmup)]
    return out + [[b] for b in backwards[total - warmup:]]


def _part(run: Run, stage: int, num_stages: int) -> int:
    return run[2] * num_stages + stage


def _input(run: Run, stage: int, num_stages: int, num_parts: int):
    """The run on another stage whose output this run reads, ``(backward, position, part)``
    (None: the first part's forward, the last part's backward)."""
    backward, i, _ = run
    part = _part(run, stage, num_stages)
    if backward:
        return (True, i, part + 1) if part + 1 < num_parts else None
    return (False, i, part - 1) if part > 0 else None


def ticks(iterations: List[List[List[Run]]], num_chunks: int) -> List[List[int]]:
    """Per stage, the tick of each iteration: the first after the stage's previous iteration and
    after the iterations that produce its inputs (``iterations[stage]``, as
    :func:`stage_iterations` gives them)."""
    num_stages = len(iterations)
    num_parts = num_stages * num_chunks
    done: Dict[Tuple[bool, int, int], int] = {}  # (backward, position, part) -> its tick
    out: List[List[int]] = [[] for _ in range(num_stages)]
    while any(len(out[s]) < len(iterations[s]) for s in range(num_stages)):
        moved = False
        for s in range(num_stages):
            if len(out[s]) == len(iterations[s]):
                continue
            runs = iterations[s][len(out[s])]
            inputs = [_input(run, s, num_stages, num_parts) for run in runs]
            if any(x is not None and x not in done for x in inputs):
                continue
            t = max([out[s][-1] + 1 if out[s] else 0] + [done[x] + 1 for x in inputs if x is not None])
            out[s].append(t)
            for backward, i, v in runs:
                done[(backward, i, v * num_stages + s)] = t
            moved = True
        if not moved:
            raise ValueError("the stages' orders wait for each other in a cycle")
    return out


def _rounds(iterations: List[List[List[Run]]], times: List[List[int]], num_chunks: int):
    """Per stage, tick -> ``(sends, receives)`` of its round at that tick."""
    num_stages = len(iterations)
    num_parts = num_stages * num_chunks
    rounds: List[Dict[int, Tuple[List[StageMessage], List[StageMessage]]]] = [{} for _ in range(num_stages)]
    for s in range(num_stages):
        for runs, t in zip(iterations[s], times[s]):
            for run in runs:
                backward, i, _ = run
                part = _part(run, s, num_stages)
                if backward and part > 0:
                    message, peer = StageMessage(i, part - 1, gradient=True), (part - 1) % num_stages
                elif not backward and part + 1 < num_parts:
                    message, peer = StageMessage(i, part), (part + 1) % num_stages
                else:
                    continue
                rounds[s].setdefault(t, ([], []))[0].append(message)
                rounds[peer].setdefault(t, ([], []))[1].append(message)
    return rounds


def interleaved_1f1b(steps: List[LoweredStep], stage: int, num_stages: int, num_chunks: int) -> List[Instruction]:
    """A pipeline stage's share of a mechanism-1 step (every step a :class:`ForwardBackward`)
    with ``num_chunks`` model chunks per rank, in the interleaved 1F1B order: one
    :class:`ForwardKeep` and one :class:`Backward` per micro-batch and chunk, and a
    :class:`Transfer` after each tick that sends or receives (the module docstring).

    Stage 0 of 2 with 2 chunks and micro-batches 0, 1 (parts 0 and 2 here, 1 and 3 on stage 1):
    ``F(0, c0) T(send 0@0) F(1, c0) T(send 1@0, recv 0@1) F(0, c1) T(send 0@2, recv 1@1)
    F(1, c1) T(send 1@2, recv 0@2 grad) B(0, c1) T(send 0@1 grad, recv 1@2 grad) B(1, c1)
    T(send 1@1 grad, recv 0@0 grad) B(0, c0) T(recv 1@0 grad) B(1, c0)``
    (``i@b``: micro-batch ``i`` at boundary ``b``)."""
    for step in steps:
        if not all(isinstance(x, ForwardBackward) for x in step.instructions):
            raise ValueError(f"the interleaved order runs independent micro-batches only, not {step.instructions}")
    order = [step.micro_batch for step in steps]  # position -> micro-batch
    if not order:  # (a pipeline without micro-batches in this step: every stage alike)
        return []
    iterations = [stage_iterations(len(order), num_chunks, num_stages, s) for s in range(num_stages)]
    times = ticks(iterations, num_chunks)
    rounds = _rounds(iterations, times, num_chunks)[stage]
    runs = dict(zip(times[stage], iterations[stage]))
    out: List[Instruction] = []
    for t in sorted(set(runs) | set(rounds)):
        for backward, i, v in runs.get(t, ()):
            out.append(Backward(order[i], chunk=v) if backward else ForwardKeep(order[i], chunk=v))
        if t in rounds:
            sends, receives = rounds[t]
            out.append(Transfer(tuple(_named(sorted(sends), order)), tuple(_named(sorted(receives), order))))
    return out


def _named(messages: List[StageMessage], order: List[int]) -> List[StageMessage]:
    """Messages of micro-batch positions as messages of the micro-batches themselves."""
    return [StageMessage(order[m.micro_batch], m.boundary, m.gradient) for m in messages]
