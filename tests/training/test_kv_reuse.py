"""Mechanism 2 under a hard KV-cache budget: exact gradients, recomputation, measured memory.

A step-wise search tree (a shared trunk of turns, then branches) ten times larger than the
micro-batch budget trains with the per-sample reference's gradients; with a budget that only
holds the K/V blocks, prefix forwards are recomputed and the result is still exact; the
measured peak memory of the step stays under the memory of a cache-free step plus the budget.
"""

import numpy as np
import pytest
import torch
from helpers.hf_reference import assert_grads_close, hf_grads_to_mcore, per_sample_loss_and_grads

from megatron_psrl.data import samples_from_dicts
from megatron_psrl.engine.memory import PeakMemory
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.kvcache import BlockKVCache, CacheBudgetError, KVGeometry
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory, simulated_peak_bytes
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

BUDGET = 16  # micro-batch tokens


def search_tree_batch(vocab=256, seed=0, branches=6):
    rng = np.random.default_rng(seed)
    recs = []
    history = rng.integers(0, vocab, 20).tolist()
    for t in range(3):  # shared trunk
        act = rng.integers(0, vocab, 4).tolist()
        recs.append({"id": f"trunk{t}", "tokens": history + act, "loss_mask": [0] * len(history) + [1] * 4,
                     "advantage": float(rng.normal())})
        history = history + act + rng.integers(0, vocab, 8).tolist()
    for b in range(branches):
        h = list(history)
        for t in range(3):
            act = rng.integers(0, vocab, 3).tolist()
            recs.append({"id": f"b{b}t{t}", "tokens": h + act, "loss_mask": [0] * len(h) + [1] * 3,
                         "advantage": float(rng.normal()), "old_logprobs": (rng.normal(size=len(h) + 3) - 5).tolist()})
            h = h + act + rng.integers(0, vocab, 6).tolist()
    return samples_from_dicts(recs, source="search-tree")


def _geometry(arch, windows=False):
    """Softmax K/V in every layer; ``windows``: as the family keeps them (gpt-oss's windowed
    layers in a pool of their own, keeping the rows their readers' windows reach)."""
    if windows:
        return KVGeometry.for_model(arch, 1, 1, torch.float32, torch.device("cpu"))
    return KVGeometry(arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu"))


def _run(arch, model, batch, budget_bytes, act_bytes, gathers=False, cut=False, windows=False, after_prefixes=False):
    tree = build_prefix_tree(batch)
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=BUDGET, sharing="tree", cut_at_branch_switches=cut,
                                         cut_after_shared_prefixes=after_prefixes))
    rank = plan.ranks[0]
    geom = _geometry(arch, windows)
    memory = plan_memory(rank, geom, budget_bytes, act_bytes, gathers_in_backward=gathers)
    cache = BlockKVCache(geom, budget_bytes)
    model.zero_grad(set_to_none=True)
    out = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=cache).train(
        plan, 0, LossConfig(loss_agg="seq-mean-token-mean"), memory)
    return tree, plan, memory, cache, out


def _tight_budget(arch, batch, gathers=False, windows=False):
    tree = build_prefix_tree(batch)
    rank = plan_step(tree, PlannerConfig(micro_batch_tokens=BUDGET, sharing="tree")).ranks[0]
    geom = _geometry(arch, windows)
    act = activation_bytes_per_token(arch, 1, 4)
    return simulated_peak_bytes(rank, geom, {s.producer: False for s in rank.sources.values()}, act,
                                gathers_in_backward=gathers), act


# gathers: readers gather cached K/V again in backward (no copies kept in graphs) or keep copies
@pytest.mark.parametrize("gathers", [False, True], ids=["copies", "regather"])
@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_tree_ten_times_the_budget_is_exact(psrl_model, hf_model, budget, gathers):
    arch, model = psrl_model
    batch = search_tree_batch()
    tight, act = _tight_budget(arch, batch, gathers)
    kv = 1 << 30 if budget == "ample" else tight
    tree, plan, memory, cache, out = _run(arch, model, batch, kv, act, gathers)
    roots = np.flatnonzero(tree.node_parent < 0)
    assert tree.subtree_tokens()[roots].max() >= 10 * BUDGET
    assert plan.ranks[0].sources
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    ref_loss, ref = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.0, 0.0, "seq-mean-token-mean")
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, hf_grads_to_mcore(ref, arch), rtol=1e-5)
    metrics = cache.metrics.to_dict()
    if budget == "tight":
        assert out.tokens_recomputed > 0 and metrics["kv_tokens_recomputed"] == out.tokens_recomputed
        assert not any(memory.keep_graph.values())
    else:
        assert out.tokens_recomputed == 0 and all(memory.keep_graph.values())
    assert out.tokens_computed == tree.num_tree_tokens + out.tokens_recomputed
    # the pool never held more than the budget
    assert cache.metrics.peak_blocks_used * cache.geometry.block_bytes(cache.block_size) <= kv


@pytest.mark.fresh_process
@pytest.mark.parametrize("gathers", [False, True], ids=["copies", "regather"])
def test_measured_peak_stays_within_a_cache_free_step_plus_the_budget(psrl_model, gathers):
    """Measured, not by construction: heap bytes in use, sampled after every torch op, in a
    process of its own (the figure is process-wide). The margin is the budget itself: what the
    cache manager holds (blocks, kept graphs, gathered copies) is what --kv-cache-budget caps,
    on top of a cache-free step of the same micro-batch size; each run goes twice and the
    second counts, so the BLAS library's per-process buffer pool is there before either."""
    arch, model = psrl_model
    batch = search_tree_batch(branches=10)
    tight, act = _tight_budget(arch, batch, gathers)
    tree = build_prefix_tree(batch)
    # Cache-free reference: the same micro-batch budget, prefixes duplicated instead of cached.
    dup = plan_step(tree, PlannerConfig(micro_batch_tokens=int(batch.lengths.max()) + 8, sharing="tree-dup"))
    peaks = {}
    for name in ("dup", "tight", "roomy"):
        for attempt in range(2):  # first run warms allocator caches
            model.zero_grad(set_to_none=True)
            if name == "dup":
                with PeakMemory(torch.device("cpu")) as m:
                    StepRunner(model, arch.vocab_size, torch.device("cpu")).train(dup, 0, LossConfig())
            else:
                kv = tight if name == "tight" else 4 * tight
                with PeakMemory(torch.device("cpu")) as m:
                    _run(arch, model, batch, kv, act, gathers)
            peaks[name] = m.peak_bytes - m.start_bytes
    assert peaks["tight"] <= peaks["dup"] + tight
    assert peaks["roomy"] <= peaks["dup"] + 4 * tight


def test_budget_below_one_block_fails_before_anything_runs(psrl_model):
    arch, model = psrl_model
    geom = KVGeometry(arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CacheBudgetError, match="cannot hold one KV block"):
        BlockKVCache(geom, geom.block_bytes(16) - 1)
    batch = search_tree_batch()
    rank = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=BUDGET)).ranks[0]
    with pytest.raises(CacheBudgetError, match="--kv-cache-budget"):
        plan_memory(rank, geom, geom.block_bytes(16), activation_bytes_per_token(arch, 1, 4))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.fresh_process
def test_repeated_steps_do_not_accumulate_memory(psrl_model):
    """Graphs, hooks and gathered K/V of a step must all be freed when it ends. Measured in a
    process of its own from the second step on (the first fills the BLAS buffer pool). A leaked
    graph or K/V block of this batch is hundreds of KB; 64 KiB leaves room for what Python and
    the allocator keep between steps (freed small chunks cached per thread, interned objects)."""
    from megatron_psrl.engine.memory import heap_bytes_in_use

    arch, model = psrl_model
    batch = search_tree_batch(branches=4)
    tight, act = _tight_budget(arch, batch)
    after = []
    for _ in range(4):
        _run(arch, model, batch, 4 * tight, act)  # keeps prefix graphs: the leak-prone path
        after.append(heap_bytes_in_use())
    assert after[-1] - after[1] < 64 * 1024, after


@pytest.mark.fresh_process
def test_regathering_in_backward_frees_the_prefix_copies_of_kept_graphs(psrl_model):
    """A chain of 12 turns with every graph kept: each reader's graph held a copy of its whole
    prefix chain; gathered again in backward, it holds none. Measured heap peak (in a process
    of its own: the figure is process-wide) drops by at least half of what the memory plan
    predicts (the plan is the budget's accounting). Half, not all: the plan charges one whole
    layer's copies while a reader runs, where the kernel frees them block by block, and the
    two runs differ in the order of their allocations, hence in allocator rounding."""
    arch, model = psrl_model
    rng = np.random.default_rng(0)
    toks = rng.integers(0, arch.vocab_size, 12 * 24).tolist()
    batch = samples_from_dicts([{"id": t, "tokens": toks[:24 * t], "loss_mask": [0] * (24 * t - 8) + [1] * 8,
                                 "advantage": 1.0} for t in range(1, 13)], source="chain")
    act = activation_bytes_per_token(arch, 1, 4)
    measured, planned = {}, {}
    for gathers in (False, True, False, True):  # the first of each warms allocator caches
        model.zero_grad(set_to_none=True)
        with PeakMemory(torch.device("cpu")) as m:
            _, _, memory, _, out = _run(arch, model, batch, 1 << 30, act, gathers)
        assert all(memory.keep_graph.values()) and out.tokens_recomputed == 0
        measured[gathers], planned[gathers] = m.peak_bytes - m.start_bytes, memory.peak_bytes
    assert planned[True] < planned[False]
    assert measured[True] + (planned[False] - planned[True]) // 2 <= measured[False]


def test_micro_batches_cut_at_branch_switches_are_exact_and_chosen_before_duplication(psrl_model, hf_model):
    """The search tree planned with micro-batches cut where the stream moves to a sibling
    branch trains exactly; and a budget that only this cut fits makes the trainer's planning
    pick it (sharing stays ``tree``) instead of duplicating prefixes."""
    from megatron_psrl.schedule.memory import plan_memory_group
    from megatron_psrl.schedule.with_memory import plan_with_memory

    arch, model = psrl_model
    batch = search_tree_batch()
    act = activation_bytes_per_token(arch, 1, 4)
    tree, plan, memory, cache, out = _run(arch, model, batch, 1 << 30, act, gathers=True, cut=True)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    ref_loss, ref = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.0, 0.0, "seq-mean-token-mean")
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, hf_grads_to_mcore(ref, arch), rtol=1e-5)

    geom = KVGeometry(arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu"))
    config = PlannerConfig(micro_batch_tokens=BUDGET, sharing="tree")
    peaks = {}
    for cut in (False, True):
        rank = plan_step(tree, PlannerConfig(micro_batch_tokens=BUDGET, sharing="tree",
                                             cut_at_branch_switches=cut)).ranks[0]
        peaks[cut] = simulated_peak_bytes(rank, geom, {s.producer: False for s in rank.sources.values()}, act,
                                          gathers_in_backward=True)
    assert peaks[True] < peaks[False]
    chosen, memories, mode = plan_with_memory(
        tree, config, lambda ranks: plan_memory_group(ranks, geom, peaks[True], act, gathers_in_backward=True))
    assert mode == "tree" and chosen.ranks[0].sources and memories[0].peak_bytes <= peaks[True]


def test_micro_batches_cut_after_shared_prefixes_are_exact(psrl_model, hf_model):
    """The search tree planned with a micro-batch ending after every prefix that branches (its
    producer's kept graph is the prefix's alone) trains exactly, every graph kept."""
    arch, model = psrl_model
    batch = search_tree_batch()
    tree, plan, memory, cache, out = _run(arch, model, batch, 1 << 30, activation_bytes_per_token(arch, 1, 4),
                                          after_prefixes=True)
    ends = {int(mb.tokens[-1]) + 1 for mb in plan.ranks[0].micro_batches}
    branching = np.flatnonzero(np.bincount(tree.node_parent[tree.node_parent >= 0], minlength=tree.num_nodes) > 1)
    assert len(branching) and all(int(tree.node_offset[n + 1]) in ends for n in branching)
    assert all(memory.keep_graph.values())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    ref_loss, ref = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.0, 0.0, "seq-mean-token-mean")
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, hf_grads_to_mcore(ref, arch), rtol=1e-5)


@pytest.mark.parametrize("gathers", [False, True], ids=["copies", "regather"])
def test_gpt_oss_under_a_tight_budget_reads_only_its_windows_rows(gpt_oss_model, gathers):
    """The search tree on gpt-oss (an 8-token window on its first layer, shorter than every turn
    and branch) with a budget that holds only the K/V blocks: producers recompute their graphs,
    the windowed layer reads at most the 7 rows of a cached prefix before its readers (the full
    layer all of them) and its pool keeps only those (fewer blocks, as many as the plan
    counted), and the loss and every gradient equal the per-sample reference."""
    arch, model, hf = gpt_oss_model
    batch = search_tree_batch(vocab=arch.vocab_size, branches=3)
    tight, act = _tight_budget(arch, batch, gathers, windows=True)
    tree, plan, memory, cache, out = _run(arch, model, batch, tight, act, gathers, windows=True)
    rank = plan.ranks[0]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    ref_loss, ref = per_sample_loss_and_grads(hf, batch, 0.2, 0.0, 0.0, "seq-mean-token-mean")
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, hf_grads_to_mcore(ref, arch), rtol=1e-5)
    assert out.tokens_recomputed > 0 and not any(memory.keep_graph.values())
    # the first layer (windowed) counts the rows read: at most window - 1 per source read (every
    # layer counts its reads), while the sources read are longer
    reads = cache.metrics.reads // arch.num_layers
    assert 0 < cache.metrics.tokens_read <= (arch.sliding_window - 1) * reads
    lengths = [rank.sources[s].length for mb in rank.micro_batches for s in mb.reads]
    assert np.mean(lengths) > 1.5 * (arch.sliding_window - 1)  # (13 rows on average)
    # the windowed pool (its own) keeps fewer rows of the sources, and every pool's peak in
    # blocks is what the plan predicted (16-token blocks: these sources take one either way)
    windowed = [j for j, p in enumerate(cache.pools) if p.state.window is not None]
    assert windowed and cache.metrics.peak_pool_blocks == memory.pool_sizes
    kept = [sum(p.kept_rows(s.length, *s.reach) for s in rank.sources.values()) for p in cache.pools]
    assert all(kept[j] < max(kept) for j in windowed)
