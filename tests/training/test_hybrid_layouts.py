"""Hybrid models (Gated DeltaNet linear-attention layers beside gated softmax layers) in the
parallel layouts, under torchrun (gloo, 2 ranks; 4 for PP x TP and PP x DP): one SGD step and the
log-probs equal the per-sample Hugging Face reference (fp32: the loss, every parameter's
update, the log-probs) for

* TP = 2 on Qwen3.5 (``in_proj`` / ``conv1d`` split part by part by heads, ``dt_bias`` /
  ``A_log`` by value heads, ``out_proj`` by columns, the gated norm's weight gradient summed
  over the ranks), and with sequence parallelism;
* PP = 2 on a 6-layer Qwen3.5 (linear, linear, full on each stage): 1F1B (mechanism 1) and plan
  order (mechanism 2), the linear layers' cached states kept per stage; and stages of one kind
  each (three linear layers, then the full one), whose caches hold different pools; and
  PP = 2 x TP = 2 with sequence parallelism, PP = 2 x DP = 2 (and x EP = 2 on Qwen3.5-MoE);
* DP = 2 on Qwen3.5, every tree whole on one data-parallel rank (the placement models with
  fixed-size states get);
* EP = 2 on Qwen3.5-MoE with router replay (``routed_experts``), and Qwen3-Next with TP = 2,
  sequence parallelism and EP = 2 over the same two ranks (its fused per-key-head projections
  regrouped and split);

* TP = 2 with sequence parallelism on gpt-oss (not hybrid: sliding windows and sinks split by
  heads, biased experts whole on both ranks; MoE under TP needs sequence parallelism);

with mechanism 1 only (every tree in a micro-batch), with mechanism 2 (16-token micro-batches,
far smaller than the trees: the prefixes' recurrent states and conv tails cached and read by
later micro-batches, graphs kept) and with mechanism 2 where the KV budget makes producers drop
their graph and recompute it: all three on TP = 2, PP = 2 and EP = 2; mechanism 1 and
recomputed producers with sequence parallelism, on DP = 2 and PP x TP; mechanisms 1 and 2
(kept graphs) on PP x DP; mechanism 2 on the one-kind stages and (recomputed producers) PP x
EP; recomputed producers on Qwen3-Next (the costliest case). The cases run in the
session's two- and four-rank pools, with the script of the pipeline tests.
"""

import contextlib
import json
import os

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import make_family_checkpoint
from helpers.hf_reference import load_hf_model, per_sample_logprobs, per_sample_loss_and_grads
from helpers.hybrid import make_hybrid_checkpoint
from helpers.moe_routes import hf_replayed, prefix_routes
from helpers.tolerance import rounding_tolerance
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.model.adapters import unfuse_experts
from megatron_psrl.model.tiny import tiny_config

SCRIPT = os.path.join(REPO_ROOT, "tests", "training", "scripts", "pipeline_step.py")
MODES = ("m1", "m2", "m2-recompute")
STAGE_KINDS = ["linear_attention", "linear_attention", "full_attention"]
MODELS = {  # name: (config, routed: the samples carry routes, replayed by the reference)
    "qwen3.5": (tiny_config("debug-qwen3.5-text"), False),
    # six layers, each pipeline stage of three holding both kinds
    "qwen3.5-6": (dict(tiny_config("debug-qwen3.5-text"), num_hidden_layers=6, layer_types=STAGE_KINDS * 2), False),
    "qwen3.5-moe": (tiny_config("debug-qwen3.5-moe-text"), True),
    "qwen3-next": (tiny_config("debug-qwen3-next"), True),
    "gpt-oss": (tiny_config("debug-gpt-oss"), False),
}
LAYOUTS = {  # id: (model, arguments of the script, mechanism-1 executor, modes)
    "tp2": ("qwen3.5", ["--tp", "2", "--pp", "1"], None, MODES),
    "tp2-sp": ("qwen3.5", ["--tp", "2", "--pp", "1", "--sequence-parallel"], None, ("m1", "m2-recompute")),
    "pp2": ("qwen3.5-6", ["--pp", "2"], "1f1b", MODES),
    # stages of one kind each (linear, linear, linear | full): each stage's cache has other pools
    "pp2-one-kind-stages": ("qwen3.5", ["--pp", "2", "--first-layers", "3"], "1f1b", ("m2", "m2-recompute")),
    # (four ranks)
    "pp2xtp2-sp": ("qwen3.5-6", ["--tp", "2", "--pp", "2", "--sequence-parallel"], "1f1b", ("m1", "m2-recompute")),
    # a stage whose last backward has nothing to run starts its gradient buckets with its peer's
    "pp2xdp2": ("qwen3.5-6", ["--pp", "2", "--dp", "2"], "1f1b", ("m1", "m2")),
    # stages linear | linear + full, each stage's experts over its two data-parallel ranks
    "pp2xep2": ("qwen3.5-moe", ["--pp", "2", "--dp", "2", "--ep", "2"], "1f1b", ("m2-recompute",)),
    "dp2": ("qwen3.5", ["--pp", "1"], None, ("m1", "m2-recompute")),
    "ep2": ("qwen3.5-moe", ["--pp", "1", "--ep", "2"], None, MODES),
    # the costliest: mechanism 2 with recomputed producers only (m1 and m2: the other layouts)
    "tp2-sp-ep2": ("qwen3-next", ["--tp", "2", "--pp", "1", "--sequence-parallel", "--ep", "2"], None,
                   ("m2-recompute",)),
    "tp2-sp-gpt-oss": ("gpt-oss", ["--tp", "2", "--pp", "1", "--sequence-parallel"], None, ("m1", "m2-recompute")),
}


def _routed(records, config):
    """The records with routes that follow their token prefixes (shared prefixes, shared routes)."""
    layers, topk, experts = config["num_hidden_layers"], config["num_experts_per_tok"], config["num_experts"]
    return [dict(r, routed_experts=prefix_routes(r["tokens"], layers, topk, experts).tolist()) for r in records]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``reference(model)``: the model's HF folder, records file, batch and per-sample reference
    (routes replayed for the routed models), computed once."""
    root = tmp_path_factory.mktemp("hybrid-layouts")
    # 3 trees of 30 to 60 tokens (19 samples): a 16-token micro-batch holds a fraction of one
    records = random_tree_records(seed=5, num_roots=3, vocab_size=256, max_len=40)
    cache = {}

    def reference(model):
        if model not in cache:
            config, routed = MODELS[model]
            make = make_family_checkpoint if model == "gpt-oss" else make_hybrid_checkpoint  # (sinks, clamps)
            hf_dir = make(config, str(root / model), seed=1)
            recs = _routed(records, config) if routed else records
            path = root / f"{model}.json"
            path.write_text(json.dumps(recs))
            batch = samples_from_dicts(recs, source="records")
            hf = load_hf_model(hf_dir)
            own_loss = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")[0]
            routes = torch.from_numpy(batch.routed_experts.astype(np.int64)) if routed else None
            with hf_replayed(hf, batch, routes) if routed else contextlib.nullcontext():
                loss, grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
            with hf_replayed(hf, batch, routes) if routed else contextlib.nullcontext():
                logprobs = per_sample_logprobs(hf, batch)
            cache[model] = dict(hf_dir=hf_dir, records=str(path), batch=batch, loss=loss, own_loss=own_loss,
                                grads=unfuse_experts(grads, hf.config.model_type) if routed else grads,
                                logprobs=logprobs)
        return cache[model]

    return reference


def _ranks(args):
    """Ranks of a layout: TP x PP x DP (``--dp``: not the script's, dropped), at least two."""
    size = lambda flag: int(args[args.index(flag) + 1]) if flag in args else 1  # noqa: E731
    return max(2, size("--tp") * size("--pp") * size("--dp"))


def _script_args(args):
    if "--dp" not in args:
        return list(args)
    k = args.index("--dp")
    return list(args[:k]) + list(args[k + 2:])


@pytest.fixture(scope="module")
def launches(references, tmp_path_factory, request):
    """The layouts of two ranks in one launch, of four in another; rank 0 of each case saves
    its results."""
    shared = SharedLaunches(selected_test_names(request))
    outs = {}
    for layout, (model, args, _, modes) in LAYOUTS.items():
        case = f"test_hybrid_step_equals_per_sample_reference[{layout}]"
        outs[case] = tmp_path_factory.mktemp("case") / "result.pt"
        shared.add(case, _ranks(args), SCRIPT, lambda model=model, args=args, modes=modes, out=outs[case]: [
            "--hf-dir", f"{model}={references(model)['hf_dir']}", "--records", references(model)["records"],
            "--modes", ",".join(modes), "--out", str(out)] + _script_args(args))

    def results(case):
        shared.check(case)
        return torch.load(outs[case], weights_only=False)

    return results


def _check(res, ref, mode, m1_schedule):
    assert res["ranks_agree"], "every rank must return the same numbers"
    if mode == "m1":  # every tree in one micro-batch: nothing cached
        assert res["tokens_recomputed"] == 0 and res["micro_batches"] >= 2, res["micro_batches"]
        assert not res["kv_hit_rate"], res["kv_hit_rate"]
    else:  # prefixes cached and read by later micro-batches
        assert res["kv_hit_rate"] > 0, res["kv_hit_rate"]
        assert (res["tokens_recomputed"] > 0) == (mode == "m2-recompute"), res["tokens_recomputed"]
    assert res["schedule"] == (None if m1_schedule is None else m1_schedule if mode == "m1" else "plan-order")
    for a, b in zip(res["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert set(res["before"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        atol = 1e-5 * float(grad.abs().max()) + rounding_tolerance(torch.float32, float(res["before"][name].abs().max()))
        torch.testing.assert_close(res["after"][name], res["before"][name] - grad, rtol=0, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
    batch = ref["batch"]
    for s, (lp, r) in enumerate(zip(res["step_logprobs"], ref["logprobs"])):
        trained = batch.loss_mask[batch.sample_slice(s)].astype(bool).copy()
        trained[0] = False
        np.testing.assert_allclose(lp[trained], r[trained], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hybrid_step_equals_per_sample_reference(references, launches, request, layout):
    model, _, m1_schedule, modes = LAYOUTS[layout]
    ref = references(model)
    results = launches(request.node.name)
    assert sorted(results) == sorted((model, mode) for mode in modes)
    for mode in modes:
        _check(results[(model, mode)], ref, mode, m1_schedule)
    if "m1" in modes:  # mechanism 2: micro-batches far smaller than the trees
        assert results[(model, modes[-1])]["micro_batches"] > 2 * results[(model, "m1")]["micro_batches"]
    if layout == "dp2":  # trees whole on each rank, both ranks given some
        res = results[(model, "m2-recompute")]
        assert res["placement"] == "whole-tree" and min(res["plan_rank_cost"]) > 0, res["plan_rank_cost"]
        assert res["tokens_recomputed_across_groups"] == 0
    if MODELS[model][1]:  # the routes matter: HF's own top-k gives another loss
        assert ref["own_loss"] != pytest.approx(ref["loss"], rel=1e-4)
