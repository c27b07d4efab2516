"""Router replay for Qwen3-MoE and GLM-4.5 (docs/moe.md "Router replay"): samples carry the
routes their rollout chose (``routed_experts``, ``[tokens, MoE layers, top-k]``), every MoE layer
takes them instead of its own top-k, the prefix tree shares a prefix only where tokens and
routes agree, and log-probs, the loss and every gradient (the router's included) equal the
per-sample Hugging Face computation with the same routes replayed (GLM-4.5: sigmoid weights of
the replayed experts without the expert bias, renormalised and scaled; routes for its MoE layers
only, the dense first layer has none); plus the data contract's errors for malformed routes.
EP = 2 under torchrun in the last (slow) test."""

import os
import re

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import make_family_checkpoint
from helpers.hf_reference import (
    assert_grads_close,
    hf_grads_to_mcore,
    load_hf_model,
    per_sample_logprobs,
    per_sample_loss_and_grads,
)
from helpers.moe_routes import hf_replayed
from helpers.moe_routes import prefix_routes as shared_prefix_routes
from helpers.torchrun import REPO_ROOT, run_torchrun

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.data.loader import load_samples, samples_from_dicts, write_samples
from megatron_psrl.data.validation import RoutingShape, SampleAccumulator, SampleValidationError
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.moe import routing_shape
from megatron_psrl.model.tiny import tiny_config
from megatron_psrl.tree import build_prefix_tree, check_tree

LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_router_replay.py")
CFG = tiny_config("debug-qwen3-moe")
LAYERS, TOPK, EXPERTS = CFG["num_hidden_layers"], CFG["num_experts_per_tok"], CFG["num_experts"]
GLM = "debug-glm4-moe"  # its 2 MoE layers (after a dense one) take routes of the same shape
DEEPSEEK = "debug-deepseek-v3-moe"  # latent attention; as GLM-4.5's, 2 MoE layers after a dense one


# ------------------------------------------------------------------------------- routes
def prefix_routes(tokens, seed: int = 0) -> np.ndarray:
    """int ``[n, L, k]`` routes of the debug model, a function of the token prefix."""
    return shared_prefix_routes(tokens, LAYERS, TOPK, EXPERTS, seed)


def routed_records(seed: int = 5, num_roots: int = 3):
    """random_tree_records with routes: shared prefixes share routes, except (1) a duplicate of a
    sample routed differently from position 3 on (its tree splits from the original there),
    (2) samples whose rollout engine returned no route for the final token (n - 1 routes)."""
    records = random_tree_records(seed=seed, num_roots=num_roots)
    for k, rec in enumerate(records):
        routes = prefix_routes(rec["tokens"])
        rec["routed_experts"] = (routes[:-1] if k % 3 == 1 else routes).tolist()
    twin = dict(records[0], id="twin")
    routes = prefix_routes(twin["tokens"])
    routes[3:] = prefix_routes(twin["tokens"], seed=1)[3:]
    twin["routed_experts"] = routes.tolist()
    records.append(twin)
    return records


def replayed(model, batch):
    """The HF model's routers take the batch's routes (a token without one keeps HF's own top-k)."""
    return hf_replayed(model, batch, torch.from_numpy(batch.routed_experts.astype(np.int64)))


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_family_checkpoint(CFG, str(tmp_path_factory.mktemp("hf-qwen3-moe-replay")))


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return load_hf_model(hf_dir)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return make_family_checkpoint(tiny_config(GLM), str(tmp_path_factory.mktemp("hf-glm4-moe-replay")), seed=3)


@pytest.fixture(scope="module")
def models(hf_dir, hf_model, glm_dir, tmp_path_factory):
    """``model -> (HF folder, HF model)``: Qwen3-MoE's, GLM-4.5's or DeepSeek-V3's (built when asked)."""
    cache = {"qwen3_moe": (hf_dir, hf_model)}

    def get(model):
        if model not in cache:
            directory = glm_dir if model == "glm4_moe" else make_family_checkpoint(
                tiny_config(DEEPSEEK), str(tmp_path_factory.mktemp("hf-deepseek-v3-moe-replay")), seed=3)
            cache[model] = directory, load_hf_model(directory)
        return cache[model]

    return get


@pytest.fixture(scope="module")
def records():
    return routed_records()


def _actor(hf_dir, micro_batch, **overrides):
    return PolicyActor(hf_dir, ActorConfig(device="cpu", micro_batch_tokens=micro_batch, loss=LOSS,
                                           optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0),
                                           **overrides))


# ------------------------------------------------------------------------------- exactness
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize("model,micro_batch,overrides", [
    ("qwen3_moe", 4096, {}), ("qwen3_moe", 32, {}),
    pytest.param("qwen3_moe", 32, RECOMPUTE, marks=pytest.mark.slow),  # recomputation on CPU: ~20 s a step here
    ("glm4_moe", 32, {}), ("deepseek_v3", 32, {}),
], ids=["tree-packing", "cached-prefixes", "cached-prefixes-recompute", "glm4-moe-cached-prefixes",
        "deepseek-v3-moe-cached-prefixes"])
def test_replayed_routes_equal_the_per_sample_reference(models, records, model, micro_batch, overrides):
    """Mechanism 1 (one tree-packed micro-batch) and mechanisms 1 + 2 (micro-batches of 32
    tokens: cached prefixes; also with activation recomputation, whose backward passes route
    again), EP = 1, fp32: log-probs, the loss and every gradient, the router's and every
    expert's included, equal the per-sample HF computation with the same routes replayed; and
    the routes matter (the model's own routing gives other log-probs). GLM-4.5: the replayed
    experts' sigmoid weights (no expert bias), renormalised and scaled, per MoE layer; DeepSeek-V3
    the same routing behind latent attention."""
    hf_dir, hf_model = models(model)
    batch = samples_from_dicts(records, source="records")
    actor = _actor(hf_dir, micro_batch, **overrides)
    ours = actor.compute_logprobs(records)
    with replayed(hf_model, batch):
        ref_logprobs = per_sample_logprobs(hf_model, batch)
    for a, b in zip(ours, ref_logprobs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    native = per_sample_logprobs(hf_model, batch)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, native)) > 1e-2

    result = actor.forward_backward(records)
    actor.engine.optimizer.reduce_gradients()
    grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}
    with replayed(hf_model, batch):
        ref_loss, ref_grads = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    assert result.metrics["tokens_computed"] < batch.num_tokens  # prefixes were shared
    if micro_batch == 32:
        assert result.metrics["micro_batches"] > 1
    else:
        assert result.metrics["micro_batches"] == 1
    ref = hf_grads_to_mcore(ref_grads, actor.arch)
    assert any(".mlp.router." in n for n in ref)
    assert_grads_close(grads, ref, rtol=1e-5)
    # the routers route on their own again for a batch without routes
    plain = [{k: v for k, v in r.items() if k != "routed_experts"} for r in records]
    for a, b in zip(actor.compute_logprobs(plain), native):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    actor.close()


# ------------------------------------------------------------------------------- the tree
def _two(tokens, routes_a, routes_b):
    return samples_from_dicts([{"id": "a", "tokens": tokens, "routed_experts": routes_a.tolist()},
                               {"id": "b", "tokens": tokens + [9], "routed_experts": routes_b.tolist()}])


def test_the_tree_splits_where_routes_differ():
    """Identical tokens: shared while the routes agree, split at the first token (of any layer)
    whose routes differ; with identical routes the whole prefix is shared, as without routes."""
    tokens = [5, 6, 7, 8, 1, 2]
    routes = prefix_routes(tokens + [9])
    same = build_prefix_tree(_two(tokens, routes[:-1], routes))
    check_tree(same)
    assert same.num_tree_tokens == len(tokens) + 1
    plain = build_prefix_tree(samples_from_dicts([{"tokens": tokens}, {"tokens": tokens + [9]}]))
    assert same.num_tree_tokens == plain.num_tree_tokens and np.array_equal(same.tokens, plain.tokens)
    for first_diff, layer in [(0, 0), (3, 1), (5, 0)]:
        other = routes.copy()
        other[first_diff:, layer] = (other[first_diff:, layer] + 1) % EXPERTS  # still distinct ids
        tree = build_prefix_tree(_two(tokens, routes[:-1], other))
        check_tree(tree)
        assert tree.num_tree_tokens == first_diff + (len(tokens) - first_diff) + (len(tokens) + 1 - first_diff)
        a, b = (tree.sample_token_index[tree.batch.sample_slice(s)] for s in range(2))
        assert np.array_equal(a[:first_diff], b[:first_diff]) and not np.intersect1d(a[first_diff:], b).size


def test_a_missing_final_route_does_not_merge_with_a_routed_token():
    """A sample one route short (no route for its final token) ends in a leaf of its own; the
    tokens before it share with the longer sample."""
    tokens = [5, 6, 7, 8]
    routes = prefix_routes(tokens + [9])
    batch = samples_from_dicts([{"tokens": tokens, "routed_experts": routes[:3].tolist()},
                                {"tokens": tokens + [9], "routed_experts": routes.tolist()}])
    assert (batch.routed_experts[3] == -1).all()
    tree = build_prefix_tree(batch)
    check_tree(tree)
    assert tree.num_tree_tokens == 3 + 1 + 2


def test_routes_survive_select_truncate_and_files(tmp_path, records):
    batch = samples_from_dicts(records, source="records")
    sub = batch.select([4, 1])
    assert np.array_equal(sub.routed_experts, np.concatenate([batch.routed_experts[batch.sample_slice(s)]
                                                              for s in (4, 1)]))
    short = batch.truncated(5)
    assert np.array_equal(short.routed_experts[:5], batch.routed_experts[:5])
    for name in ("r.jsonl", "r.parquet"):
        again = load_samples(write_samples(batch, tmp_path / name))
        assert np.array_equal(again.routed_experts, batch.routed_experts), name


# ------------------------------------------------------------------------------- validation
SHAPE = RoutingShape(LAYERS, TOPK, EXPERTS, model="qwen3_moe model")


def _add(routes, tokens=(1, 2, 3), routing=SHAPE):
    acc = SampleAccumulator("data.jsonl", "line", routing=routing)
    acc.add({"id": "s", "tokens": list(tokens), "routed_experts": routes}, 4)
    return acc


def _good(n=3):
    return prefix_routes(list(range(n))).tolist()


@pytest.mark.parametrize("mutate,words", [
    (lambda r: r[:1], ["1 routes for len(tokens) 3 tokens", "or one less"]),
    (lambda r: r + r, ["6 routes for len(tokens) 3"]),
    (lambda r: [[t[0]] for t in r], ["shape [3, 1, 2]", "[tokens, 2, 2]"]),
    (lambda r: [[ids + [7] if ids[0] != 7 and ids[1] != 7 else ids + [6] for ids in t] for t in r],
     ["shape [3, 2, 3]"]),
    (lambda r: r[:1] + [[r[1][0], [r[1][1][0]]]] + r[2:], ["token 1, layer 1 has 1 expert ids"]),
    (lambda r: r[:2] + [[r[2][0]]], ["token 2 has routes for 1 MoE layers"]),
    (lambda r: r[:2] + [[r[2][0], [8, r[2][1][1]]]], ["expert id 8 at token 2, layer 1", "[0, 8)"]),
    (lambda r: r[:1] + [[[-1, 0], r[1][1]]] + r[2:], ["expert id -1 at token 1, layer 0"]),
    (lambda r: r[:1] + [[r[1][0], [3, 3]]] + r[2:], ["duplicate expert id", "[3, 3] of token 1, layer 1"]),
    (lambda r: r[:1] + [[r[1][0], [3, 1.0]]] + r[2:], ["token 1, layer 1: element float 1.0", "integers"]),
    (lambda r: r[:1] + [[r[1][0], [True, 1]]] + r[2:], ["token 1, layer 1: element bool True"]),
    (lambda r: 7, ["nested list of expert ids, got int 7"]),
], ids=["too-short", "too-long", "layers", "topk", "ragged-topk", "ragged-layers", "id-too-large", "negative-id",
        "duplicate", "float", "bool", "scalar"])
def test_malformed_routes_are_refused(mutate, words):
    with pytest.raises(SampleValidationError) as err:
        _add(mutate(_good()))
    message = str(err.value)
    assert message.startswith("data.jsonl line 4 (sample id 's'): field 'routed_experts': "), message
    for word in words:
        assert word in message, message


def test_routes_for_a_dense_model_and_partial_routes_are_refused(hf_dir):
    dense = routing_shape(ModelArchitecture.from_hf_config(tiny_config("debug-llama")))
    with pytest.raises(SampleValidationError, match="dense llama model has no mixture-of-experts layer"):
        _add(_good(), routing=dense)
    assert routing_shape(ModelArchitecture.from_hf_dir(hf_dir)) == SHAPE
    # GLM-4.5: a route per MoE layer (its first layer is dense)
    assert routing_shape(ModelArchitecture.from_hf_config(tiny_config(GLM))) == RoutingShape(
        2, TOPK, EXPERTS, model="glm4_moe model")
    acc = _add(_good())
    with pytest.raises(SampleValidationError, match=r"line 5 \(sample id 't'\): field 'routed_experts': missing, "
                                                    r"but the first sample \(line 4\) carries them"):
        acc.add({"id": "t", "tokens": [1, 2]}, 5)
    # without the model's shape, every sample must have the first one's
    acc = _add(_good(), routing=None)
    with pytest.raises(SampleValidationError, match=r"shape \[2, 1, 2\].*the first sample's \(line 4\) routes are "
                                                    r"\[tokens, 2, 2\]"):
        acc.add({"id": "t", "tokens": [1, 2], "routed_experts": [[[0, 1]], [[0, 1]]]}, 5)


def test_a_batch_with_routes_that_do_not_fit_the_model_is_refused(hf_dir, records):
    """A SampleBatch built without the model's shape is checked when the actor takes it."""
    from megatron_psrl.data.validation import check_routed_experts

    batch = samples_from_dicts(records, source="records")
    batch.routed_experts[batch.offsets[2] + 1, 1, 0] = EXPERTS
    with pytest.raises(SampleValidationError, match=rf"records row 2 \(sample id '{batch.ids[2]}'\): field "
                                                    r"'routed_experts': expert ids \[8, \d\] at token 1, layer 1"):
        check_routed_experts(batch, SHAPE)
    with pytest.raises(SampleValidationError, match="has no mixture-of-experts layer"):
        check_routed_experts(batch, RoutingShape(0, 0, 0, model="dense llama model"))


# ------------------------------------------------------------------------------- EP = 2
@pytest.mark.slow  # two processes
@pytest.mark.parametrize("model", ["qwen3_moe", "glm4_moe", "gpt_oss"])
def test_router_replay_with_expert_parallelism_under_torchrun(hf_dir, glm_dir, tmp_path, model):
    """EP = DP = 2 over gloo, alltoall dispatcher, cached prefixes, routes replayed: every rank
    matches the per-sample reference with the same routes (asserted inside the script), while
    the lockstep's empty passes route on their own; GLM-4.5's dense first layer has no router
    (the routes' layers are its MoE layers). gpt-oss (the same layers, top-k and experts as
    Qwen3-MoE's: the same routes fit) adds its biased router, sliding windows and sinks."""
    directory = {"qwen3_moe": hf_dir, "glm4_moe": glm_dir}.get(model)
    if directory is None:
        directory = make_family_checkpoint(tiny_config("debug-gpt-oss"), str(tmp_path / model))
    out = run_torchrun(SCRIPT, [directory, "16"], nproc=2, timeout=600)
    reports = re.findall(r"rank (\d) replay ok: .*?empty passes (\d+)", out)
    assert sorted(rank for rank, _ in reports) == ["0", "1"], out[-3000:]
    assert sum(int(empty) for _, empty in reports) > 0, reports
