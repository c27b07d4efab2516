"""``--memory-budget`` on real steps (issue 46, items 2 and 3): the step refused before it runs
when no plan fits (naming the smallest budget that does, which then plans), one log line per
step, the measured peak under the budget on small versions of the bench workloads (and its fall
under host offload), and a plan chosen by the budget (activation recomputation, dropped graphs,
host offload) exactly the per-sample computation."""

import dataclasses

import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import PARALLEL_CONFIGS
from helpers.hf_reference import load_hf_model, make_hf_checkpoint, per_sample_loss_and_grads
from helpers.step_memory import PEER_MODEL, measured_step, peer_actor, small_workloads
from helpers.tolerance import rounding_tolerance

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.data import make_grpo
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.engine.budget import _evaluate_cut, evaluate_lever
from megatron_psrl.engine.memory import heap_bytes_in_use
from megatron_psrl.schedule.budget import Lever, MemoryBudgetError, budget_for
from megatron_psrl.tree import build_prefix_tree

UNLIMITED = 1 << 40


def _smallest_budget(actor, batch) -> int:
    """The budget a refusal names for ``batch`` (the actor's budget set too small to fit)."""
    budget = actor.engine.memory_budget
    budget.budget_bytes = budget.static.total + 1
    with pytest.raises(MemoryBudgetError, match="smallest budget that fits is") as refused:
        actor.engine.plan(batch)
    return int(str(refused.value).split("smallest budget that fits is ")[1].split(" ")[0])


@pytest.fixture(scope="module")
def peer():
    """One actor on the bench_peers model for the tests below (each sets its budget)."""
    return peer_actor(memory_budget=UNLIMITED)


def test_a_budget_no_plan_fits_is_refused_before_the_step_and_the_named_one_plans(peer):
    actor = peer
    actor.zero_grad()
    batch = small_workloads()["grpo-256x4x256"]
    smallest = _smallest_budget(actor, batch)
    actor.engine.memory_budget.budget_bytes = smallest - 1
    with pytest.raises(MemoryBudgetError):
        actor.forward_backward(batch, return_logprobs=False)
    assert all(p.grad is None for p in actor.model.parameters())  # nothing ran
    actor.engine.memory_budget.budget_bytes = smallest
    _, plan, _, _ = actor.engine.plan(batch)
    chosen = actor.engine.memory_budget.last
    assert chosen.fits and budget_for(chosen.peak_bytes, actor.engine.memory_budget.static) <= smallest


def test_a_prompt_cut_alone_lets_its_responses_share_micro_batches(peer):
    """A GRPO group under a budget that its default cut (the prompt packed with the first response,
    that micro-batch's graph kept until the last response's backward) does not fit, without
    recomputed layers: the planner ends a micro-batch after the shared prompt, so the kept graph
    is the prompt's alone and the responses still go two per micro-batch (not one per
    micro-batch, as cut at branch switches)."""
    from exact_workloads import grpo_exact  # (benchmarks/, on the path once helpers.step_memory is imported)

    engine = peer.engine
    batch = grpo_exact(256, 8, 256, PEER_MODEL["vocab_size"])
    tree = build_prefix_tree(batch)
    outcomes = {}
    for cut in (False, True):
        config = dataclasses.replace(engine.planner_config("tree", 512), local_rank=None, cut_after_shared_prefixes=cut)
        outcomes[cut] = _evaluate_cut(engine, tree, config, Lever(512), UNLIMITED, False, (None, None, None))
    sizes = {cut: [len(mb.computed_tokens) for mb in o.details["plan"].ranks[0].micro_batches]
             for cut, o in outcomes.items()}
    assert sizes == {False: [512, 512, 512, 512, 256], True: [256, 512, 512, 512, 512]}
    assert outcomes[True].peak_bytes < outcomes[False].peak_bytes
    budget = engine.memory_budget
    budget.budget_bytes = budget_for(outcomes[True].peak_bytes, budget.static)
    layers, budget.max_recompute_layers = budget.max_recompute_layers, 0  # (recomputing layers may be faster here)
    try:
        _, plan, _, _ = engine.plan(batch)
        chosen = budget.last
        assert chosen.details["plan"].config.cut_after_shared_prefixes, chosen
        assert [len(mb.computed_tokens) for mb in chosen.details["plan"].ranks[0].micro_batches] == sizes[True]
        assert chosen.details["dropped_graphs"] == 0 and chosen.lever.recompute_layers == 0
    finally:
        budget.budget_bytes, budget.max_recompute_layers = UNLIMITED, layers


def test_weights_alone_over_the_budget_are_refused_at_start_up():
    with pytest.raises(MemoryBudgetError, match="cannot hold the weights, gradients and optimizer state"):
        peer_actor(memory_budget=1 << 20)


def test_one_log_line_per_step_says_what_was_chosen(peer):
    lines = []
    actor = peer
    actor.engine.memory_budget.budget_bytes = UNLIMITED
    actor.engine.log = lines.append
    batch = make_grpo(num_prompts=1, group_size=4, prompt_len=(64, 64), response_len=(32, 32), vocab_size=2048)
    for _ in range(2):
        metrics = actor.forward_backward(batch, return_logprobs=False).metrics
    chosen = [line for line in lines if line.startswith("memory budget")]
    assert len(chosen) == 2, lines
    assert "micro-batches of 4096 tokens" in chosen[0] and "predicted peak" in chosen[0]
    plan = metrics["memory_plan"]
    assert plan["micro_batch_tokens"] == 4096 and plan["recompute_layers"] == 0
    assert plan["predicted_peak_bytes"] > plan["static_bytes"] > 0


def test_levers_are_priced_in_the_seconds_measured_at_start_up(peer):
    """A budget run measures its costs at start-up, and a lever's predicted seconds are in those:
    the same tokens cut into more micro-batches cost the measured fixed cost once per extra
    micro-batch (FLOPs alone would price them alike)."""
    engine = peer.engine
    assert engine.measured is not None and engine.measured.seconds_per_token > 0  # (measured at start-up)
    measured = dataclasses.replace(engine.measured, seconds_per_micro_batch=0.01)  # (a loaded machine may fit 0)
    tree = build_prefix_tree(small_workloads()["grpo-256x4x256"])
    before, engine.measured = engine.measured, measured
    try:
        large, small = (evaluate_lever(engine, tree, "tree", Lever(t), UNLIMITED, entropy=False) for t in (4096, 256))
    finally:
        engine.measured = before
    assert large.fits and small.fits and large.details["dropped_graphs"] == small.details["dropped_graphs"] == 0
    count = lambda o: sum(mb.computes for mb in o.details["plan"].ranks[0].micro_batches)  # noqa: E731
    assert count(small) > count(large)
    extra = (count(small) - count(large)) * measured.seconds_per_micro_batch
    assert small.seconds - large.seconds == pytest.approx(extra, rel=1e-9, abs=1e-12)


def _offload_leaves_the_heap(actor, monkeypatch):
    """Host offload forced on the small rollout tree: the heap (the CPU's "device" memory; the
    CPU link's host buffers lie outside it) peaks lower by about what the plan says."""
    from megatron_psrl.engine import budget as engine_budget

    batch, tokens = small_workloads()["tree"], 256  # (4 kept graphs, cached prefixes read later)
    measured, predicted = {}, {}
    for offload in (True, False, True):  # (the first warms up)
        monkeypatch.setattr(engine_budget, "choose", lambda evaluate, *a, **k: evaluate(Lever(tokens, 0, offload),
                                                                                     UNLIMITED))
        measured[offload] = measured_step(actor, batch)
        predicted[offload] = actor.engine.memory_budget.last.peak_bytes
        assert actor.engine.memory_budget.last.lever.offload == offload
    moved = actor.engine.runner.last_host_offload
    fall, planned = measured[False] - measured[True], predicted[False] - predicted[True]
    print(f"offload: measured {measured}, predicted {predicted}: falls {fall} (plan {planned}); moved graphs "
          f"{sum(moved.graph_bytes)} B, K/V {sum(moved.kv_bytes)} B")
    assert planned > 0 and abs(fall / planned - 1) <= 0.25, (measured, predicted)
    assert abs(predicted[True] / measured[True] - 1) <= 0.10, (measured, predicted)


@pytest.mark.skipif(heap_bytes_in_use() is None, reason="needs glibc's mallinfo2")
@pytest.mark.fresh_process  # heap figures: nothing else may allocate or free meanwhile
def test_measured_peak_stays_under_the_budget(monkeypatch):
    torch.set_num_threads(1)  # (no thread-pool spinning on a loaded machine)
    actor = peer_actor(memory_budget=UNLIMITED)
    budget = actor.engine.memory_budget
    static = budget.static.total
    for name, batch in small_workloads().items():
        budget.budget_bytes = UNLIMITED
        default = measured_step(actor, batch)  # (also the warm-up: the largest GEMMs)
        smallest = _smallest_budget(actor, batch)
        for limit in sorted({max(smallest, int(0.6 * (static + default))), smallest}):
            budget.budget_bytes = limit
            measured = measured_step(actor, batch)
            chosen = budget.last
            total = static + measured
            print(f"{name:16} budget {limit / 2**20:6.1f} MiB: measured {total / 2**20:6.1f} MiB, predicted "
                  f"{(static + chosen.peak_bytes) / 2**20:6.1f} MiB, lever {chosen.lever}")
            assert total <= limit, (name, limit, total, chosen.lever)
            assert abs(chosen.peak_bytes / measured - 1) <= 0.10, (name, chosen.peak_bytes, measured)
    _offload_leaves_the_heap(actor, monkeypatch)


# ---------------------------------------------------------------------- exactness of a chosen plan
MODEL = dict(PARALLEL_CONFIGS["qwen3"], num_hidden_layers=3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    records = random_tree_records(seed=5, num_roots=3, vocab_size=251)
    batch = samples_from_dicts(records, source="records")
    hf_dir = make_hf_checkpoint(MODEL, seed=1, directory=str(tmp_path_factory.mktemp("hf")))
    loss, grads = per_sample_loss_and_grads(load_hf_model(hf_dir), batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    return hf_dir, records, batch, loss, grads


def _actor(hf_dir, offload=False):
    return PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=16, memory_budget=UNLIMITED, memory_offload=offload,
        optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0),
        loss=LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")))


@pytest.mark.parametrize("squeeze", ["one-layer", "leanest", "offload"])
def test_a_plan_chosen_by_the_budget_equals_the_per_sample_reference(reference, squeeze):
    """A budget that the default plan (every graph kept, nothing recomputed) does not fit: the
    chosen plan recomputes layers or producer graphs (or, priced on CPU where it moves nothing,
    offloads them), and one SGD step still equals the per-sample Hugging Face reference (as
    ``test_recompute.py`` checks for the flags)."""
    hf_dir, records, batch, ref_loss, ref_grads = reference
    actor = _actor(hf_dir, offload=squeeze == "offload")
    engine, tree = actor.engine, build_prefix_tree(batch)
    peak = {k: evaluate_lever(engine, tree, "tree", Lever(16, k), UNLIMITED, True).peak_bytes for k in (0, 1, 3)}
    assert peak[0] > peak[1] > peak[3]
    peak["offload"] = evaluate_lever(engine, tree, "tree", Lever(16, 0, True), UNLIMITED, True).peak_bytes
    assert peak["offload"] < peak[0]
    budget = engine.memory_budget
    budget.budget_bytes = budget_for({"one-layer": peak[1], "leanest": peak[3]}.get(squeeze, peak["offload"]),
                                     budget.static)
    before = actor.state_dict_hf()
    metrics = actor.train_step(records)
    after = actor.state_dict_hf()
    chosen = metrics["memory_plan"]
    assert chosen["recompute_layers"] > 0 or chosen["dropped_graphs"] > 0 or chosen["host_offload"], chosen
    assert chosen["host_offload"] == (squeeze == "offload"), chosen
    assert chosen["predicted_peak_bytes"] <= budget.budget_bytes
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in ref_grads.items():
        atol = 1e-5 * float(grad.abs().max()) + rounding_tolerance(torch.float32, float(before[name].abs().max()))
        torch.testing.assert_close(after[name], before[name] - grad, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
    if squeeze == "offload":
        _offload_moved_what_the_plan_says(engine, hf_dir, records, metrics, after)


def _offload_moved_what_the_plan_says(engine, hf_dir, records, metrics, after):
    """The offloaded step moved kept graphs and cached K/V at the steps its plan prices copies
    (and about as many bytes), and computed bit for bit what the same plan computes on the
    device alone (copies are exact): the unlimited budget's plan keeps every graph too."""
    memory = engine.memory_budget.last.details["memories"][0]
    assert memory.host_offload and metrics["memory_plan"]["dropped_graphs"] == 0
    moved = engine.runner.last_host_offload
    runtime = [g + kv for g, kv in zip(moved.graph_bytes, moved.kv_bytes)]
    assert sum(moved.graph_bytes) > 0  # (this tree's cached prefixes are read by the next micro-batch: never moved)
    assert [t for t, b in enumerate(runtime) if b] == [t for t, b in enumerate(memory.offloaded_bytes) if b]
    assert 0.5 <= sum(runtime) / sum(memory.offloaded_bytes) <= 1.5, (runtime, memory.offloaded_bytes)
    device_only = _actor(hf_dir)
    plain = device_only.train_step(records)
    assert not plain["memory_plan"]["host_offload"] and plain["memory_plan"]["dropped_graphs"] == 0
    assert plain["loss"] == metrics["loss"]
    for name, value in device_only.state_dict_hf().items():
        assert torch.equal(value, after[name]), name
