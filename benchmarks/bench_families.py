#!/usr/bin/env python
"""The model families of late 2026 (DeepSeek-V3 / Kimi K2 latent attention, gpt-oss windows and
sinks, GLM-4.5 grouped routing): what a cached prefix token costs, and the update step with
prefix sharing against none, side by side.

    python benchmarks/bench_families.py [--repeats 3] [--workloads grpo stepwise tree mixed]
                                         [--models debug-deepseek-v3-moe,debug-gpt-oss,debug-glm4-moe]
                                         [--bytes-only]

1. **Bytes a cached prefix token holds**, per family, at its debug size and at its published
   class shape (one tensor-parallel rank, bf16 model): the KV cache's bytes per prefix token
   (``KVGeometry.row_bytes_per_token``, what the memory plan charges and the cache allocates);
   for latent attention both ways: per-head K/V (``--latent-cache per-head``) and the compressed
   latent plus the shared RoPE key (``kv_lora_rank + qk_rope_head_dim`` numbers a token and
   layer, the default).
2. **The update step** of each family's debug config (fp32 on the CPU) on the synthetic
   workloads, through ``bench_update_step`` (one process, interleaved runs): prefix sharing,
   ``--no-prefix-sharing``, a dense tree mask and per-sample micro-batches, the ideal ratio
   (the family's FLOP cost model) beside the measured speedup, and each mode's peak memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import torch  # noqa: E402

from megatron_psrl.kvcache import KVGeometry  # noqa: E402
from megatron_psrl.model.architecture import ModelArchitecture  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402

STEP_MODELS = ("debug-deepseek-v3-moe", "debug-gpt-oss", "debug-glm4-moe")
SHAPES = ("debug-deepseek-v3-moe", "deepseek-v3-class", "debug-gpt-oss", "gpt-oss-120b-class", "debug-glm4-moe")


def row_bytes(arch: ModelArchitecture, dtype: torch.dtype) -> int:
    """Bytes of one cached prefix token's values over every layer (one rank), from the cache's geometry."""
    return KVGeometry.for_model(arch, 1, 1, dtype, torch.device("meta")).row_bytes_per_token


def bytes_row(name: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """What one cached prefix token costs a ``name`` model (one rank): the cache's row bytes as
    it runs, and for latent attention both ways (``--latent-cache per-head`` / ``latent``)."""
    arch = ModelArchitecture.from_hf_config(tiny_config(name))
    if not arch.multi_latent_attention:
        return dict(model=name, family=arch.model_type, layers=arch.num_layers, kv_row=row_bytes(arch, dtype),
                    latent=None)
    per_head = dataclasses.replace(arch, latent_cache="per-head")
    latent = dataclasses.replace(arch, latent_cache="latent")
    return dict(model=name, family=arch.model_type, layers=arch.num_layers, kv_row=row_bytes(per_head, dtype),
                latent=row_bytes(latent, dtype))


def print_bytes(rows: List[dict]) -> None:
    print("| model | family | layers | cached K/V per prefix token (KiB; latent attention: per-head) | "
          "latent + RoPE key per token (KiB) | K/V / latent |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lat = "-" if r["latent"] is None else f"{r['latent'] / 1024:.2f}"
        ratio = "-" if r["latent"] is None else f"{r['kv_row'] / r['latent']:.1f}x"
        print(f"| {r['model']} | {r['family']} | {r['layers']} | {r['kv_row'] / 1024:.2f} | {lat} | {ratio} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", nargs="*", default=["grpo", "stepwise", "tree", "mixed"])
    p.add_argument("--models", default=",".join(STEP_MODELS))
    p.add_argument("--micro-batch-tokens", type=int, default=32768)
    p.add_argument("--bytes-only", action="store_true", help="only the cached-bytes table")
    args = p.parse_args()
    print("Bytes one cached prefix token holds (bf16 model, one rank):\n")
    print_bytes([bytes_row(name) for name in SHAPES])
    if args.bytes_only:
        return
    import bench_update_step

    for model in args.models.split(","):
        print(f"\nThe update step of {model}:\n")
        step_args = argparse.Namespace(model=model, micro_batch_tokens=args.micro_batch_tokens,
                                       repeats=args.repeats, workloads=args.workloads, device="cpu")
        rows = bench_update_step.run(step_args)
        meta = {"model": model, "device": "cpu", "threads": torch.get_num_threads(),
                "micro_batch_tokens": args.micro_batch_tokens, "repeats": args.repeats}
        print()
        print(bench_update_step.markdown(rows, meta))


if __name__ == "__main__":
    main()
