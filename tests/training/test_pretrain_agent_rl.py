"""End to end: pretrain_agent_rl.py trains, logs, saves, resumes; errors are clear and early."""

import json
import os

import pytest
from helpers.faults import train
from helpers.launch_pool import run_python
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl.checkpoint.layout import TRACKER, read_checkpoint_info
from megatron_psrl.training.trainer import main

SCRIPT = os.path.join(REPO_ROOT, "pretrain_agent_rl.py")
REQUIRED = {"iter", "step_time_s", "tokens_total", "tokens_computed", "ideal_speedup", "loss", "grad_norm",
            "peak_mem_bytes"}
DATA = ["--data", "stepwise", "--synthetic-tokens", "3000", "--micro-batch-tokens", "512",
        "--quiet", "--seed", "3"]
BASE = ["--model", "debug-llama"] + DATA


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # the converter in a process of its own (launch pool)
def test_train_log_save_resume_convert(tmp_path):
    log = tmp_path / "log.jsonl"
    ckpt = tmp_path / "ckpt"
    main(BASE + ["--train-iters", "2", "--log-json", str(log), "--save", str(ckpt), "--lr", "1e-3"])
    recs = _records(log)
    assert [r["iter"] for r in recs] == [1, 2]
    for r in recs:
        assert REQUIRED <= set(r)
        assert r["tokens_computed"] < r["tokens_total"]  # step-wise trajectories share their history
        assert r["ideal_speedup"] > 1.5 and r["peak_mem_bytes"] > 0
        assert r["kv_hit_rate"] > 0  # trajectories exceed 512 tokens: mechanism 2 is used
    assert open(ckpt / TRACKER).read().strip() == "2"
    _, info = read_checkpoint_info(str(ckpt))
    assert info.iteration == 2 and info.architecture.model_type == "llama"
    # resume: continues at iteration 3
    main(DATA + ["--train-iters", "3", "--load", str(ckpt), "--log-json", str(log), "--save", str(ckpt)])
    assert [r["iter"] for r in _records(log)] == [1, 2, 3]
    # the trained checkpoint converts to Hugging Face
    out = tmp_path / "hf"
    proc = run_python(os.path.join(REPO_ROOT, "tools", "convert_hf_checkpoint.py"),
                      ["mcore-to-hf", "--load", str(ckpt), "--out-dir", str(out), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


@pytest.mark.parametrize("model", ["debug-llama", "debug-deepseek-v3"])
def test_sharing_and_baseline_agree(tmp_path, model):
    """Also DeepSeek-V3's latent attention (its prefixes cached as the latent, --latent-cache auto)."""
    logs = {}
    # mechanism 2 within 512-token micro-batches; the others need a budget >= the longest sample
    for mode in (["--prefix-sharing", "tree"], ["--no-prefix-sharing", "--micro-batch-tokens", "4096"],
                 ["--prefix-sharing", "tree-dup", "--micro-batch-tokens", "4096"]):
        path = tmp_path / f"{mode[0]}{len(mode)}.jsonl"
        main(["--model", model] + DATA + ["--train-iters", "2", "--log-json", str(path)] + mode)
        logs[" ".join(mode)] = _records(path)
    base = logs["--no-prefix-sharing --micro-batch-tokens 4096"]
    for name, recs in logs.items():
        for a, b in zip(recs, base):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), name
    assert logs["--prefix-sharing tree"][0]["tokens_computed"] < base[0]["tokens_computed"]
    assert logs["--prefix-sharing tree"][0]["kv_hit_rate"] > 0  # mechanism 2 is used


def _run_cli(args, tmp_path):
    return train(args, tmp_path, here=True)  # (test_train_log_save_resume_convert starts it as users do)


def test_bad_sample_fails_before_training_naming_line_and_field(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": "ok", "tokens": [1, 2, 3], "advantage": 1.0}\n'
                    '{"id": "broken", "tokens": [1, 2, 3], "loss_mask": [0, 1], "advantage": 0.5}\n')
    proc = _run_cli(["--model", "debug-llama", "--data", str(data), "--save", str(tmp_path / "ck")], tmp_path)
    assert proc.returncode == 2
    assert "bad.jsonl line 2" in proc.stderr and "'broken'" in proc.stderr and "loss_mask" in proc.stderr
    assert not (tmp_path / "ck").exists()


def test_kv_budget_below_one_block_is_refused(tmp_path):
    proc = _run_cli(BASE + ["--kv-cache-budget", "1KB", "--save", str(tmp_path / "ck")], tmp_path)
    assert proc.returncode == 2 and "cannot hold one KV block" in proc.stderr
    assert not (tmp_path / "ck").exists()


TWO_RANKS = {"tp2": ["--tensor-model-parallel-size", "2"], "dp2": []}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, request):
    """Both 2-rank trainings in one torchrun launch; ``two_rank_runs(id)``: the run's folder
    (``log.jsonl``, ``ckpt``)."""
    selected = selected_test_names(request)
    shared = SharedLaunches({name for name in TWO_RANKS
                             if f"test_two_rank_training_saves_a_loadable_checkpoint[{name}]" in selected})
    folders = {name: tmp_path_factory.mktemp(name) for name in TWO_RANKS}
    for name, parallel in TWO_RANKS.items():
        shared.add(name, 2, SCRIPT, lambda d=folders[name], parallel=parallel: BASE + [
            "--train-iters", "2", "--log-json", str(d / "log.jsonl"), "--save", str(d / "ckpt"),
            "--ckpt-format", "legacy"] + parallel)

    def run(name):
        shared.check(name)
        return folders[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("parallel", list(TWO_RANKS.values()), ids=list(TWO_RANKS))
def test_two_rank_training_saves_a_loadable_checkpoint(two_rank_runs, request, tmp_path, parallel):
    folder = two_rank_runs(request.node.callspec.id)
    log = folder / "log.jsonl"
    ckpt = folder / "ckpt"
    recs = _records(log)
    assert len(recs) == 2 and all(REQUIRED <= set(r) for r in recs)
    _, info = read_checkpoint_info(str(ckpt))
    assert info.tensor_parallel_size == (2 if parallel else 1) and info.has_optimizer_state
    if parallel:  # legacy TP=2 optimizer state cannot be resumed with TP=1 (torch_dist's can): refused
        with pytest.raises(ValueError, match="--no-load-optim"):
            main(DATA + ["--train-iters", "3", "--load", str(ckpt)])
        main(DATA + ["--train-iters", "3", "--load", str(ckpt), "--no-load-optim"])
    # the same data on one rank gives the same first-step loss
    single = tmp_path / "single.jsonl"
    main(BASE + ["--train-iters", "1", "--log-json", str(single)])
    assert _records(single)[0]["loss"] == pytest.approx(recs[0]["loss"], rel=1e-5)
