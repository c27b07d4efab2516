"""The bench_peers model and small versions of its four workloads (GRPO, step-wise, rollout tree,
mixed), and one training step's measured peak beside the memory plan's prediction.

The model is bench_peers' (tiny-llama's h256 / i512 / 4 layers, 8 heads of 32, 4 KV heads,
vocabulary 2048, fp32) with random weights; the workloads hold about a thousand tree tokens
each, so a step takes a fraction of a second. Heap figures are process-wide: the tests that
measure run in a process of their own (``@pytest.mark.fresh_process``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch

from helpers.torchrun import REPO_ROOT
from megatron_psrl.checkpoint import ModelSource
from megatron_psrl.data import make_mixed, make_tree_rollouts
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.engine.memory import PeakMemory
from megatron_psrl.model.tiny import tiny_config
from megatron_psrl.rl.actor import PolicyActor

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

PEER_MODEL = dict(tiny_config("tiny-llama"), num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  vocab_size=2048)
"""bench_peers' model (``benchmarks/bench_peers.py``)."""

LARGE_KV = 1 << 36
"""A KV cache limit under which any configuration here plans (the plans' budgets are set per step)."""


def peer_actor(**config) -> PolicyActor:
    """A log-prob-and-gradient actor (no optimizer: the parameters' gradients appear in the step,
    as in bench_peers) on the bench_peers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PEER_MODEL)).float()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    base = dict(device="cpu", seed=0, attention_backend="torch", kv_cache_budget=LARGE_KV)
    return PolicyActor(ModelSource(hf_config=dict(PEER_MODEL), hf_state_dict=state),
                       ActorConfig(**dict(base, **config)), for_training=False)


def small_workloads(vocab: int = PEER_MODEL["vocab_size"]):
    """Small versions of bench_peers' four workloads (1,000 to 1,300 tree tokens each)."""
    from exact_workloads import grpo_exact, stepwise_exact

    return {
        "grpo-256x4x256": grpo_exact(256, 4, 256, vocab),
        "stepwise-4x256": stepwise_exact(4, 256, 64, vocab),
        "tree": make_tree_rollouts(num_roots=1, vocab_size=vocab, seed=1, prompt_len=(256, 512),
                                   obs_len=(32, 128), segment_len=(16, 64)),
        "mixed": make_mixed(grpo=dict(num_prompts=1, group_size=4, prompt_len=(128, 256), response_len=(32, 96)),
                            stepwise=dict(num_trajectories=1, turns=(3, 4), obs_len=(32, 96), action_len=(16, 48),
                                          task_len=(64, 128)),
                            tree=dict(num_roots=1, branching=2, depth=2, segment_len=(16, 48), prompt_len=(64, 128),
                                      obs_len=(16, 48)), vocab_size=vocab, seed=1),
    }


@contextlib.contextmanager
def configured(actor: PolicyActor, recompute=None, **overrides):
    """The actor's config with ``overrides`` (and megatron's ``full`` recomputation of
    ``recompute = (method, layers)``) for the duration."""
    config, engine = actor.config, actor.engine
    before = engine.recompute_setting
    actor.config = engine.config = dataclasses.replace(config, **overrides)
    if recompute is not None:
        engine.set_recompute("full", *recompute)
    try:
        yield
    finally:
        actor.config = engine.config = config
        engine.set_recompute(*before)


def fresh_step(actor: PolicyActor, batch) -> None:
    """Gradients and the KV cache's pool released: what a step's measurement starts from."""
    actor.zero_grad()
    actor.kv_cache.release_pool()


def measured_step(actor: PolicyActor, batch) -> int:
    """Heap bytes in use above the step's start at its peak (every torch operation)."""
    fresh_step(actor, batch)
    with PeakMemory(torch.device("cpu"), mode="ops") as mem:
        actor.forward_backward(batch, return_logprobs=False)
    return int(mem.peak_bytes - mem.start_bytes)


def predicted_step(actor: PolicyActor, batch) -> int:
    """The memory plan's step peak of the step ``actor`` would run on ``batch``."""
    _, plan, memory, _ = actor.engine.plan(batch)
    return actor.engine.predicted_step_peak(plan, memory)
