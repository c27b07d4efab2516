"""examples/verl_ppo_cpu.py: verl's GRPO loop steps (rollout, rule reward, GRPO advantages, old
and reference log-probs, train_mini_batch with verl's ppo_loss and KL in the loss, weights to
the rollout) with psrl engines as actor and reference, in verl's TrainingWorker, on CPU."""

import importlib.util
import math
import os
import socket
import sys

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")
pytest.importorskip("uvicorn", reason="verl's worker module imports uvicorn and fastapi")

from helpers.torchrun import REPO_ROOT  # noqa: E402

EXAMPLE = os.path.join(REPO_ROOT, "examples", "verl_ppo_cpu.py")


def _example():
    spec = importlib.util.spec_from_file_location("verl_ppo_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow  # two engines and two iterations: 3 s on 2 quiet cores, about a minute under heavy load
def test_two_iterations_of_verls_loop_with_psrl_actor_and_reference(tmp_path, monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port()).items():
        monkeypatch.setenv(key, value)
    example = _example()
    lines = []
    loop = example.run(iterations=2, prompts=2, group_size=3, response_length=8, workdir=str(tmp_path), log=lines.append)
    first, second = loop.history
    assert len(lines) == 2 and lines[0].startswith("iteration 1:")
    params = dict(loop.rollout_model.named_parameters())
    for row in loop.history:
        assert row["tensors_synced"] == len(params) and row["grad_norm"] > 0 and math.isfinite(row["loss"])
        assert 0.0 <= row["reward"] <= 1.0 and row["response_tokens"] > 0
    # iteration 1: the actor is the reference (KL 0); after one update it has moved away from it
    assert first["kl_loss"] == 0.0 and second["kl_loss"] > 0.0
    # the rollout holds the actor's weights; the reference kept the initial ones
    actor = loop.actor.engine.actor.state_dict_hf()
    ref = loop.ref.engine.actor.state_dict_hf()
    assert all(torch.equal(params[name].detach(), actor[name]) for name in params)
    assert any(not torch.equal(actor[name], ref[name]) for name in params)
