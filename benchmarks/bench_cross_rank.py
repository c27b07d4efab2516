#!/usr/bin/env python
"""Cross-rank placement: balance on simulated clusters, a real 2-rank run, and the cost model.

    python benchmarks/bench_cross_rank.py [--ranks 2 8 64 512] [--micro-batch-tokens 2048]
        [--micro-batches-per-rank 4] [--real] [--predict]

1. **Planner on simulated ranks** (no model): for step-wise trajectories of 16-64 turns, search
   trees (one tree per task) and the mixed workload, sized to ``--micro-batches-per-rank``
   micro-batches of unique tokens per rank, the imbalance (max / mean rank cost) of whole-tree
   placement and of cross-rank placement, with one exchange group over all ranks and with
   node-sized groups of 8 (trees balanced whole over the groups), the K/V bytes exchanged per
   step (Llama-3-8B in bf16) and the planning time.
2. **A real run** (``--real``): ``pretrain_agent_rl.py`` under torchrun with 2 CPU ranks on a
   batch that is one large rollout tree, cross-rank vs whole-tree placement, median step time
   and the planner's predicted step time.
3. **Cost model** (``--predict``): predicted (start-up calibration) vs measured time of
   random packs (1-9 causal segments of 16-400 tokens, random logit rows), on the tiny Llama
   in this process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.data.synthetic import make_mixed, make_stepwise, make_tree_rollouts  # noqa: E402
from megatron_psrl.tree import CostModel, build_prefix_tree  # noqa: E402
from megatron_psrl.tree.cost import NAMED_MODEL_DIMS  # noqa: E402
from megatron_psrl.tree.planner import compare_placements  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "stepwise-16-64": lambda n, seed: make_stepwise(num_trajectories=n, turns=(16, 64), obs_len=(50, 400),
                                                   action_len=(10, 100), system_len=500, seed=seed),
    "search-tree": lambda n, seed: make_tree_rollouts(num_roots=n, branching=3, depth=4, seed=seed),
    "mixed": lambda n, seed: make_mixed(num_tokens_target=n * 20_000, seed=seed),
}


def sized_tree(name: str, unique_tokens: int):
    """A batch of ``name`` with about ``unique_tokens`` tree tokens."""
    probe = build_prefix_tree(WORKLOADS[name](4, 0))
    units = max(1, int(round(4 * unique_tokens / probe.num_tree_tokens)))
    return build_prefix_tree(WORKLOADS[name](units, 1))


def simulate(args) -> None:
    dims = NAMED_MODEL_DIMS["llama3-8b"]
    kv_bytes = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * 2  # K and V, bf16
    cost = CostModel.named("llama3-8b")
    print("| workload | ranks | micro-batches / rank | whole-tree | cross-rank, one group | cross-rank, groups of 8 "
          "| exchanged / step | plan ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in WORKLOADS:
        for ranks in args.ranks:
            tree = sized_tree(name, args.micro_batches_per_rank * ranks * args.micro_batch_tokens)
            mb_per_rank = tree.num_tree_tokens / args.micro_batch_tokens / ranks
            one = compare_placements(tree, cost, ranks, args.micro_batch_tokens, None, kv_bytes)
            cells = [f"{one['whole-tree']['imbalance']:.3f}", f"{one['cross-rank']['imbalance']:.3f}"]
            if ranks > 8:
                node = compare_placements(tree, cost, ranks, args.micro_batch_tokens, 8, kv_bytes)
                cells.append(f"{node['cross-rank']['imbalance']:.3f}")
            else:
                cells.append("(one group)")
            print(f"| {name} | {ranks} | {mb_per_rank:.1f} | {' | '.join(cells)} | "
                  f"{one['cross-rank']['exchanged_bytes'] / 2**20:.1f} MiB | "
                  f"{one['cross-rank']['plan_seconds'] * 1e3:.0f} |", flush=True)


def real_run(args) -> None:
    from megatron_psrl.data.loader import write_samples

    batch = make_tree_rollouts(num_roots=1, branching=3, depth=4, seed=3, prompt_len=(1500, 2000))
    tree = build_prefix_tree(batch)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_samples(batch, os.path.join(tmp, "one_tree.jsonl"))
        print(f"\none rollout tree: {batch.num_samples} samples, {batch.num_tokens} tokens, "
              f"{tree.num_tree_tokens} unique; 2 CPU ranks, tiny Llama, micro-batch {args.real_micro_batch} tokens")
        print("| placement | median step s | predicted step s | imbalance | exchanged MiB |")
        print("|---|---|---|---|---|")
        times = {}
        for placement in ("whole-tree", "cross-rank"):
            log = os.path.join(tmp, f"{placement}.jsonl")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   os.path.join(REPO, "pretrain_agent_rl.py"), "--data", str(data), "--micro-batch-tokens",
                   str(args.real_micro_batch), "--train-iters", str(args.real_iters), "--placement", placement,
                   "--log-json", log, "--quiet"]
            subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
            recs = [json.loads(line) for line in open(log)][1:]  # the first step warms up
            times[placement] = float(np.median([r["step_time_s"] for r in recs]))
            predicted = recs[-1].get("predicted_step_s")
            print(f"| {placement} | {times[placement]:.3f} | "
                  f"{predicted if predicted is None else f'{predicted:.3f}'} | {recs[-1]['plan_imbalance']:.2f} | "
                  f"{recs[-1]['exchanged_bytes'] / 2**20:.1f} |", flush=True)
        print(f"cross-rank speedup over whole-tree placement: {times['whole-tree'] / times['cross-rank']:.2f}x")


def predict(args) -> None:
    import torch

    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.engine.calibration import calibrate, median_seconds, pack_step
    from megatron_psrl.model import tiny_config
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.model.builder import build_model

    initialize_parallel(1, 1, seed=0, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("tiny-llama"))
    model = build_model(arch)
    measured = calibrate(model, arch.vocab_size, torch.device("cpu"), 2048)
    rng = np.random.default_rng(0)
    print("\n| micro-batch | tokens | key pairs | logit rows | predicted s | measured s | error |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for k in range(8):
        segments = rng.integers(16, 400, size=int(rng.integers(1, 10))).tolist()
        rows = int(rng.integers(0, sum(segments)))
        keys = sum(s * (s + 1) // 2 for s in segments)
        t = median_seconds(pack_step(model, arch.vocab_size, torch.device("cpu"), segments, rows), 3)
        p = measured.predict(sum(segments), keys, rows)
        errors.append(abs(p - t) / t)
        print(f"| {k} | {sum(segments)} | {keys} | {rows} | {p:.4f} | {t:.4f} | {100 * (p - t) / t:+.1f}% |")
    print(f"mean absolute error of the calibrated cost model: {100 * np.mean(errors):.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 512])
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--micro-batches-per-rank", type=float, default=4.0)
    p.add_argument("--real", action="store_true", help="also time a 2-rank run on one large tree")
    p.add_argument("--real-micro-batch", type=int, default=1024)
    p.add_argument("--real-iters", type=int, default=5)
    p.add_argument("--predict", action="store_true", help="also compare predicted and measured micro-batch times")
    args = p.parse_args()
    t0 = time.perf_counter()
    simulate(args)
    if args.real:
        real_run(args)
    if args.predict:
        predict(args)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
