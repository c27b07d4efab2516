"""The psrl engine beside verl's own FSDP2 engine (on CPU through the platform module
megatron_psrl.integrations.verl_cpu_platform): the same weights, batch and verl ``ppo_loss``
give the same log-probs and the same weight update (SGD, lr 1: the update is the gradient),
up to fp32 rounding of two different computations. The engines are the ones
benchmarks/bench_verl_engine.py times."""

import os
import sys
from functools import partial

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")

# isort: off
import megatron_psrl.integrations.verl_cpu_platform  # noqa: E402,F401  (verl's device: CPU)
# isort: on
from helpers.hf_reference import make_hf_checkpoint  # noqa: E402
from helpers.torchrun import REPO_ROOT  # noqa: E402
from helpers.verl_harness import VOCAB, multi_turn_samples, response_positions, verl_batch, verl_loss_config  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.model import tiny_config  # noqa: E402

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from bench_verl_engine import for_fsdp2, fsdp2_engine, psrl_engine, train_step  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(dict(tiny_config("debug-llama"), vocab_size=VOCAB), seed=0,
                              directory=str(tmp_path_factory.mktemp("hf")))


def _weights(engine):
    return {name: tensor.detach().float().clone() for name, tensor in engine.get_per_tensor_param()[0]}


def test_psrl_and_fsdp2_log_probs_and_update_agree(hf_dir):
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    loss = partial(ppo_loss, verl_loss_config())
    psrl = psrl_engine(hf_dir, "tree", micro_batch_tokens=48, optimizer="sgd", lr=1.0)
    fsdp2 = fsdp2_engine(hf_dir, micro_batch_tokens=64, optimizer="SGD", lr=1.0)
    before = _weights(psrl)
    assert before.keys() <= _weights(fsdp2).keys()

    keep = response_positions(data)
    with psrl.eval_mode():
        ours = psrl.infer_batch(data.clone())["model_output"]["log_probs"].values()[keep]
    with fsdp2.eval_mode():
        theirs = fsdp2.infer_batch(for_fsdp2(data.clone(), 64))["model_output"]["log_probs"].values()[keep]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    out_psrl = train_step(psrl, data, loss)
    out_fsdp2 = train_step(fsdp2, for_fsdp2(data.clone(), 64), loss)
    assert sum(out_psrl["loss"]) == pytest.approx(sum(out_fsdp2["loss"]), rel=1e-5)
    step_psrl = {k: before[k] - v for k, v in _weights(psrl).items()}
    after_fsdp2 = _weights(fsdp2)
    worst = 0.0
    for name, step in step_psrl.items():
        other = before[name] - after_fsdp2[name]
        assert step.abs().max() > 0, name
        torch.testing.assert_close(step, other, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
        worst = max(worst, float((step - other).norm() / other.norm()))
    assert worst < 1e-4
