"""The memory plan's step peak against the measured one (issue 46, item 1).

The plan charges a micro-batch's graph by its rows (``schedule/step_charge.py``): every layer's
saved tensors for every token, the last layer's past its K/V and the final norm for the rows
whose log-prob is computed, the loss head by its claimed rows and chunking, the parameters'
gradients once a backward ran, recomputed units by their inputs. Measured here on the
bench_peers model and small versions of its four workloads at the default micro-batch budget,
two smaller ones, the KV budget at its floor and with megatron's full recomputation: the
prediction is within 10% of the measured peak everywhere (``benchmarks/memory_breakdown.py``
shows where the bytes go; docs/architecture.md, "One memory budget", has the full-size table).
"""

import dataclasses

import numpy as np
import pytest
import torch
from helpers.step_memory import PEER_MODEL, configured, measured_step, peer_actor, predicted_step, small_workloads

from megatron_psrl.engine.memory import heap_bytes_in_use
from megatron_psrl.kvcache import CacheBudgetError
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import saved_activation_bytes_per_token
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.schedule.step_charge import ActivationCharge, add_row_counts
from megatron_psrl.schedule.with_memory import memory_plans
from megatron_psrl.tree import build_prefix_tree

ARCH = ModelArchitecture.from_hf_config(PEER_MODEL)


def _charge(**kw) -> ActivationCharge:
    return ActivationCharge.of(ARCH, 1, 4, ARCH.vocab_size, kw.pop("chunk_rows", 8192), **kw)


@pytest.mark.parametrize("micro_batch_tokens", [256, 4096])
def test_row_counts_are_the_packs_claimed_and_output_rows(micro_batch_tokens):
    """``add_row_counts`` counts from the tree what packing and the runner compute: the claimed
    logit rows, their distinct hidden-state rows, the pack's tokens."""
    for batch in small_workloads().values():
        plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=micro_batch_tokens))
        rank = plan.ranks[0]
        add_row_counts(plan.index, rank)
        for i, (tokens, output_rows, claimed_rows) in rank.row_counts.items():
            pack = rank.pack(plan.index, i)
            targets = pack.logit_targets
            claimed = np.flatnonzero(plan.tree.claim_offsets[targets + 1] > plan.tree.claim_offsets[targets])
            assert (tokens, output_rows, claimed_rows) == (
                pack.num_tokens, len(np.unique(pack.logit_rows[claimed])), len(claimed)), i


def test_without_the_row_skip_a_graph_is_the_per_token_count():
    charge = _charge(row_skip=False)
    per_token = saved_activation_bytes_per_token(ARCH, 1, 4)
    assert charge.graph((1000, 1000, 0)) == 1000 * per_token
    skipping = _charge()  # the last layer past its K/V and the final norm: output rows only
    assert skipping.graph((1000, 1000, 0)) == 1000 * per_token
    assert skipping.graph((1000, 10, 0)) < charge.graph((1000, 10, 0))


def test_loss_head_is_charged_by_its_claimed_rows_and_chunks():
    h, logit = ARCH.hidden_size * 4, ARCH.vocab_size * 4
    whole, chunked = _charge(), _charge(chunk_rows=100)
    base = whole.graph((1000, 1000, 0))
    assert whole.graph((1000, 1000, 300)) - base == 300 * (h + logit)  # the log-softmax is kept
    assert chunked.graph((1000, 1000, 300)) - base == 300 * h  # each chunk recomputed in backward
    # the backward's start: three [rows, V] fp32 tensors (the kept one and two more), or a chunk's three
    plain, chunks = _charge(weight_grad_temporaries=False), _charge(weight_grad_temporaries=False, chunk_rows=100)
    assert plain.head_backward((1000, 1000, 300)) == 2 * 300 * logit
    assert chunks.head_backward((1000, 1000, 300)) == 3 * 100 * logit
    entropy = dataclasses.replace(plain, entropy=True)  # its exp kept too, five tensors at the start
    assert entropy.graph((1000, 1000, 300)) - base == 300 * (h + 2 * logit)
    assert entropy.head_backward((1000, 1000, 300)) == 3 * 300 * logit
    # the output layer's weight gradient [V, h] is a tensor of its own beside the logits' gradient
    # (without gradient_accumulation_fusion): it is the larger moment when few rows are claimed
    dw = ARCH.vocab_size * h
    assert whole.output_weight_grad == dw and plain.output_weight_grad == 0
    assert whole.head_backward((1000, 1000, 10)) == 10 * logit + dw
    assert whole.head_backward((1000, 1000, 300)) == max(2 * 300 * logit, 300 * logit + dw)
    assert whole.head_backward((1000, 1000, 0)) == 0  # (no loss head)


def test_a_kept_layers_backward_holds_the_graph_less_the_head_and_its_temporaries():
    """At the last layer's backward the head's tensors are gone and the layer's temporaries
    (LAYER_BACKWARD_TEMPORARIES per row it computed) join what is left of the graph."""
    charge = _charge(weight_grad_temporaries=False)
    rows = (1000, 1000, 0)  # (no head: the layers' moment is the peak)
    assert charge.layer_temporaries == (3 * ARCH.ffn_hidden_size + 2 * ARCH.hidden_size) * 4
    assert charge.backward_peak(rows, 0) == charge.graph(rows) + 1000 * charge.layer_temporaries
    skip = (1000, 100, 0)  # the last layer computed 100 output rows: the layer before it peaks
    assert charge.backward_peak(skip, 0) == max(charge.graph(skip) + 100 * charge.layer_temporaries,
                                                charge.graph(skip) - charge._layers_bytes(skip, 1, with_last=True)
                                                + 1000 * charge.layer_temporaries)


def test_recomputed_layers_keep_their_inputs_only():
    rows = (1000, 1000, 0)
    full = _charge(recompute=("full", "uniform", 1))
    block = _charge(recompute=("full", "block", 2))
    plain = _charge()
    layer = plain.graph(rows) - _charge(num_layers=3).graph(rows)
    assert full.graph(rows) == plain.graph(rows) - 4 * layer + 4 * 1000 * ARCH.hidden_size * 4
    assert block.graph(rows) == plain.graph(rows) - 2 * layer + 2 * 1000 * ARCH.hidden_size * 4
    # its backward recomputes a layer at a time: more than the graph, less than keeping every layer
    assert full.graph(rows) < full.backward_peak(rows, 0) < plain.backward_peak(rows, 0)
    grads = 10**6
    ends = _charge(grad_bytes=(grads, 0, 0))
    assert ends.backward_peak((1, 1, 0), 0) == grads  # a tiny micro-batch: the gradients are the peak


def _kv_floor(actor, batch) -> int:
    """The smallest ``--kv-cache-budget`` the step's plan accepts (bisection, to 1/100)."""
    _, plan, _, _ = actor.engine.plan(batch)
    settings = actor.engine.memory_settings
    lo, hi = 0, settings.budget_bytes
    while hi - lo > max(1 << 16, hi // 100):
        mid = (lo + hi) // 2
        try:
            memory_plans(plan, dataclasses.replace(settings, budget_bytes=mid))
            hi = mid
        except CacheBudgetError:
            lo = mid
    return hi


SETTINGS = {
    "default": {},
    "mb256": dict(micro_batch_tokens=256),
    "mb256-kv-floor": dict(micro_batch_tokens=256, kv_cache_budget="floor"),
    "recompute": dict(recompute=("uniform", 1)),
    "mb512-recompute-2-layers": dict(micro_batch_tokens=512, recompute=("block", 2)),
}


@pytest.mark.skipif(heap_bytes_in_use() is None, reason="needs glibc's mallinfo2")
@pytest.mark.fresh_process  # heap figures: nothing else may allocate or free meanwhile
def test_predicted_step_peak_is_within_ten_percent_of_the_measured():
    torch.set_num_threads(1)  # (no thread-pool spinning on a loaded machine: seconds, not minutes)
    actor = peer_actor()
    workloads = small_workloads()
    with configured(actor, recompute=("uniform", 1)):
        measured_step(actor, workloads["tree"])  # warm-up of the recomputation path
    rows = []
    for name, batch in workloads.items():
        measured_step(actor, batch)  # warm-up: the BLAS library's buffers grow with the largest GEMM (the default's)
        for setting, overrides in SETTINGS.items():
            overrides = dict(overrides)
            if overrides.get("kv_cache_budget") == "floor":
                with configured(actor, micro_batch_tokens=overrides["micro_batch_tokens"]):
                    overrides["kv_cache_budget"] = _kv_floor(actor, batch)
            with configured(actor, **overrides):
                measured = measured_step(actor, batch)
                predicted = predicted_step(actor, batch)
            rows.append((name, setting, measured, predicted))
            print(f"{name:16} {setting:26} measured {measured / 2**20:7.2f} MB predicted {predicted / 2**20:7.2f} MB "
                  f"({predicted / measured:.3f})")
    bad = [r for r in rows if abs(r[3] / r[2] - 1) > 0.10]
    assert not bad, bad
