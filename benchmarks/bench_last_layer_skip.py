#!/usr/bin/env python
"""The last layer only for the rows whose log-prob is trained: step time with the skip on and off
(issue 23, item 3).

    python benchmarks/bench_last_layer_skip.py [--model tiny-llama] [--repeats 9] [--workloads grpo,stepwise]
                                               [--threads N]
    python benchmarks/bench_last_layer_skip.py --quick      # small batches, 3 repeats (a smoke run)

One ``PolicyActor`` (fp32, CPU unless ``--device``), one batch per workload, built so that about
a quarter of the rows carry a training claim:

- ``grpo``: GRPO groups with a long prompt (prompt ~3x the group's response tokens; the
  responses are trained);
- ``stepwise``: step-wise trajectories (every turn a sample, only its last action trained),
  observations ~3x as long as actions.

Timed: ``forward_backward`` of the whole batch (tree build, plan, pack, forward, loss head,
backward; no optimizer step) at the default micro-batch budget (4096 tokens). Per round the two
variants run back to back, their order alternating from round to round, so load from other
processes hits them alike. Printed per workload and variant: the median, min-max and IQR of
the rounds (wall clock, and process CPU time); the saving ``1 - skip / full`` of the medians, of
the fastest rounds (the least disturbed by other load) and of the median per-round ratio (with
its IQR); and the rows that reach the last layer's MLP per step (the skip's effect, counted by
a forward hook). The two variants' loss and log-probs are checked
equal first (fp32 rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_psrl import ActorConfig, PolicyActor  # noqa: E402
from megatron_psrl.data.samples import SampleBatch  # noqa: E402
from megatron_psrl.data.synthetic import make_grpo, make_stepwise  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402


def workloads(vocab: int, quick: bool) -> Dict[str, SampleBatch]:
    """About a quarter of the rows trained in each."""
    if quick:
        return {"grpo": make_grpo(num_prompts=1, group_size=4, prompt_len=(190, 194), response_len=(15, 17),
                                  vocab_size=vocab, with_logprobs=True),
                "stepwise": make_stepwise(num_trajectories=1, turns=(4, 4), obs_len=(40, 60), action_len=(15, 20),
                                          system_len=40, task_len=(30, 40), vocab_size=vocab, with_logprobs=True)}
    return {"grpo": make_grpo(num_prompts=2, group_size=8, prompt_len=(1500, 1572), response_len=(56, 72),
                              vocab_size=vocab, with_logprobs=True),
            "stepwise": make_stepwise(num_trajectories=2, turns=(8, 8), obs_len=(130, 170), action_len=(40, 60),
                                      system_len=200, task_len=(80, 120), vocab_size=vocab, with_logprobs=True)}


def _quartiles(xs: List[float]):
    q = np.percentile(xs, [25, 50, 75])
    return float(q[0]), float(q[1]), float(q[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="a tiny config name (random weights)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=9, help="timed rounds per workload (each runs both variants)")
    p.add_argument("--workloads", default="grpo,stepwise")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="small batches, 3 repeats")
    args = p.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)

    vocab = tiny_config(args.model)["vocab_size"]
    actor = PolicyActor(args.model, ActorConfig(device=args.device))
    runner = actor.runner
    last_mlp = actor.model.decoder.layers[-1].mlp
    rows: List[int] = []
    last_mlp.register_forward_hook(lambda mod, inp, out: rows.append(int(inp[0].shape[0])))
    sync = (lambda: torch.cuda.synchronize()) if args.device == "cuda" else (lambda: None)
    print(f"model {args.model} ({actor.arch.num_layers} layers, h{actor.arch.hidden_size}), device {args.device}, "
          f"torch threads {torch.get_num_threads()}, {repeats} rounds per workload")

    def step(batch: SampleBatch, skip: bool):
        runner.last_layer_row_skip = skip
        actor.engine.zero_grad()
        sync()
        w0, c0 = time.perf_counter(), time.process_time()
        result = actor.forward_backward(batch)
        sync()
        return result, time.perf_counter() - w0, time.process_time() - c0

    names = [w for w in args.workloads.split(",") if w]
    batches = workloads(vocab, args.quick)
    for name in names:
        batch = batches[name]
        trained = int(batch.loss_mask.sum())
        # warm-up, and the two variants agree (fp32 rounding)
        rows.clear()
        on, _, _ = step(batch, True)
        rows_on = sum(rows)
        rows.clear()
        off, _, _ = step(batch, False)
        rows_off = sum(rows)
        np.testing.assert_allclose(np.concatenate(on.logprobs), np.concatenate(off.logprobs), rtol=0, atol=1e-5)
        assert abs(on.loss - off.loss) <= 1e-5 * max(1.0, abs(off.loss)), (on.loss, off.loss)
        wall: Dict[bool, List[float]] = {True: [], False: []}
        cpu: Dict[bool, List[float]] = {True: [], False: []}
        for r in range(repeats):
            for skip in ((True, False) if r % 2 == 0 else (False, True)):
                _, w, c = step(batch, skip)
                wall[skip].append(w)
                cpu[skip].append(c)
        print(f"\n{name}: {batch.num_samples} samples, {batch.num_tokens} tokens, tokens computed "
              f"{on.metrics['tokens_computed']}, micro-batches {on.metrics['micro_batches']}, trained tokens "
              f"{trained}; rows into the last layer's MLP per step: {rows_on} (skip) vs {rows_off} (full), "
              f"{rows_on / max(rows_off, 1):.0%}")
        print(f"  {'variant':<8} {'wall median':>12} {'min-max':>17} {'IQR':>17} {'cpu median':>11}")
        for skip in (False, True):
            q1, med, q3 = _quartiles(wall[skip])
            print(f"  {'skip' if skip else 'full':<8} {med * 1e3:>10.1f}ms {min(wall[skip]) * 1e3:>7.1f}-"
                  f"{max(wall[skip]) * 1e3:<7.1f}ms {q1 * 1e3:>7.1f}-{q3 * 1e3:<7.1f}ms "
                  f"{statistics.median(cpu[skip]) * 1e3:>9.1f}ms")
        ratios = [a / b for a, b in zip(wall[True], wall[False])]
        r1, rmed, r3 = _quartiles(ratios)
        saving = 1 - statistics.median(wall[True]) / statistics.median(wall[False])
        print(f"  saving of the step: {saving:+.1%} (medians), {1 - min(wall[True]) / min(wall[False]):+.1%} (fastest "
              f"rounds), {1 - rmed:+.1%} (median per-round ratio skip/full {rmed:.3f}, IQR {r1:.3f}-{r3:.3f}); "
              f"cpu {1 - statistics.median(cpu[True]) / statistics.median(cpu[False]):+.1%} (medians)")
    actor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
