#!/usr/bin/env python
"""The update phase of verl's PPO / GRPO trainer: the psrl engine (prefix sharing on and off)
beside verl's own FSDP2 engine, on the same multi-turn GRPO mini-batch in verl's format, the
same weights and verl's ``ppo_loss`` (what verl's ``TrainingWorker.train_batch`` calls).

    python benchmarks/bench_verl_engine.py [--model tiny-llama] [--groups 4] [--group-size 8] [--rounds 5]
    python benchmarks/bench_verl_engine.py --quick            # seconds: a smoke run for tests
    python benchmarks/bench_verl_engine.py --profile          # FSDP2's top CPU ops (torch.profiler)

Workload: ``--groups`` prompts of ``--prompt-tokens`` tokens, ``--group-size`` responses each
(GRPO); every response of a group shares its first turn and the tool's output (an agent loop's
first tool call), then continues with its own turns.

Engines, all in one process on CPU (verl's FSDP2 engine through the CPU platform module
``megatron_psrl.integrations.verl_cpu_platform``, looked up as a ``cuda`` engine (verl
registers it for cuda and npu only), with
remove-padding on, ``sdpa`` attention and fp32 parameters, reduction and buffers):

- ``psrl-tree``: the psrl engine, mechanisms 1 and 2 (``prefix_sharing=tree``); verl's
  ``ppo_loss`` runs in one forward and backward (the engine's one-pass path);
- ``psrl-tree-two-pass``: the same, with ``ppo_loss`` wrapped in a plain function so the engine
  cannot tell it is verl's: a log-prob pass first, then the forward and backward (what any other
  loss function gets);
- ``psrl`` (none): the psrl engine, samples packed back to back (``prefix_sharing=none``);
- ``fsdp2``: verl's FSDP2 engine, one process, micro-batches of up to ``--micro-batch-tokens``
  tokens (verl's dynamic batch size).

Timing: ``--rounds`` interleaved rounds, each one ``train_batch`` per engine in turn (so a load
change on a shared machine hits every engine alike); the median per engine. Memory: the peak
heap above the step's start during one ``train_batch`` (the step's working memory: the
engines' weights and optimizer states are outside it). The optimizer is Adam at lr 0, so every
round sees the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# verl imports these when it is imported: the CPU platform first (verl's device), then the engine
os.environ.setdefault("VERL_USE_EXTERNAL_MODULES",
                      "megatron_psrl.integrations.verl_cpu_platform,megatron_psrl.integrations.verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig as VerlActorConfig  # noqa: E402
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import megatron_psrl.integrations.verl_cpu_platform  # noqa: E402,F401  (when verl was imported before)
from megatron_psrl.engine.memory import PeakMemory  # noqa: E402
from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig, training_batch  # noqa: E402
from megatron_psrl.model import tiny_config  # noqa: E402

QUICK = dict(model="debug-llama", groups=2, group_size=3, prompt_tokens=48, turn_tokens=8, tail_tokens=16,
             micro_batch_tokens=256, rounds=1)
"""``--quick``: a batch small enough for a test."""


def grpo_multi_turn(args, vocab: int, seed: int = 0) -> TensorDict:
    """verl's training batch: left-padded prompts, right-padded responses, response masks with
    the tool output masked, GRPO advantages, old log-probs; made jagged by verl's own code."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(args.groups):
        prompt = rng.integers(1, vocab, args.prompt_tokens)
        turn, tool = rng.integers(1, vocab, args.turn_tokens), rng.integers(1, vocab, args.turn_tokens)
        for _ in range(args.group_size):
            tail = rng.integers(1, vocab, int(rng.integers(args.tail_tokens // 2, args.tail_tokens + 1)))
            response = np.concatenate([turn, tool, tail])
            mask = np.concatenate([np.ones(len(turn)), np.zeros(len(tool)), np.ones(len(tail))])
            rows.append((prompt, response, mask))
    b, r_max = len(rows), max(len(r) for _, r, _ in rows)
    advantages = torch.from_numpy(rng.normal(size=(b, 1)).astype(np.float32))
    old = torch.from_numpy(rng.normal(-3.0, 0.3, size=(b, r_max)).astype(np.float32))
    return training_batch(rows, advantages, old, global_batch_size=b)


def loss_function(group_size: int):
    """verl's ``ppo_loss`` as its trainer configures it (token-mean, clip 0.2)."""
    return partial(ppo_loss, VerlActorConfig(strategy="fsdp2", rollout_n=group_size, ppo_mini_batch_size=1,
                                             ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False))


def psrl_engine(hf_dir: str, sharing: str, micro_batch_tokens: int, optimizer: str = "adam", lr: float = 0.0):
    engine = EngineRegistry.new(
        "language_model", backend=BACKEND, model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
        engine_config=PsrlEngineConfig(dtype="float32", device="cpu", prefix_sharing=sharing,
                                       micro_batch_tokens=micro_batch_tokens),
        optimizer_config=McoreOptimizerConfig(optimizer=optimizer, lr=lr, clip_grad=1e9, weight_decay=0.0),
        checkpoint_config=None)
    engine.initialize()
    return engine


def fsdp2_engine(hf_dir: str, micro_batch_tokens: int, optimizer: str = "AdamW", lr: float = 0.0):
    """verl's FSDP2 engine on CPU: remove-padding on, ``sdpa`` attention, fp32 throughout."""
    from unittest import mock

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    # verl registers FSDP2 for cuda (and npu) only: looked up as cuda, it runs on the platform's CPU
    with mock.patch.dict(os.environ, {"VERL_ENGINE_DEVICE": "cuda"}):
        engine = EngineRegistry.new(
            "language_model", backend="fsdp2",
            model_config=HFModelConfig(path=hf_dir, load_tokenizer=False, use_remove_padding=True,
                                       override_config={"attn_implementation": "sdpa"}),
            engine_config=FSDPEngineConfig(strategy="fsdp2", forward_only=False, model_dtype="fp32",
                                           mixed_precision=fp32, use_dynamic_bsz=True,
                                           max_token_len_per_gpu=micro_batch_tokens),
            optimizer_config=FSDPOptimizerConfig(optimizer=optimizer, lr=lr, clip_grad=1e9, weight_decay=0.0),
            checkpoint_config=None)
    with _without_trl_value_head():
        engine.initialize()
    return engine


def _without_trl_value_head():
    """verl 0.9.1's ``apply_monkey_patch`` patches trl's ``AutoModelForCausalLMWithValueHead``
    whenever trl is installed, and fails with trl >= 1.0, which no longer has that class; the
    patch concerns value heads only, so it is skipped for this causal-LM actor."""
    from contextlib import nullcontext
    from unittest import mock

    try:
        from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
    except ImportError:
        return mock.patch("verl.models.transformers.monkey_patch.is_trl_available", return_value=False)
    return nullcontext()


def for_fsdp2(data: TensorDict, micro_batch_tokens: int) -> TensorDict:
    """The settings verl's ``TrainingWorker.train_batch`` adds for its FSDP engines."""
    tu.assign_non_tensor(data, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=micro_batch_tokens,
                         micro_batch_size_per_gpu=None, use_fused_kernels=False)
    return data


def train_step(engine, data: TensorDict, loss) -> dict:
    with engine.train_mode():
        return engine.train_batch(data.clone(), loss)


def hf_checkpoint(model: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = tempfile.mkdtemp(prefix="bench-verl-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(model))).save_pretrained(hf_dir)
    return hf_dir


def _spy_tokens(engine, seen: dict) -> None:
    original = engine.actor.forward_backward

    def spy(batch, **kwargs):
        result = original(batch, **kwargs)
        seen.update(result.metrics)
        return result

    engine.actor.forward_backward = spy


def profile_fsdp2(engine, data: TensorDict, loss, rows: int = 15) -> str:
    """torch.profiler's top ops by self CPU time over one FSDP2 ``train_batch``."""
    from torch.profiler import ProfilerActivity, profile

    train_step(engine, data, loss)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(engine, data, loss)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="tiny config name (random weights)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=64, help="the shared first turn, and the tool output")
    parser.add_argument("--tail-tokens", type=int, default=128, help="each response's own turns (up to)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--engines", default="psrl-tree,psrl-tree-two-pass,psrl-none,fsdp2", help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="a tiny batch, one round (for tests)")
    parser.add_argument("--profile", action="store_true", help="print FSDP2's top CPU ops and stop")
    parser.add_argument("--out", default=None, help="write the table's rows as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def build_engines(args, hf_dir: str, names):
    from megatron_psrl.integrations.verl_cpu_platform import open_process_group

    open_process_group()  # one gloo rank (verl's FSDP engine needs an open group)
    engines = {}
    for name in names:
        if name == "fsdp2":
            engines[name] = fsdp2_engine(hf_dir, args.micro_batch_tokens)
        elif name.startswith("psrl-"):
            engines[name] = psrl_engine(hf_dir, name.split("-")[1], args.micro_batch_tokens)
        else:
            raise SystemExit(f"unknown engine {name!r}")
    return engines


def run(args) -> list:
    hf_dir = hf_checkpoint(args.model)
    data = grpo_multi_turn(args, tiny_config(args.model)["vocab_size"])
    one_pass = loss_function(args.group_size)
    two_pass = lambda **kw: one_pass(**kw)  # noqa: E731  (not ppo_loss itself: the two-pass path)
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    losses = {n: two_pass if n.endswith("-two-pass") else one_pass for n in names}
    engines = build_engines(args, hf_dir, names)
    batches = {n: for_fsdp2(data.clone(), args.micro_batch_tokens) if n == "fsdp2" else data for n in names}
    if args.profile:
        print(profile_fsdp2(engines["fsdp2"], batches["fsdp2"], one_pass))
        return []
    seen = {n: {} for n in names if n != "fsdp2"}
    for n in seen:
        _spy_tokens(engines[n], seen[n])
    seconds = {n: [] for n in names}
    for n in names:  # warm-up (first-call costs: planner calibration, allocator)
        train_step(engines[n], batches[n], losses[n])
    for r in range(args.rounds):
        for n in names:
            start = time.perf_counter()
            train_step(engines[n], batches[n], losses[n])
            seconds[n].append(time.perf_counter() - start)
        print(f"round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names), file=sys.stderr, flush=True)
    rows = []
    total = int(data["input_ids"].offsets()[-1])
    for n in names:
        with PeakMemory(torch.device("cpu"), mode="sampled") as mem:
            train_step(engines[n], batches[n], losses[n])
        rows.append(dict(engine=n, seconds=statistics.median(seconds[n]), rounds=seconds[n], tokens_total=total,
                         tokens_computed=seen.get(n, {}).get("tokens_computed", total),
                         step_peak_mb=(mem.peak_bytes - mem.start_bytes) / 2**20))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = run(args)
    if not rows:
        return
    base = next((r["seconds"] for r in rows if r["engine"] == "fsdp2"), rows[-1]["seconds"])
    print(f"verl train_batch, {args.model}, {args.groups} groups x {args.group_size} responses, prompt "
          f"{args.prompt_tokens}, shared turn + tool {2 * args.turn_tokens}, own turns <= {args.tail_tokens} "
          f"({rows[0]['tokens_total']} tokens), {args.rounds} interleaved rounds")
    print("| engine | s / train_batch (median) | vs fsdp2 | tokens computed | step peak MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        r["speedup_vs_fsdp2"] = base / r["seconds"]
        print(f"| {r['engine']} | {r['seconds']:.3f} | {r['speedup_vs_fsdp2']:.2f}x | {r['tokens_computed']} | "
              f"{r['step_peak_mb']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
