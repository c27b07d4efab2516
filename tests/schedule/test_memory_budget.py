"""``--memory-budget``'s arithmetic and choice (issue 46, items 2 and 3), without a model: the
CUDA default from a faked free-memory figure, the optimizer state, the levers' search and its
refusal, host offload's pricing, and 1F1B's graphs in flight."""

import argparse
import dataclasses

import pytest
import torch

from megatron_psrl.data import make_grpo, make_stepwise
from megatron_psrl.engine.budget import in_flight_graphs, resolve_budget
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.kvcache import KVGeometry
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.tiny import tiny_config
from megatron_psrl.schedule.budget import (
    Lever,
    MemoryBudgetError,
    Outcome,
    StaticMemory,
    budget_for,
    choose,
    default_memory_budget,
    exposed_transfer_seconds,
    micro_batch_ladder,
    optimizer_state_bytes,
    step_budget,
)
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.instructions import Residency, step_residents, training_instructions
from megatron_psrl.schedule.memory import StepCharge, plan_memory, step_peak_bytes
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.schedule.step_charge import ActivationCharge, add_row_counts
from megatron_psrl.training.arguments import parse_memory_budget
from megatron_psrl.tree import build_prefix_tree

GiB = 1 << 30
ARCH = ModelArchitecture.from_hf_config(tiny_config("debug-llama"))
CHARGE = ActivationCharge.of(ARCH, 1, 4, ARCH.vocab_size, 4096)


# ---------------------------------------------------------------------- the budget a run plans with
def test_cuda_default_is_free_memory_at_start_up_less_the_headroom():
    assert default_memory_budget(70 * GiB, 80 * GiB) == 62 * GiB  # 10% of the device's total kept free
    assert default_memory_budget(5 * GiB, 80 * GiB) == 0
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # (a device object; nothing runs on it)
    faked = (70 * GiB, 80 * GiB)  # what torch.cuda.mem_get_info would say
    assert resolve_budget(ActorConfig(), cuda, faked) == 62 * GiB
    assert resolve_budget(ActorConfig(memory_budget=0), cuda, faked) is None  # off
    assert resolve_budget(ActorConfig(memory_budget=3 * GiB), cuda, faked) == 3 * GiB
    assert resolve_budget(ActorConfig(), cpu, None) is None  # CPU: today's behaviour unless given
    assert resolve_budget(ActorConfig(memory_budget=3 * GiB), cpu, None) == 3 * GiB


def test_offload_is_a_lever_on_cuda_and_cpu_alike():
    for device in ("cuda", "cpu"):
        assert resolve_budget(ActorConfig(memory_budget=GiB, memory_offload=True), torch.device(device), None) == GiB


def test_memory_budget_flag_takes_bytes_auto_and_off():
    assert parse_memory_budget("2GiB") == 2 * GiB
    assert parse_memory_budget("512MB") == 512 * 10**6
    assert parse_memory_budget("auto") is None
    assert parse_memory_budget("off") == 0
    with pytest.raises(argparse.ArgumentTypeError):
        parse_memory_budget("lots")
    with pytest.raises(ValueError, match="memory_budget"):
        ActorConfig(memory_budget=-1)


def test_flags_reach_the_actor_config():
    from megatron_psrl.training.arguments import parse_args
    from megatron_psrl.training.trainer import actor_config_from_args

    config = actor_config_from_args(parse_args(["--memory-budget", "6GiB", "--memory-offload"]), "float32")
    assert (config.memory_budget, config.memory_offload) == (6 * GiB, True)
    assert actor_config_from_args(parse_args([]), "float32").memory_budget is None
    assert actor_config_from_args(parse_args(["--memory-budget", "off"]), "float32").memory_budget == 0


def test_optimizer_state_is_megatrons():
    assert optimizer_state_bytes(1000, 4, "adam") == 8000  # two fp32 moments
    assert optimizer_state_bytes(1000, 2, "adam") == 12000  # and the fp32 master weights of a bf16 model
    assert optimizer_state_bytes(1000, 2, "adam", shards=4) == 3000  # the distributed optimizer's shard
    assert optimizer_state_bytes(1000, 4, "sgd") == 0
    assert optimizer_state_bytes(1000, 4, "sgd", momentum=0.9) == 4000


# ---------------------------------------------------------------------- the choice
STATIC = StaticMemory(weights=100, gradients=0, optimizer_state=0)


def _fake(levers):
    """An evaluate function over a table ``{(tokens, recomputed layers, offload): (peak, seconds)}``."""
    def evaluate(lever: Lever, room: int) -> Outcome:
        peak, seconds = levers[(lever.micro_batch_tokens, lever.recompute_layers, lever.offload)]
        return Outcome(lever, peak <= room, peak, seconds if peak <= room else float("inf"))
    return evaluate


def _budget_for(room: int) -> int:
    """The smallest memory budget whose step room (:func:`step_budget`) is ``room``."""
    budget = budget_for(room, STATIC)
    assert step_budget(budget, STATIC) == room and step_budget(budget - 1, STATIC) == room - 1
    return budget


LEVERS = {  # (tokens, recomputed layers, offload) -> (peak, seconds): smaller, recomputed, offloaded are leaner
    (4096, 0, False): (1000, 1.0), (4096, 1, False): (800, 1.2), (4096, 2, False): (600, 1.4),
    (2048, 0, False): (700, 1.1), (2048, 1, False): (550, 1.3), (2048, 2, False): (400, 1.5),
    (4096, 0, True): (650, 1.05), (4096, 1, True): (500, 1.25), (4096, 2, True): (350, 1.45),
    (2048, 0, True): (450, 1.15), (2048, 1, True): (380, 1.35), (2048, 2, True): (300, 1.55),
}


def test_a_budget_between_two_plans_picks_the_faster_that_fits():
    evaluate = _fake(LEVERS)
    assert choose(evaluate, _budget_for(1000), STATIC, [4096, 2048], 2).lever == Lever(4096, 0)
    # 700 fits the halved micro-batches (1.1 s) and 4096 with a recomputed layer (1.2 s): the faster
    assert choose(evaluate, _budget_for(850), STATIC, [4096, 2048], 2).lever == Lever(2048, 0)
    # 650: halved with a recomputed layer (550, 1.3 s) beats two recomputed layers (600, 1.4 s)
    assert choose(evaluate, _budget_for(650), STATIC, [4096, 2048], 2).lever == Lever(2048, 1)
    assert choose(evaluate, _budget_for(600), STATIC, [4096], 2).lever == Lever(4096, 2)
    # with host offload a lever: its 4096-token plan (1.05 s) beats halving (1.1 s)
    assert choose(evaluate, _budget_for(700), STATIC, [4096, 2048], 2, offload=True).lever == Lever(4096, 0, True)


def test_a_first_lever_that_needs_nothing_recomputed_is_taken_without_the_others():
    calls = []

    def evaluate(lever, room):
        calls.append(lever)
        return _fake(LEVERS)(lever, room)

    assert choose(evaluate, _budget_for(1000), STATIC, [4096, 2048], 2, unbeatable=lambda o: True).lever == Lever(4096)
    assert calls == [Lever(4096)]
    calls.clear()
    assert choose(evaluate, _budget_for(850), STATIC, [4096, 2048], 2, unbeatable=lambda o: True).lever == Lever(2048)
    assert len(calls) > 1


def test_recomputation_takes_the_fewest_layers_that_fit():
    calls = []
    levers = {(4096, k, False): (1000 - 10 * k, 1.0 + k) for k in range(33)}

    def evaluate(lever, room):
        calls.append(lever.recompute_layers)
        return _fake(levers)(lever, room)

    chosen = choose(evaluate, _budget_for(1000 - 10 * 13), STATIC, [4096], 32)
    assert chosen.lever == Lever(4096, 13)
    assert len(calls) <= 8  # a bisection, not every layer count


def test_recomputed_layers_that_let_larger_micro_batches_keep_their_graphs_are_found():
    """4096-token micro-batches fit with nothing recomputed only by recomputing producers' graphs
    whole (2.0 s), 2048 fit keeping them (1.5 s), and 4096 with two layers recomputed keeps them
    too (1.2 s). The fewest layers that fit (the old rule) stop at the first: the choice also
    takes the fewest layers that fit keeping every graph, and compares."""
    seconds = {0: 2.0, 1: 1.6, 2: 1.2, 3: 1.3, 4: 1.4}
    calls = []

    def evaluate(lever: Lever, room: int) -> Outcome:
        calls.append(lever)
        if lever.micro_batch_tokens == 2048:
            return Outcome(lever, True, 500 - lever.recompute_layers, 1.5 + 0.1 * lever.recompute_layers,
                           dict(dropped_graphs=0))
        k = lever.recompute_layers
        return Outcome(lever, True, 900 - 10 * k, seconds[k], dict(dropped_graphs=max(0, 2 - k)))

    chosen = choose(evaluate, _budget_for(1000), STATIC, [4096, 2048], 4)
    assert chosen.lever == Lever(4096, 2) and chosen.seconds == 1.2
    assert len(calls) <= 6  # (two bisections at 4096, one evaluation at 2048)
    # the old rule (the fewest layers that fit, whatever the plan recomputes) took the halved ones
    assert choose(evaluate, _budget_for(1000), STATIC, [4096, 2048], 4, clean=lambda o: True).lever == Lever(2048)


def test_a_budget_below_every_plan_is_refused_naming_the_smallest_that_fits():
    evaluate = _fake(LEVERS)
    with pytest.raises(MemoryBudgetError, match="smallest budget that fits is") as refused:
        choose(evaluate, _budget_for(399), STATIC, [4096, 2048], 2)
    smallest = int(str(refused.value).split("smallest budget that fits is ")[1].split(" ")[0])
    assert "micro-batches of 2048 tokens, 2 recomputed layers" in str(refused.value)
    assert choose(evaluate, smallest, STATIC, [4096, 2048], 2).lever == Lever(2048, 2)
    with pytest.raises(MemoryBudgetError):
        choose(evaluate, smallest - 1, STATIC, [4096, 2048], 2)
    # the weights alone fill it: the leanest plan still named
    with pytest.raises(MemoryBudgetError, match="smallest budget that fits is 520 bytes"):  # 100 + 400 x 1.05
        choose(evaluate, 50, STATIC, [4096, 2048], 2)


def test_micro_batch_ladder_halves_down_to_the_floor():
    assert micro_batch_ladder(4096) == [4096, 2048, 1024, 512, 256]
    assert micro_batch_ladder(65536) == [65536, 32768, 16384, 8192, 4096]
    assert micro_batch_ladder(300) == [300]
    assert micro_batch_ladder(100) == [100]


def test_host_copies_cost_what_the_compute_does_not_hide():
    assert exposed_transfer_seconds([0, 10**10, 10**10], [1.0, 0.5, 2.0], 1e10) == pytest.approx(0.5)


# ---------------------------------------------------------------------- what the plan prices
def _stepwise_plan(tokens=40):
    batch = make_stepwise(num_trajectories=1, turns=(4, 4), obs_len=(20, 30), action_len=(8, 12), task_len=(20, 30),
                          system_len=16, vocab_size=ARCH.vocab_size, seed=3)
    plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=tokens))
    rank = plan.ranks[0]
    add_row_counts(plan.index, rank)
    return rank


def test_offload_prices_kept_graphs_and_cached_kv_off_the_device():
    rank = _stepwise_plan()
    assert rank.sources and len(rank.micro_batches) > 2
    geometry = KVGeometry.for_model(ARCH, 1, 1, torch.float32, torch.device("cpu"))
    on = plan_memory(rank, geometry, 1 << 40, 100, step=StepCharge(CHARGE))
    off = plan_memory(rank, geometry, 1 << 40, 100, step=StepCharge(CHARGE, offload=True))
    assert off.keep_graph == on.keep_graph
    assert max(off.step_timeline_bytes) < max(on.step_timeline_bytes)
    assert sum(off.offloaded_bytes) > 0 and not on.offloaded_bytes
    # the pool holds the blocks on the device only; the executor is told what stays where
    assert off.host_offload and not on.host_offload and off.pool_sizes <= on.pool_sizes
    stream = training_instructions(rank, off)
    residencies = [x for x in stream if isinstance(x, Residency)]
    assert len(residencies) == len(rank.schedule) and not any(isinstance(x, Residency)
                                                              for x in training_instructions(rank, on))
    order = [i for _, i in rank.schedule]
    for t, x in enumerate(residencies):
        mbs, sources = step_residents(rank, order, t)
        assert x.graphs == (order[t],) and set(x.graphs + x.next_graphs) == set(mbs)
        assert set(x.sources) | set(x.next_sources) == sources and not set(x.sources) & set(x.next_sources)
    assert [x for x in stream if not isinstance(x, Residency)] == training_instructions(rank, dataclasses.replace(
        off, host_offload=False))
    # a step budget between the two: offload keeps every graph where the device alone drops some
    room = (max(off.step_timeline_bytes) + max(on.step_timeline_bytes)) // 2
    assert all(plan_memory(rank, geometry, 1 << 40, 100, step=StepCharge(CHARGE, room, True)).keep_graph.values())
    assert not all(plan_memory(rank, geometry, 1 << 40, 100, step=StepCharge(CHARGE, room)).keep_graph.values())


def test_1f1b_stages_hold_their_graphs_in_flight():
    assert [in_flight_graphs(pp) for pp in (1, 2, 4)] == [1, 2, 4]
    assert in_flight_graphs(4, 2) == 6  # interleaved: 2 (4 - 1) + 4 + 1 chunks of half a rank's layers
    batch = make_grpo(num_prompts=4, group_size=2, prompt_len=(30, 40), response_len=(8, 12),
                      vocab_size=ARCH.vocab_size, seed=2)
    plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=120, max_trees_per_micro_batch=1))
    rank = plan.ranks[0]
    add_row_counts(plan.index, rank)
    assert not rank.sources and len(rank.micro_batches) >= 3
    order = [i for _, i in rank.schedule]
    graphs = [CHARGE.graph(rank.row_counts[i]) for i in order]
    own = [CHARGE.backward_peak(rank.row_counts[i], 0) for i in order]  # (no gradients allocated in this step)
    for k in (1, 2, len(order)):  # at each backward, the next k - 1 micro-batches' graphs are alive too
        expected = max(own[t] + sum(graphs[t + 1:t + k]) for t in range(len(order)))
        assert step_peak_bytes(rank, None, 0, in_flight=k, charge=CHARGE) == expected, k
    assert step_peak_bytes(rank, None, 0, in_flight=2, charge=CHARGE) > step_peak_bytes(rank, None, 0, charge=CHARGE)
    assert step_budget(1100, STATIC) == 952  # (1100 - 100) / 1.05, rounded down
