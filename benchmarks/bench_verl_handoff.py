#!/usr/bin/env python
"""The verl engine's hand-off: the time a ``forward_backward_batch`` call spends outside the
model's forward and backward (verl's batch to the engine's samples, ranks' shares gathered,
outputs back to verl's layout, verl's loss where the engine calls it), on a large mini-batch.

    python benchmarks/bench_verl_handoff.py [--before DIR] [--prompts 32] [--responses 8] \
        [--prompt-tokens 8192] [--response-tokens 2048] [--repeats 3]

The model's computation is replaced by stubs that return zeros of the right shapes (the engine's
``compute_logprobs`` and ``forward_backward``), so only the hand-off is timed, whatever the
model. Rows: the code at ``--before`` (a directory holding an older ``megatron_psrl`` package,
e.g. ``git archive <commit> megatron_psrl | tar -x -C DIR``), and this checkout on both of its
paths: two passes (any loss function; here verl's ``ppo_loss`` wrapped in a plain function)
and one pass (verl's ``ppo_loss`` itself). Each row runs in its own process; the median of
``--repeats`` calls. Needs the ``verl`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_batch(args, vocab: int):
    """verl's batch: ``--prompts`` prompts x ``--responses`` responses each (GRPO groups)."""
    import numpy as np
    import torch

    from megatron_psrl.integrations.verl import training_batch

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(args.prompts):
        prompt = rng.integers(1, vocab, args.prompt_tokens)
        for _ in range(args.responses):
            rows.append((prompt, rng.integers(1, vocab, args.response_tokens), np.ones(args.response_tokens)))
    b = len(rows)
    advantages = torch.from_numpy(rng.normal(size=(b, 1)).astype(np.float32))
    old = torch.from_numpy(rng.normal(-3.0, 0.3, size=(b, args.response_tokens)).astype(np.float32))
    return training_batch(rows, advantages, old, global_batch_size=b)


def stub_model(engine) -> None:
    """The engine's computation replaced by zeros of the right shapes (only the hand-off runs)."""
    import numpy as np

    from megatron_psrl.engine.engine import StepResult

    def compute_logprobs(batch, with_entropy=False):
        out = [np.zeros(int(n), np.float32) for n in batch.lengths]
        return (out, [x.copy() for x in out]) if with_entropy else out

    engine.actor.engine.compute_logprobs = compute_logprobs
    engine.actor.engine.forward_backward = lambda batch, loss, return_logprobs: StepResult(loss=0.0, metrics={})


def child(args) -> None:
    """One row: build the batch and the stubbed engine with the package at ``args.code``, time
    the calls, print them as JSON."""
    sys.path.insert(0, args.code)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    from functools import partial

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.config import HFModelConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    import megatron_psrl
    from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig
    from megatron_psrl.model import tiny_config

    assert megatron_psrl.__file__.startswith(os.path.abspath(args.code)), megatron_psrl.__file__
    hf_dir = tempfile.mkdtemp(prefix="bench-handoff-")
    config = dict(tiny_config("debug-llama"), max_position_embeddings=2 * (args.prompt_tokens + args.response_tokens))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(hf_dir)
    data = build_batch(args, config["vocab_size"])
    engine = EngineRegistry.new(
        "language_model", backend=BACKEND, model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
        engine_config=PsrlEngineConfig(dtype="float32", device="cpu"),
        optimizer_config=McoreOptimizerConfig(optimizer="sgd", lr=0.0, clip_grad=0.0), checkpoint_config=None)
    engine.initialize()
    stub_model(engine)
    verl_config = VerlActorConfig(strategy="megatron", rollout_n=args.responses, ppo_mini_batch_size=1,
                                  ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False)
    loss = partial(ppo_loss, verl_config)
    if args.path == "two-pass":  # any loss function other than ppo_loss itself
        loss = lambda **kw: ppo_loss(verl_config, **kw)  # noqa: E731

    def timed(forward_only: bool) -> float:
        times = []
        for _ in range(args.repeats):
            batch = data.clone()
            t0 = time.perf_counter()
            with engine.train_mode():
                engine.forward_backward_batch(batch, None if forward_only else loss, forward_only=forward_only)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    tokens = int(data["input_ids"].offsets()[-1])
    print(json.dumps(dict(tokens=tokens, infer_s=timed(True), train_s=timed(False))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=None, help="a directory with the older megatron_psrl package")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--response-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--code", default=REPO, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.path is not None:
        return child(args)
    runs = [("before", args.before, "two-pass")] if args.before else []
    runs += [("this checkout", REPO, "two-pass"), ("this checkout", REPO, "one-pass")]
    shape = ["--prompts", str(args.prompts), "--responses", str(args.responses), "--prompt-tokens",
             str(args.prompt_tokens), "--response-tokens", str(args.response_tokens), "--repeats", str(args.repeats)]
    rows = []
    for code_name, code, path in runs:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--code", os.path.abspath(code), "--path", path,
                              *shape], check=True, capture_output=True, text=True).stdout
        rows.append(dict(code=code_name, path=path, **json.loads(out.strip().splitlines()[-1])))
    print(f"verl hand-off, {args.prompts} prompts of {args.prompt_tokens} tokens x {args.responses} responses of "
          f"{args.response_tokens} ({rows[0]['tokens']} tokens), model computation stubbed")
    print("| code | path | s / infer_batch call | s / training call |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['code']} | {r['path']} | {r['infer_s']:.2f} | {r['train_s']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
