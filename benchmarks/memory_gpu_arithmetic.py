#!/usr/bin/env python
"""The memory plan's predicted step peak on a GPU, by arithmetic (no GPU, no model), against what
AReaL-DTA's depth-first walk holds by the same arithmetic (issue 35).

    python benchmarks/memory_gpu_arithmetic.py [--budgets 2048,4096,...]

Models: Qwen2.5-7B and Qwen2.5-32B shapes, and the hybrid linear-attention ones (``--models
qwen3.5-27b,qwen3-next-80b``: Qwen3.5-27B-class and Qwen3-Next-80B-A3B, whose linear layers
cache a fixed-size state per prefix instead of K/V per token), bf16, one tensor-parallel rank
(most terms divide by TP), the GPU attention backends' saved tensors (``flash``/``te``: cached
prefixes kept as copies by a kept graph, not gathered again). Workloads: one step-wise
trajectory of 32,768 tokens (16 turns of 2,048, sample t = turns 1..t trained on turn t's last
512 tokens), the same of 131,072 tokens (16 turns of 8,192, ``--long``) and a GRPO group of 16
responses of 2,048 tokens on one 8,192-token prompt.

The project, per micro-batch budget: the planner's plan and its memory plan
(``schedule.memory``), ``step_peak_bytes``: KV blocks, kept graphs, gathered K/V copies, the loss
head, and the running micro-batch's graph; with the KV budget unbounded (every graph kept) and
at its floor (the smallest budget the plan accepts: graphs dropped and recomputed).

AReaL-DTA by the same terms (softmax models only: its tree training refuses linear-attention
layers): it walks the prefix tree depth first; on the way down every
segment's graph stays until its subtree is done (its backward runs on the way back up), with
the path's K/V cached and their gradients accumulated. Its peak is at the deepest leaf: the
activations of the path's tokens (whole-sequence blocks) or of one block (blocks of B tokens:
the earlier blocks of a sequence are rebuilt in backward), plus K, V, dK, dV of the path, plus
the same loss head. Per-token activation bytes are the plan's (``activation_bytes_per_token``)
for both: the same arithmetic, not a measurement of either.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from exact_workloads import grpo_exact, stepwise_exact  # noqa: E402

from megatron_psrl.kvcache import CacheBudgetError, KVGeometry  # noqa: E402
from megatron_psrl.model.architecture import ModelArchitecture  # noqa: E402
from megatron_psrl.model.logits import loss_head_peak_bytes  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory, step_peak_bytes  # noqa: E402
from megatron_psrl.schedule.planner import PlannerConfig, plan_step  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402

QWEN25 = {
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
}
HYBRID_SHAPES = {"qwen3.5-27b": "qwen3.5-27b-class", "qwen3-next-80b": "qwen3-next-80b-a3b"}
"""``--models`` name -> the family's shape config (megatron_psrl.model.tiny.SHAPE_CONFIGS)."""
WORKLOADS = {
    "step-wise 32k (16 x 2048)": lambda vocab: stepwise_exact(16, 2048, 512, vocab),
    "GRPO 16 x 2k on 8k": lambda vocab: grpo_exact(8192, 16, 2048, vocab),
}
LONG_WORKLOADS = {"step-wise 128k (16 x 8192)": lambda vocab: stepwise_exact(16, 8192, 512, vocab)}
DTA_BLOCKS = (-1, 4096, 2048)
GIB = 2**30


def architecture(name: str) -> ModelArchitecture:
    if name in HYBRID_SHAPES:
        return ModelArchitecture.from_hf_config(tiny_config(HYBRID_SHAPES[name]))
    return ModelArchitecture.from_hf_config(dict(tiny_config("tiny-qwen2"), **QWEN25[name],
                                                 max_position_embeddings=131072, torch_dtype="bfloat16"))


def model_title(name: str) -> str:
    return {"qwen3.5-27b": "Qwen3.5-27B-class", "qwen3-next-80b": "Qwen3-Next-80B-A3B"}.get(name, f"Qwen2.5-{name}")


def floor_budget(rank, geometry, act, head, high: int) -> int:
    lo, hi = 0, high  # lo infeasible, hi feasible
    while hi - lo > max(1 << 20, hi // 1000):
        mid = (lo + hi) // 2
        try:
            plan_memory(rank, geometry, mid, act, head_bytes=head)
            hi = mid
        except CacheBudgetError:
            lo = mid
    return hi


def project(tree, arch, geometry, act, budget: int) -> dict:
    head = loss_head_peak_bytes(arch.padded_vocab_size(1), budget)
    rank = plan_step(tree, PlannerConfig(micro_batch_tokens=budget, sharing="tree")).ranks[0]
    out = {"micro_batches": len(rank.micro_batches)}
    if not rank.sources:
        out["keep_all"] = out["floor"] = step_peak_bytes(rank, None, act, head)
        out["recomputed"] = 0
        return out
    keep = plan_memory(rank, geometry, 1 << 60, act, head_bytes=head)
    out["keep_all"] = step_peak_bytes(rank, keep, act, head)
    low = plan_memory(rank, geometry, floor_budget(rank, geometry, act, head, keep.peak_bytes), act, head_bytes=head)
    out["floor"] = step_peak_bytes(rank, low, act, head)
    out["recomputed"] = low.recompute_tokens
    return out


def dta(batch, arch, geometry, act, block: int) -> int:
    """Peak bytes of the depth-first walk at its deepest path (see module doc)."""
    path = int(max(batch.lengths))  # the deepest root-to-leaf path: the longest sample
    held_act = act * (path if block < 0 else min(block, path))
    kv = 4 * geometry.bytes_per_token * path  # K, V, dK, dV of the path
    head = loss_head_peak_bytes(arch.padded_vocab_size(1), path)
    return held_act + kv + head


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="2048,4096,8192,16384,32768")
    p.add_argument("--models", default="7B,32B")
    p.add_argument("--long", action="store_true", help="also the 128k-token step-wise trajectory")
    args = p.parse_args(argv)
    workloads = dict(WORKLOADS, **(LONG_WORKLOADS if args.long else {}))
    budgets = [int(b) for b in args.budgets.split(",")]
    for model in args.models.split(","):
        arch = architecture(model)
        geometry = KVGeometry.for_model(arch, 1, 1, torch.bfloat16, torch.device("cpu"))
        act = activation_bytes_per_token(arch, 1, 2, "flash")
        fixed = geometry.fixed_bytes_per_source
        state = f", {fixed / 2**20:.0f} MiB of linear-layer states per cached prefix" if fixed else ""
        print(f"\n**{model_title(model)}** (bf16, TP 1): {act / 1024:.0f} KiB of kept graph per token, "
              f"{geometry.row_bytes_per_token / 1024:.0f} KiB of K+V per token{state}, loss head "
              f"{loss_head_peak_bytes(arch.padded_vocab_size(1), 1 << 20) / GIB:.2f} GiB\n")
        print("| workload | contender | micro-batches | peak GiB (KV unbounded) | peak GiB (KV at floor) | "
              "recomputed tokens at floor |")
        print("|---|---|---|---|---|---|")
        for wname, make in workloads.items():
            batch = make(arch.vocab_size)
            tree = build_prefix_tree(batch)
            for b in budgets:
                r = project(tree, arch, geometry, act, b)
                print(f"| {wname} | psrl, budget {b} | {r['micro_batches']} | {r['keep_all'] / GIB:.1f} | "
                      f"{r['floor'] / GIB:.1f} | {r['recomputed']} |", flush=True)
            for block in (DTA_BLOCKS if not fixed else ()):
                name = "whole sequences" if block < 0 else f"blocks of {block}"
                print(f"| {wname} | AReaL-DTA, {name} | - | {dta(batch, arch, geometry, act, block) / GIB:.1f} | - | - |")


if __name__ == "__main__":
    main()
