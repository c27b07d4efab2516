#!/usr/bin/env python
"""The memory plan's predicted step peak on a GPU, by arithmetic (no GPU, no model), against what
AReaL-DTA's depth-first walk holds by the same arithmetic (issue 35).

    python benchmarks/memory_gpu_arithmetic.py [--budgets 2048,4096,...]

Models: Qwen2.5-7B and Qwen2.5-32B shapes, and the hybrid linear-attention ones (``--models
qwen3.5-27b,qwen3-next-80b``: Qwen3.5-27B-class and Qwen3-Next-80B-A3B, whose linear layers
cache a fixed-size state per prefix instead of K/V per token), bf16, one tensor-parallel rank
(most terms divide by TP), the GPU attention backends' saved tensors (``flash``/``te``: cached
prefixes read from the cache in the forward and again in the backward, no copy kept by a graph;
``--copies-kept`` charges the copies a kept graph held before). Workloads: one step-wise
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

``--memory-budget`` (issue 46): per model (``MODELS``), workload, device memory and TP, the
plan the planner picks under one budget (``schedule.budget.choose``, each lever evaluated by the
engine's ``engine.budget.evaluate_lever`` on :class:`ArithmeticEngine`), its predicted time
relative to the fastest plan with no memory limit, and AReaL-DTA's peak by the same terms; the
static memory of one rank of an 8-GPU node (:func:`node_static`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from types import SimpleNamespace
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from exact_workloads import grpo_exact, stepwise_exact  # noqa: E402

from megatron_psrl.attention import backends  # noqa: E402
from megatron_psrl.engine.budget import evaluate_lever, unbeatable  # noqa: E402
from megatron_psrl.engine.engine import Engine, cost_model_for  # noqa: E402
from megatron_psrl.kvcache import CacheBudgetError, KVGeometry  # noqa: E402
from megatron_psrl.model.architecture import ModelArchitecture  # noqa: E402
from megatron_psrl.model.logits import chunk_rows, loss_head_peak_bytes  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402
from megatron_psrl.schedule.budget import (  # noqa: E402
    DEFAULT_HEADROOM_FRACTION,
    MemoryBudgetError,
    Outcome,
    Pricing,
    StaticMemory,
    budget_for,
    choose,
    micro_batch_ladder,
    optimizer_state_bytes,
)
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory, step_peak_bytes  # noqa: E402
from megatron_psrl.schedule.planner import PlannerConfig, plan_step  # noqa: E402
from megatron_psrl.schedule.step_charge import ActivationCharge  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402

QWEN25 = {
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
}


def _qwen25(size: str) -> dict:
    return dict(tiny_config("tiny-qwen2"), **QWEN25[size], max_position_embeddings=131072, torch_dtype="bfloat16")


MODELS = {
    "7B": ("Qwen2.5-7B", lambda: _qwen25("7B")),
    "32B": ("Qwen2.5-32B", lambda: _qwen25("32B")),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B-class", lambda: tiny_config("qwen3-30b-a3b-class")),
    "qwen3.5-27b": ("Qwen3.5-27B-class", lambda: tiny_config("qwen3.5-27b-class")),
    "qwen3-next-80b": ("Qwen3-Next-80B-A3B", lambda: tiny_config("qwen3-next-80b-a3b")),
    "deepseek-v3": ("DeepSeek-V3-class (671B, MLA)", lambda: tiny_config("deepseek-v3-class")),
    "gpt-oss-120b": ("gpt-oss-120B-class (117B, windows of 128 and sinks)", lambda: tiny_config("gpt-oss-120b-class")),
}
"""``--models`` name -> (title, its Hugging Face config): add a shape here to tabulate it (a
family's shape configs are in megatron_psrl.model.tiny.SHAPE_CONFIGS)."""
WORKLOADS = {
    "step-wise 32k (16 x 2048)": lambda vocab: stepwise_exact(16, 2048, 512, vocab),
    "GRPO 16 x 2k on 8k": lambda vocab: grpo_exact(8192, 16, 2048, vocab),
}
LONG_WORKLOADS = {"step-wise 128k (16 x 8192)": lambda vocab: stepwise_exact(16, 8192, 512, vocab)}
DTA_BLOCKS = (-1, 4096, 2048)
GIB = 2**30


def architecture(name: str) -> ModelArchitecture:
    return ModelArchitecture.from_hf_config(MODELS[name][1]())


def model_title(name: str) -> str:
    return MODELS[name][0]


def gathers_in_backward() -> bool:
    """The ``flash`` backend reads cached prefixes again in its backward (no copies in kept
    graphs; the engine's rule, ``READS_CACHED_PREFIXES``); not with ``--copies-kept``."""
    return "flash" in backends.READS_CACHED_PREFIXES


def floor_budget(rank, geometry, act, head, high: int) -> int:
    lo, hi = 0, high  # lo infeasible, hi feasible
    while hi - lo > max(1 << 20, hi // 1000):
        mid = (lo + hi) // 2
        try:
            plan_memory(rank, geometry, mid, act, head_bytes=head, gathers_in_backward=gathers_in_backward())
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
    keep = plan_memory(rank, geometry, 1 << 60, act, head_bytes=head, gathers_in_backward=gathers_in_backward())
    out["keep_all"] = step_peak_bytes(rank, keep, act, head)
    low = plan_memory(rank, geometry, floor_budget(rank, geometry, act, head, keep.peak_bytes), act, head_bytes=head,
                      gathers_in_backward=gathers_in_backward())
    out["floor"] = step_peak_bytes(rank, low, act, head)
    out["recomputed"] = low.recompute_tokens
    return out


def dta(batch, arch, geometry, act, block: int) -> int:
    """Peak bytes of the depth-first walk at its deepest path (see module doc); a latent-attention
    model's path as per-head K/V (the walk caches what its attention reads)."""
    if arch.multi_latent_attention and arch.latent_cache != "per-head":
        geometry = KVGeometry.for_model(dataclasses.replace(arch, latent_cache="per-head"), 1, 1, torch.bfloat16,
                                        torch.device("cpu"))
    path = int(max(batch.lengths))  # the deepest root-to-leaf path: the longest sample
    held_act = act * (path if block < 0 else min(block, path))
    kv = 2 * geometry.row_bytes_per_token * path  # K, V, dK, dV of the path (every layer's, its window's or not)
    head = loss_head_peak_bytes(arch.padded_vocab_size(1), path)
    return held_act + kv + head



# ---------------------------------------------------------------------- --memory-budget
BUDGET_WORKLOADS = {
    "step-wise 32k (16 x 2048)": lambda vocab: stepwise_exact(16, 2048, 512, vocab),
    "step-wise 64k (16 x 4096)": lambda vocab: stepwise_exact(16, 4096, 512, vocab),
    "step-wise 128k (16 x 8192)": lambda vocab: stepwise_exact(16, 8192, 512, vocab),
    "GRPO 16 x 2k on 8k": lambda vocab: grpo_exact(8192, 16, 2048, vocab),
    "smoke: step-wise 2k (4 x 512)": lambda vocab: stepwise_exact(4, 512, 128, vocab),
}
"""``--memory-budget`` workloads (the last one is the smoke test's)."""
NODE_GPUS = 8
"""GPUs of the node: data-parallel ranks = ``NODE_GPUS / TP``."""


class ArithmeticEngine:
    """What :func:`megatron_psrl.engine.budget.evaluate_lever` reads of an engine, built from a
    model's architecture alone (no model, no device): one rank of ``tp`` tensor-parallel ranks,
    the ``flash`` backend, bf16, megatron's DDP gradient buffers allocated before the step (in
    the static memory), the configured recomputation none; the same memory settings (the
    engine's own method) and the FLOP cost model the engine plans with."""

    memory_settings_for = Engine.memory_settings_for
    _charge_for = Engine._charge_for
    varlen_charge = Engine.varlen_charge

    def __init__(self, arch: ModelArchitecture, tp: int, pricing: Pricing, chunk_mb: float = 64.0):
        self.arch, self.backend_name, self.virtual_pipeline_size = arch, "flash", 1
        self.config = SimpleNamespace(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                                      kv_cache_budget=1 << 62, torch_dtype=torch.bfloat16)
        self.layout = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1)
        self.plan_geometry = KVGeometry.for_pipeline_planning(arch, tp, 1, torch.bfloat16, torch.device("cpu"))
        self.act_bytes = activation_bytes_per_token(arch, tp, 2)
        self.head_bytes = 0
        local_vocab = arch.padded_vocab_size(tp) // tp
        # (sequence parallelism off, as the actor's default: the last layer computes the output rows only)
        self.graph_charge = ActivationCharge.of(arch, tp, 2, local_vocab, chunk_rows(local_vocab, int(chunk_mb * 2**20)))
        self.flop_model = cost_model_for(arch)
        self.measured = None  # (no device to measure on: levers priced in FLOPs at the pricing's rate)
        self.memory_budget = SimpleNamespace(pricing=pricing)

    def planner_config(self, sharing: str, micro_batch_tokens: int) -> PlannerConfig:
        return PlannerConfig(micro_batch_tokens=micro_batch_tokens, sharing=sharing, cost_model=self.flop_model)


def parameter_split(arch: ModelArchitecture) -> Tuple[int, int]:
    """``(parameters outside the routed experts, the routed experts')``."""
    dense_layers = len(arch.dense_mlp_layers)
    experts = (arch.num_layers - dense_layers) * arch.num_experts * 3 * arch.hidden_size * arch.moe_ffn_hidden_size \
        if arch.is_moe else 0
    return arch.num_parameters() - experts, experts


def node_static(arch: ModelArchitecture, tp: int, distributed_optimizer: bool) -> Tuple[StaticMemory, int]:
    """``(one rank's static memory, its expert-parallel size)`` on a node of :data:`NODE_GPUS`
    GPUs: bf16 weights and fp32 gradient buffers of this rank's shards (the experts whole on
    every tensor-parallel rank, spread over the ``8 / TP`` data-parallel ranks by expert
    parallelism), Adam's moments and fp32 master weights (:func:`optimizer_state_bytes`),
    sharded over the data-parallel ranks by the distributed optimizer when it is assumed."""
    dp = NODE_GPUS // tp
    dense, experts = parameter_split(arch)
    ep = dp if experts else 1
    params = -(-dense // tp) + experts // ep
    return StaticMemory(weights=2 * params, gradients=4 * params,
                        optimizer_state=optimizer_state_bytes(params, 2, "adam", shards=dp if distributed_optimizer else 1)), ep


def _fastest(engine: ArithmeticEngine, tree, ladder: List[int], budget: int, static: StaticMemory, layers: int,
             offload: bool) -> Outcome:
    """The planner's choice under ``budget`` (:func:`choose` with the engine's evaluation)."""
    return choose(lambda lever, room: evaluate_lever(engine, tree, "tree", lever, room, False), budget, static,
                  ladder, layers, offload, unbeatable=lambda o: unbeatable(o, "tree"))


def budget_case(arch, batch, tp: int, budgets: Dict[str, int], ladder: List[int], distributed_optimizer: bool = True,
                offload: bool = False) -> dict:
    """One (model, workload, TP) row group: the static memory, the fastest plan ignoring
    memory, per device budget the planner's choice (or the smallest budget that fits) and
    AReaL-DTA's peak by the same terms."""
    static, ep = node_static(arch, tp, distributed_optimizer)
    engine = ArithmeticEngine(arch, tp, Pricing.for_device("cuda"))
    tree = build_prefix_tree(batch)
    # (the engine's rule: recomputation is a lever without expert parallelism)
    layers = arch.num_layers if ep == 1 else 0
    free = _fastest(engine, tree, ladder, 1 << 62, StaticMemory(0, 0, 0), 0, False)
    out = dict(static=static, ep=ep, dp=NODE_GPUS // tp, keep_all=free, devices={})
    for device, budget in budgets.items():
        try:
            o = _fastest(engine, tree, ladder, budget, static, layers, offload)
        except MemoryBudgetError as exc:
            out["devices"][device] = dict(budget=budget, refused=int(re.search(r"fits is (\d+) bytes", str(exc))[1]))
            continue
        moved = sum(sum(m.offloaded_bytes or []) for m in o.details["memories"] if m is not None)
        out["devices"][device] = dict(budget=budget, outcome=o, peak=static.total + o.peak_bytes, offloaded=moved,
                                      ratio=o.seconds / free.seconds)
    if not engine.plan_geometry.fixed_bytes_per_source:  # (AReaL-DTA refuses linear-attention layers)
        geometry = KVGeometry.for_model(arch, tp, 1, torch.bfloat16, torch.device("cpu"))
        act = activation_bytes_per_token(arch, tp, 2, "flash")
        out["dta"] = {block: static.total + dta(batch, arch, geometry, act, block) for block in DTA_BLOCKS}
    return out


def budget_rows(model: str, case: dict, workload: str, tp: int) -> List[str]:
    """The markdown rows of one :func:`budget_case`."""
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    dta_text = " / ".join(f"{g(case['dta'][b])}" for b in DTA_BLOCKS) if "dta" in case else "refused (linear layers)"
    rows = []
    for device, d in case["devices"].items():
        head = f"| {model} | {workload} | {tp} ({case['dp']}, EP {case['ep']}) | {device} | {g(case['static'].total)} |"
        fits_dta = ", ".join(f"{'fits' if budget_for(case['dta'][b] - case['static'].total, case['static']) <= d['budget'] else 'no'}"
                             for b in DTA_BLOCKS) if "dta" in case else "-"
        if "refused" in d:
            rows.append(f"{head} does not fit: smallest budget {g(d['refused'])} | - | - | - | - | {dta_text} ({fits_dta}) |")
            continue
        o = d["outcome"]
        lever = (f"{o.lever.micro_batch_tokens} tokens, {o.lever.recompute_layers} layers recomputed, "
                 f"{o.details['dropped_graphs']} producers recomputed"
                 + (f", {g(d['offloaded'])} GiB offloaded" if o.lever.offload else ""))
        rows.append(f"{head} {lever} | {g(d['peak'])} | {d['ratio']:.3f} | {o.details['sharing']} | "
                    f"{o.seconds:.2f} | {dta_text} ({fits_dta}) |")
    return rows


def budget_main(args) -> None:
    """``--memory-budget``: the table of docs/benchmarks.md's "The GPU arithmetic under one budget"."""
    budgets = {f"{float(gib):g} GiB": int(float(gib) * GIB * (1 - DEFAULT_HEADROOM_FRACTION)) for gib in args.devices.split(",")}
    ladder = micro_batch_ladder(args.micro_batch_tokens)
    workloads = [w for w in BUDGET_WORKLOADS if not args.workloads or any(w.startswith(k) for k in args.workloads.split(";"))]
    print(f"static: bf16 weights + fp32 gradient buffers + Adam (fp32 moments and master weights), "
          f"{'sharded over DP = 8 / TP by the distributed optimizer' if not args.no_distributed_optimizer else 'not sharded (no distributed optimizer)'}; "
          f"budget: the device's memory less {DEFAULT_HEADROOM_FRACTION:.0%}; micro-batch ladder {ladder}\n")
    print("| model | workload | TP (DP, EP) | device | static GiB | chosen plan | predicted peak GiB | time vs keeping "
          "everything | sharing | predicted step s | AReaL-DTA peak GiB (whole / blocks 4096 / 2048; fits) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        arch = architecture(model)
        for workload in workloads:
            batch = BUDGET_WORKLOADS[workload](arch.vocab_size)
            for tp in (int(t) for t in args.tp.split(",")):
                if arch.num_attention_heads % tp or arch.num_kv_heads % tp:
                    continue  # (TP must divide the heads: the model does not take it)
                case = budget_case(arch, batch, tp, budgets, ladder, not args.no_distributed_optimizer, args.offload)
                for row in budget_rows(model_title(model), case, workload, tp):
                    print(row, flush=True)

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="2048,4096,8192,16384,32768")
    p.add_argument("--models", default="7B,32B")
    p.add_argument("--long", action="store_true", help="also the 128k-token step-wise trajectory")
    p.add_argument("--latent-cache", default="latent", choices=["latent", "per-head"],
                   help="latent attention: what a cached prefix keeps (the actor's --latent-cache)")
    p.add_argument("--memory-budget", action="store_true", help="the planner's choice under one memory budget per "
                   "device, model and TP (its own table; --models default 7B,32B,qwen3-30b-a3b)")
    p.add_argument("--devices", default="80,141", help="--memory-budget: device memories in GiB")
    p.add_argument("--tp", default="1,2,4,8", help="--memory-budget: tensor-parallel sizes")
    p.add_argument("--workloads", default="", help="--memory-budget: ';'-separated prefixes of the workloads' "
                   "names (default: all but the smoke test's)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384, help="--memory-budget: the ladder's top")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--offload", action="store_true", help="--memory-budget: host offload is a lever (priced; "
                   "not implemented on CUDA yet)")
    p.add_argument("--copies-kept", action="store_true", help="plan the flash backend as it was before it read "
                   "cached prefixes again in backward: every kept graph holds copies of the prefixes it read")
    args = p.parse_args(argv)
    if args.copies_kept:  # (what the engine and this script read)
        backends.READS_CACHED_PREFIXES = backends.READS_CACHED_PREFIXES - {"flash"}
    if args.memory_budget:
        if args.models == "7B,32B":
            args.models = "7B,32B,qwen3-30b-a3b"
        if not args.workloads:
            args.workloads = ";".join(w for w in BUDGET_WORKLOADS if not w.startswith("smoke"))
        return budget_main(args)
    workloads = dict(WORKLOADS, **(LONG_WORKLOADS if args.long else {}))
    budgets = [int(b) for b in args.budgets.split(",")]
    for model in args.models.split(","):
        arch = architecture(model)
        latent = arch.multi_latent_attention
        if latent:
            arch = dataclasses.replace(arch, latent_cache=args.latent_cache)
        geometry = KVGeometry.for_model(arch, 1, 1, torch.bfloat16, torch.device("cpu"))
        act = activation_bytes_per_token(arch, 1, 2, "flash")
        fixed = geometry.fixed_bytes_per_source
        state = f", {fixed / 2**20:.0f} MiB of linear-layer states per cached prefix" if fixed else ""
        kept = f"{'latent + RoPE key' if arch.latent_cache == 'latent' else 'per-head K+V'} (--latent-cache " \
               f"{arch.latent_cache})" if latent else "K+V"
        print(f"\n**{model_title(model)}** (bf16, TP 1): {act / 1024:.0f} KiB of kept graph per token, "
              f"{geometry.row_bytes_per_token / 1024:.0f} KiB of {kept} per token{state}, loss head "
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
