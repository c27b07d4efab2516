"""The verl engine's columnar hand-off (megatron_psrl.integrations.verl_batch) against the
per-sample construction it replaces: the same samples, masks, per-token columns and layouts."""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")

from helpers.verl_harness import VOCAB, multi_turn_samples, verl_batch  # noqa: E402

from megatron_psrl.data.loader import samples_from_dicts  # noqa: E402
from megatron_psrl.errors import ConfigurationError  # noqa: E402
from megatron_psrl.integrations.verl_batch import from_verl, gather_sequences, sequences_of, to_verl  # noqa: E402


def test_the_batch_equals_the_per_sample_construction():
    samples = multi_turn_samples()
    data = verl_batch(samples, global_batch_size=len(samples))
    seqs = sequences_of(data)
    every = gather_sequences(seqs, None, 1, 0, "cpu")
    advantages = seqs.per_token(data["advantages"])
    batch = every.batch(every.response_mask(), VOCAB, advantages=advantages)
    dicts = []
    for i, (prompt, response, _) in enumerate(samples):  # one dict per sample, as the engine built them before
        mask = [0] * len(prompt) + [1] * len(response)
        adv = [0.0] * len(prompt) + data["advantages"][i, :len(response)].tolist()
        dicts.append({"id": i, "tokens": np.concatenate([prompt, response]).tolist(), "loss_mask": mask,
                      "advantage": adv})
    expected = samples_from_dicts(dicts, vocab_size=VOCAB, require_advantage=True, source="<batch>")
    assert np.array_equal(batch.offsets, expected.offsets) and np.array_equal(batch.tokens, expected.tokens)
    assert np.array_equal(batch.loss_mask, expected.loss_mask)
    assert np.array_equal(batch.advantages, expected.advantages)  # copies of the same floats
    assert every.mine == slice(0, len(samples)) and every.my_tokens == slice(0, batch.num_tokens)
    with pytest.raises(ConfigurationError, match="vocabulary"):
        every.batch(every.response_mask(), VOCAB - 50)


def test_layouts_shift_by_one_token_within_each_sample():
    offsets = np.array([0, 3, 7])
    x = np.arange(7, dtype=np.float32) + 1  # the project's layout: x[t] about token t
    y = to_verl(x, offsets)
    assert y.tolist() == [2, 3, 0, 5, 6, 7, 0]  # verl's: y[t] = x[t + 1], 0 at each sample's end
    assert from_verl(y, offsets).tolist() == [0, 2, 3, 0, 5, 6, 7]  # back, 0 at each sample's start


def test_position_ids_that_restart_elsewhere_are_refused():
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    values = data["position_ids"].values().clone()
    values[5] += 1
    data["position_ids"] = torch.nested.nested_tensor_from_jagged(values, offsets=data["position_ids"].offsets())
    with pytest.raises(ConfigurationError, match="position_ids"):
        sequences_of(data)
