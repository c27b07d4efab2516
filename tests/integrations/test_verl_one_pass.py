"""The verl engine's one-pass update for verl's own ``ppo_loss`` (megatron_psrl.integrations.
verl_loss) against verl's function: every accepted policy-loss mode, aggregation, entropy and
KL setting, on one rank here and on two data-parallel ranks in the torchrun script of
test_verl_engine.py. Loss and metrics are compared with verl's ``ppo_loss`` on the engine's own
log-probs (the same terms summed in another order: rounding only); gradients with verl's loss on
per-sample Hugging Face log-probs. Needs the ``verl`` extra."""

import logging
import os
from functools import partial

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")

from helpers.hf_reference import load_hf_model, make_hf_checkpoint  # noqa: E402
from helpers.tolerance import assert_equal_up_to_rounding  # noqa: E402
from helpers.verl_harness import (  # noqa: E402
    ONE_PASS_CASES,
    TWO_PASS_CASES,
    VOCAB,
    assert_every_position,
    case_batch,
    case_config,
    metric_values,
    multi_turn_samples,
    reference,
    trained_metric_values,
)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss, sft_loss  # noqa: E402

from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig  # noqa: E402
from megatron_psrl.integrations.verl_loss import one_pass_config  # noqa: E402
from megatron_psrl.model import tiny_config  # noqa: E402

GRAD_TOLERANCE = dict(rtol=1e-4, atol=2e-6)
"""Megatron's model against Hugging Face's (other kernels), as test_verl_engine.py compares them."""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(dict(tiny_config("debug-llama"), vocab_size=VOCAB), seed=0,
                              directory=str(tmp_path_factory.mktemp("hf")))


def _engine(hf_dir):
    engine = EngineRegistry.new("language_model", backend=BACKEND,
                                model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
                                engine_config=PsrlEngineConfig(dtype="float32", device="cpu", micro_batch_tokens=48),
                                optimizer_config=McoreOptimizerConfig(optimizer="sgd", lr=1.0, clip_grad=0.0,
                                                                      weight_decay=0.0),
                                checkpoint_config=None)
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def engine(hf_dir):
    return _engine(hf_dir)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return load_hf_model(hf_dir)


def _log_prob_passes(engine):
    """Counts the engine's separate log-prob passes (the first of the two-pass path)."""
    calls = []
    original = engine.engine.compute_logprobs

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    engine.engine.compute_logprobs = counted
    return calls, lambda: setattr(engine.engine, "compute_logprobs", original)


QUICK = ("vanilla-token-mean-entropy", "vanilla-seq-mean-token-sum-k3-is", "gspo-seq-mean-token-mean")
"""The cases of the quick suite (the rest are marked slow: a few seconds each)."""


@pytest.mark.parametrize("name", [name if name in QUICK else pytest.param(name, marks=pytest.mark.slow)
                                  for name in list(ONE_PASS_CASES) + list(TWO_PASS_CASES)])
def test_train_batch_matches_verls_ppo_loss(engine, hf_model, name):
    """train_batch's loss and every metric verl reports equal verl's ppo_loss on the engine's own
    log-probs; every parameter's gradient (SGD, lr 1) equals verl's loss on per-sample HF
    log-probs, and so do the log-probs (entropies) train_batch returns, at every position, as
    verl's engines fill them. Accepted configurations run without a separate log-prob pass."""
    one_pass = name in ONE_PASS_CASES
    case = (ONE_PASS_CASES if one_pass else TWO_PASS_CASES)[name]
    data = case_batch(multi_turn_samples(), case, global_batch_size=6)
    config = case_config(case)
    with engine.eval_mode():
        inferred = engine.infer_batch(data.clone())
    own = data.clone()
    tu.assign_non_tensor(own, batch_num_tokens=int(own["response_mask"].sum()), dp_size=1)
    expected_loss, expected_metrics = ppo_loss(case_config(case), inferred["model_output"], own)

    before = engine.actor.state_dict_hf()
    passes, restore = _log_prob_passes(engine)
    try:
        with engine.train_mode():
            trained = engine.train_batch(data.clone(), partial(ppo_loss, config))
    finally:
        restore()
    after = engine.actor.state_dict_hf()
    engine.actor.load_hf_state_dict(before)  # the next case starts from the same weights
    assert len(passes) == (0 if one_pass else 1)

    expected_loss = float(expected_loss)
    assert_equal_up_to_rounding(torch.tensor(trained["loss"][0]), torch.tensor(expected_loss), abs(expected_loss))
    got = trained_metric_values(trained)
    want = metric_values(expected_metrics)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_equal_up_to_rounding(torch.tensor(got[key]), torch.tensor(value), abs(value))
    ref = reference(hf_model, [data], case_config(case), "entropy" in inferred["model_output"])
    for key in ("log_probs", "entropy") if "entropy" in inferred["model_output"] else ("log_probs",):
        assert_every_position(trained["model_output"][key], ref[key][0], data, key)
    for param, grad in ref["grads"].items():
        torch.testing.assert_close(before[param] - after[param], grad, **GRAD_TOLERANCE, msg=lambda m: f"{param}: {m}")


def test_modes_outside_one_pass_are_refused():
    """Sequence-level and batch-statistic modes, other losses and a batch without verl's global
    normalisers keep the two-pass path."""
    data = case_batch(multi_turn_samples(), {}, global_batch_size=6)
    tu.assign_non_tensor(data, batch_num_tokens=10, dp_size=1)
    for mode in ("gspo", "geo_mean", "clip_cov", "kl_cov", "bypass_mode"):
        config, why = one_pass_config(partial(ppo_loss, case_config(dict(loss_mode=mode))), data)
        assert config is None and mode in why
    assert one_pass_config(partial(sft_loss, case_config({})), data)[0] is None
    assert one_pass_config(partial(ppo_loss, case_config({})), data)[0] is not None
    assert one_pass_config(partial(ppo_loss, config=case_config({})), data)[0] is not None
    assert one_pass_config(partial(ppo_loss, case_config(dict(use_kl_loss=True))), data)[0] is None  # no ref_log_prob
    tu.assign_non_tensor(data, global_batch_size=None)
    assert one_pass_config(partial(ppo_loss, case_config({})), data)[0] is None


def test_the_engine_says_once_which_path_it_took(hf_dir, caplog):
    engine = _engine(hf_dir)
    data = case_batch(multi_turn_samples(), {}, global_batch_size=6)
    with caplog.at_level(logging.INFO, logger="megatron_psrl.integrations.verl"), engine.train_mode():
        for loss_mode in ("vanilla", "vanilla", "gspo"):
            engine.train_batch(data.clone(), partial(ppo_loss, case_config(dict(loss_mode=loss_mode))))
    said = [r.getMessage() for r in caplog.records if r.name == "megatron_psrl.integrations.verl"]
    assert len(said) == 2 and "one forward and backward" in said[0] and "two passes" in said[1], said
    assert "gspo" in said[1]
