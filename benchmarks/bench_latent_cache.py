#!/usr/bin/env python
"""Latent attention (DeepSeek-V3): a shared prefix cached as the K/V latent against per-head K/V.

    python benchmarks/bench_latent_cache.py [--repeats 5] [--threads 1]

1. **Bytes a cached prefix keeps** per token (``PrefixState.nbytes``: values, and values plus
   their fp32 gradient slots; and what a reader's graph keeps of every token it reads,
   ``PrefixState.reader_nbytes``), one layer and all layers, for ``debug-deepseek-v3`` in fp32
   and ``deepseek-v3-class`` in bf16 (TP 1 and 8), both ways (``--latent-cache``).
2. **The update step** of ``debug-deepseek-v3`` (random weights, fp32, CPU, one rank) with
   mechanism 2 on workloads with long shared prefixes (a GRPO group on a long prompt, a
   step-wise chain), micro-batches smaller than the trees so that the prefixes are cached and
   read: both ways, interleaved, median of ``--repeats`` (after one warm-up each), and the
   cached tokens the readers read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import torch  # noqa: E402

from megatron_psrl.checkpoint import ModelSource, load_model  # noqa: E402
from megatron_psrl.data.synthetic import make_grpo, make_stepwise  # noqa: E402
from megatron_psrl.distributed.setup import initialize_parallel  # noqa: E402
from megatron_psrl.engine.step import StepRunner  # noqa: E402
from megatron_psrl.kvcache import BlockKVCache, KVGeometry  # noqa: E402
from megatron_psrl.kvcache.prefix_state import VALUES_ONLY  # noqa: E402
from megatron_psrl.model.architecture import ModelArchitecture  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402
from megatron_psrl.rl.loss import LossConfig  # noqa: E402
from megatron_psrl.schedule.config import PlannerConfig  # noqa: E402
from megatron_psrl.schedule.cost import CostModel  # noqa: E402
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory  # noqa: E402
from megatron_psrl.schedule.planner import plan_step  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402

CACHES = ("latent", "per-head")
WORKLOADS = {  # long shared prefixes: every response reads its prompt, every turn its history
    "GRPO 8 x 32 on a 512-token prompt": lambda: make_grpo(num_prompts=1, group_size=8, prompt_len=(512, 512),
                                                           response_len=(32, 32), vocab_size=256, seed=0,
                                                           with_logprobs=True),
    "step-wise chain, 8 turns (~600 tokens)": lambda: make_stepwise(
        num_trajectories=1, turns=8, obs_len=(40, 60), action_len=(10, 20), system_len=100, task_len=(20, 30),
        vocab_size=256, seed=0, with_logprobs=True),
}


def bytes_rows() -> None:
    print("| model | dtype | TP | cache | values B/token/layer | values + grads | reader keeps | "
          "values, all layers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, dtype, tps in (("debug-deepseek-v3", torch.float32, (1,)),
                             ("deepseek-v3-class", torch.bfloat16, (1, 8))):
        base = ModelArchitecture.from_hf_config(tiny_config(name))
        for tp in tps:
            for cache in CACHES:
                arch = dataclasses.replace(base, latent_cache=cache)
                state = KVGeometry.for_model(arch, tp, 1, dtype, torch.device("meta")).layer_states[0]
                print(f"| {name} | {str(dtype)[6:]} | {tp} | {cache} | {state.nbytes(1, VALUES_ONLY):,} | "
                      f"{state.nbytes(1):,} | {state.reader_nbytes(1):,} | "
                      f"{arch.num_layers * state.nbytes(1, VALUES_ONLY):,} |")


def step_seconds(arch, model, batch, micro_batch_tokens: int):
    """One update step with mechanism 2 (every prefix graph kept: the budget is ample)."""
    plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=micro_batch_tokens,
                                                             cost_model=CostModel.for_architecture(arch)))
    rank = plan.ranks[0]
    geometry = KVGeometry.for_model(arch, 1, 1, torch.float32, torch.device("cpu"))
    memory = plan_memory(rank, geometry, 1 << 34, activation_bytes_per_token(arch, 1, 4))
    runner = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=BlockKVCache(geometry, 1 << 34))
    loss_cfg = LossConfig(clip_eps=0.2, kl_coef=0.0, entropy_coef=0.0, loss_agg="seq-mean-token-mean")
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    runner.train(plan, 0, loss_cfg, memory)
    seconds = time.perf_counter() - start
    read = sum(rank.sources[s].length for mb in rank.micro_batches for s in mb.reads)
    return seconds, read, len(rank.micro_batches)


def step_rows(repeats: int, micro_batch_tokens: int) -> None:
    initialize_parallel(1, 1, seed=0, device="cpu")
    base, model, _ = load_model(ModelSource(tiny="debug-deepseek-v3"), dtype=torch.float32)
    print(f"\n| workload | cache | micro-batches | cached tokens read | step ms (median of {repeats}) |")
    print("|---|---|---|---|---|")
    for wname, make in WORKLOADS.items():
        batch = make()
        archs = {c: dataclasses.replace(base, latent_cache=c) for c in CACHES}
        times = {c: [] for c in CACHES}
        info = {}
        for c in CACHES:  # warm-up
            info[c] = step_seconds(archs[c], model, batch, micro_batch_tokens)[1:]
        for _ in range(repeats):  # interleaved
            for c in CACHES:
                times[c].append(step_seconds(archs[c], model, batch, micro_batch_tokens)[0])
        for c in CACHES:
            read, mbs = info[c]
            print(f"| {wname} | {c} | {mbs} | {read} | {1000 * statistics.median(times[c]):.1f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=128)
    p.add_argument("--bytes-only", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bytes_rows()
    if not args.bytes_only:
        step_rows(args.repeats, args.micro_batch_tokens)


if __name__ == "__main__":
    main()
