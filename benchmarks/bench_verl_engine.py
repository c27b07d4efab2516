#!/usr/bin/env python
"""The update phase of verl's PPO / GRPO trainer through the psrl engine, prefix sharing on vs
off and one pass vs two, on a multi-turn GRPO mini-batch in verl's own format (verl's ``ppo_loss``, verl's batch
layout after ``left_right_2_no_padding``; what verl's ``TrainingWorker.train_batch`` calls).

    python benchmarks/bench_verl_engine.py [--model tiny-llama] [--groups 4] [--group-size 8] [--repeats 3]

Workload: ``--groups`` prompts of ``--prompt-tokens`` tokens, ``--group-size`` responses each
(GRPO); every response of a group shares its first turn and the tool's output (an agent loop's
first tool call), then continues with its own turns. Both variants run in one process on the
same weights and batch: ``tree`` (the engine's default: mechanisms 1 and 2) and ``none``
(samples packed back to back, the per-sample computation every framework does today). verl's
``ppo_loss`` runs in one forward and backward (``one-pass``); any other loss function pays a
log-prob pass first (``two-pass``: here ``ppo_loss`` wrapped in a plain function, so the
engine cannot tell it is verl's). Reported: median seconds per ``train_batch``, speedup, tokens computed in
the update pass and the batch's ideal speedup (FLOP ratio of the prefix tree), peak memory.
Needs the ``verl`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.workers.config import ActorConfig as VerlActorConfig  # noqa: E402
from verl.workers.config import HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.engine.calibration import median_seconds  # noqa: E402
from megatron_psrl.engine.memory import PeakMemory  # noqa: E402
from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig, training_batch  # noqa: E402
from megatron_psrl.model import tiny_config  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="tiny config name (random weights)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=64, help="the shared first turn, and the tool output")
    parser.add_argument("--tail-tokens", type=int, default=128, help="each response's own turns (up to)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the table's rows as JSON here")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = tempfile.mkdtemp(prefix="bench-verl-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(args.model))).save_pretrained(hf_dir)
    vocab = tiny_config(args.model)["vocab_size"]
    data = grpo_multi_turn(args, vocab)
    loss = partial(ppo_loss, VerlActorConfig(strategy="megatron", rollout_n=args.group_size, ppo_mini_batch_size=1,
                                             ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False))
    two_pass_loss = lambda **kw: loss(**kw)  # noqa: E731  (not ppo_loss itself: the two-pass path)
    rows = []
    for mode, path in (("tree", "one-pass"), ("tree", "two-pass"), ("none", "one-pass")):
        engine = EngineRegistry.new(
            "language_model", backend=BACKEND, model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
            engine_config=PsrlEngineConfig(dtype="float32", device="cpu", prefix_sharing=mode,
                                           micro_batch_tokens=args.micro_batch_tokens),
            optimizer_config=McoreOptimizerConfig(optimizer="adam", lr=0.0, clip_grad=1.0), checkpoint_config=None)
        engine.initialize()
        seen = {}
        original = engine.actor.forward_backward

        def spy(batch, _orig=original, **kwargs):
            result = _orig(batch, **kwargs)
            seen.update(result.metrics)
            return result

        engine.actor.forward_backward = spy

        def step(engine=engine, fn=loss if path == "one-pass" else two_pass_loss):
            with engine.train_mode():
                engine.train_batch(data.clone(), fn)

        seconds = median_seconds(step, args.repeats)
        with PeakMemory(torch.device("cpu"), mode="sampled") as mem:
            step()
        rows.append(dict(mode=mode, path=path, seconds=seconds, tokens_total=seen["tokens_total"],
                         tokens_computed=seen["tokens_computed"], ideal_speedup=seen["ideal_speedup"],
                         peak_mem_mb=mem.peak_bytes / 2**20))
    base = rows[-1]["seconds"]
    print(f"verl train_batch, {args.model}, {args.groups} groups x {args.group_size} responses, prompt "
          f"{args.prompt_tokens}, shared turn + tool {2 * args.turn_tokens}, own turns <= {args.tail_tokens} "
          f"({rows[0]['tokens_total']} tokens)")
    print("| prefix sharing | path | s / train_batch | speedup | tokens computed (update pass) | ideal speedup | peak MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["speedup"] = base / r["seconds"]
        print(f"| {r['mode']} | {r['path']} | {r['seconds']:.3f} | {r['speedup']:.2f}x | {r['tokens_computed']} | "
              f"{r['ideal_speedup']:.2f}x | {r['peak_mem_mb']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
