#!/usr/bin/env python
"""Update-step speed and memory: prefix sharing vs no sharing vs a dense tree mask, side by side.

    python benchmarks/bench_update_step.py [--model tiny-llama] [--repeats 3] [--out-dir runs/bench_update_step]

For every workload it builds one global batch and measures, in the same process and with the
same model and kernels, one full update step (tree build + planning + forward + backward of
every micro-batch; the optimizer update is identical for all and left out):

- ``shared``: prefix sharing (mechanism 1 tree packing; blockwise tree attention);
- ``baseline``: ``--no-prefix-sharing``: samples packed back to back, every prefix recomputed;
- ``dense``: prefix sharing with one dense boolean tree mask over the pack (SDPA), the usual
  way tree packing is done;
- ``per-sample``: no sharing, every sample its own micro-batch (how published prefix-sharing
  figures define their speedups);

and reports the median step time over ``--repeats`` interleaved runs, the ideal speedup
(FLOPs ratio for this model and batch, docs/prefix-tree.md), efficiency = measured speedup / ideal, and the
measured peak memory of the step (heap bytes in use above the step's start, sampled after
every torch operation in a separate, untimed run; CUDA: the allocator's peak).
Results go to ``bench_update_step.json`` and ``bench_update_step.md`` in ``--out-dir``.

``--peers`` adds the distance to the best alternative: for the workloads both benchmarks have
(``grpo-2048x8x128``, ``grpo-512x8x512``, ``stepwise-8x256``), the same invocation then runs
``benchmarks/bench_peers.py`` (its own model, the project's step beside the other
prefix-sharing trainers that are installed, gradients checked) and adds the best peer's step
time and ``psrl / best peer`` from that measurement.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import torch  # noqa: E402
from exact_workloads import grpo_exact, stepwise_exact  # noqa: E402
from step_bench import Bench, write_results  # noqa: E402

from megatron_psrl.data import make_grpo, make_mixed, make_stepwise, make_tree_rollouts  # noqa: E402
from megatron_psrl.data.samples import SampleBatch  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402


# ---------------------------------------------------------------------- workloads
def workloads(vocab: int) -> Dict[str, Callable[[], SampleBatch]]:
    return {
        "grpo": lambda: make_grpo(num_prompts=2, group_size=8, prompt_len=(512, 1536), response_len=(64, 384),
                                  vocab_size=vocab, seed=1),
        "stepwise": lambda: make_stepwise(num_trajectories=1, turns=(10, 14), obs_len=(60, 400), action_len=(10, 60),
                                          system_len=200, task_len=(100, 200), vocab_size=vocab, seed=1),
        "tree": lambda: make_tree_rollouts(num_roots=2, vocab_size=vocab, seed=1),
        "mixed": lambda: make_mixed(vocab_size=vocab, seed=1),
        # The shapes other prefix-sharing trainers were measured on (docs/benchmarks.md).
        "grpo-2048x8x128": lambda: grpo_exact(2048, 8, 128, vocab),
        "grpo-512x8x512": lambda: grpo_exact(512, 8, 512, vocab),
        "stepwise-8x256": lambda: stepwise_exact(8, 256, 64, vocab),
    }


# ---------------------------------------------------------------------- measurement
def run(args) -> List[dict]:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    bench = Bench(args.model, args.micro_batch_tokens, device)
    variants = ["shared", "baseline", "dense", "per-sample"]
    rows = []
    for name, make in workloads(bench.arch.vocab_size).items():
        if args.workloads and name not in args.workloads:
            continue
        batch = make()
        tree = build_prefix_tree(batch)
        ideal = bench.cost.ideal_speedup(tree)
        results: Dict[str, List[dict]] = {v: [] for v in variants}
        peak = {v: bench.step(batch, v, measure_memory=True)["peak_bytes"] for v in variants}  # also warms up
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for v in variants:
                results[v].append(bench.step(batch, v))
        med = {v: statistics.median(r["seconds"] for r in results[v]) for v in variants}
        losses = {v: results[v][0]["loss"] for v in variants}
        speedup = med["baseline"] / med["shared"]
        row = {
            "workload": name, "samples": batch.num_samples, "tokens": batch.num_tokens,
            "tree_tokens": tree.num_tree_tokens, "ideal_speedup": ideal,
            "step_s_shared": med["shared"], "step_s_baseline": med["baseline"], "step_s_dense": med["dense"],
            "step_s_per_sample": med["per-sample"], "speedup_vs_per_sample": med["per-sample"] / med["shared"],
            "speedup": speedup, "speedup_dense": med["baseline"] / med["dense"], "efficiency": speedup / ideal,
            "peak_mb_shared": peak["shared"] / 2**20, "peak_mb_baseline": peak["baseline"] / 2**20,
            "peak_mb_dense": peak["dense"] / 2**20,
            "loss_rel_diff": abs(losses["shared"] - losses["baseline"]) / max(abs(losses["baseline"]), 1e-12),
            "micro_batches_shared": results["shared"][0]["micro_batches"],
            "micro_batches_baseline": results["baseline"][0]["micro_batches"],
        }
        rows.append(row)
        print(f"{name:>16}: ideal {ideal:5.2f}x  shared {med['shared']:.3f}s  baseline {med['baseline']:.3f}s  "
              f"dense {med['dense']:.3f}s  per-sample {med['per-sample']:.3f}s  speedup {speedup:5.2f}x  "
              f"efficiency {speedup / ideal:4.2f}  vs per-sample {med['per-sample'] / med['shared']:5.2f}x  "
              f"peak MB shared/baseline/dense {peak['shared'] / 2**20:.0f}/{peak['baseline'] / 2**20:.0f}/"
              f"{peak['dense'] / 2**20:.0f}", flush=True)
    return rows


def add_best_peers(rows: List[dict], repeats: int) -> None:
    """``--peers``: run bench_peers on the shared workloads and add its best-peer columns."""
    import bench_peers

    shared = [r["workload"] for r in rows if r["workload"] in bench_peers.workloads(2048)]
    if not shared:
        return
    out = bench_peers.main_result(["--workloads", ",".join(shared), "--repeats", str(repeats), "--profile", "none",
                                   "--out-dir", "runs/bench_update_step_peers"])
    by_name = {s["workload"]: s for s in out["workloads"]}
    for r in rows:
        s = by_name.get(r["workload"])
        if s and s["best_peer"]:
            best = next(x for x in s["rows"] if x["contender"] == s["best_peer"])
            r.update(best_peer=s["best_peer"], best_peer_s=best["median_s"], psrl_over_best_peer=s["psrl_over_best_peer"])


def markdown(rows: List[dict], meta: dict) -> str:
    lines = [
        f"Model `{meta['model']}` ({meta['device']}, fp32, {meta['threads']} threads), micro-batch budget "
        f"{meta['micro_batch_tokens']} tokens, median of {meta['repeats']} interleaved steps "
        "(tree build + planning + forward + backward).",
        "",
        "| workload | samples | tokens | tree tokens | ideal | shared s | baseline s | dense-mask s | speedup | "
        "efficiency | dense-mask speedup | speedup vs per-sample | peak MB shared / baseline / dense | "
        "best peer (bench_peers) | psrl / best peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['samples']} | {r['tokens']} | {r['tree_tokens']} | {r['ideal_speedup']:.2f}x | "
            f"{r['step_s_shared']:.3f} | {r['step_s_baseline']:.3f} | {r['step_s_dense']:.3f} | {r['speedup']:.2f}x | "
            f"{r['efficiency']:.2f} | {r['speedup_dense']:.2f}x | {r['speedup_vs_per_sample']:.2f}x | "
            f"{r['peak_mb_shared']:.0f} / {r['peak_mb_baseline']:.0f}"
            f" / {r['peak_mb_dense']:.0f} | "
            + (f"{r['best_peer']} {r['best_peer_s']:.3f} s | {r['psrl_over_best_peer']:.2f} |" if r.get("best_peer")
               else "- | - |"))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--micro-batch-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", nargs="*", default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out-dir", default="runs/bench_update_step")
    p.add_argument("--peers", action="store_true",
                   help="also run bench_peers on the shared workloads: best peer and psrl / best peer columns")
    args = p.parse_args()
    rows = run(args)
    if args.peers:
        add_best_peers(rows, max(args.repeats, 3))
    meta = {"model": args.model, "device": args.device, "threads": torch.get_num_threads(),
            "micro_batch_tokens": args.micro_batch_tokens, "repeats": args.repeats,
            "torch": torch.__version__, "platform": platform.platform()}
    md = markdown(rows, meta)
    write_results(args.out_dir, "bench_update_step", {"meta": meta, "rows": rows}, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
