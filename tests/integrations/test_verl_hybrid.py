"""The verl training engine on a Qwen3.5 model (Gated DeltaNet and gated softmax layers) against
verl's own computation: per-sample Hugging Face log-probs through verl's ppo_loss, on the
multi-turn GRPO mini-batch of ``test_verl_engine.py``, with 48-token micro-batches (the shared
prompts and first turn cached: the linear layers' states and the softmax layers' K/V). Needs the
``verl`` extra, which CI installs."""

import os
from functools import partial

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")  # verl assumes CUDA unless told

from helpers.hf_reference import load_hf_model  # noqa: E402
from helpers.hybrid import make_hybrid_checkpoint  # noqa: E402
from helpers.verl_harness import (  # noqa: E402
    VOCAB,
    multi_turn_samples,
    psrl_engine,
    reference,
    response_positions,
    verl_batch,
    verl_loss_config,
)
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.model import tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hybrid_checkpoint(dict(tiny_config("debug-qwen3.5-text"), vocab_size=VOCAB),
                                  str(tmp_path_factory.mktemp("hf-qwen3.5")))


def test_one_rank_matches_the_per_sample_reference_through_verls_loss(hf_dir):
    """infer_batch's log-probs and train_batch's loss and every parameter's gradient (SGD, lr 1)
    equal the per-sample HF computation through verl's ppo_loss; cached prefixes are read."""
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    config = verl_loss_config("token-mean", 0.0)
    engine = psrl_engine(hf_dir)
    seen = {}
    original = engine.actor.forward_backward

    def spy(batch, **kwargs):
        result = original(batch, **kwargs)
        seen.update(result.metrics)
        return result

    engine.actor.forward_backward = spy
    with engine.eval_mode():
        inferred = engine.infer_batch(data.clone())
    before = engine.actor.state_dict_hf()
    with engine.train_mode():
        trained = engine.train_batch(data.clone(), partial(ppo_loss, config))
    after = engine.actor.state_dict_hf()
    ref = reference(load_hf_model(hf_dir), [data], config, False)

    keep = response_positions(data)
    torch.testing.assert_close(inferred["model_output"]["log_probs"].values()[keep], ref["log_probs"][0][keep],
                               rtol=0, atol=1e-5)
    assert trained["loss"][0] == pytest.approx(ref["losses"][0], rel=1e-5)
    assert seen["kv_hit_rate"] > 0 and seen["tokens_computed"] < int(data["input_ids"].offsets()[-1])
    assert len(ref["grads"]) == len(before)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(before[name] - after[name], grad, rtol=1e-4, atol=2e-6,
                                   msg=lambda m: f"{name}: {m}")
