#!/usr/bin/env python
"""Update-step speed and memory of a mixture-of-experts model: prefix sharing vs no sharing vs
the ideal, side by side on the four synthetic workloads.

    python benchmarks/bench_moe.py [--model tiny-qwen3-moe] [--repeats 3] [--out-dir runs/bench_moe]

The update step of ``bench_update_step.py`` (tree build + planning + forward + backward of every
micro-batch, no optimizer update; ``step_bench.Bench``) on a Qwen3-MoE model with random
weights, for the workloads ``grpo``, ``stepwise``, ``tree`` and ``mixed`` of that benchmark:

- ``shared``: prefix sharing (tree packing, cached prefixes across micro-batches);
- ``baseline``: ``--no-prefix-sharing`` (samples packed back to back, every prefix recomputed);

the median step time over ``--repeats`` interleaved runs, the ideal speedup (the FLOP ratio of
the engine's cost model, which counts the top-k experts and the router per token), efficiency
= measured speedup / ideal, the measured peak memory of each (a separate untimed run, heap
bytes above the step's start after every torch operation), the loss of both (prefix sharing is
exact) and the expert load of the shared step (the busiest expert's tokens over the mean, the
most uneven layer: the routers of a randomly initialised model are not trained to balance).

Models: ``debug-qwen3-moe`` (``megatron_psrl.model.tiny``: h64, 2 layers, 8 experts of 32,
top-2) or ``tiny-qwen3-moe`` (defined here: tiny-llama's attention, h256, 4 layers, 4/2 heads of
64, with 8 experts of 128, top-2: an MLP as wide per token as tiny-llama's 512 counting the
routed copies' SwiGLU, 2 x 128 x 2, and with the router's).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import torch  # noqa: E402
from bench_update_step import workloads  # noqa: E402
from step_bench import Bench, write_results  # noqa: E402

from megatron_psrl.model.moe import ExpertLoad, expert_load_summary  # noqa: E402
from megatron_psrl.model.tiny import MOE_CONFIGS, tiny_config  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402

WORKLOADS = ("grpo", "stepwise", "tree", "mixed")
"""The four synthetic workloads of bench_update_step.py (same seeds, same batches)."""

BENCH_CONFIGS = {
    "tiny-qwen3-moe": dict(tiny_config("debug-qwen3-moe"), vocab_size=1024, hidden_size=256, intermediate_size=512,
                           moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64),
}
"""MoE configs of this benchmark only (random weights), besides ``MOE_CONFIGS``."""


def _register(name: str) -> None:
    """A benchmark-only config becomes a named tiny config of this process."""
    if name in BENCH_CONFIGS:
        MOE_CONFIGS.setdefault(name, BENCH_CONFIGS[name])
    elif name not in MOE_CONFIGS:
        raise SystemExit(f"--model must be one of {sorted(MOE_CONFIGS) + sorted(BENCH_CONFIGS)}, got {name!r}")


def run(args) -> List[dict]:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    _register(args.model)
    bench = Bench(args.model, args.micro_batch_tokens, device)
    rows = []
    for name, make in workloads(bench.arch.vocab_size).items():
        if name not in args.workloads:
            continue
        batch = make()
        tree = build_prefix_tree(batch)
        ideal = bench.cost.ideal_speedup(tree)
        peak = {v: bench.step(batch, v, measure_memory=True)["peak_bytes"] for v in ("shared", "baseline")}  # warm-up
        with ExpertLoad(bench.model) as load:
            first = {v: bench.step(batch, v) for v in ("shared",)}
        ratios = [m / a for m, a in expert_load_summary(load.counts())]
        results = {v: [] for v in ("shared", "baseline")}
        results["shared"].append(first["shared"])
        results["baseline"].append(bench.step(batch, "baseline"))
        for _ in range(args.repeats - 1):  # interleaved, so drift hits both alike
            for v in ("shared", "baseline"):
                results[v].append(bench.step(batch, v))
        med = {v: statistics.median(r["seconds"] for r in results[v]) for v in results}
        loss = {v: results[v][0]["loss"] for v in results}
        speedup = med["baseline"] / med["shared"]
        row = {
            "workload": name, "samples": batch.num_samples, "tokens": batch.num_tokens,
            "tree_tokens": tree.num_tree_tokens, "ideal_speedup": ideal,
            "step_s_shared": med["shared"], "step_s_baseline": med["baseline"], "speedup": speedup,
            "runs_s_shared": [r["seconds"] for r in results["shared"]],
            "runs_s_baseline": [r["seconds"] for r in results["baseline"]],
            "efficiency": speedup / ideal, "peak_mb_shared": peak["shared"] / 2**20,
            "peak_mb_baseline": peak["baseline"] / 2**20,
            "loss_rel_diff": abs(loss["shared"] - loss["baseline"]) / max(abs(loss["baseline"]), 1e-12),
            "micro_batches_shared": results["shared"][0]["micro_batches"],
            "micro_batches_baseline": results["baseline"][0]["micro_batches"],
            "expert_load_max_over_mean": max(ratios),
        }
        rows.append(row)
        print(f"{name:>9}: ideal {ideal:5.2f}x  shared {med['shared']:.3f}s  baseline {med['baseline']:.3f}s  "
              f"speedup {speedup:5.2f}x  efficiency {speedup / ideal:4.2f}  peak MB shared/baseline "
              f"{row['peak_mb_shared']:.0f}/{row['peak_mb_baseline']:.0f}  loss rel diff {row['loss_rel_diff']:.1e}  "
              f"expert load max/mean {max(ratios):.2f}", flush=True)
    return rows


def markdown(rows: List[dict], meta: dict) -> str:
    a = meta["arch"]
    lines = [
        f"Model `{meta['model']}` ({a['model_type']} h{a['hidden_size']} L{a['num_layers']}, {a['num_experts']} "
        f"experts of {a['moe_ffn_hidden_size']}, top {a['moe_router_topk']}; {meta['device']}, fp32, "
        f"{meta['threads']} threads), micro-batch budget {meta['micro_batch_tokens']} tokens, median of "
        f"{meta['repeats']} interleaved steps (tree build + planning + forward + backward).",
        "",
        "| workload | samples | tokens | tree tokens | ideal | shared s | baseline s | speedup | efficiency | "
        "peak MB shared / baseline | loss rel. diff | expert load max/mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['samples']} | {r['tokens']} | {r['tree_tokens']} | {r['ideal_speedup']:.2f}x | "
            f"{r['step_s_shared']:.3f} | {r['step_s_baseline']:.3f} | {r['speedup']:.2f}x | {r['efficiency']:.2f} | "
            f"{r['peak_mb_shared']:.0f} / {r['peak_mb_baseline']:.0f} | {r['loss_rel_diff']:.1e} | "
            f"{r['expert_load_max_over_mean']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-moe", help=f"one of {sorted(MOE_CONFIGS) + sorted(BENCH_CONFIGS)}")
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out-dir", default="runs/bench_moe")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    rows = run(args)
    arch = tiny_config(args.model)
    meta = {"model": args.model, "device": args.device, "threads": torch.get_num_threads(),
            "micro_batch_tokens": args.micro_batch_tokens, "repeats": args.repeats, "torch": torch.__version__,
            "platform": platform.platform(), "load_average": os.getloadavg()[0],
            "arch": {"model_type": arch["model_type"], "hidden_size": arch["hidden_size"],
                     "num_layers": arch["num_hidden_layers"], "num_experts": arch["num_experts"],
                     "moe_ffn_hidden_size": arch["moe_intermediate_size"],
                     "moe_router_topk": arch["num_experts_per_tok"]}}
    md = markdown(rows, meta)
    write_results(args.out_dir, "bench_moe", {"meta": meta, "rows": rows}, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
