"""The prefix sharing check inside verl's worker layer: ``PsrlEngineConfig.check_sharing_every``
runs it at the start of a training ``forward_backward_batch`` (verl has zeroed the gradients),
on the response tokens' log-probs and their gradient, whatever verl's loss; the update that
follows is unchanged. Needs the ``verl`` extra."""

import os
from functools import partial

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")

from helpers.hf_reference import make_hf_checkpoint  # noqa: E402
from helpers.verl_harness import (  # noqa: E402
    ONE_PASS_CASES,
    VOCAB,
    case_batch,
    case_config,
    multi_turn_samples,
    psrl_engine,
)
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.model import tiny_config  # noqa: E402


def test_the_verl_engine_checks_sharing_on_its_steps_and_trains_as_without(tmp_path):
    hf_dir = make_hf_checkpoint(dict(tiny_config("debug-llama"), vocab_size=VOCAB), seed=0, directory=str(tmp_path))
    case = ONE_PASS_CASES["vanilla-token-mean-entropy"]
    data = case_batch(multi_turn_samples(), case, global_batch_size=6)
    checked, plain = psrl_engine(hf_dir, check_sharing_every=1, check_sharing_samples=3), psrl_engine(hf_dir)
    outputs = []
    for engine in (checked, plain):
        with engine.train_mode():
            outputs.append(engine.train_batch(data.clone(), partial(ppo_loss, case_config(case))))
    check = checked.last_sharing_check
    assert check is not None and check.passed and len(check.samples) == 3, check
    assert plain.last_sharing_check is None
    assert outputs[0]["loss"] == outputs[1]["loss"]  # the step itself is unchanged
    for a, b in zip(checked.actor.state_dict_hf().values(), plain.actor.state_dict_hf().values()):
        assert (a == b).all()
