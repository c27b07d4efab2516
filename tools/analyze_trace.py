#!/usr/bin/env python
"""Prefix-sharing statistics of a trace and the ideal speedup for a model size.

    python tools/analyze_trace.py --data trace.parquet --model llama3-8b \\
        --out-json runs/summary.json --plots-dir runs/plots

Reads (and validates) the trace, builds its global prefix tree, prints the statistics of
megatron_psrl.tree.stats.TreeStats and the ideal speedup (docs/prefix-tree.md) for --model and
for every other known model size (the mixture-of-experts ones, ``qwen3-30b-a3b`` and
``qwen3-235b-a22b``, count the FLOPs of the experts a token is routed to), and writes:

- ``--out-json``: the statistics, the per-sample redundancy summary, the ideal speedup per
  model and the context-length curve below;
- ``--plots-dir``: PNG plots (matplotlib, Agg):
  ``redundancy.png``: histogram of each sample's shared fraction (tokens in nodes shared with
  another sample; that part is what sharing saves);
  ``depth_branching.png``: histograms of node start positions (tokens), node levels (nodes
  above) and children per inner node;
  ``speedup_vs_context.png``: ideal speedup and token dedup ratio when every sample is cut to
  its first L tokens, for L = 32, 64, ... up to the longest sample. It shows how the benefit
  grows with context: attention (quadratic) dominates longer contexts, and deep step-wise
  histories only share once they are long.

With ``--ranks N`` it also plans the batch over N ranks without running a model and prints,
side by side, whole-tree placement (every tree on one rank) and cross-rank placement (equal-cost
fragments of the trees over the ranks, prefix K/V exchanged): the imbalance (max / mean rank
cost), the makespan against perfect balance, and the bytes exchanged per step (K/V of --model
in bf16); ``placement.png`` plots every rank's cost under both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.cli import HelpFormatter, call_cli  # noqa: E402
from megatron_psrl.data.loader import load_samples  # noqa: E402
from megatron_psrl.data.samples import SampleBatch  # noqa: E402
from megatron_psrl.engine.engine import cost_model_for  # noqa: E402
from megatron_psrl.schedule.cost import NAMED_MODEL_DIMS, CostModel
from megatron_psrl.schedule.planner import compare_placements  # noqa: E402
from megatron_psrl.tree import (
    PrefixTree,
    build_prefix_tree,
    node_level,
    node_num_children,
    sample_shared_fraction,
    tree_stats,
)

LARGE_INPUT_BYTES = 32 << 20
"""Inputs above this size get tqdm progress bars."""

MOE_MODEL_CONFIGS = {
    # The published config.json of each (Hugging Face Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B):
    # every layer a top-8 mixture of 128 SwiGLU experts, no shared expert.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0, torch_dtype="bfloat16"),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=40960, rope_theta=1000000.0, torch_dtype="bfloat16"),
}
"""Mixture-of-experts model sizes of ``--model``: their cost models count the FLOPs of the
experts a token is routed to (and the router), as the trainer's planner does
(:func:`~megatron_psrl.engine.engine.cost_model_for`), not of all experts."""

MODEL_NAMES = tuple(NAMED_MODEL_DIMS) + tuple(MOE_MODEL_CONFIGS)
"""Every ``--model`` choice: the dense sizes of the cost model, then the MoE ones."""


def named_cost_model(name: str) -> CostModel:
    """The FLOP cost model of a ``--model`` size (an MoE one from its architecture)."""
    if name not in MOE_MODEL_CONFIGS:
        return CostModel.named(name)
    return dataclasses.replace(cost_model_for(_moe_architecture(name)), name=name)


def kv_bytes_per_token(name: str) -> int:
    """K and V of one token over all layers of a ``--model`` size, bf16."""
    if name in MOE_MODEL_CONFIGS:
        arch = _moe_architecture(name)
        layers, kv_heads, head_dim = arch.num_layers, arch.num_kv_heads, arch.head_dim
    else:
        dims = NAMED_MODEL_DIMS[name]
        layers, kv_heads, head_dim = dims.num_layers, dims.num_kv_heads, dims.head_dim
    return 2 * layers * kv_heads * head_dim * 2


def _moe_architecture(name: str):
    from megatron_psrl.model.architecture import ModelArchitecture

    return ModelArchitecture.from_hf_config(dict(MOE_MODEL_CONFIGS[name]))


def context_lengths(max_len: int, smallest: int = 32) -> List[int]:
    """Cut lengths for the context curve: powers of two from ``smallest``, then max_len."""
    lengths = [1 << k for k in range(int(math.log2(smallest)), 64) if (1 << k) < max_len]
    return sorted(set(lengths + [max_len]))


def speedup_vs_context(batch: SampleBatch, model: CostModel, progress: bool) -> List[dict]:
    from tqdm import tqdm

    rows = []
    max_len = int(batch.lengths.max())
    for cut in tqdm(context_lengths(max_len), desc="context curve", disable=not progress):
        truncated = batch if cut >= max_len else batch.truncated(cut)
        tree = build_prefix_tree(truncated)
        rows.append({
            "max_len": cut,
            "tokens_total": truncated.num_tokens,
            "tokens_in_tree": tree.num_tree_tokens,
            "token_dedup_ratio": truncated.num_tokens / tree.num_tree_tokens,
            "ideal_speedup": model.ideal_speedup(tree),
        })
    return rows


def redundancy_summary(shared_fraction: np.ndarray) -> dict:
    return {
        "mean": float(shared_fraction.mean()),
        "median": float(np.median(shared_fraction)),
        "p10": float(np.percentile(shared_fraction, 10)),
        "p90": float(np.percentile(shared_fraction, 90)),
        "fraction_of_samples_sharing_nothing": float((shared_fraction == 0).mean()),
    }


def make_plots(tree: PrefixTree, shared_fraction: np.ndarray, curve: List[dict], model_name: str,
               plots_dir: str, title: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plots_dir, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    counts, _, _ = ax.hist(shared_fraction, bins=np.linspace(0, 1, 41), color="tab:blue")
    if _spans_decades(counts):
        ax.set_yscale("log")
    ax.set_xlabel("fraction of the sample's tokens shared with other samples")
    ax.set_ylabel("samples")
    ax.set_title(f"{title}: redundancy per sample (mean {shared_fraction.mean():.2f})")
    paths.append(_save(fig, plots_dir, "redundancy.png"))

    children = node_num_children(tree)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _histogram(axes[0], tree.node_depth + 1, "tab:green")
    axes[0].set_xlabel("node start position + 1 (tokens above it, plus one)")
    axes[0].set_ylabel("nodes")
    _histogram(axes[1], node_level(tree) + 1, "tab:olive", integers=True)
    axes[1].set_xlabel("node level + 1 (nodes above it, plus one)")
    inner = children[children > 0]
    if inner.size:
        _histogram(axes[2], inner, "tab:orange", integers=True)
    axes[2].set_xlabel("children per inner node")
    fig.suptitle(f"{title}: tree depth and branching")
    paths.append(_save(fig, plots_dir, "depth_branching.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    cuts = [row["max_len"] for row in curve]
    ax.plot(cuts, [row["ideal_speedup"] for row in curve], "o-",
            label=f"ideal speedup ({model_name})")
    ax.plot(cuts, [row["token_dedup_ratio"] for row in curve], "s--", label="token dedup ratio")
    ax.set_xscale("log", base=2)
    speedups = [row[k] for row in curve for k in ("ideal_speedup", "token_dedup_ratio")]
    if _spans_decades(speedups):
        ax.set_yscale("log")
    ax.set_xlabel("context length L (every sample cut to its first L tokens)")
    ax.set_ylabel("x over no sharing")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"{title}: sharing vs context length")
    paths.append(_save(fig, plots_dir, "speedup_vs_context.png"))
    return paths


def _spans_decades(values) -> bool:
    """Positive values whose max / min is at least 30: a linear axis would hide the small ones."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v) & (v > 0)]
    return v.size > 0 and v.max() / v.min() >= 30


def _histogram(ax, values: np.ndarray, color: str, integers: bool = False) -> None:
    """A histogram of positive values, on log axes (log bins) where they span decades, so a
    real trace (one node with 10,000 children beside thousands with 2) stays readable."""
    values = np.asarray(values)
    if _spans_decades(values):
        bins = np.unique(np.geomspace(values.min(), values.max() + 1, 40).round() if integers
                         else np.geomspace(values.min(), values.max() + 1, 40))
        ax.hist(values, bins=bins, color=color)
        ax.set_xscale("log")
    else:
        bins = np.arange(values.min(), values.max() + 2) - 0.5 if integers else 50
        ax.hist(values, bins=bins, color=color)
    counts, _ = np.histogram(values, bins=bins)
    if _spans_decades(counts):
        ax.set_yscale("log")


def _save(fig, plots_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(plots_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_placement(report: dict, plots_dir: str, title: str) -> str:
    """Every rank's planned cost under whole-tree and cross-rank placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.4
    for k, (name, rep) in enumerate(report.items()):
        costs = np.asarray(rep["rank_cost"])
        ax.bar(np.arange(len(costs)) + (k - 0.5) * width, costs / max(costs.max(), 1e-30), width,
               label=f"{name} (imbalance {rep['imbalance']:.2f})")
    ax.set_xlabel("rank")
    ax.set_ylabel("planned cost / max")
    ax.set_title(f"{title}: work per rank")
    ax.set_ylim(0, 1.3)
    ax.legend(loc="upper center", ncol=2)
    os.makedirs(plots_dir, exist_ok=True)
    path = os.path.join(plots_dir, "placement.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--data", required=True, help="trace (.jsonl or .parquet)")
    parser.add_argument("--model", default="llama3-8b", choices=MODEL_NAMES,
                        help="model size of the cost model (default llama3-8b; the MoE sizes count the FLOPs of "
                             "the experts each token is routed to)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="also check token ids against this vocabulary")
    parser.add_argument("--ranks", type=int, default=None,
                        help="also compare whole-tree and cross-rank placement over this many ranks")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="token budget of one micro-batch")
    parser.add_argument("--exchange-group-size", type=int, default=None,
                        help="ranks that may split a tree between them (default: all --ranks)")
    parser.add_argument("--out-json", default=None, help="write the summary here")
    parser.add_argument("--plots-dir", default=None, help="write PNG plots here")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    return call_cli(lambda: _main(argv))


def _main(argv: Optional[List[str]]) -> int:
    args = parse_args(argv)
    large = os.path.exists(args.data) and os.path.getsize(args.data) > LARGE_INPUT_BYTES
    batch = load_samples(args.data, vocab_size=args.vocab_size, progress=large)
    model = named_cost_model(args.model)
    start = time.perf_counter()
    tree = build_prefix_tree(batch)
    build_seconds = time.perf_counter() - start
    stats = tree_stats(tree, model)
    by_model = {name: named_cost_model(name).ideal_speedup(tree) for name in MODEL_NAMES}
    shared_fraction = sample_shared_fraction(tree)
    curve = speedup_vs_context(batch, model, progress=large)

    print(f"{args.data}: {stats.num_samples} samples, {stats.tokens_total} tokens "
          f"(tree built in {build_seconds:.3f} s)")
    width = max(len(k) for k in stats.to_dict())
    for key, value in stats.to_dict().items():
        if key != "cost_model":
            print(f"  {key:<{width}}  {value:.4g}" if isinstance(value, float)
                  else f"  {key:<{width}}  {value}")
    print("  ideal speedup by model: "
          + ", ".join(f"{name} {value:.3f}x" for name, value in by_model.items()))
    print("  ideal speedup vs context length: "
          + ", ".join(f"{row['max_len']}: {row['ideal_speedup']:.2f}x" for row in curve))

    summary = {
        "data": str(args.data),
        "model": args.model,
        "build_seconds": build_seconds,
        "stats": stats.to_dict(),
        "ideal_speedup_by_model": by_model,
        "redundancy": redundancy_summary(shared_fraction),
        "speedup_vs_context": curve,
        "plots": [],
    }
    if args.ranks:
        kv_bytes = kv_bytes_per_token(args.model)
        summary["placement"] = compare_placements(tree, model, args.ranks, args.micro_batch_tokens,
                                                  args.exchange_group_size, kv_bytes)
        print(f"  placement over {args.ranks} ranks (micro-batch {args.micro_batch_tokens} tokens):")
        for name, rep in summary["placement"].items():
            print(f"    {name:<11} imbalance {rep['imbalance']:.3f}  makespan / perfect "
                  f"{rep['makespan'] / max(rep['perfect'], 1e-30):.3f}  micro-batches {rep['micro_batches']}  "
                  f"exchanged {rep['exchanged_bytes'] / 2**20:.1f} MiB  duplicated {rep['tokens_duplicated']} tokens  "
                  f"planned in {rep['plan_seconds'] * 1e3:.0f} ms")
    if args.plots_dir:
        title = os.path.basename(str(args.data))
        summary["plots"] = make_plots(tree, shared_fraction, curve, args.model, args.plots_dir,
                                      title)
        if args.ranks:
            summary["plots"].append(plot_placement(summary["placement"], args.plots_dir, title))
        print(f"  plots: {', '.join(summary['plots'])}")
    if args.out_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
        tmp = f"{args.out_json}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)
        os.replace(tmp, args.out_json)
        print(f"  summary: {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
