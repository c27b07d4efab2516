#!/usr/bin/env python
"""Throughput and peak memory of the global prefix tree construction.

    python benchmarks/bench_tree_build.py --out runs/bench_tree_build.json

For every workload (GRPO, step-wise, tree rollouts, mixed) and size (1M and 10M tokens by
default) it generates the batch (not timed), then times ``build_prefix_tree``:

- ``first``: the first build of that batch in the process (includes the OS mapping fresh
  memory pages for the output and temporaries, which later builds partly reuse);
- ``median``: the median of ``--repeats`` further builds (steady state, as in a training loop
  that builds one tree per step);
- ``peak_bytes``: the peak of memory allocated during one build (tracemalloc, which also
  tracks numpy buffers), i.e. output plus temporaries; reported per input token as well.

Everything runs on one core (numpy's sorting, gathers and cumsums are single-threaded).
Shapes are the realistic ones of the synthetic generators (SWE-agent-like step-wise turns,
GRPO groups of 8, rollout trees of depth 3), not the small defaults of make_workload.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_psrl.data.samples import SampleBatch  # noqa: E402
from megatron_psrl.data.synthetic import (  # noqa: E402
    make_grpo,
    make_mixed,
    make_stepwise,
    make_tree_rollouts,
)
from megatron_psrl.tree import build_prefix_tree, tree_stats  # noqa: E402

VOCAB_SIZE = 128_256  # a Llama-3 vocabulary: realistic token-id spread

GRPO_SHAPE = dict(group_size=8, prompt_len=(128, 2048), response_len=(64, 1024))
STEPWISE_SHAPE = dict(turns=(16, 64), obs_len=(100, 3000), action_len=(10, 100), system_len=1000,
                      task_len=(200, 1000))
TREE_SHAPE = dict(branching=(2, 3), depth=3, segment_len=(16, 256), prompt_len=(256, 2048),
                  obs_len=(32, 1024))

WORKLOADS: Dict[str, Callable[[int, int], SampleBatch]] = {
    "grpo": lambda tokens, seed: make_grpo(num_tokens_target=tokens, vocab_size=VOCAB_SIZE,
                                           seed=seed, **GRPO_SHAPE),
    "stepwise": lambda tokens, seed: make_stepwise(num_tokens_target=tokens,
                                                   vocab_size=VOCAB_SIZE, seed=seed,
                                                   **STEPWISE_SHAPE),
    "tree": lambda tokens, seed: make_tree_rollouts(num_tokens_target=tokens,
                                                    vocab_size=VOCAB_SIZE, seed=seed,
                                                    **TREE_SHAPE),
    "mixed": lambda tokens, seed: make_mixed(
        grpo=dict(num_prompts=1, **GRPO_SHAPE),
        stepwise=dict(num_trajectories=1, **{k: v for k, v in STEPWISE_SHAPE.items()
                                             if k != "system_len"}),
        tree=dict(num_roots=1, **TREE_SHAPE),
        system_len=500, num_tokens_target=tokens, vocab_size=VOCAB_SIZE, seed=seed),
}


def measure(batch: SampleBatch, repeats: int) -> dict:
    start = time.perf_counter()
    tree = build_prefix_tree(batch)
    first = time.perf_counter() - start
    del tree
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tree = build_prefix_tree(batch)
        times.append(time.perf_counter() - start)
        del tree
    tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    tree = build_prefix_tree(batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stats = tree_stats(tree)
    median = statistics.median(times)
    return {
        "num_tokens": batch.num_tokens,
        "num_samples": batch.num_samples,
        "tokens_in_tree": stats.tokens_in_tree,
        "num_nodes": stats.num_nodes,
        "num_claims": stats.num_claims,
        "token_dedup_ratio": stats.token_dedup_ratio,
        "first_s": first,
        "median_s": median,
        "times_s": times,
        "first_tokens_per_s": batch.num_tokens / first,
        "median_tokens_per_s": batch.num_tokens / median,
        "peak_bytes": peak - base,
        "peak_bytes_per_token": (peak - base) / batch.num_tokens,
    }


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,10000000",
                        help="comma-separated token counts (default 1M,10M)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    results = []
    header = (f"{'workload':9s} {'tokens':>10s} {'samples':>8s} {'dedup':>6s} "
              f"{'first Mtok/s':>13s} {'median Mtok/s':>14s} {'peak MB':>8s} {'B/token':>8s}")
    print(header)
    print("-" * len(header))
    for name in args.workloads.split(","):
        for size in sizes:
            batch = WORKLOADS[name](size, args.seed)
            row = {"workload": name, "target_tokens": size, **measure(batch, args.repeats)}
            results.append(row)
            print(f"{name:9s} {row['num_tokens']:>10d} {row['num_samples']:>8d} "
                  f"{row['token_dedup_ratio']:>6.2f} {row['first_tokens_per_s'] / 1e6:>13.1f} "
                  f"{row['median_tokens_per_s'] / 1e6:>14.1f} {row['peak_bytes'] / 2**20:>8.0f} "
                  f"{row['peak_bytes_per_token']:>8.1f}", flush=True)
            del batch
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        payload = {
            "benchmark": "bench_tree_build",
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "repeats": args.repeats,
            "results": results,
        }
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
