"""Never train on garbage: non-finite steps are skipped everywhere and counted, too many stop the
run with an error, ratios cannot overflow, and no checkpoint ever holds a NaN or inf."""

import json

import numpy as np
import pytest
import torch
from helpers.faults import error_line, leftovers, train

from megatron_psrl.checkpoint.loading import load_full_state_dict
from megatron_psrl.checkpoint.saving import save_training_checkpoint
from megatron_psrl.data import samples_from_dicts
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.engine.optimizer import OptimizerSettings, TrainingOptimizer
from megatron_psrl.errors import CheckpointWriteError
from megatron_psrl.model import tiny_config
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.builder import build_model
from megatron_psrl.rl.loss import LOG_RATIO_BOUND, LossConfig, claim_coefficients, gather_claims, policy_loss
from megatron_psrl.tree import build_prefix_tree

VOCAB = 256  # debug-llama


def _write_samples(path, bad_every=None, bad=None, n=8, length=24, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            sample = {"id": f"s{i}", "tokens": rng.integers(0, VOCAB, length).tolist(), "advantage": 1.0}
            if bad_every is not None and i % bad_every == 0:
                sample.update(bad(length))
            f.write(json.dumps(sample) + "\n")
    return path


def _records(path):
    return [json.loads(line) for line in open(path)]


def _all_finite(ckpt):
    _, state = load_full_state_dict(str(ckpt))
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def test_huge_advantage_is_skipped_then_stops_the_run_with_finite_checkpoints(tmp_path):
    """A finite advantage of 3e38 overflows the gradients: every step is skipped (nothing
    changes), counted, and --max-skipped-iters consecutive ones stop the run (exit 2)."""
    data = _write_samples(tmp_path / "huge.jsonl", bad_every=1, bad=lambda n: {"advantage": 3e38})
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    proc = train(["--model", "debug-llama", "--data", str(data), "--train-iters", "10", "--max-skipped-iters", "2",
                  "--save", str(ckpt), "--save-interval", "1", "--log-json", str(log)], tmp_path, here=True)
    line = error_line(proc)
    assert "2 consecutive steps" in line and "--max-skipped-iters 2" in line
    recs = _records(log)
    assert [r["iter"] for r in recs] == [1, 2]
    assert all(r["skipped"] for r in recs) and [r["skipped_iters"] for r in recs] == [1, 2]
    assert recs[0]["grad_norm"] is None  # a NaN norm is written as null (strict JSON)
    assert "SKIPPED" in proc.stdout
    # the checkpoint after the first (skipped) step holds the initial, finite weights
    assert _all_finite(ckpt) and leftovers(ckpt) == []


def test_an_isolated_bad_batch_is_skipped_and_training_goes_on(tmp_path):
    """Bad samples only in the first global batch: that step is skipped, the next trains."""
    data = _write_samples(tmp_path / "once.jsonl", bad_every=100, bad=lambda n: {"advantage": 3e38})
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    proc = train(["--model", "debug-llama", "--data", str(data), "--global-batch-size", "4", "--train-iters", "2",
                  "--save", str(ckpt), "--log-json", str(log)], tmp_path, here=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(log)
    assert [r["skipped"] for r in recs] == [True, False]
    assert recs[1]["skipped_iters"] == 1 and np.isfinite(recs[1]["grad_norm"]) and np.isfinite(recs[1]["loss"])
    assert _all_finite(ckpt)


def test_old_logprobs_far_below_the_model_clamp_the_ratio(tmp_path):
    """old_logprobs 200 nats below the model's: the log-ratio is clamped, the loss stays finite,
    the claims are counted, nothing is skipped."""
    data = _write_samples(tmp_path / "stale.jsonl", bad_every=2,
                          bad=lambda n: {"old_logprobs": [0.0] + [-200.0] * (n - 1), "advantage": -1.0})
    log = tmp_path / "log.jsonl"
    proc = train(["--model", "debug-llama", "--data", str(data), "--train-iters", "1", "--log-json", str(log)],
                 tmp_path, here=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = _records(log)[0]
    assert not rec["skipped"] and np.isfinite(rec["loss"]) and np.isfinite(rec["grad_norm"])
    assert rec["ratio_clamped"] == 4 * 23  # 4 bad samples x 23 trained tokens
    assert "ratio clamped 92" in proc.stdout


def test_policy_loss_clamps_the_log_ratio_and_keeps_gradients_finite():
    batch = samples_from_dicts([
        {"id": "far", "tokens": [1, 2, 3], "advantage": -1.0, "old_logprobs": [0.0, -150.0, -0.5]},
    ])
    tree = build_prefix_tree(batch)
    cfg = LossConfig()
    claims = gather_claims(tree, claim_coefficients(tree, cfg.loss_agg), np.array([1, 2]), cfg, torch.device("cpu"))
    logp = torch.tensor([-1.0, -0.5], requires_grad=True)
    total, metrics = policy_loss(logp, None, claims, cfg)
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert float(metrics["ratio_clamped"]) == 1.0
    # the clamped claim: ratio exp(20), advantage -1, unclipped branch; token-mean over 2 claims
    clamped_term = np.exp(LOG_RATIO_BOUND) * 1.0 / 2
    assert float(total.detach()) == pytest.approx(clamped_term + 1.0 / 2, rel=1e-6)
    assert float(logp.grad[0]) == 0.0  # no gradient through a clamped ratio


def _tiny_model():
    initialize_parallel(1, 1, seed=0, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-llama"))
    return arch, build_model(arch)


def test_optimizer_skip_changes_nothing():
    """A NaN gradient: parameters, optimizer state and the learning-rate schedule stay as they were."""
    _, model = _tiny_model()
    opt = TrainingOptimizer(model, OptimizerSettings(optimizer="adam", lr=1e-3, lr_warmup_iters=4))

    def backward(nan=False):  # gradients of ones (a NaN in the first one), through DDP's main_grad
        opt.zero_grad()
        sum(p.sum() for p in model.parameters()).backward()
        if nan:
            next(model.parameters()).main_grad.view(-1)[0] = float("nan")

    def adam_state():
        (inner,) = opt.optimizer.chained_optimizers
        return {(i, k): v.clone() for i, st in enumerate(inner.optimizer.state.values()) for k, v in st.items()}

    backward()
    assert not opt.step().skipped  # one real step: Adam state exists, lr warmed up once
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = adam_state()
    lr = opt.lr
    assert state
    backward(nan=True)
    outcome = opt.step()
    assert outcome.skipped and not np.isfinite(outcome.grad_norm)
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())
    after = adam_state()
    assert after.keys() == state.keys() and all(torch.equal(state[k], v) for k, v in after.items())
    assert opt.lr == lr and all(not p.main_grad.any() for p in model.parameters())
    # a caller-side skip (non-finite loss) is the same
    backward()
    assert opt.step(skip=True).skipped and opt.lr == lr


def test_save_refuses_a_non_finite_tensor_and_leaves_nothing(tmp_path):
    arch, model = _tiny_model()
    layout = initialize_parallel(1, 1, seed=0, device="cpu")
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(CheckpointWriteError, match="holds NaN or inf"):
        save_training_checkpoint(str(tmp_path / "ckpt"), 1, model, None, arch, layout)
    assert leftovers(tmp_path) == [] and not (tmp_path / "ckpt" / "iter_0000001").exists()
