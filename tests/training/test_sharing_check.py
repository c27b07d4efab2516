"""``--check-sharing-every``: a run checks its own prefix sharing against the per-sample
computation (megatron_psrl/rl/sharing_check.py). It passes on a correct run with differences
far below the tolerance, leaves the step itself unchanged, catches a planted sharing defect
(stopping the run, or warning with ``check_sharing_warn_only``), and is wired into the command
line and the verl engine's config."""

import numpy as np
import pytest
import torch

from megatron_psrl.data import make_workload
from megatron_psrl.kvcache.manager import BlockKVCache
from megatron_psrl.rl.actor import ActorConfig, PolicyActor
from megatron_psrl.rl.sharing_check import SharingCheckError, choose_samples, tolerances

BATCH = make_workload("grpo", seed=1)  # 16 samples on 2 prompts: cached prefixes at 256-token micro-batches


def _actor(**kw):
    return PolicyActor("tiny-llama", ActorConfig(device="cpu", micro_batch_tokens=256, check_sharing_samples=3, **kw))


def test_a_correct_run_passes_far_below_the_tolerance_and_its_step_is_unchanged():
    checked = _actor(check_sharing_every=2)
    plain = _actor()
    first = checked.train_step(BATCH)
    assert "sharing_check" not in first  # every 2nd step only
    plain.train_step(BATCH)
    second, reference = checked.train_step(BATCH), plain.train_step(BATCH)
    check = second["sharing_check"]
    tol = tolerances(torch.float32)
    assert check["passed"] and check["samples"] == choose_samples(BATCH, 3, 1234 + 1)
    # the checked samples share a prompt (one GRPO group): the subset exercises sharing
    prompts = {tuple(BATCH.tokens[BATCH.offsets[s]:BATCH.offsets[s] + 32]) for s in check["samples"]}
    assert len(prompts) == 1
    # measured here: about 1e-6 nats, 2e-8 relative, 1 - 2e-13: two orders of magnitude of room
    assert check["logprob_max_abs"] < tol.logprob / 10 and check["grad_norm_rel"] < tol.grad_norm / 10
    assert check["grad_cosine"] > 1 - (1 - tol.grad_cosine) / 10
    # the check runs on zeroed gradients before the step and restores the random state
    assert second["loss"] == reference["loss"] and second["grad_norm"] == reference["grad_norm"]
    for a, b in zip(checked.state_dict_hf().values(), plain.state_dict_hf().values()):
        assert torch.equal(a, b)


def _corrupt_cached_reads(monkeypatch):
    """A sharing defect: cached prefix values read back slightly wrong (only shared runs read them)."""
    original = BlockKVCache.read

    def read(self, source_id, layer, count=True):
        return tuple(x * 1.01 for x in original(self, source_id, layer, count))

    monkeypatch.setattr(BlockKVCache, "read", read)


def test_a_planted_sharing_defect_stops_the_run_naming_samples_and_differences(monkeypatch):
    actor = _actor(check_sharing_every=1)
    _corrupt_cached_reads(monkeypatch)
    with pytest.raises(SharingCheckError, match=r"iteration 1: prefix sharing check on samples \[\d+, \d+, \d+\]: "
                                                r"log-probs differ by up to [0-9.e-]+ nats \(tolerance 0.0001\)"):
        actor.train_step(BATCH)


def test_warn_only_logs_the_failure_and_trains_on(monkeypatch):
    said = []
    actor = PolicyActor("tiny-llama", ActorConfig(device="cpu", micro_batch_tokens=256, check_sharing_every=1,
                                                  check_sharing_warn_only=True), log=said.append)
    _corrupt_cached_reads(monkeypatch)
    metrics = actor.train_step(BATCH)
    assert not metrics["sharing_check"]["passed"] and np.isfinite(metrics["loss"]) and actor.iteration == 1
    assert any(m.startswith("warning: iteration 1: prefix sharing check on samples") for m in said), said


def test_the_command_line_and_the_verl_config_carry_the_settings():
    from megatron_psrl.training.arguments import build_parser
    from megatron_psrl.training.trainer import actor_config_from_args

    args = build_parser().parse_args(["--check-sharing-every", "50", "--check-sharing-samples", "4",
                                      "--check-sharing-warn-only"])
    config = actor_config_from_args(args, "float32")
    assert (config.check_sharing_every, config.check_sharing_samples, config.check_sharing_warn_only) == (50, 4, True)
    pytest.importorskip("verl", reason="the verl extra is not installed")
    from megatron_psrl.integrations.verl import PsrlEngineConfig, actor_config

    engine = actor_config(PsrlEngineConfig(dtype="float32", device="cpu", check_sharing_every=10,
                                           check_sharing_samples=1))
    assert (engine.check_sharing_every, engine.check_sharing_samples) == (10, 1)
    with pytest.raises(Exception, match="check_sharing_every must be >= 0"):
        ActorConfig(check_sharing_every=-1)


@pytest.mark.slow
def test_two_data_parallel_ranks_check_alike_and_train_as_without():
    import os

    from helpers.torchrun import run_torchrun

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "sharing_check_dp2.py")
    out = run_torchrun(script, nproc=2)
    assert out.count("OK rank") == 2, out[-3000:]
