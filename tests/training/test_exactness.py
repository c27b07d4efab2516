"""Prefix-shared training equals per-sample training (Hugging Face reference), exactly.

For random trees with duplicates, samples that are prefixes of others, loss claims on shared
tokens with different advantages, per-token advantages, weights, old/ref log-probs: the loss,
the per-token log-probs and every parameter gradient of megatron_psrl (mechanism 1, mechanism 2
with kept or recomputed prefix graphs, the duplication stopgap, and the no-sharing baseline)
equal a plain per-sample forward/backward of the HF model (fp32, rel. err <= 1e-5). gpt-oss
(sliding windows shorter than the branches, attention sinks, biases, clamped experts) too, on
GRPO groups, a step-wise chain and a branching tree, with mechanism 1 and mechanism 2 at a
tight budget. DeepSeek-V3's latent attention (its prefixes cached as the K/V latent and the RoPE
key, projected up again by every reader; or as per-head K and V of different widths) on a GRPO
group, a step-wise chain and a branching tree, mechanism 1 and mechanism 2 at a tight KV budget
and with kept producer graphs.
"""

import dataclasses

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_batch
from helpers.hf_reference import assert_grads_close, hf_grads_to_mcore, per_sample_logprobs, per_sample_loss_and_grads

from megatron_psrl.data.synthetic import make_mixed
from megatron_psrl.engine.logprobs import compute_logprobs
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

CASES = [
    # (sharing mode, micro-batch tokens, kv budget bytes): M1, baseline, dup, M2 keep, M2 recompute
    ("tree", 4096, 1 << 30),
    ("none", 4096, 1 << 30),
    ("tree-dup", 64, 1 << 30),
    ("tree", 24, 1 << 30),
    ("tree", 24, "tight"),
]


def _geometry(arch):
    """What the family's layers keep (latent attention: keys and values of different widths)."""
    return KVGeometry.for_model(arch, 1, 1, torch.float32, torch.device("cpu"))


def run_ours(arch, model, batch, loss_cfg, mode, budget, kv_budget, dp=1):
    tree = build_prefix_tree(batch)
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=budget, sharing=mode, data_parallel_size=dp))
    geom = _geometry(arch)
    act = activation_bytes_per_token(arch, 1, 4)
    model.zero_grad(set_to_none=True)
    loss, recomputed, kept = 0.0, 0, []
    for r in range(dp):
        rank = plan.ranks[r]
        memory = None
        if rank.sources:
            if kv_budget == "tight":  # just the blocks: every prefix graph must be recomputed
                floor = plan_memory(rank, geom, 1 << 40, 0)
                kv = floor.peak_bytes
            else:
                kv = kv_budget
            memory = plan_memory(rank, geom, kv, act)
            kept += list(memory.keep_graph.values())
        cache = BlockKVCache(geom, kv if rank.sources else 1 << 20)
        out = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=cache).train(plan, r, loss_cfg, memory)
        loss += out.loss
        recomputed += out.tokens_recomputed
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss, grads, plan, recomputed, kept


@pytest.mark.parametrize("mode,budget,kv_budget", CASES)
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradients_equal_per_sample_reference(psrl_model, hf_model, mode, budget, kv_budget, loss_agg):
    arch, model = psrl_model
    batch = random_tree_batch(seed=11 + len(loss_agg))
    cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg=loss_agg)
    ref_loss, ref_hf = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, loss_agg)
    loss, grads, plan, recomputed, kept = run_ours(arch, model, batch, cfg, mode, budget, kv_budget)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_grads_close(grads, hf_grads_to_mcore(ref_hf, arch), rtol=1e-5)
    if mode == "tree" and budget < 100:
        assert plan.ranks[0].sources, "the budget must force mechanism 2"
        if kv_budget == "tight":
            assert recomputed > 0 and not any(kept)
        else:
            assert all(kept) and recomputed == 0


def test_clipping_is_per_claim(psrl_model, hf_model):
    """Large old-log-prob gaps make the PPO clip active on shared tokens with different
    advantages: merging claims would change the gradient."""
    arch, model = psrl_model
    batch = random_tree_batch(seed=5)
    batch.old_logprobs[:] = batch.old_logprobs + 3.0  # ratio far from 1 -> clipping everywhere
    batch.has_old_logprobs[:] = True
    cfg = LossConfig(clip_eps=0.1, loss_agg="token-mean")
    ref_loss, ref_hf = per_sample_loss_and_grads(hf_model, batch, 0.1, 0.0, 0.0, "token-mean")
    loss, grads, *_ = run_ours(arch, model, batch, cfg, "tree", 24, 1 << 30)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, hf_grads_to_mcore(ref_hf, arch), rtol=1e-5)


def test_data_parallel_shares_sum_to_the_reference(psrl_model, hf_model):
    """Three ranks' shares (run one after another here) add up to the global gradient."""
    arch, model = psrl_model
    batch = random_tree_batch(seed=3, num_roots=4)
    cfg = LossConfig(loss_agg="seq-mean-token-mean")
    ref_loss, ref_hf = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.0, 0.0, "seq-mean-token-mean")
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    loss = 0.0
    tree = build_prefix_tree(batch)
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=30, sharing="tree", data_parallel_size=3))
    assert sum(1 for r in plan.ranks if r.micro_batches) == 3
    for r in range(3):
        model.zero_grad(set_to_none=True)
        rank = plan.ranks[r]
        geom = _geometry(arch)
        memory = plan_memory(rank, geom, 1 << 30, 1) if rank.sources else None
        out = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=BlockKVCache(geom, 1 << 30)).train(
            plan, r, cfg, memory)
        loss += out.loss
        for n, p in model.named_parameters():
            if p.grad is not None:
                total[n] += p.grad
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(total, hf_grads_to_mcore(ref_hf, arch), rtol=1e-5)


@pytest.mark.parametrize("sharing,budget", [(True, 4096), (True, 16), (False, 4096)])
def test_logprobs_equal_reference(psrl_model, hf_model, sharing, budget):
    arch, model = psrl_model
    batch = random_tree_batch(seed=21)
    ref = per_sample_logprobs(hf_model, batch)
    ours = compute_logprobs(model, arch, batch, prefix_sharing=sharing, micro_batch_tokens=budget)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and a[0] == 0.0
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_logprobs_under_a_tiny_kv_budget_duplicate_prefixes_instead(psrl_model, hf_model):
    """A KV budget that cannot hold the cached prefixes: the forward pass duplicates them
    instead (same result); with samples longer than a micro-batch it cannot and says so."""
    from megatron_psrl.kvcache import CacheBudgetError

    arch, model = psrl_model
    batch = random_tree_batch(seed=21)
    one_block = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4 * 16
    ref = per_sample_logprobs(hf_model, batch)
    longest = int(batch.lengths.max())  # duplication can still split the trees
    tree = build_prefix_tree(batch)
    assert tree.subtree_tokens()[tree.node_parent < 0].max() > longest  # caching would be needed
    ours = compute_logprobs(model, arch, batch, micro_batch_tokens=longest, kv_cache_budget=one_block)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, atol=1e-4)
    with pytest.raises(CacheBudgetError, match="without caching"):
        compute_logprobs(model, arch, batch, micro_batch_tokens=16, kv_cache_budget=one_block)


@pytest.mark.parametrize("budget,kv_budget", [(4096, 1 << 30), (24, "tight")], ids=["m1", "m2-tight"])
def test_gpt_oss_windows_and_sinks_equal_the_per_sample_reference(gpt_oss_model, budget, kv_budget):
    """GRPO groups, a step-wise chain and a branching tree (the mixed workload) on the debug
    gpt-oss model, whose 8-token window is shorter than the tree's branches and prefixes: the
    loss, every gradient (sinks, biases, router, experts) and the log-probs equal the per-sample
    HF computation; at the tight budget cached prefixes are recomputed and their rows older than
    every reader's window are not read."""
    arch, model, hf = gpt_oss_model
    batch = make_mixed(grpo=dict(num_prompts=1, group_size=3, prompt_len=(12, 16), response_len=(9, 12)),
                       stepwise=dict(num_trajectories=1, turns=3, obs_len=(6, 9), action_len=(4, 6), task_len=(4, 6)),
                       tree=dict(num_roots=1, branching=2, depth=2, segment_len=(9, 12), prompt_len=(10, 12),
                                 obs_len=(3, 5)),
                       vocab_size=arch.vocab_size, seed=5, with_logprobs=True)  # 10 samples, 280 tokens
    tree = build_prefix_tree(batch)
    assert arch.sliding_window == 8 and tree.node_len.min() > arch.sliding_window  # every branch longer
    cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    ref_loss, ref_hf = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    loss, grads, plan, recomputed, _ = run_ours(arch, model, batch, cfg, "tree", budget, kv_budget)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    ref = hf_grads_to_mcore(ref_hf, arch)
    assert ref["decoder.layers.0.self_attention.core_attention.softmax_offset"].abs().min() > 0
    assert_grads_close(grads, ref, rtol=1e-5)
    assert bool(plan.ranks[0].sources) == (budget < 100) and (recomputed > 0) == (kv_budget == "tight")
    windowed = [p for p in _geometry(arch).pools if p.state.window is not None]
    sources = plan.ranks[0].sources.values()  # (mechanism 2: the windowed pool keeps fewer of their rows)
    cut = any(p.kept_rows(s.length, *s.reach) < s.length for p in windowed for s in sources)
    assert windowed and cut == (budget < 100)
    ours = compute_logprobs(model, arch, batch, micro_batch_tokens=budget)
    for a, b in zip(ours, per_sample_logprobs(hf, batch)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def _latent_batch(kind: str):
    """Small batches of the three shapes (24-token micro-batches hold a fraction of each)."""
    from megatron_psrl.data.synthetic import make_grpo, make_stepwise, make_tree_rollouts

    common = dict(vocab_size=256, seed=3, with_logprobs=True)
    if kind == "grpo-group":  # one prompt, four responses
        return make_grpo(num_prompts=1, group_size=4, prompt_len=(24, 30), response_len=(6, 12), **common)
    if kind == "stepwise-chain":  # one trajectory: every sample a prefix of the next
        return make_stepwise(num_trajectories=1, turns=4, obs_len=(6, 10), action_len=(3, 6), system_len=10,
                             task_len=(6, 10), **common)
    return make_tree_rollouts(num_roots=1, branching=2, depth=2, segment_len=(4, 8), prompt_len=(16, 20),
                              obs_len=(3, 6), **common)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("kind", ["grpo-group", "stepwise-chain", "branching-tree"])
@pytest.mark.parametrize("mode,budget,kv_budget", [CASES[0], CASES[4]], ids=["m1", "m2-tight"])
def test_latent_attention_gradients_equal_per_sample_reference(request, moe, kind, mode, budget, kv_budget):
    """DeepSeek-V3's latent attention with dense MLPs (``debug-deepseek-v3``) and with its MoE
    layers (``debug-deepseek-v3-moe``: grouped sigmoid routing, an expert bias, a shared expert)."""
    prefix = "latent_moe" if moe else "latent"
    arch, model = request.getfixturevalue(f"{prefix}_model")
    latent_hf_model = request.getfixturevalue(f"{prefix}_hf_model")
    assert arch.multi_latent_attention and arch.is_moe == moe
    batch = _latent_batch(kind)
    cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    ref_loss, ref_hf = per_sample_loss_and_grads(latent_hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    assert _geometry(arch).layer_states[0].kinds("values") == ("latent", "rope_key")  # (the default)
    loss, grads, plan, recomputed, kept = run_ours(arch, model, batch, cfg, mode, budget, kv_budget)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_grads_close(grads, hf_grads_to_mcore(ref_hf, arch), rtol=1e-5)
    if kv_budget == "tight":  # prefixes cached, every producer's graph dropped and recomputed
        assert plan.ranks[0].sources and recomputed > 0 and not any(kept)
    else:
        assert not plan.ranks[0].sources


@pytest.mark.parametrize("kind", ["grpo-group", "branching-tree"])
@pytest.mark.parametrize("latent_cache,mode,budget,kv_budget", [("latent", *CASES[3]), ("per-head", *CASES[4])],
                         ids=["latent-m2-keep", "per-head-m2-tight"])
def test_latent_cache_choices_equal_per_sample_reference(latent_model, latent_hf_model, kind, latent_cache, mode,
                                                         budget, kv_budget):
    """Mechanism 2 with the latent cache and kept producer graphs (the readers' latent and RoPE
    key gradients injected into the captured rows), and with per-head K/V (``--latent-cache
    per-head``) at a tight budget."""
    arch, model = latent_model
    arch = dataclasses.replace(arch, latent_cache=latent_cache)
    kinds = {"latent": ("latent", "rope_key"), "per-head": ("k", "v")}[latent_cache]
    assert _geometry(arch).layer_states[0].kinds("values") == kinds
    batch = _latent_batch(kind)
    cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    ref_loss, ref_hf = per_sample_loss_and_grads(latent_hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    loss, grads, plan, recomputed, kept = run_ours(arch, model, batch, cfg, mode, budget, kv_budget)
    assert plan.ranks[0].sources and (all(kept) and not recomputed if kv_budget != "tight" else recomputed > 0)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_grads_close(grads, hf_grads_to_mcore(ref_hf, arch), rtol=1e-5)


def test_latent_attention_logprobs_with_cached_prefixes(latent_model, latent_hf_model):
    arch, model = latent_model
    batch = _latent_batch("stepwise-chain")
    ref = per_sample_logprobs(latent_hf_model, batch)
    for a, b in zip(compute_logprobs(model, arch, batch, prefix_sharing=True, micro_batch_tokens=16), ref):
        np.testing.assert_allclose(a, b, atol=1e-4)
