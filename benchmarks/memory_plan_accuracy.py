#!/usr/bin/env python
"""The memory plan's step peak against the measured one (issue 46), on bench_peers' model and
workloads, at several micro-batch budgets, the KV budget at its floor and with megatron's full
recomputation.

    python benchmarks/memory_plan_accuracy.py [--workloads grpo-512x8x512,stepwise-8x256,tree,mixed]
                                              [--out runs/memory_plan_accuracy.md]

Per workload and setting: one warm-up step, then one step under ``PeakMemory`` (``ops`` mode:
the C heap's bytes in use after every torch operation, above the step's start) beside
``Engine.predicted_step_peak`` of the same step. Memory, not time: a loaded machine changes
nothing here. One thread (a busy machine's thread pool spins otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import bench_peers  # noqa: E402
import memory_curve  # noqa: E402
import torch  # noqa: E402

from megatron_psrl.engine.memory import PeakMemory  # noqa: E402

SETTINGS = {
    "default": {}, "mb2048": dict(micro_batch_tokens=2048), "mb1024": dict(micro_batch_tokens=1024),
    "mb512": dict(micro_batch_tokens=512), "kv-floor": dict(kv_cache_budget="floor"),
    "mb1024-kv-floor": dict(micro_batch_tokens=1024, kv_cache_budget="floor"),
    "recompute": dict(recompute=True), "mb1024-recompute": dict(micro_batch_tokens=1024, recompute=True),
}


def measure(bench, batch, overrides: dict) -> dict:
    """One setting: the measured peak (after a warm-up step) and the plan's prediction."""
    overrides = dict(overrides)
    recompute = overrides.pop("recompute", False)
    if overrides.get("kv_cache_budget") == "floor":
        bench.configure(**{k: v for k, v in overrides.items() if k != "kv_cache_budget"})
        try:
            overrides["kv_cache_budget"] = max(1, memory_curve.kv_floor(bench, batch))
        finally:
            bench.configure()
    with memory_curve.recomputing(bench) if recompute else contextlib.nullcontext():
        bench.actor.zero_grad()
        bench.forward_backward(batch, **overrides)  # warm-up
        bench.actor.zero_grad()
        bench.actor.kv_cache.release_pool()
        bench.configure(**overrides)
        try:
            _, plan, memory, _ = bench.engine.plan(batch)
            predicted = bench.engine.predicted_step_peak(plan, memory)
        finally:
            bench.configure()
        with PeakMemory(torch.device("cpu"), mode="ops") as mem:
            bench.forward_backward(batch, **overrides)
    bench.actor.zero_grad()
    return {"measured": mem.peak_bytes - mem.start_bytes, "predicted": predicted,
            "micro_batches": len(plan.ranks[0].micro_batches)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(bench_peers.DEFAULT_WORKLOADS))
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args()
    torch.set_num_threads(1)
    hf_config = dict(bench_peers.PEER_MODEL)
    bench = bench_peers.PeerBench(hf_config, bench_peers.random_weights(hf_config, 0), bench_peers.DEFAULT_BUDGET,
                                  torch.device("cpu"))
    workloads = bench_peers.workloads(bench.arch.vocab_size)
    lines = ["| workload | setting | micro-batches | measured MB | plan MB | plan / measured |", "|---|---|---|---|---|---|"]
    for name in args.workloads.split(","):
        batch = workloads[name]()
        for setting, overrides in SETTINGS.items():
            r = measure(bench, batch, overrides)
            lines.append(f"| {name} | {setting} | {r['micro_batches']} | {r['measured'] / 2**20:.1f} | "
                         f"{r['predicted'] / 2**20:.1f} | {r['predicted'] / r['measured']:.3f} |")
            print(lines[-1], flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
