#!/usr/bin/env python
"""Hybrid linear-attention models (Qwen3.5, Qwen3-Next): what a cached prefix costs, and the
update step with prefix sharing against none, side by side.

    python benchmarks/bench_hybrid.py [--repeats 3] [--workloads grpo stepwise tree mixed] [--bytes-only]

1. **Bytes a cached prefix holds**, per model, against a softmax-attention model of the same
   width (the same config with every layer ``full_attention``): the blocks the prefix cache
   (``BlockKVCache``) allocates for one prefix's values, measured by allocating it (on the meta
   device: bookkeeping, no memory), at several prefix lengths. A linear layer keeps a fixed-size
   state (fp32: the recurrent ``[h_v, d_k, d_v]`` and the conv tail) whatever the length; a
   softmax layer keeps K and V per token. The break-even length is where the two are equal.
2. **The update step** of the debug-size Qwen3.5 (``debug-qwen3.5-text``, fp32 on the CPU) on
   the four synthetic workloads, through ``bench_update_step`` (one process, interleaved runs):
   prefix sharing, ``--no-prefix-sharing``, a dense tree mask and per-sample micro-batches, the
   ideal ratio (FLOPs) beside the measured speedup, and each mode's peak memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import torch  # noqa: E402

from megatron_psrl.kvcache import KVGeometry  # noqa: E402
from megatron_psrl.kvcache.manager import BlockKVCache  # noqa: E402
from megatron_psrl.kvcache.prefix_state import VALUES_ONLY  # noqa: E402
from megatron_psrl.model.architecture import ModelArchitecture  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402

MODELS = ("debug-qwen3.5-text", "qwen3.5-27b-class", "qwen3-next-80b-a3b")
LENGTHS = (256, 2048, 32768, 131072)
BLOCK_SIZE = 64


def softmax_twin(config: Dict) -> Dict:
    """The same model with every layer softmax attention (same width, heads and MLP)."""
    return dict(config, layer_types=["full_attention"] * config["num_hidden_layers"])


def cached_prefix_bytes(config: Dict, length: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the prefix cache allocates for the values of one prefix of ``length`` tokens of a
    ``config`` model (one tensor-parallel rank), measured by allocating it."""
    arch = ModelArchitecture.from_hf_config(config)
    geometry = KVGeometry.for_model(arch, 1, 1, dtype, torch.device("meta"))
    cache = BlockKVCache(geometry, 1 << 62)
    sizes = [pool.source_blocks(length, VALUES_ONLY, BLOCK_SIZE) for pool in geometry.pools]
    cache.begin_step(BLOCK_SIZE, sum(sizes), sizes)
    cache.allocate(0, length, VALUES_ONLY)
    used = sum(n * pool.block_bytes(BLOCK_SIZE) for n, pool in zip(cache.pool_blocks_in_use, geometry.pools))
    cache.free(0, VALUES_ONLY)
    return used


def break_even_length(config: Dict, dtype: torch.dtype = torch.bfloat16) -> int:
    """The shortest prefix (a multiple of the block size) at which the hybrid caches no more
    bytes than its softmax twin."""
    lo, hi = BLOCK_SIZE, BLOCK_SIZE
    while cached_prefix_bytes(config, hi, dtype) > cached_prefix_bytes(softmax_twin(config), hi, dtype):
        lo, hi = hi, 2 * hi
    while hi - lo > BLOCK_SIZE:
        mid = (lo + hi) // 2 // BLOCK_SIZE * BLOCK_SIZE
        if cached_prefix_bytes(config, mid, dtype) > cached_prefix_bytes(softmax_twin(config), mid, dtype):
            lo = mid
        else:
            hi = mid
    return hi


def bytes_rows(models=MODELS, lengths=LENGTHS) -> List[dict]:
    rows = []
    for name in models:
        config = tiny_config(name)
        for length in lengths:
            hybrid = cached_prefix_bytes(config, length)
            softmax = cached_prefix_bytes(softmax_twin(config), length)
            rows.append(dict(model=name, length=length, hybrid=hybrid, softmax=softmax))
    return rows


def print_bytes(rows: List[dict]) -> None:
    print("| model | prefix tokens | hybrid MiB | softmax twin MiB | hybrid / softmax |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['length']} | {r['hybrid'] / 2**20:.2f} | {r['softmax'] / 2**20:.2f} | "
              f"{r['hybrid'] / r['softmax']:.3f} |")
    print()
    for name in dict.fromkeys(r["model"] for r in rows):
        print(f"{name}: break-even at {break_even_length(tiny_config(name))} tokens "
              "(longer prefixes cost the hybrid less than its softmax twin)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", nargs="*", default=["grpo", "stepwise", "tree", "mixed"])
    p.add_argument("--micro-batch-tokens", type=int, default=32768)
    p.add_argument("--bytes-only", action="store_true", help="only the cached-bytes table")
    args = p.parse_args()
    print("Bytes one cached prefix holds (values, bf16 model; linear states fp32), one rank:\n")
    print_bytes(bytes_rows())
    if args.bytes_only:
        return
    import bench_update_step

    print("\nThe update step of debug-qwen3.5-text:\n")
    step_args = argparse.Namespace(model="debug-qwen3.5-text", micro_batch_tokens=args.micro_batch_tokens,
                                   repeats=args.repeats, workloads=args.workloads, device="cpu")
    rows = bench_update_step.run(step_args)
    meta = {"model": step_args.model, "device": "cpu", "threads": torch.get_num_threads(),
            "micro_batch_tokens": args.micro_batch_tokens, "repeats": args.repeats}
    print()
    print(bench_update_step.markdown(rows, meta))


if __name__ == "__main__":
    main()
