"""pretrain_agent_rl.py and tools/compute_logprobs.py with pipeline parallelism under torchrun:
an uneven split (--decoder-first-pipeline-num-layers) trains, logs its bubble, saves and resumes
exactly (2 + 1 iterations = 3, bit for bit: the same operations in the same order); the
checkpoint loads under another layout, and log-probs with PP=2 equal the reference. (Legacy
checkpoints here; tests/training/test_dist_checkpoint.py covers torch_dist.)"""

import json
import os

import numpy as np
import pytest
import torch
from helpers.hf_reference import load_hf_model, make_hf_checkpoint, per_sample_logprobs
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl.checkpoint.layout import read_checkpoint_info
from megatron_psrl.checkpoint.loading import load_full_state_dict
from megatron_psrl.data import make_workload, write_samples
from megatron_psrl.model import tiny_config

SCRIPT = os.path.join(REPO_ROOT, "pretrain_agent_rl.py")
TOOL = os.path.join(REPO_ROOT, "tools", "compute_logprobs.py")
PP = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(dict(tiny_config("debug-llama"), num_hidden_layers=4, vocab_size=300),
                              directory=str(tmp_path_factory.mktemp("hf")))


def _train(hf, save, iters, log, load=None):
    args = ["--hf-dir", hf, "--data", "stepwise", "--synthetic-tokens", "1500", "--micro-batch-tokens", "256",
            "--train-iters", str(iters), "--save", str(save), "--log-json", str(log), "--lr", "1e-3", "--seed", "3",
            "--optimizer", "adam", "--ckpt-format", "legacy"] + PP  # (the legacy files are inspected)
    if load is not None:
        args += ["--load", str(load)]
    return args


VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.fixture(scope="module")
def runs(hf_dir, tmp_path_factory, request):
    """Every 2-rank run of this module in one torchrun launch, in this order: PP=2 trained 3
    iterations straight, 2 + 1 resumed, the resumed checkpoint trained on with TP=2; log-probs
    with PP=2; virtual stages trained 2 iterations, then resumed for a third. ``runs(case)``
    returns the case's output and the folder of its test."""
    tests = {"resume": "test_pipeline_training_resumes_exactly_and_loads_under_another_layout",
             "logprobs": "test_compute_logprobs_with_two_stages_equals_the_reference",
             "vpp": "test_virtual_pipeline_checkpoint_resumes_and_reshards"}
    selected = selected_test_names(request)
    folders = {name: tmp_path_factory.mktemp(name) for name in tests}
    cases = {
        "resume/straight": (SCRIPT, lambda d: _train(hf_dir, d / "straight", 3, d / "a.jsonl")),
        "resume/split": (SCRIPT, lambda d: _train(hf_dir, d / "split", 2, d / "b.jsonl")),
        "resume/resumed": (SCRIPT, lambda d: _train(hf_dir, d / "split", 3, d / "b.jsonl", load=d / "split")),
        "resume/tp2": (SCRIPT, lambda d: ["--load", str(d / "split"), "--data", "stepwise", "--synthetic-tokens",
                                          "1500", "--micro-batch-tokens", "256", "--train-iters", "4",
                                          "--no-load-optim", "--tensor-model-parallel-size", "2", "--quiet"]),
        "logprobs/pp2": (TOOL, lambda d: ["--hf-dir", hf_dir, "--data", str(_samples(d)), "--out", str(d / "lp.jsonl"),
                                          "--micro-batch-tokens", "256", "--pipeline-model-parallel-size", "2"]),
        "vpp/saved": (SCRIPT, lambda d: _vpp_base(hf_dir, d) + ["--train-iters", "2"]),
        "vpp/resumed": (SCRIPT, lambda d: _vpp_base(hf_dir, d) + ["--train-iters", "3", "--load", str(d / "ckpt"),
                                                                  "--log-json", str(d / "log.jsonl")]),
    }
    shared = SharedLaunches({case for case in cases if tests[case.split("/")[0]] in selected})
    for case, (script, make_args) in cases.items():
        shared.add(case, 2, script, lambda make_args=make_args, d=folders[case.split("/")[0]]: make_args(d))

    def run(case):
        return shared.check(case), folders[case.split("/")[0]]

    return run


def _samples(folder):
    data = folder / "samples.jsonl"
    write_samples(make_workload("mixed", vocab_size=300, seed=4), data)
    return data


def _vpp_base(hf_dir, folder):
    return ["--hf-dir", hf_dir, "--data", "grpo", "--synthetic-tokens", "1500", "--micro-batch-tokens", "512",
            "--save", str(folder / "ckpt"), "--lr", "1e-3", "--seed", "3", "--ckpt-format", "legacy"] + VPP


@pytest.mark.slow
def test_pipeline_training_resumes_exactly_and_loads_under_another_layout(runs):
    out, tmp_path = runs("resume/straight")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert "PP 2 (layers 1/3)" in out and "pipeline plan-order bubble" in out
    recs = [json.loads(x) for x in open(tmp_path / "a.jsonl")]
    assert [r["iter"] for r in recs] == [1, 2, 3]
    assert all(0.0 <= r["pipeline_bubble"] < 1.0 and r["kv_hit_rate"] > 0 for r in recs)
    runs("resume/split")
    runs("resume/resumed")
    assert [json.loads(x)["iter"] for x in open(tmp_path / "b.jsonl")] == [1, 2, 3]
    _, info = read_checkpoint_info(str(split))
    assert info.pipeline_layers == (1, 3) and info.iteration == 3
    for stage in ("mp_rank_00_000", "mp_rank_00_001"):  # weights and Adam moments
        a = torch.load(straight / "iter_0000003" / stage / "model_optim_rng.pt", weights_only=False)
        b = torch.load(split / "iter_0000003" / stage / "model_optim_rng.pt", weights_only=False)
        for name, t in a["model"].items():
            assert torch.equal(t, b["model"][name]), (stage, name)
        assert all(torch.equal(x["exp_avg"], y["exp_avg"]) for x, y in
                   zip(a["optimizer"]["optimizer"]["state"].values(), b["optimizer"]["optimizer"]["state"].values()))
    # the uneven PP=2 checkpoint reshards into PP=1 (a copy: exact) and trains on with TP=2
    _, full = load_full_state_dict(str(split))
    assert len([k for k in full if k.endswith("mlp.linear_fc2.weight")]) == 4
    runs("resume/tp2")  # (it ran after the resumed run, in the same launch, and saves nothing)


@pytest.mark.slow
def test_compute_logprobs_with_two_stages_equals_the_reference(hf_dir, runs):
    batch = make_workload("mixed", vocab_size=300, seed=4)
    _, tmp_path = runs("logprobs/pp2")
    out = tmp_path / "lp.jsonl"
    ref = per_sample_logprobs(load_hf_model(hf_dir), batch)
    got = [json.loads(x) for x in open(out)]
    assert [g["id"] for g in got] == list(batch.ids)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.array(g["logprobs"]), r, atol=1e-5)


@pytest.mark.slow
def test_virtual_pipeline_checkpoint_resumes_and_reshards(runs):
    """Virtual stages train their steps of whole trees in the interleaved order (the project's
    executor), save the files of a PP x V layout (4 here: one per layer), resume with their
    optimizer state, and load under PP=1 with the same weights."""
    from megatron_psrl import ActorConfig, PolicyActor

    out, tmp_path = runs("vpp/saved")
    ckpt = tmp_path / "ckpt"
    assert "PP 2 (2 virtual stages of layers 1/1/1/1)" in out and "pipeline interleaved bubble" in out
    runs("vpp/resumed")
    assert [json.loads(x)["iter"] for x in open(tmp_path / "log.jsonl")] == [3]
    _, info = read_checkpoint_info(str(ckpt))
    assert (info.pipeline_parallel_size, info.virtual_pipeline_size, info.num_stage_files) == (2, 2, 4)
    files = sorted(p.name for p in (ckpt / "iter_0000003").iterdir() if p.is_dir())
    assert files == [f"mp_rank_00_{s:03d}" for s in range(4)]
    blobs = [torch.load(ckpt / "iter_0000003" / f / "model_optim_rng.pt", weights_only=False) for f in files]
    assert [b["optimizer"] is not None for b in blobs] == [True, True, False, False]  # with each rank's first chunk
    _, full = load_full_state_dict(str(ckpt))
    actor = PolicyActor(str(ckpt), ActorConfig(device="cpu"), for_training=False)
    got = actor.full_state_dict()
    assert set(got) == set(full)
    for name, t in full.items():  # a reshard is copies: exact
        assert torch.equal(got[name], t), name
