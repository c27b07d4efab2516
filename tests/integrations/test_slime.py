"""slime's train data <-> samples: fields land where docs/data-format.md puts them, bad data is
named by sample and field, and a PolicyActor fed through the adapter returns, in slime's
response layout, the log-probs and the loss of a per-sample Hugging Face computation."""

import numpy as np
import pytest
import torch
from helpers.hf_reference import load_hf_model, make_hf_checkpoint, per_sample_logprobs, per_sample_loss_and_grads

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.validation import SampleValidationError
from megatron_psrl.integrations.slime import logprobs_to_slime, samples_from_slime
from megatron_psrl.model import tiny_config

VOCAB = 256


def _rollout_data(seed=0, as_tensors=True, with_advantages=True):
    """One GRPO group (a shared 24-token prompt, 4 responses) and a 2-turn agent trajectory
    whose second turn repeats the first (tool output in the middle: loss mask 0), in slime's
    layout: per-response-token lists, tensors as slime's actor holds them."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 24).tolist()
    turn1 = rng.integers(0, VOCAB, 20).tolist()
    tool = rng.integers(0, VOCAB, 6).tolist()
    turn2 = rng.integers(0, VOCAB, 9).tolist()
    rows = [(prompt, rng.integers(0, VOCAB, int(rng.integers(5, 12))).tolist(), None) for _ in range(4)]
    rows.append((turn1[:8], turn1[8:] + tool + turn2, [1] * 12 + [0] * 6 + [1] * 9))
    rows.append((turn1[:8], turn1[8:], None))
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward", "truncated",
                            "sample_indices", "log_probs", "rollout_log_probs", "ref_log_probs")}
    if with_advantages:
        data["advantages"] = []
    convert = (lambda x, dt: torch.tensor(x, dtype=dt)) if as_tensors else (lambda x, dt: list(x))
    for i, (p, r, mask) in enumerate(rows):
        n = len(r)
        data["tokens"].append(convert(p + r, torch.long))
        data["response_lengths"].append(n)
        data["loss_masks"].append(convert(mask or [1] * n, torch.int))
        data["rewards"].append(float(rng.normal()))
        data["raw_reward"].append(1.0)
        data["truncated"].append(0)
        data["sample_indices"].append(100 + i)
        for key in ("log_probs", "rollout_log_probs", "ref_log_probs"):
            data[key].append(convert((-rng.random(n) * 3).tolist(), torch.float32))
        if with_advantages:
            data["advantages"].append(convert(rng.normal(size=n).tolist(), torch.float32))
    return data


@pytest.mark.parametrize("as_tensors", [True, False], ids=["tensors", "lists"])
def test_fields_land_on_the_whole_sequence(as_tensors):
    data = _rollout_data(as_tensors=as_tensors)
    samples = samples_from_slime(data)
    assert [s["id"] for s in samples] == data["sample_indices"]
    for i, s in enumerate(samples):
        tokens = np.asarray(data["tokens"][i]).tolist()
        n = data["response_lengths"][i]
        prompt = len(tokens) - n
        assert s["tokens"] == tokens
        assert s["loss_mask"] == [0] * prompt + np.asarray(data["loss_masks"][i]).tolist()
        for ours, theirs in (("advantage", "advantages"), ("old_logprobs", "log_probs"),
                             ("ref_logprobs", "ref_log_probs")):
            np.testing.assert_array_equal(s[ours][:prompt], 0.0)
            np.testing.assert_array_equal(np.asarray(s[ours][prompt:], np.float32),
                                          np.asarray(data[theirs][i], np.float32))
    # they are valid samples, and the group shares its prompt
    batch = samples_from_dicts(samples, vocab_size=VOCAB, require_advantage=True, source="slime")
    assert batch.num_samples == len(samples)


def test_rewards_as_advantages_and_rollout_log_probs_on_request():
    data = _rollout_data(with_advantages=False)
    samples = samples_from_slime(data, old_logprobs="rollout_log_probs")
    for i, s in enumerate(samples):
        assert s["advantage"] == pytest.approx(data["rewards"][i])
        n = data["response_lengths"][i]
        np.testing.assert_array_equal(np.asarray(s["old_logprobs"][-n:], np.float32),
                                      np.asarray(data["rollout_log_probs"][i], np.float32))
    del data["log_probs"], data["rollout_log_probs"]
    assert all("old_logprobs" not in s for s in samples_from_slime(data))


@pytest.mark.parametrize("change,words", [
    (lambda d: d["response_lengths"].__setitem__(2, 10_000), "sample 2 (sample id 102): field 'response_lengths'"),
    (lambda d: d["loss_masks"].__setitem__(1, torch.ones(3, dtype=torch.int)),
     "sample 1 (sample id 101): field 'loss_masks': length 3 != response length"),
    (lambda d: d["log_probs"].__setitem__(0, torch.zeros(1)), "sample 0 (sample id 100): field 'log_probs'"),
    (lambda d: d.pop("loss_masks"), "field 'loss_masks': missing"),
    (lambda d: d["rewards"].pop(), "field 'rewards': 5 entries, 'tokens' has 6"),
    (lambda d: (d.pop("advantages"), d.pop("rewards")), "neither 'advantages' nor 'rewards'"),
])
def test_bad_train_data_is_named(change, words):
    data = _rollout_data()
    change(data)
    with pytest.raises(SampleValidationError, match=words.replace("(", r"\(").replace(")", r"\)")):
        samples_from_slime(data)


def test_log_probs_back_in_the_response_layout():
    lps = [np.arange(10, dtype=np.float32), np.arange(4, dtype=np.float32)]
    out = logprobs_to_slime(lps, [3, 1])
    assert [t.tolist() for t in out] == [[7.0, 8.0, 9.0], [3.0]]
    with pytest.raises(ValueError, match="sample 1"):
        logprobs_to_slime(lps, [3, 4])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(dict(tiny_config("debug-llama"), vocab_size=VOCAB), seed=0,
                              directory=str(tmp_path_factory.mktemp("hf")))


def test_an_actor_fed_by_the_adapter_matches_the_per_sample_reference(hf_dir):
    """Log-probs in slime's layout and the step's loss equal a per-sample HF computation on
    the same samples; micro-batches of 32 tokens make the prompt a cached prefix (mechanism 2)."""
    data = _rollout_data()
    samples = samples_from_slime(data)
    batch = samples_from_dicts(samples, vocab_size=VOCAB, require_advantage=True, source="slime")
    hf = load_hf_model(hf_dir)
    loss_cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.0, loss_agg="token-mean")
    actor = PolicyActor(hf_dir, ActorConfig(device="cpu", micro_batch_tokens=32, loss=loss_cfg,
                                            optimizer=OptimizerSettings(optimizer="sgd", lr=0.0)))
    ours = logprobs_to_slime(actor.compute_logprobs(samples), data["response_lengths"])
    reference = logprobs_to_slime(per_sample_logprobs(hf, batch), data["response_lengths"])
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    metrics = actor.train_step(samples)
    ref_loss, _ = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.0, "token-mean")
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert metrics["tokens_computed"] < batch.num_tokens  # the group's prompt was computed once
