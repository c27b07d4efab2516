"""PolicyActor, the in-memory API: every call against the per-sample Hugging Face reference.

Log-probs, one SGD step (every weight), custom losses (SFT, GSPO) computed directly with HF,
the log-probs a step returns, weights in and out with HF names, checkpoints, batch forms,
the caller's RNG, and the same numbers under torchrun (TP=2 and DP=2) and from the CLI.
"""

import json
import os

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_records
from helpers.hf_reference import assert_grads_close, hf_grads_to_mcore, per_sample_logprobs, per_sample_loss_and_grads
from helpers.launch_pool import run_python
from helpers.tolerance import rounding_tolerance
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl import (
    ActorConfig,
    GSPOLoss,
    LossConfig,
    OptimizerSettings,
    PolicyActor,
    log_likelihood_loss,
)
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.validation import SampleValidationError
from megatron_psrl.errors import PsrlError

MICRO_BATCH = 32  # below the longest trees: mechanism 2 (cached prefix K/V) runs in every test
LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
SCRIPT = os.path.join(REPO_ROOT, "tests", "training", "scripts", "actor_step.py")


def make_actor(model, lr=1.0, **overrides) -> PolicyActor:
    overrides.setdefault("loss", LOSS)
    config = ActorConfig(device="cpu", micro_batch_tokens=MICRO_BATCH,
                         optimizer=OptimizerSettings(optimizer="sgd", lr=lr, clip_grad=0.0), **overrides)
    return PolicyActor(model, config)


@pytest.fixture(scope="module")
def records():
    return random_tree_records(seed=5, num_roots=3)


@pytest.fixture(scope="module")
def batch(records):
    return samples_from_dicts(records, source="records")


@pytest.fixture(scope="module")
def reference_logprobs(hf_model, batch):
    return per_sample_logprobs(hf_model, batch)


def _grads(actor):
    """The accumulated gradients: megatron DDP's fp32 main_grad (on CPU as on CUDA)."""
    return {n: actor.optimizer.main_grad(p).detach().clone() for n, p in actor.model.named_parameters()}


def _trained(batch, s):
    mask = batch.loss_mask[batch.sample_slice(s)].astype(bool).copy()
    mask[0] = False
    return mask


# ---------------------------------------------------------------------------------------- log-probs
def test_compute_logprobs_equals_per_sample_reference(hf_dir, records, reference_logprobs):
    actor = make_actor(hf_dir)
    ours = actor.compute_logprobs(records)
    assert len(ours) == len(records)
    for a, b, r in zip(ours, reference_logprobs, records):
        assert a.dtype == np.float32 and len(a) == len(r["tokens"]) and a[0] == 0.0
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow  # the command line in a subprocess
def test_compute_logprobs_equals_the_cli(hf_dir, records, tmp_path):
    data, out = tmp_path / "data.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = run_python(os.path.join(REPO_ROOT, "tools", "compute_logprobs.py"),
                      ["--hf-dir", hf_dir, "--data", str(data), "--out", str(out), "--micro-batch-tokens", str(MICRO_BATCH)],
                      timeout=300)
    assert proc.returncode == 0, proc.stderr
    cli = [np.array(json.loads(line)["logprobs"], dtype=np.float32) for line in out.read_text().splitlines()]
    ours = make_actor(hf_dir).compute_logprobs(records)
    for a, b in zip(ours, cli):  # the same computation (threads may reorder a reduction)
        np.testing.assert_allclose(a, b, rtol=0, atol=rounding_tolerance(torch.float32, np.abs(b).max()))


# ---------------------------------------------------------------------------------------- training
# the loss head in one chunk, and one claimed row per chunk (0.001 MB < one row's fp32 logits)
@pytest.mark.parametrize("chunk_mb", [256.0, 0.001], ids=["one-chunk", "row-chunks"])
def test_one_sgd_step_equals_per_sample_reference(hf_dir, hf_model, records, batch, reference_logprobs, chunk_mb):
    actor = make_actor(hf_dir, lr=1.0, loss_head_chunk_mb=chunk_mb)
    before = actor.state_dict_hf()
    metrics = actor.train_step(records)
    after = actor.state_dict_hf()
    ref_loss, ref_grads = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert not metrics["skipped"] and metrics["micro_batches"] > 1
    assert set(after) == set(before) and set(ref_grads) <= set(after)
    for name, grad in ref_grads.items():  # SGD, lr 1: after = before - grad
        expected = before[name] - grad
        scale = float(grad.abs().max())
        atol = 1e-5 * scale + rounding_tolerance(torch.float32, float(before[name].abs().max()))
        torch.testing.assert_close(after[name], expected, rtol=0, atol=atol, msg=name)
    # The log-probs the step computed: at least every trained token (NaN where none was computed).
    for s, (lp, ref) in enumerate(zip(metrics["logprobs"], reference_logprobs)):
        computed = ~np.isnan(lp)
        assert computed[_trained(batch, s)].all()
        np.testing.assert_allclose(lp[computed], ref[computed], atol=1e-5)
    for key in ("grad_norm", "lr", "tokens_total", "tokens_computed", "ideal_speedup", "plan_imbalance", "times",
                "step_time_s", "pg_loss", "clip_frac", "kl", "entropy"):
        assert key in metrics, key
    assert set(metrics["times"]) >= {"tree", "plan", "forward_backward", "optimizer"}


def test_loss_overrides_change_only_this_call(hf_dir, hf_model, records, batch):
    actor = make_actor(hf_dir)
    actor.zero_grad()
    result = actor.forward_backward(records, kl_coef=0.0, entropy_coef=0.0, loss_agg="token-mean")
    ref_loss, ref_grads = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.0, 0.0, "token-mean")
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(_grads(actor), hf_grads_to_mcore(ref_grads, actor.arch), rtol=1e-5)
    assert actor.config.loss == LOSS


def test_forward_backward_accumulates_until_the_optimizer_step(hf_dir, records):
    actor = make_actor(hf_dir)
    actor.zero_grad()
    actor.forward_backward(records)
    once = _grads(actor)
    actor.forward_backward(records)
    twice = _grads(actor)
    for name in once:  # g + g is exact in floating point
        torch.testing.assert_close(twice[name], 2 * once[name], rtol=0, atol=rounding_tolerance(
            torch.float32, float(once[name].abs().max())), msg=name)
    before = actor.state_dict_hf()
    outcome = actor.optimizer_step()
    assert not outcome.skipped and actor.iteration == 1
    assert any(not torch.equal(before[k], v) for k, v in actor.state_dict_hf().items())


def _hf_logprobs(hf_model, batch, s):
    toks = torch.from_numpy(batch.tokens[batch.sample_slice(s)].astype(np.int64))
    logsm = torch.log_softmax(hf_model(toks[None]).logits[0, :-1].float(), -1)
    return logsm.gather(1, toks[1:, None])[:, 0]


def test_sft_loss_equals_direct_hf_computation(hf_dir, hf_model, records, batch):
    """``log_likelihood_loss`` with token-mean: the mean negative log-likelihood of the trained
    tokens (``view.coef`` follows the configured aggregation)."""
    actor = make_actor(hf_dir, loss=LossConfig(loss_agg="token-mean"))
    actor.zero_grad()
    result = actor.forward_backward(records, loss_fn=log_likelihood_loss)
    hf_model.zero_grad(set_to_none=True)
    claims = sum(int(_trained(batch, s).sum()) for s in range(batch.num_samples))
    total = 0.0
    for s in range(batch.num_samples):
        mask = torch.from_numpy(_trained(batch, s)[1:])
        if mask.any():
            loss = -float(batch.weights[s]) * (_hf_logprobs(hf_model, batch, s) * mask).sum() / claims
            loss.backward()
            total += float(loss.detach())
    assert result.loss == pytest.approx(total, rel=1e-5)
    ref = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    assert_grads_close(_grads(actor), hf_grads_to_mcore(ref, actor.arch), rtol=1e-5)


def test_gspo_sequence_loss_equals_direct_hf_computation(hf_dir, hf_model, records, batch):
    """GSPO: a clipped ratio per sequence (the mean log-ratio of its trained tokens) with the
    advantage of its last trained token, weighted by the sample weight, averaged over trained
    samples; a sample's claims span micro-batches here (mechanism 2)."""
    gspo = GSPOLoss(clip_eps=0.05)
    actor = make_actor(hf_dir)
    actor.zero_grad()
    result = actor.forward_backward(records, loss_fn=gspo)
    hf_model.zero_grad(set_to_none=True)
    trained = [s for s in range(batch.num_samples) if _trained(batch, s).any()]
    assert len({float(batch.weights[s]) for s in trained}) > 1, "the batch must weight its samples differently"
    total, clipped = 0.0, 0
    for s in trained:
        sl = batch.sample_slice(s)
        mask = torch.from_numpy(_trained(batch, s)[1:])
        logp = _hf_logprobs(hf_model, batch, s)
        old = (torch.from_numpy(batch.old_logprobs[sl][1:]).float() if batch.has_old_logprobs[s]
               else logp.detach())
        ratio = torch.exp(((logp - old) * mask).sum() / mask.sum())
        adv = float(batch.advantages[sl][np.flatnonzero(_trained(batch, s))[-1]])
        loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - 0.05, 1 + 0.05) * adv)
        loss = float(batch.weights[s]) * loss / len(trained)
        clipped += int(abs(float(ratio.detach()) - 1) > 0.05)
        loss.backward()
        total += float(loss.detach())
    assert 0 < clipped < len(trained), "the batch must have clipped and unclipped sequences"
    assert result.loss == pytest.approx(total, rel=1e-5)
    ref = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in hf_model.named_parameters()}
    assert_grads_close(_grads(actor), hf_grads_to_mcore(ref, actor.arch), rtol=1e-5)


def test_a_sequence_loss_without_advantages(hf_dir):
    """A SequenceLoss that needs no advantage runs on a batch without any."""
    class MeanLogLikelihood(GSPOLoss):
        needs_advantage = False

        def token_terms(self, view):
            return view.logp / view.sample_claims

        def sequence_loss(self, sums, samples):
            assert not samples.advantage.any()
            return -(sums * samples.trained).sum()

    records = [{"tokens": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]}, {"tokens": [1, 2, 3, 9]}]
    assert np.isfinite(make_actor(hf_dir).train_step(records, loss_fn=MeanLogLikelihood())["loss"])


def test_a_custom_loss_needs_no_advantage(hf_dir):
    records = [{"tokens": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]}]
    actor = make_actor(hf_dir)
    with pytest.raises(SampleValidationError, match="advantage"):
        actor.train_step(records)
    assert np.isfinite(actor.train_step(records, loss_fn=log_likelihood_loss)["loss"])


# ---------------------------------------------------------------------------------------- weights
def test_hf_weights_out_and_in(hf_dir, hf_model, records, tmp_path):
    actor = make_actor(hf_dir)
    weights = actor.state_dict_hf()
    reference = hf_model.state_dict()
    assert set(weights) == set(reference) - ({"lm_head.weight"} if hf_model.config.tie_word_embeddings else set())
    for name, tensor in weights.items():  # a conversion of the same numbers: bit for bit
        assert torch.equal(tensor, reference[name]), name
    perturbed = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
                 for k, v in weights.items()}
    actor.load_hf_state_dict(perturbed)
    assert all(torch.equal(actor.state_dict_hf()[k], v) for k, v in perturbed.items())
    # export_hf writes a folder transformers loads, with the same log-probs.
    from transformers import AutoModelForCausalLM

    folder = actor.export_hf(str(tmp_path / "exported"))
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = samples_from_dicts(records)
    ours = actor.compute_logprobs(records)
    for a, b in zip(ours, per_sample_logprobs(exported, batch)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    bad = dict(perturbed, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(PsrlError, match="model.norm.weight.*shape"):
        actor.load_hf_state_dict(bad)


def test_built_from_memory_equals_built_from_the_folder(hf_dir, hf_model, records):
    from_folder = make_actor(hf_dir).compute_logprobs(records)
    from_object = make_actor(hf_model).compute_logprobs(records)
    from_state_dict = make_actor((hf_model.config.to_dict(), hf_model.state_dict())).compute_logprobs(records)
    for a, b, c in zip(from_folder, from_object, from_state_dict):  # the same weights, the same computation
        assert np.array_equal(a, b) and np.array_equal(a, c)


def test_save_and_load_round_trip(hf_dir, records, tmp_path):
    """Weights, Adam moments, the learning-rate schedule and the iteration survive save and
    load: the next step from the original and from the reloaded actor are the same."""
    def adam_actor(model):
        return PolicyActor(model, ActorConfig(device="cpu", micro_batch_tokens=MICRO_BATCH, loss=LOSS,
                                              optimizer=OptimizerSettings(lr=1e-3, min_lr=1e-5, lr_warmup_iters=1,
                                                                          lr_decay_style="linear", lr_decay_iters=4)))

    actor = adam_actor(hf_dir)
    actor.train_step(records)
    actor.train_step(records)
    actor.save(str(tmp_path / "ckpt"))
    resumed = adam_actor(str(tmp_path / "ckpt"))
    assert resumed.iteration == actor.iteration == 2
    mine, theirs = actor.state_dict_hf(), resumed.state_dict_hf()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    other = adam_actor(hf_dir)
    other.load(str(tmp_path / "ckpt"))
    assert other.iteration == 2 and all(torch.equal(mine[k], v) for k, v in other.state_dict_hf().items())
    a, b, c = actor.train_step(records), resumed.train_step(records), other.train_step(records)
    assert a["lr"] == b["lr"] == c["lr"] and a["loss"] == b["loss"] == c["loss"]
    after = actor.state_dict_hf()
    for replica in (resumed, other):
        assert all(torch.equal(after[k], v) for k, v in replica.state_dict_hf().items())


# ---------------------------------------------------------------------------------------- inputs
def test_batches_as_lists_numpy_arrays_or_tensors(hf_dir, records):
    as_numpy = [{k: np.asarray(v) if isinstance(v, list) else v for k, v in r.items()} for r in records]
    as_torch = [{k: torch.tensor(v) if isinstance(v, list) else v for k, v in r.items()} for r in records]
    for r in as_torch:  # what a rollout worker holds: int64 ids, bool masks, bf16 log-probs
        r["tokens"] = r["tokens"].long()
        if "loss_mask" in r:
            r["loss_mask"] = r["loss_mask"].bool()
    actor = make_actor(hf_dir)
    ours = [actor.compute_logprobs(b) for b in (records, as_numpy, as_torch)]
    for a, b, c in zip(*ours):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    bf16 = [dict(r, old_logprobs=torch.tensor(r["old_logprobs"]).bfloat16()) for r in records if "old_logprobs" in r]
    assert np.isfinite(make_actor(hf_dir).train_step(bf16)["loss"])


@pytest.mark.parametrize("typo,meant", [("lossmask", "loss_mask"), ("advantages", "advantage")])
def test_a_misspelled_field_names_the_likely_one(hf_dir, typo, meant):
    record = {"tokens": [1, 2, 3], "advantage": 1.0, typo: [0, 1, 1] if typo == "lossmask" else 1.0}
    if typo == "advantages":
        del record["advantage"]
    with pytest.raises(SampleValidationError, match=f"'{typo}'.*did you mean '{meant}'"):
        make_actor(hf_dir).train_step([record])


def test_creating_and_using_an_actor_leaves_the_callers_rng_alone(hf_dir, records):
    torch.manual_seed(321)
    state = torch.get_rng_state()
    actor = make_actor("debug-llama", seed=99)  # random initialisation: seeded privately
    actor.compute_logprobs(records)
    actor.train_step(records)
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------------------------------- torchrun
@pytest.fixture(scope="module")
def torchrun_cases(hf_dir, records, tmp_path_factory, request):
    """The module's torchrun runs in one launch (2 ranks): TP=2, DP=2, then the refused one
    (ranks with different batches; it ends the launch, so it runs last). ``torchrun_cases(id)``:
    the case's folder (``result.pt``), or the AssertionError of a failed case."""
    root = tmp_path_factory.mktemp("torchrun")
    data = root / "records.json"
    data.write_text(json.dumps(records))
    tests = {"tp2": "test_under_torchrun_every_rank_gets_the_reference_numbers[tp2]",
             "dp2": "test_under_torchrun_every_rank_gets_the_reference_numbers[dp2]",
             "different-batches": "test_under_torchrun_ranks_with_different_batches_are_refused"}
    selected = selected_test_names(request)
    shared = SharedLaunches({case for case, test in tests.items() if test in selected})
    folders = {case: tmp_path_factory.mktemp(case) for case in tests}
    for case, tp in (("tp2", 2), ("dp2", 1)):
        shared.add(case, 2, SCRIPT, lambda tp=tp, d=folders[case]: [
            "--hf-dir", hf_dir, "--records", str(data), "--tp", str(tp), "--out", str(d / "result.pt")])
    shared.add("different-batches", 2, SCRIPT, lambda d=folders["different-batches"]: [
        "--hf-dir", hf_dir, "--records", str(data), "--different-batches", "--out", str(d / "r.pt")])

    def run(case):
        shared.check(case)
        return folders[case]

    return run


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_under_torchrun_every_rank_gets_the_reference_numbers(torchrun_cases, hf_model, batch, reference_logprobs, tp):
    res = torch.load(torchrun_cases("tp2" if tp == 2 else "dp2") / "result.pt", weights_only=False)
    assert res["ranks_agree"] and res["world"] == 2
    for a, b in zip(res["logprobs"], reference_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    ref_loss, ref_grads = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in ref_grads.items():
        atol = 1e-5 * float(grad.abs().max()) + rounding_tolerance(torch.float32, float(res["before"][name].abs().max()))
        torch.testing.assert_close(res["after"][name], res["before"][name] - grad, rtol=0, atol=atol, msg=name)
    for s, (lp, ref) in enumerate(zip(res["step_logprobs"], reference_logprobs)):
        trained = _trained(batch, s)
        np.testing.assert_allclose(lp[trained], ref[trained], atol=1e-5)


def test_a_user_written_ppo_loss_equals_the_built_in_one(hf_dir, records):
    """A DAPO-style per-claim function (clip-higher), with equal clip ranges, is PPO: the same
    loss and gradients as the built-in LossConfig, with the configured seq-mean-token-mean
    aggregation in ``view.coef`` (the function docs/api.md shows)."""
    def dapo(view, eps_low=0.2, eps_high=0.2):
        old = torch.where(torch.isnan(view.old_logprob), view.logp.detach(), view.old_logprob)
        ratio = torch.exp((view.logp - old).clamp(-20, 20))
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        return -view.coef * view.weight * torch.minimum(ratio * view.advantage, clipped * view.advantage)

    builtin = make_actor(hf_dir)
    builtin.zero_grad()
    expected = builtin.forward_backward(records, kl_coef=0.0, entropy_coef=0.0)
    custom = make_actor(hf_dir)
    custom.zero_grad()
    got = custom.forward_backward(records, loss_fn=dapo)
    assert got.loss == pytest.approx(expected.loss, rel=1e-6, abs=1e-9)
    assert_grads_close(_grads(custom), _grads(builtin), rtol=1e-6)
    # loss_agg= for this call only changes the coefficients (token-mean now, not seq-mean).
    builtin.zero_grad()
    token_mean = builtin.forward_backward(records, loss_fn=dapo, loss_agg="token-mean")
    builtin.zero_grad()
    assert token_mean.loss == pytest.approx(
        builtin.forward_backward(records, kl_coef=0.0, entropy_coef=0.0, loss_agg="token-mean").loss, rel=1e-6)
    assert token_mean.loss != pytest.approx(got.loss, rel=1e-3)


def test_loaded_weights_survive_the_next_bf16_step(hf_dir, records):
    """A bf16 actor steps through fp32 master copies: loaded weights must reach them too."""
    actor = make_actor(hf_dir, lr=0.0, dtype="bfloat16")
    weights = actor.state_dict_hf()
    perturbed = {k: (v.float() + 0.05).to(v.dtype) for k, v in weights.items()}
    actor.load_hf_state_dict(perturbed)
    actor.train_step(records)  # lr 0: the weights must stay the loaded ones
    assert all(torch.equal(actor.state_dict_hf()[k], v) for k, v in perturbed.items())


def test_a_log_prob_only_actor_refuses_to_train(hf_dir, records):
    actor = PolicyActor(hf_dir, ActorConfig(device="cpu"), for_training=False)
    assert actor.optimizer is None
    with pytest.raises(PsrlError, match="for_training=False"):
        actor.train_step(records)


def test_bad_sources_and_weights_are_named(hf_dir, tmp_path):
    with pytest.raises(PsrlError, match="no-such-model: no such folder"):
        PolicyActor(str(tmp_path / "no-such-model"), ActorConfig(device="cpu"))
    actor = make_actor(hf_dir)
    with pytest.raises(PsrlError, match="model.norm.weigth"):
        actor.load_hf_state_dict(dict(actor.state_dict_hf(), **{"model.norm.weigth": torch.ones(64)}))


@pytest.mark.slow  # torchrun
def test_under_torchrun_ranks_with_different_batches_are_refused(torchrun_cases):
    """A framework that hands each rank its own slice gets an error, not mixed-up numbers."""
    with pytest.raises(AssertionError, match="the ranks passed different batches"):
        torchrun_cases("different-batches")
