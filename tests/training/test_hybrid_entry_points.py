"""Qwen3-Next and Qwen3.5 through the entry points users run: ``pretrain_agent_rl.py --model``
(prefix sharing with cached prefixes against the per-sample baseline) and ``PolicyActor``
loading a Hugging Face folder and streaming it back bit for bit. (The converter's round trips
are in ``tests/model/test_hybrid_families.py``; the verl engine in
``tests/integrations/test_verl_engine.py``.)"""

import json

import pytest
import torch
from helpers.hybrid import WRAPPERS, make_hybrid_checkpoint, read_safetensors

from megatron_psrl.model.tiny import HYBRID_CONFIGS, tiny_config
from megatron_psrl.rl.actor import ActorConfig, PolicyActor
from megatron_psrl.training.arguments import HYBRID_MODEL_NAMES, parse_args
from megatron_psrl.training.trainer import main

DATA = ["--data", "stepwise", "--synthetic-tokens", "2500", "--quiet", "--seed", "3"]


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_every_hybrid_config_is_a_model_choice():
    assert HYBRID_MODEL_NAMES == tuple(sorted(HYBRID_CONFIGS))
    assert parse_args(["--model", "debug-qwen3.5-text"]).model == "debug-qwen3.5-text"


@pytest.mark.parametrize("model", ["debug-qwen3.5-text", "debug-qwen3-next"])
def test_sharing_with_cached_states_trains_as_the_baseline(tmp_path, model):
    """Two iterations with tree packing and cached prefixes (256-token micro-batches: the
    linear layers' states and the softmax layers' K/V cached) against --no-prefix-sharing: the
    same loss and gradient norm, fewer tokens computed."""
    logs = {}
    for mode in (["--prefix-sharing", "tree", "--micro-batch-tokens", "256"],
                 ["--no-prefix-sharing", "--micro-batch-tokens", "4096"]):
        path = tmp_path / f"{mode[0]}.jsonl"
        main(["--model", model, "--train-iters", "2", "--log-json", str(path)] + DATA + mode)
        logs[mode[0]] = _records(path)
    shared, base = logs["--prefix-sharing"], logs["--no-prefix-sharing"]
    for a, b in zip(shared, base):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert shared[0]["tokens_computed"] < base[0]["tokens_computed"]
    assert shared[0]["kv_hit_rate"] > 0  # trajectories exceed 256 tokens: mechanism 2 is used




@pytest.mark.parametrize("name", ["debug-qwen3.5", "debug-qwen3-next"])
def test_the_actor_streams_back_the_checkpoint_it_loaded(tmp_path, name):
    """``PolicyActor(hf_dir).state_dict_hf()`` (the weights a rollout engine receives) is the
    folder's language model bit for bit, under its own names (a wrapper's vision tower is not
    the actor's)."""
    hf_dir = make_hybrid_checkpoint(tiny_config(name), str(tmp_path / "hf"))
    actor = PolicyActor(hf_dir, ActorConfig(device="cpu"))
    try:
        streamed = actor.state_dict_hf()
    finally:
        actor.close()
    stored = {k: v for k, v in read_safetensors(hf_dir).items() if not k.startswith("model.visual.")}
    assert (tiny_config(name)["model_type"] in WRAPPERS) == any(k.startswith("model.language_model.") for k in stored)
    assert set(streamed) == set(stored)
    assert all(torch.equal(streamed[k], stored[k]) for k in stored)
