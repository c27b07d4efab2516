"""The MoE router z-loss and load-balancing (aux) loss with prefix sharing (docs/moe.md "Router
losses"): the loss and every gradient (the routers' included) of a step with sharing equal the
per-sample Hugging Face computation of the policy loss plus the router losses of the whole batch
(every sample's tokens, a shared token once per sample), with and without router replay
(without: the route-count pre-pass), with one tree-packed micro-batch (mechanism 1) and with
cached prefixes (mechanism 2). Qwen3-MoE, fp32, EP = 1; GLM-4.5's grouped sigmoid router with
cached prefixes."""

import contextlib
import os
import re

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import make_family_checkpoint
from helpers.hf_reference import assert_grads_close, hf_grads_to_mcore, load_hf_model, per_sample_loss_and_grads
from helpers.moe_routes import hf_replayed
from helpers.moe_routes import prefix_routes as shared_prefix_routes
from helpers.torchrun import REPO_ROOT, run_torchrun

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.model.adapters import get_adapter, unfuse_experts
from megatron_psrl.model.tiny import tiny_config

LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
CFG = tiny_config("debug-qwen3-moe")
LAYERS, TOPK, EXPERTS = CFG["num_hidden_layers"], CFG["num_experts_per_tok"], CFG["num_experts"]
Z_COEFF, AUX_COEFF = 0.05, 0.5  # large enough that the router losses move the routers' gradients
SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_router_losses.py")


# ------------------------------------------------------------------------------- routes
def prefix_routes(tokens, seed: int = 0) -> np.ndarray:
    """``[n, L, k]`` routes of the debug model, a function of the token prefix (a shared prefix shares them)."""
    return shared_prefix_routes(tokens, LAYERS, TOPK, EXPERTS, seed)


def with_routes(records):
    """Routes on every sample; every third one without a route for its final token."""
    out = []
    for k, rec in enumerate(records):
        routes = prefix_routes(rec["tokens"])
        out.append(dict(rec, routed_experts=(routes[:-1] if k % 3 == 1 else routes).tolist()))
    return out


def replay_routes(batch) -> torch.Tensor:
    """int64 ``[N, L, k]``: the routes the replay takes (a token without one: experts 0..k-1)."""
    routes = torch.from_numpy(batch.routed_experts.astype(np.int64)).clone()
    missing = routes[:, 0, 0] < 0
    routes[missing] = torch.arange(TOPK)
    return routes


def replayed(model, batch):
    """The HF model's routers take the batch's replayed routes (:func:`replay_routes`)."""
    return hf_replayed(model, batch, replay_routes(batch))


# ------------------------------------------------------------------------------- the reference
def reference_router_losses(model, batch, z_coeff: float, aux_coeff: float, replay: bool):
    """The router losses of the per-sample batch, restated: one HF forward per sample with
    ``output_router_logits``; per layer, over all N tokens of all samples,
    ``z = z_coeff * mean_t logsumexp(logits_t)^2`` and
    ``aux = aux_coeff * E / (k N^2) * sum_e (sum_t softmax(logits_t)_e) * count_e``, ``count_e``
    the tokens routed to e (replayed routes, or HF's own top-k). Their backward adds their
    gradients to the model's ``.grad``; returns ``(z, aux)`` summed over layers."""
    logits = [[] for _ in range(LAYERS)]
    for s in range(batch.num_samples):
        toks = torch.from_numpy(batch.sample_tokens(s).astype(np.int64))
        out = model(toks[None], output_router_logits=True)
        for layer, lg in enumerate(out.router_logits):
            logits[layer].append(lg.reshape(-1, EXPERTS).float())
    n = batch.num_tokens
    routes = replay_routes(batch) if replay else None
    z_total, aux_total = torch.zeros(()), torch.zeros(())
    for layer in range(LAYERS):
        lg = torch.cat(logits[layer])  # [N, E], the batch's token order
        assert lg.shape[0] == n
        z_total = z_total + z_coeff * torch.logsumexp(lg, dim=-1).square().sum() / n
        p = torch.softmax(lg, dim=-1)
        chosen = routes[:, layer] if replay else torch.topk(p, TOPK, dim=-1).indices
        counts = torch.zeros(EXPERTS).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        aux_total = aux_total + aux_coeff * EXPERTS / (TOPK * n * n) * (p.sum(dim=0) * counts).sum()
    (z_total + aux_total).backward()
    return float(z_total.detach()), float(aux_total.detach())


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_family_checkpoint(CFG, str(tmp_path_factory.mktemp("hf-qwen3-moe-router-losses")))


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return load_hf_model(hf_dir)


def _actor(hf_dir, micro_batch, **overrides):
    return PolicyActor(hf_dir, ActorConfig(device="cpu", micro_batch_tokens=micro_batch, loss=LOSS,
                                           optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0),
                                           **overrides))


# ------------------------------------------------------------------------------- exactness
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize("replay,micro_batch,overrides", [
    (False, 4096, {}), (True, 4096, {}), (False, 32, {}), (True, 32, {}),
    pytest.param(True, 32, RECOMPUTE, marks=pytest.mark.slow),  # recomputation on CPU: slow
], ids=["tree-packing-own-routes", "tree-packing-replay", "cached-prefixes-own-routes", "cached-prefixes-replay",
        "cached-prefixes-replay-recompute"])
def test_router_losses_equal_the_per_sample_reference(hf_dir, hf_model, replay, micro_batch, overrides):
    """z-loss + aux loss with sharing: the step's loss (policy + router losses), the reported
    ``moe_z_loss`` / ``moe_aux_loss`` and every gradient equal the per-sample reference's (also
    with activation recomputation, whose backward passes route and add the terms again)."""
    records = random_tree_records(seed=5, num_roots=3)
    if replay:
        records = with_routes(records)
    batch = samples_from_dicts(records, source="records")
    actor = _actor(hf_dir, micro_batch, moe_z_loss_coeff=Z_COEFF, moe_aux_loss_coeff=AUX_COEFF, **overrides)
    result = actor.forward_backward(records)
    actor.engine.optimizer.reduce_gradients()
    grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}
    actor.close()

    ctx = replayed(hf_model, batch) if replay else contextlib.nullcontext()
    with ctx:
        ref_loss, policy_grads = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
        z, aux = reference_router_losses(hf_model, batch, Z_COEFF, AUX_COEFF, replay)
    ref_grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in hf_model.named_parameters() if n in policy_grads}

    assert result.metrics["tokens_computed"] < batch.num_tokens  # prefixes were shared
    assert (result.metrics["micro_batches"] > 1) == (micro_batch == 32)
    assert result.metrics["moe_z_loss"] == pytest.approx(z, rel=1e-5)
    assert result.metrics["moe_aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert result.loss == pytest.approx(ref_loss + z + aux, rel=1e-5)
    to_mcore = get_adapter(actor.arch).hf_to_mcore
    ref = dict(to_mcore(lambda n: unfuse_experts(ref_grads)[n]))
    assert_grads_close(grads, ref, rtol=1e-5)
    # the router losses matter: they move the routers' gradients well beyond the tolerance
    policy = dict(to_mcore(lambda n: unfuse_experts(policy_grads)[n]))
    router = [n for n in ref if ".mlp.router." in n]
    assert router and all((ref[n] - policy[n]).abs().max() > 1e-3 * ref[n].abs().max() for n in router)


# ------------------------------------------------------------------------------- grouped routing
def reference_grouped_router_losses(model, batch, z_coeff: float, aux_coeff: float):
    """:func:`reference_router_losses` of a GLM-4.5 model (DeepSeek-V3's MoE): per MoE layer
    (its dense first layer has no router), megatron's aux-loss scores of a sigmoid router
    (``sigmoid(logits)`` normalised over all experts) and the experts transformers' grouped,
    biased selection routed each token to."""
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "route_tokens_to_experts")]
    logits, chosen = [[] for _ in moe], [[] for _ in moe]
    hooks = [mlp.gate.register_forward_hook(lambda m, a, out, row=row: logits[row].append(out.float()))
             for row, mlp in enumerate(moe)]
    for row, mlp in enumerate(moe):
        def route(lg, own=mlp.route_tokens_to_experts, row=row):
            indices, weights = own(lg)
            chosen[row].append(indices)
            return indices, weights
        mlp.route_tokens_to_experts = route
    try:
        for s in range(batch.num_samples):
            model(torch.from_numpy(batch.sample_tokens(s).astype(np.int64))[None])
    finally:
        for hook, mlp in zip(hooks, moe):
            hook.remove()
            del mlp.route_tokens_to_experts
    n, experts, k = batch.num_tokens, moe[0].n_routed_experts, moe[0].top_k
    z_total, aux_total = torch.zeros(()), torch.zeros(())
    for row in range(len(moe)):
        lg = torch.cat(logits[row])  # [N, E]
        z_total = z_total + z_coeff * torch.logsumexp(lg, dim=-1).square().sum() / n
        scores = torch.sigmoid(lg)
        p = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        ids = torch.cat(chosen[row]).reshape(-1)
        counts = torch.zeros(experts).index_add_(0, ids, torch.ones(ids.numel()))
        aux_total = aux_total + aux_coeff * experts / (k * n * n) * (p.sum(dim=0) * counts).sum()
    (z_total + aux_total).backward()
    return float(z_total.detach()), float(aux_total.detach())


def test_grouped_sigmoid_router_losses_equal_the_per_sample_reference(tmp_path):
    """GLM-4.5 (a dense first layer, then grouped sigmoid routing with the expert bias), cached
    prefixes, the route-count pre-pass (the model's own routes): the z-loss and megatron's aux
    loss over sigmoid scores, counted per MoE layer, a shared token once per sample, and every
    gradient equal the per-sample reference's; with the expert bias's update on, which the same
    per-row weights count for (tests/model/test_glm4_moe.py checks the bias)."""
    hf_dir = make_family_checkpoint(tiny_config("debug-glm4-moe"), str(tmp_path / "hf"), seed=3)
    hf = load_hf_model(hf_dir)
    records = random_tree_records(seed=5, num_roots=3)
    batch = samples_from_dicts(records, source="records")
    actor = _actor(hf_dir, 32, moe_z_loss_coeff=Z_COEFF, moe_aux_loss_coeff=AUX_COEFF,
                   moe_router_enable_expert_bias=True)
    result = actor.forward_backward(records)
    actor.engine.optimizer.reduce_gradients()
    grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}
    actor.close()
    ref_loss, policy_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    z, aux = reference_grouped_router_losses(hf, batch, Z_COEFF, AUX_COEFF)
    ref_grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in hf.named_parameters() if n in policy_grads}
    assert result.metrics["tokens_computed"] < batch.num_tokens and result.metrics["micro_batches"] > 1
    assert result.metrics["moe_z_loss"] == pytest.approx(z, rel=1e-5)
    assert result.metrics["moe_aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert result.loss == pytest.approx(ref_loss + z + aux, rel=1e-5)
    ref, policy = hf_grads_to_mcore(ref_grads, actor.arch), hf_grads_to_mcore(policy_grads, actor.arch)
    assert_grads_close(grads, ref, rtol=1e-5)
    router = [n for n in ref if ".mlp.router." in n]
    assert router and all((ref[n] - policy[n]).abs().max() > 1e-3 * ref[n].abs().max() for n in router)


# ------------------------------------------------------------------------------- EP = 2
@pytest.mark.slow  # two processes
@pytest.mark.parametrize("tp", [1, 2], ids=["ep2xdp2", "ep2xtp2"])
def test_router_losses_with_expert_parallelism_under_torchrun(hf_dir, tp):
    """EP = 2 over gloo, alltoall dispatcher, cached prefixes, the experts split over two
    data-parallel ranks, or over two tensor-parallel ranks with sequence parallelism (each routes
    its share of every pack's rows, padding rows weighing nothing): with replay and with the
    route-count pre-pass, every rank matches the per-sample reference (asserted in the script)."""
    out = run_torchrun(SCRIPT, [hf_dir, "16", str(tp)], nproc=2, timeout=900)
    reports = re.findall(rf"rank (\d) tp {tp} (replay|own-routes) router losses ok", out)
    assert sorted(reports) == [("0", "own-routes"), ("0", "replay"), ("1", "own-routes"), ("1", "replay")], out[-3000:]
    if tp == 1:  # data-parallel ranks with different passes: the lockstep's empty passes ran
        assert sum(int(n) for n in re.findall(r"empty passes (\d+)", out)) > 0
