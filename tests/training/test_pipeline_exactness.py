"""Pipeline parallelism under torchrun (gloo): one SGD step and the log-probs equal the
per-sample Hugging Face reference (fp32, rel 1e-5: loss, every parameter, log-probs) for
PP=2 (even, 1 + 3 layers, and with full activation recomputation), PP=4, PP=2 x TP=2, PP=2 x DP=2, virtual PP=2 x PP=2 and virtual
PP=2 x PP=4, on Llama
and Qwen3 (tied embeddings: the first and last stages hold one parameter), each with
mechanism 1 only (1F1B, or the interleaved 1F1B order with virtual stages), with mechanism 2 (micro-batches far
smaller than the trees, graphs kept) and with mechanism 2 where the KV budget makes producers
recompute their forward (every pair on PP=2, each mode once on the other layouts, the two
families taking turns); and one tree spread over two pipelines (PP=2 x DP=2, also with virtual
stages) by cross-rank placement, stage exchanging prefix K/V with stage."""

import json
import os

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import PARALLEL_CONFIGS
from helpers.hf_reference import load_hf_model, make_hf_checkpoint, per_sample_logprobs, per_sample_loss_and_grads
from helpers.tolerance import rounding_tolerance
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.schedule.with_memory import whole_tree_reasons

SCRIPT = os.path.join(REPO_ROOT, "tests", "training", "scripts", "pipeline_step.py")
FAMILIES = ("llama", "qwen3")
MODES = ("m1", "m2", "m2-recompute")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    # 8 trees: with 72-token micro-batches, 8 micro-batches of whole trees (PP=4 interleaved: two groups of 4)
    records = random_tree_records(seed=5, num_roots=8, vocab_size=251)
    (root / "records.json").write_text(json.dumps(records))
    return root, samples_from_dicts(records, source="records"), {}


def _reference(data, name, layers):
    root, batch, cache = data
    if (name, layers) not in cache:
        hf_dir = make_hf_checkpoint(dict(PARALLEL_CONFIGS[name], num_hidden_layers=layers), seed=1,
                                    directory=str(root / f"{name}{layers}"))
        hf = load_hf_model(hf_dir)
        loss, grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
        cache[(name, layers)] = dict(hf_dir=hf_dir, loss=loss, grads=grads, logprobs=per_sample_logprobs(hf, batch))
    return cache[(name, layers)]


def _check(res, ref, batch, mode, m1_schedule):
    assert res["ranks_agree"], "every rank must return the same numbers"
    if mode == "m1":
        assert res["tokens_recomputed"] == 0 and res["micro_batches"] >= 2, res["micro_batches"]
    else:
        assert res["tokens_computed"] < res["tokens_total"]  # prefixes shared across micro-batches
        assert (res["tokens_recomputed"] > 0) == (mode == "m2-recompute"), res["tokens_recomputed"]
    assert res["schedule"] == (m1_schedule if mode == "m1" else "plan-order")
    assert 0.0 <= res["bubble"] < 1.0
    for a, b in zip(res["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name, grad in ref["grads"].items():
        atol = 1e-5 * float(grad.abs().max()) + rounding_tolerance(torch.float32, float(res["before"][name].abs().max()))
        torch.testing.assert_close(res["after"][name], res["before"][name] - grad, rtol=0, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
    for s, (lp, r) in enumerate(zip(res["step_logprobs"], ref["logprobs"])):
        trained = batch.loss_mask[batch.sample_slice(s)].astype(bool).copy()
        trained[0] = False
        np.testing.assert_allclose(lp[trained], r[trained], atol=1e-5)


LAYOUTS = {  # id: (TP, PP, ranks, layers per virtual stage, model layers, mechanism-1 executor, first stage)
    "pp2": (1, 2, 2, None, 4, "1f1b"),
    # stages of 1 and 3 layers: every stage plans memory alike (keep / recompute decisions match)
    "pp2-uneven": (1, 2, 2, None, 4, "1f1b", 1),
    # with full activation recomputation (prefix gradients injected inside the graph)
    "pp2-recompute": (1, 2, 2, None, 4, "1f1b", None, True),
    "pp4": (1, 4, 4, None, 4, "1f1b"),
    "pp2xtp2": (2, 2, 4, None, 4, "1f1b"),
    "pp2xdp2": (1, 2, 4, None, 4, "1f1b"),
    # virtual stages: the interleaved order, its transfers instructions of the stream
    "vpp2xpp2": (1, 2, 2, 1, 4, "interleaved"),
    "vpp2xpp4": (1, 4, 4, 1, 8, "interleaved"),
}


def _runs(layout):
    """(family, mode) pairs of a layout: every pair on PP=2; elsewhere each mode once, the
    families taking turns (layout by layout), so every layout runs all three modes and both
    families (Qwen3's tied embeddings included) at half the cost."""
    families = _families(layout)
    if layout == "pp2" or len(families) == 1:
        return [(name, mode) for name in families for mode in MODES]
    turn = list(LAYOUTS).index(layout)
    return [(families[(turn + i) % 2], mode) for i, mode in enumerate(MODES)]


def _layout_args(data, layout, out):
    tp, pp, nproc, vpp_layers, layers, m1_schedule, *extra = LAYOUTS[layout]
    first, recompute = (extra + [None, False])[:2]
    root = data[0]
    args = ["--records", str(root / "records.json"), "--tp", str(tp), "--pp", str(pp), "--out", str(out)]
    if vpp_layers:
        args += ["--vpp-layers", str(vpp_layers)]
    if first:
        args += ["--first-layers", str(first)]
    if recompute:
        args += ["--recompute"]
    for name in _families(layout):
        args += ["--hf-dir", f"{name}={_reference(data, name, layers)['hf_dir']}"]
    return args + ["--modes", ",".join(f"{name}:{mode}" for name, mode in _runs(layout))]


def _families(layout):
    return FAMILIES if LAYOUTS[layout][4] == 4 else ("llama",)  # the 8-layer case: one family is enough


@pytest.fixture(scope="module")
def one_tree(tmp_path_factory):
    """One tree (the batch of the tests that split it between pipelines) and its reference."""
    root = tmp_path_factory.mktemp("one-tree")
    records = random_tree_records(seed=5, num_roots=1, vocab_size=251, max_len=80)
    (root / "records.json").write_text(json.dumps(records))
    batch = samples_from_dicts(records, source="records")
    return root, batch, _reference((root, batch, {}), "llama", 4)


SPREAD = {"pp2xdp2": None, "vpp2xpp2xdp2": 1}  # id: layers per virtual stage


@pytest.fixture(scope="module")
def launches(data, one_tree, tmp_path_factory, request):
    """Every case of this module runs in one torchrun launch per world size (2 and 4 ranks);
    rank 0 of each case saves its results to the case's ``out`` file."""
    shared = SharedLaunches(selected_test_names(request))
    outs = {}

    def add(case_id, nproc, make_args):
        outs[case_id] = tmp_path_factory.mktemp("case") / "result.pt"
        shared.add(case_id, nproc, SCRIPT, lambda: make_args(outs[case_id]))

    for layout in LAYOUTS:
        add(f"test_pipeline_step_equals_per_sample_reference[{layout}]", LAYOUTS[layout][2],
            lambda out, layout=layout: _layout_args(data, layout, out))
    root, _, ref = one_tree
    one = ["--records", str(root / "records.json"), "--pp", "2", "--modes", "m2", "--hf-dir", f"llama={ref['hf_dir']}"]
    add("test_one_tree_is_split_between_pipelines_exactly", 4, lambda out: one + ["--out", str(out)])
    for case, vpp_layers in SPREAD.items():
        add(f"test_one_tree_is_spread_over_pipelines_by_cross_rank_exchange[{case}]", 4,
            lambda out, vpp_layers=vpp_layers: one + ["--out", str(out), "--placement", "cross-rank"]
            + (["--vpp-layers", str(vpp_layers)] if vpp_layers else []))

    def results(test_name):
        shared.check(test_name)
        return torch.load(outs[test_name], weights_only=False)

    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_step_equals_per_sample_reference(data, launches, request, layout):
    m1_schedule = LAYOUTS[layout][5]
    _, batch, _ = data
    results = launches(request.node.name)
    assert sorted(results) == sorted(_runs(layout))
    for name, mode in _runs(layout):
        _check(results[(name, mode)], _reference(data, name, LAYOUTS[layout][4]), batch, mode, m1_schedule)


@pytest.mark.slow
def test_one_tree_is_split_between_pipelines_exactly(one_tree, launches, request):
    """PP=2 x DP=2 with a batch that is one tree: the planner splits it between the two
    pipelines (each recomputing the prefix its part shares) instead of leaving one idle; the
    step and the log-probs still equal the per-sample reference."""
    _, batch, ref = one_tree
    res = launches(request.node.name)[("llama", "m2")]
    assert res["tokens_recomputed_across_groups"] > 0
    _check(res, ref, batch, "m2", "1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("vpp_layers", list(SPREAD.values()), ids=list(SPREAD))
def test_one_tree_is_spread_over_pipelines_by_cross_rank_exchange(one_tree, launches, request, vpp_layers):
    """PP=2 x DP=2 (and with two virtual stages per rank), one tree, ``--placement cross-rank``
    with 16-token micro-batches: the tree's fragments run on both pipelines in lockstep steps,
    every stage exchanging its layers' prefix K/V with the same stage of the other pipeline
    (in plan order); the step and the log-probs equal the per-sample reference."""
    _, batch, ref = one_tree
    res = launches(request.node.name)[("llama", "m2")]
    assert res["placement"] == "cross-rank" and res["exchanged_bytes"] > 0
    assert res["tokens_recomputed_across_groups"] == 0  # one exchange group: every tree token computed once
    assert len(res["plan_rank_cost"]) == 2 and min(res["plan_rank_cost"]) > 0  # fragments on both pipelines
    assert res["micro_batches"] >= 4  # several lockstep steps (summed over the two pipelines)
    _check(res, ref, batch, "m2", "1f1b")


def test_pipelines_split_trees_only_with_cross_rank_placement():
    assert whole_tree_reasons(2, False, "auto") == ["pipeline parallelism"]
    assert whole_tree_reasons(2, False, "whole-tree") == ["pipeline parallelism"]
    assert whole_tree_reasons(2, False, "cross-rank") == []
    assert whole_tree_reasons(2, True, "cross-rank") == ["activation recomputation"]
    assert whole_tree_reasons(1, False) == []
