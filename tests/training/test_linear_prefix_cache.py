"""Mechanism 2 on hybrid models: a Gated DeltaNet layer's cached prefix is its recurrent state.

Tiny Qwen3.5 / Qwen3-Next models (fp32, CPU) train on trees whose micro-batches are far
smaller than the trees, so prefixes are cached across micro-batches: every linear layer reads
the state and conv tail of the prefix it continues from the cache (a fixed slot per source
and layer) and its gradient is summed there over the readers and injected at the producer's
backward, kept graphs and dropped-and-recomputed producers alike. The loss and every
parameter gradient equal transformers run per sample. A reader that ignored the cached state
(started from zero) would not: the last test shows the comparison sees it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf_reference import assert_grads_close, hf_grads_to_mcore, per_sample_logprobs, per_sample_loss_and_grads
from helpers.hybrid import make_hybrid_checkpoint

from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.engine.logprobs import compute_logprobs
from megatron_psrl.engine.prefix_kv import PrefixKV
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.kvcache.prefix_state import Storage
from megatron_psrl.model.adapters import unfuse_experts
from megatron_psrl.model.linear_attention import LinearState
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

LOSS = dict(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="token-mean")
MICRO_BATCH_TOKENS = 12


def _record(rng, tokens, prompt):
    n = len(tokens)
    return {"id": f"s{int(rng.integers(1 << 30))}", "tokens": [int(t) for t in tokens],
            "loss_mask": [0] * prompt + [1] * (n - prompt), "advantage": float(rng.normal()),
            "old_logprobs": (rng.normal(size=n) * 0.3 - 5.5).tolist(),
            "ref_logprobs": (rng.normal(size=n) * 0.3 - 5.5).tolist()}


def _batch(kind, vocab, seed=0):
    """A GRPO group (one prompt, four completions), a step-wise chain (every turn's sample a
    prefix of the next one's) or a branching tree (two levels)."""
    rng = np.random.default_rng(seed)
    draw = lambda lo, hi: rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist()  # noqa: E731
    prompt = draw(18, 22)
    if kind == "grpo-group":
        samples = [prompt + draw(5, 10) for _ in range(4)]
    elif kind == "step-wise-chain":
        samples, turn = [], prompt
        for _ in range(3):
            turn = turn + draw(6, 10)
            samples.append(turn)
    else:
        samples = [mid + draw(3, 8) for mid in (prompt + draw(4, 9), prompt + draw(4, 9)) for _ in range(2)]
    return samples_from_dicts([_record(rng, s, len(prompt)) for s in samples], source=kind)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """``name -> (arch, model, hf model)``, built once per module and process-group state."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from megatron_psrl.checkpoint import ModelSource, load_model
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model.tiny import tiny_config

    cache = {}

    def get(name):
        # (built again when the process groups it was built under are gone: an actor's close() ends them)
        initialize_parallel(1, 1, seed=0, device="cpu")
        group = parallel_state.get_tensor_model_parallel_group()
        if cache.get("group") is not group:
            cache.clear()
            cache["group"] = group
        if name not in cache:
            d = make_hybrid_checkpoint(tiny_config(name), str(tmp_path_factory.mktemp(name)))
            arch, model, _ = load_model(ModelSource(hf_dir=d), dtype=torch.float32)
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
            hf.eval()
            cache[name] = (arch, model, hf)
        return cache[name]

    return get


def _run(arch, model, batch, tight):
    """One mechanism-2 step: ``(loss, grads, plan, memory, tokens recomputed)``; ``tight``: a
    KV budget of the blocks alone, so every producer's graph is dropped and recomputed."""
    tree = build_prefix_tree(batch)
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=MICRO_BATCH_TOKENS, sharing="tree"))
    rank = plan.ranks[0]
    geometry = KVGeometry.for_model(arch, 1, 1, torch.float32, torch.device("cpu"))
    kv = plan_memory(rank, geometry, 1 << 40, 0).peak_bytes if tight else 1 << 30
    memory = plan_memory(rank, geometry, kv, activation_bytes_per_token(arch, 1, 4))
    model.zero_grad(set_to_none=True)
    out = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=BlockKVCache(geometry, kv)).train(
        plan, 0, LossConfig(**LOSS), memory)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.loss, grads, plan, memory, out.tokens_recomputed


def _reference(arch, hf, batch):
    loss, grads = per_sample_loss_and_grads(hf, batch, LOSS["clip_eps"], LOSS["kl_coef"], LOSS["entropy_coef"],
                                            LOSS["loss_agg"])
    if arch.is_moe:
        grads = unfuse_experts(grads, arch.model_type)
    return loss, hf_grads_to_mcore(grads, arch)


CASES = [("debug-qwen3.5-text", kind) for kind in ("grpo-group", "step-wise-chain", "branching-tree")]
CASES += [("debug-qwen3-next", "branching-tree")]


@pytest.mark.parametrize("tight", [False, True], ids=["kept-graphs", "recomputed-producers"])
@pytest.mark.parametrize("name,kind", CASES)
def test_cached_linear_states_train_exactly(hybrid, name, kind, tight):
    arch, model, hf = hybrid(name)
    batch = _batch(kind, arch.vocab_size)
    ref_loss, ref_grads = _reference(arch, hf, batch)
    loss, grads, plan, memory, recomputed = _run(arch, model, batch, tight)
    rank = plan.ranks[0]
    # mechanism 2 is in force: prefixes cached, read by later micro-batches, linear layers included
    assert rank.sources and any(src.consumers for src in rank.sources.values())
    assert any(p.state.storage is Storage.FIXED for p in KVGeometry.for_model(
        arch, 1, 1, torch.float32, torch.device("cpu")).pools)
    if tight:
        assert recomputed > 0 and not any(memory.keep_graph.values())
    else:
        assert recomputed == 0 and all(memory.keep_graph.values())
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_grads_close(grads, ref_grads, rtol=1e-5)


def test_a_reader_starting_from_zero_state_is_caught(hybrid, monkeypatch):
    """The comparison above sees the cached state: readers handed zero states (the prefix's
    K/V still read by the softmax layers) give another loss and other gradients."""
    arch, model, hf = hybrid("debug-qwen3.5-text")
    batch = _batch("grpo-group", arch.vocab_size)
    ref_loss, ref_grads = _reference(arch, hf, batch)
    read = PrefixKV.external_linear_state

    def zero_state(self, layer_number):
        state = read(self, layer_number)
        return LinearState(torch.zeros_like(state.recurrent), torch.zeros_like(state.conv_tail))

    monkeypatch.setattr(PrefixKV, "external_linear_state", zero_state)
    loss, grads, _, _, _ = _run(arch, model, batch, tight=False)
    assert loss != pytest.approx(ref_loss, rel=1e-3)
    with pytest.raises(AssertionError):
        assert_grads_close(grads, ref_grads, rtol=1e-5)


def test_a_producer_missing_its_readers_state_gradient_is_caught(hybrid, monkeypatch):
    """The comparison sees the injected state gradient too: a producer whose backward injected
    nothing into its linear layers' final states (the K/V gradients still injected) gives
    other gradients."""
    arch, model, hf = hybrid("debug-qwen3.5-text")
    batch = _batch("grpo-group", arch.vocab_size)
    _, ref_grads = _reference(arch, hf, batch)
    read_grad = BlockKVCache.read_grad

    def no_state_grad(self, source_id, layer):
        grads = read_grad(self, source_id, layer)
        fixed = not self.geometry.state_of(layer).per_token
        return tuple(torch.zeros_like(g) for g in grads) if fixed else grads

    monkeypatch.setattr(BlockKVCache, "read_grad", no_state_grad)
    _, grads, _, _, _ = _run(arch, model, batch, tight=False)
    with pytest.raises(AssertionError):
        assert_grads_close(grads, ref_grads, rtol=1e-5)


@pytest.mark.parametrize("budget", [None, 200000], ids=["kept-graphs", "dropped-graphs"])
def test_recomputed_layers_inject_the_state_gradient_once(hybrid, budget):
    """megatron's full recomputation (a layer's forward runs twice; the cached gradients are
    injected inside the graph, the states written once): one SGD step of the actor equals
    the per-sample reference."""
    from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor
    from megatron_psrl.model.gpt import model_chunks

    arch, _, hf = hybrid("debug-qwen3.5-text")
    batch = _batch("grpo-group", arch.vocab_size)
    ref_loss, ref_grads = _reference(arch, hf, batch)
    extra = {} if budget is None else dict(kv_cache_budget=budget)
    actor = PolicyActor(hf.name_or_path, ActorConfig(
        device="cpu", optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0), loss=LossConfig(**LOSS),
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        micro_batch_tokens=MICRO_BATCH_TOKENS, **extra))
    try:
        params = dict(model_chunks(actor.engine.model)[0].named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        metrics = actor.train_step(batch)
        assert metrics["kv_hit_rate"] > 0 and (metrics["tokens_recomputed"] > 0) == (budget is not None)
        assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for name, grad in ref_grads.items():
            step = before[name] - params[name].detach()
            torch.testing.assert_close(step, grad, rtol=0, atol=2e-5 * float(grad.abs().max()) + 1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    finally:
        actor.close()


@pytest.mark.parametrize("kind", ["step-wise-chain", "branching-tree"])
def test_the_logprob_pass_reads_cached_states(hybrid, kind):
    """Forward only (no graph): the cached states are read as they are, the same log-probs."""
    arch, model, hf = hybrid("debug-qwen3.5-text")
    batch = _batch(kind, arch.vocab_size)
    ours = compute_logprobs(model, arch, batch, micro_batch_tokens=MICRO_BATCH_TOKENS)
    for a, b in zip(ours, per_sample_logprobs(hf, batch)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-5)
