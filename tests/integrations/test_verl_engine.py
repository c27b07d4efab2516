"""The verl training engine (megatron_psrl.integrations.verl) against verl's own computation:
per-sample Hugging Face log-probs through verl's ppo_loss, on a multi-turn GRPO mini-batch in
verl's format. Needs the ``verl`` extra (``pip install -e ".[verl]"``), which CI installs."""

import json
import os
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")  # verl assumes CUDA unless told

from helpers.hf_reference import load_hf_model, make_hf_checkpoint  # noqa: E402
from helpers.hybrid import make_hybrid_checkpoint  # noqa: E402
from helpers.torchrun import REPO_ROOT, run_torchrun  # noqa: E402
from helpers.verl_harness import (  # noqa: E402
    ONE_PASS_CASES,
    TWO_PASS_CASES,
    VOCAB,
    multi_turn_samples,
    psrl_engine,
    reference,
    response_positions,
    spy_step_metrics,
    verl_batch,
    verl_loss_config,
)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import McoreOptimizerConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.errors import ConfigurationError  # noqa: E402
from megatron_psrl.integrations.verl import PsrlEngine, PsrlEngineConfig, actor_config  # noqa: E402
from megatron_psrl.model import tiny_config  # noqa: E402

SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "scripts", "verl_engine_step.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(dict(tiny_config("debug-llama"), vocab_size=VOCAB), seed=0,
                              directory=str(tmp_path_factory.mktemp("hf")))


_engine = psrl_engine  # (fp32 on the CPU, SGD lr 1, 48-token micro-batches unless given)


def test_verl_builds_the_registered_engine(hf_dir):
    engine = _engine(hf_dir)
    assert isinstance(engine, PsrlEngine)
    assert engine.get_data_parallel_size() == 1 and engine.is_mp_src_rank_with_outputs()
    names = dict(engine.get_per_tensor_param()[0])
    assert torch.equal(names["lm_head.weight"], engine.actor.state_dict_hf()["lm_head.weight"])


def _infer_and_train(engine, data, config):
    """``infer_batch`` then one ``train_batch`` through verl's ``ppo_loss``: (inferred, trained,
    the HF state dict before the step, after it)."""
    with engine.eval_mode():
        inferred = engine.infer_batch(data.clone())
    before = engine.actor.state_dict_hf()
    with engine.train_mode():
        trained = engine.train_batch(data.clone(), partial(ppo_loss, config))
    return inferred, trained, before, engine.actor.state_dict_hf()


@pytest.mark.parametrize("loss_agg, entropy_coeff", [("token-mean", 0.01), ("seq-mean-token-mean", 0.0)])
def test_one_rank_matches_the_per_sample_reference_through_verls_loss(hf_dir, loss_agg, entropy_coeff):
    """infer_batch's log-probs (and entropies), and train_batch's loss and every parameter's
    gradient (SGD, lr 1), equal the per-sample HF computation through verl's ppo_loss; the
    shared prompt and first turn are computed once (fewer tokens than the batch holds)."""
    entropy = entropy_coeff != 0.0
    data = verl_batch(multi_turn_samples(), global_batch_size=6, calculate_entropy=entropy)
    config = verl_loss_config(loss_agg, entropy_coeff)
    inferred, trained, before, after = _infer_and_train(_engine(hf_dir), data, config)
    ref = reference(load_hf_model(hf_dir), [data], config, entropy)

    keep = response_positions(data)
    log_probs = inferred["model_output"]["log_probs"]
    assert log_probs.is_nested and torch.equal(log_probs.offsets(), data["input_ids"].offsets())
    torch.testing.assert_close(log_probs.values()[keep], ref["log_probs"][0][keep], rtol=0, atol=1e-5)
    if entropy:
        torch.testing.assert_close(inferred["model_output"]["entropy"].values()[keep], ref["entropy"][0][keep],
                                   rtol=0, atol=1e-5)
    assert trained["loss"][0] == pytest.approx(ref["losses"][0], rel=1e-5)
    assert "actor/pg_loss" in trained["metrics"] and trained["metrics"]["grad_norm"] > 0
    assert len(ref["grads"]) == len(before)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(before[name] - after[name], grad, rtol=1e-4, atol=2e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_the_batch_is_computed_with_its_prefixes_shared(hf_dir):
    """The engine's step over verl's batch computes each shared prompt and turn once."""
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    engine = _engine(hf_dir)
    seen = spy_step_metrics(engine)
    with engine.train_mode():
        engine.train_batch(data.clone(), partial(ppo_loss, verl_loss_config()))
    total = int(data["input_ids"].offsets()[-1])
    assert seen["tokens_total"] == total
    assert seen["tokens_computed"] < 0.75 * total  # two prompts of ~20 tokens and a 11-token turn, shared


def test_the_learning_rate_schedule_advances_when_verl_says(hf_dir):
    engine = _engine(hf_dir)
    lr = engine.actor.optimizer.lr
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    scheduler = engine.actor.optimizer.scheduler
    before = scheduler.num_steps
    with engine.train_mode():
        engine.train_batch(data.clone(), partial(ppo_loss, verl_loss_config()))
    steps = scheduler.num_steps
    assert steps == before  # the optimizer step leaves the schedule to verl
    assert engine.lr_scheduler_step() == pytest.approx(lr)  # constant schedule
    assert scheduler.num_steps == steps + 1


def test_unsupported_settings_are_refused_in_one_line(hf_dir):
    engine = _engine(hf_dir)
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    tu.assign_non_tensor(data, temperature=0.7)
    with pytest.raises(ConfigurationError, match="temperature"):
        engine.infer_batch(data)
    with pytest.raises(ConfigurationError, match="offload"):
        PsrlEngineConfig(param_offload=True)
    with pytest.raises(ConfigurationError, match="strategy"):
        PsrlEngineConfig(strategy="megatron")


def test_verl_optimizer_config_maps_to_megatron_names():
    config = actor_config(PsrlEngineConfig(dtype="bfloat16", tensor_model_parallel_size=2, micro_batch_tokens=1024),
                          McoreOptimizerConfig(optimizer="adam", lr=3e-6, weight_decay=0.1, clip_grad=0.5,
                                               betas=(0.9, 0.95), lr_warmup_steps=5, total_training_steps=100))
    assert config.dtype == "bfloat16" and config.tensor_model_parallel_size == 2 and config.micro_batch_tokens == 1024
    o = config.optimizer
    assert (o.optimizer, o.lr, o.weight_decay, o.clip_grad, o.adam_beta2) == ("adam", 3e-6, 0.1, 0.5, 0.95)
    assert (o.lr_warmup_iters, o.lr_decay_iters, o.lr_decay_style) == (5, 100, "linear")
    # no total: nothing to decay over (a decay over one step would end the rate after one update)
    assert actor_config(PsrlEngineConfig(), McoreOptimizerConfig(lr=1e-6)).optimizer.lr_decay_style == "constant"


def test_verl_engine_config_carries_the_memory_budget():
    assert actor_config(PsrlEngineConfig(memory_budget=8 << 30)).memory_budget == 8 << 30
    assert actor_config(PsrlEngineConfig()).memory_budget is None  # the CUDA default, none on CPU


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_two_ranks_match_the_per_sample_reference(hf_dir, tmp_path, tp):
    """Under torchrun (gloo): DP=2, each rank its own half of the GRPO groups (verl's split,
    so each group's prompt is on both ranks and is computed once), and TP=2; every share's
    loss, the log-probs and entropies, and every gradient equal the reference's. The DP=2 launch
    also runs every verl ppo_loss configuration of the one-pass tests (test_verl_one_pass.py)
    and the two-pass one: each rank's loss and metrics against verl's function, every gradient."""
    out = tmp_path / "summary.json"
    cases = ",".join(list(ONE_PASS_CASES) + list(TWO_PASS_CASES)) if tp == 1 else ""
    run_torchrun(SCRIPT, ["--hf-dir", hf_dir, "--tp", str(tp), "--entropy-coeff", "0.01", "--cases", cases,
                          "--out", str(out)], nproc=2, timeout=1800)
    summary = json.loads(out.read_text())
    assert summary["dp"] == 2 // tp and summary["tp"] == tp
    assert summary["parameters"] == 21 and summary["worst_grad"] <= 2e-6 + 1e-4
    assert len(summary["losses"]) == 2 and all(np.isfinite(v) for v in summary["losses"].values())
    if tp == 1:
        assert sorted(summary["cases"]) == sorted(list(ONE_PASS_CASES) + list(TWO_PASS_CASES))


@pytest.fixture(scope="module")
def hybrid_hf_dir(tmp_path_factory):
    return make_hybrid_checkpoint(dict(tiny_config("debug-qwen3.5-text"), vocab_size=VOCAB),
                                  str(tmp_path_factory.mktemp("hf-qwen3.5")))


def test_a_qwen3_5_model_matches_the_per_sample_reference_with_cached_states(hybrid_hf_dir):
    """A Qwen3.5 model (Gated DeltaNet and gated softmax layers), 48-token micro-batches (the
    shared prompts and first turn cached: the linear layers' states and the softmax layers' K/V):
    infer_batch's log-probs and train_batch's loss and every parameter's gradient (SGD, lr 1)
    equal the per-sample HF computation through verl's ppo_loss; cached prefixes are read."""
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    config = verl_loss_config("token-mean", 0.0)
    engine = _engine(hybrid_hf_dir)
    seen = spy_step_metrics(engine)
    inferred, trained, before, after = _infer_and_train(engine, data, config)
    ref = reference(load_hf_model(hybrid_hf_dir), [data], config, False)

    keep = response_positions(data)
    torch.testing.assert_close(inferred["model_output"]["log_probs"].values()[keep], ref["log_probs"][0][keep],
                               rtol=0, atol=1e-5)
    assert trained["loss"][0] == pytest.approx(ref["losses"][0], rel=1e-5)
    assert seen["kv_hit_rate"] > 0 and seen["tokens_computed"] < int(data["input_ids"].offsets()[-1])
    assert len(ref["grads"]) == len(before)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(before[name] - after[name], grad, rtol=1e-4, atol=2e-6,
                                   msg=lambda m: f"{name}: {m}")
