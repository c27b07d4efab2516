#!/usr/bin/env python
"""What a sliding window's KV cut saves: cached bytes with and without it (gpt-oss).

    python benchmarks/bench_window_cut.py [--micro-batch-tokens 128] [--tokens 20000]

1. Measured, no model: workloads with long shared prefixes are planned (mechanism 2, one rank,
   every graph kept) on the debug gpt-oss geometry (fp32, 2 layers: a sliding one and a full
   one), then the step's lowered instructions allocate and free the blocks of a real
   ``BlockKVCache`` as the runner does. Printed: the cache's peak bytes in use (every pool's
   peak, as allocated) and the K/V + dK/dV bytes of every cached source, with the windowed
   layers' rows cut to what their readers' windows reach (``PrefixState.window``) and without
   (every layer keeps every row). The debug window is 8 tokens; ``--window`` runs the same
   geometry with another one (gpt-oss-120b's is 128).
2. Arithmetic from the spec: gpt-oss-120b-class (36 layers alternating a 128-token window and
   full attention, 8 key/value groups of 64, bf16) bytes a cached prefix keeps per token, for a
   prefix of ``--context`` tokens read right after its end, at TP 1 and TP 8.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import torch  # noqa: E402

from megatron_psrl.data import make_workload  # noqa: E402
from megatron_psrl.kvcache import BlockKVCache, KVGeometry  # noqa: E402
from megatron_psrl.kvcache.prefix_state import ALL_ROLES, VALUES_ONLY  # noqa: E402
from megatron_psrl.model import ModelArchitecture, tiny_config  # noqa: E402
from megatron_psrl.schedule import instructions as ins  # noqa: E402
from megatron_psrl.schedule.config import PlannerConfig  # noqa: E402
from megatron_psrl.schedule.memory import plan_memory  # noqa: E402
from megatron_psrl.schedule.planner import plan_step  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402

CPU = torch.device("cpu")


def replay(rank, geometry, memory) -> int:
    """Peak bytes of a real cache driven by the step's lowered allocations and releases."""
    cache = BlockKVCache(geometry, 1 << 50)
    cache.begin_step(memory.block_size, memory.pool_blocks, memory.pool_sizes, memory.pool_states,
                     memory.pool_block_sizes)
    for step in ins.lower_training(rank, memory.keep_graph, memory.kv_release_step):
        for x in step.instructions:
            if isinstance(x, ins.AllocateKV):
                for s in x.sources:
                    src = rank.sources[s]
                    cache.allocate(s, src.length, kinds=x.kinds or src.kinds, reach=src.reach)
            elif isinstance(x, ins.ReleaseKV):
                for s in x.sources:
                    cache.free(s, x.kinds)
    assert cache.metrics.peak_pool_blocks == memory.pool_sizes, (cache.metrics.peak_pool_blocks, memory.pool_sizes)
    return sum(n * p.block_bytes(bs) for n, p, bs in zip(cache.metrics.peak_pool_blocks, cache.pools, cache.block_sizes))


def source_bytes(rank, geometry) -> int:
    """K, V, dK and dV every cached source keeps (exact rows, no block padding)."""
    return sum(len(p.layers) * p.state.nbytes(p.kept_rows(s.length, *s.reach), ALL_ROLES)
               for s in rank.sources.values() for p in geometry.pools)


def debug_table(args) -> None:
    cfg = dict(tiny_config("debug-gpt-oss"))
    if args.window:
        cfg["sliding_window"] = args.window
    arch = ModelArchitecture.from_hf_config(cfg)
    cut = KVGeometry.for_model(arch, 1, 1, torch.float32, CPU)
    whole = KVGeometry(arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32, CPU)
    print(f"debug gpt-oss geometry, window {arch.sliding_window}, fp32, micro-batches of {args.micro_batch_tokens} "
          "tokens, one rank, every graph kept")
    print("| workload | tokens | cached sources | mean source length | peak cache bytes, whole / cut | "
          "source K/V+grad bytes, whole / cut |")
    print("|---|---|---|---|---|---|")
    for name in args.workloads:
        batch = make_workload(name, num_tokens_target=args.tokens, vocab_size=arch.vocab_size, seed=1)
        rank = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=args.micro_batch_tokens,
                                                                 sharing="tree")).ranks[0]
        if not rank.sources:
            print(f"| {name} | {batch.num_tokens} | 0 | | | |")
            continue
        peaks = [replay(rank, g, plan_memory(rank, g, 1 << 50, 0)) for g in (whole, cut)]
        held = [source_bytes(rank, g) for g in (whole, cut)]
        mean = sum(s.length for s in rank.sources.values()) / len(rank.sources)
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        print(f"| {name} | {batch.num_tokens} | {len(rank.sources)} | {mean:.0f} | {mib(peaks[0])} / {mib(peaks[1])} "
              f"({peaks[1] / peaks[0]:.2f}) | {mib(held[0])} / {mib(held[1])} ({held[1] / held[0]:.2f}) |", flush=True)


def large_table(context: int) -> None:
    arch = ModelArchitecture.from_hf_config(tiny_config("gpt-oss-120b-class"))
    print(f"\ngpt-oss-120b-class, bf16 values (fp32 gradients), a {context}-token prefix read right after its end "
          f"(window {arch.sliding_window}): bytes per prefix token, all layers of a rank")
    print("| TP | values, whole | values, cut | values + grads, whole | values + grads, cut | cut / whole |")
    print("|---|---|---|---|---|---|")
    for tp in (1, 8):
        g = KVGeometry.for_model(arch, tp, 1, torch.bfloat16, CPU)
        reach = (0, context)  # the first reader's first query sits at depth `context`

        def per_token(roles, cut):
            kept = lambda p: p.kept_rows(context, *reach) if cut else context  # noqa: E731
            return sum(len(p.layers) * p.state.nbytes(kept(p), roles) for p in g.pools) / context

        v = [per_token(VALUES_ONLY, c) for c in (False, True)]
        a = [per_token(ALL_ROLES, c) for c in (False, True)]
        print(f"| {tp} | {v[0]:,.0f} | {v[1]:,.1f} | {a[0]:,.0f} | {a[1]:,.1f} | {a[1] / a[0]:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--micro-batch-tokens", type=int, default=128)
    p.add_argument("--workloads", nargs="+", default=["stepwise", "tree", "mixed"])
    p.add_argument("--tokens", type=int, default=20000, help="tokens per workload batch")
    p.add_argument("--window", type=int, default=0, help="the debug geometry's window (0: its own, 8)")
    p.add_argument("--context", type=int, default=32768)
    args = p.parse_args()
    debug_table(args)
    large_table(args.context)


if __name__ == "__main__":
    main()
