"""A training step's measured peak against the memory plan with a varlen backend (flash / te).

The kernels need CUDA; their gather, regather and fp32 gradient sum are torch code. Here a CPU
step runs the ``flash`` path with the reference varlen kernel (flash-attn's contract, in
``tests/helpers/varlen_reference.py``) in place of flash-attn, and the heap's peak above the
step's start (``PeakMemory``, every torch operation) must stay under
:func:`~megatron_psrl.schedule.memory.step_peak_bytes` with the plan's :class:`VarlenCharge`,
on a GRPO batch (one prompt's K/V gathered once per response, 160 responses) and a step-wise
chain (mechanism 2: every turn reads the cached turns before it).

Measured on a loaded 2-core machine, tiny-llama fp32, micro-batches of 512 tokens: GRPO 86.7 MB
against a plan of 170.1 MB (0.51; 73.8 MB without the charge, which the step exceeds: 1.18),
step-wise 38.8 MB against 57.0 MB (0.68; 55.2 MB without). The charge is an upper bound for
flash-attn, looser than the reference kernel needs: it counts flash-attn's per-query-head dK/dV
under GQA and one fp32 sum row per gathered key. The cached prefixes are read from the cache
again in backward, not kept as copies: on a step-wise chain of three micro-batches 93.2 MB
against 97.0 MB with copies kept (planned 102.0 and 103.5 MB).
"""

import os
import sys

import pytest
import torch
from helpers.torchrun import REPO_ROOT
from helpers.varlen_reference import reference_kernel

from megatron_psrl.attention import core_attention
from megatron_psrl.attention.backends.varlen import varlen_tree_attention
from megatron_psrl.engine.memory import heap_bytes_in_use

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

MICRO_BATCH_TOKENS = 512


def _workloads(vocab: int):
    from megatron_psrl.data import make_grpo, make_stepwise

    return {
        "grpo": make_grpo(num_prompts=1, group_size=160, prompt_len=(384, 384), response_len=(4, 8),
                          vocab_size=vocab, seed=1),
        "stepwise": make_stepwise(num_trajectories=1, turns=(6, 6), obs_len=(60, 120), action_len=(10, 20),
                                  system_len=100, task_len=(50, 80), vocab_size=vocab, seed=1),
    }


@pytest.fixture
def varlen_engine(monkeypatch):
    """A CPU engine whose attention takes the ``flash`` path around the reference kernel."""
    import gpu_acceptance

    def flash_on_cpu(q, k, v, plan, external=(), scale=None, deterministic=False):
        return varlen_tree_attention(q, k, v, plan, external, reference_kernel(scale))

    monkeypatch.setattr(core_attention, "flash_tree_attention", flash_on_cpu)
    torch.set_num_threads(1)  # (the reference kernel's many small products; and no thread-pool noise)
    engine = gpu_acceptance._engine(gpu_acceptance.Target("cpu", "tiny-llama"), "torch", MICRO_BATCH_TOKENS)
    engine.backend_name = "flash"
    engine.runner.attention_backend = "flash"
    return gpu_acceptance, engine


def _measured_and_planned(gpu_acceptance, engine, batch):
    """The step's measured peak and the plan's prediction, with the varlen charge and without."""
    gpu_acceptance._step(engine, engine.runner, batch, "tree", "flash")  # warm-up: allocator, gradient buffers
    row = gpu_acceptance._step(engine, engine.runner, batch, "tree", "flash", measure=True)
    charged = type(engine).__dict__["varlen_charge"]
    try:
        type(engine).varlen_charge = property(lambda self: None)  # the plan as it was: no varlen terms
        row["predicted_without_charge"] = gpu_acceptance.predicted_peak_bytes(engine, batch, "tree", "flash")
    finally:
        type(engine).varlen_charge = charged
    return row


@pytest.mark.skipif(heap_bytes_in_use() is None, reason="needs glibc's mallinfo2")
@pytest.mark.slow  # a process of its own, eight CPU training steps (a warm-up and the measured one per workload, and
# a longer step-wise chain read from the cache and with copies kept)
@pytest.mark.fresh_process  # heap figures: nothing else may allocate or free meanwhile
def test_measured_step_peak_is_within_the_plan_with_the_varlen_path(varlen_engine, monkeypatch):
    gpu_acceptance, engine = varlen_engine
    assert engine.varlen_charge is not None
    for name, batch in _workloads(engine.arch.vocab_size).items():
        row = _measured_and_planned(gpu_acceptance, engine, batch)
        ratio = row["measured_bytes"] / row["predicted_bytes"]
        print(f"{name}: measured {row['measured_bytes']} planned {row['predicted_bytes']} ratio {ratio:.3f} "
              f"(planned without the varlen charge {row['predicted_without_charge']}) "
              f"micro-batches {row['micro_batches']} mechanism2 {row['mechanism2']}")
        assert ratio <= 1.0, (name, row)
        assert row["mechanism2"] and row["micro_batches"] > 1, row
        if name == "grpo":  # the gathered copies are what the plan without the charge misses
            assert row["measured_bytes"] > row["predicted_without_charge"], row
    _check_the_copies_cut(gpu_acceptance, engine, monkeypatch)


def _check_the_copies_cut(gpu_acceptance, engine, monkeypatch):
    """The cut of the copies, measured: a step-wise chain of three micro-batches whose kept
    producers read the turns before them, run as it is (cached prefixes read from the cache,
    again in backward) and with the cached prefixes handed to the attention as copies
    (``PrefixCopies``, what the flash / te path did before), which every kept producer's graph
    holds until its backward. The plan charges the copies (``held_reads``); the step measures
    the saving."""
    from megatron_psrl.attention import backends
    from megatron_psrl.data import make_stepwise

    batch = make_stepwise(num_trajectories=1, turns=(12, 12), obs_len=(60, 120), action_len=(10, 20),
                          system_len=100, task_len=(50, 80), vocab_size=engine.arch.vocab_size, seed=2)
    row = _measured_and_planned(gpu_acceptance, engine, batch)
    with monkeypatch.context() as patch:
        patch.setattr(backends, "READS_CACHED_PREFIXES", frozenset({"torch"}))
        copies = _measured_and_planned(gpu_acceptance, engine, batch)
    saved, planned = copies["measured_bytes"] - row["measured_bytes"], copies["predicted_bytes"] - row["predicted_bytes"]
    print(f"stepwise, {row['micro_batches']} micro-batches: read from the cache: measured {row['measured_bytes']} "
          f"planned {row['predicted_bytes']}; copies kept: measured {copies['measured_bytes']} planned "
          f"{copies['predicted_bytes']}; the cut saves {saved} measured, {planned} planned")
    assert row["micro_batches"] >= 3, row
    for r in (row, copies):
        assert r["measured_bytes"] <= r["predicted_bytes"], r
    assert saved > 0.5 * planned > 0, (copies, row)


@pytest.mark.parametrize("micro_batch_tokens", [64, 256, 4096])
def test_segment_shapes_are_the_packs_gathered_keys(micro_batch_tokens):
    """``add_segment_shapes`` counts from the tree what packing builds: per micro-batch its
    segments, its longest segment and the rows ``AttentionPlan.gathered_keys`` gathers."""
    from megatron_psrl.schedule.config import PlannerConfig
    from megatron_psrl.schedule.memory import add_segment_shapes
    from megatron_psrl.schedule.planner import plan_step
    from megatron_psrl.tree import build_prefix_tree

    for batch in _workloads(1000).values():
        plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=micro_batch_tokens))
        rank = plan.ranks[0]
        add_segment_shapes(plan.index, rank)
        assert set(rank.segment_shapes) == set(range(len(rank.micro_batches)))
        for i, (segments, longest, keys) in rank.segment_shapes.items():
            pack = rank.pack(plan.index, i).plan
            key_index, cu_q, _ = pack.gathered_keys()
            lengths = cu_q[1:] - cu_q[:-1]
            assert (segments, longest, keys) == (len(lengths), int(lengths.max()), len(key_index)), i
