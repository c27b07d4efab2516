"""PolicyActor in a parallel layout under torchrun (pipeline, tensor, sequence, data or expert
parallelism): for every model and mode, log-probs and one SGD step (lr 1, so the step is minus
the gradient); rank 0 saves what every rank got.

    torchrun --nproc_per_node 4 pipeline_step.py --hf-dir llama=DIR --hf-dir qwen3=DIR \\
        --records FILE.json --tp 1 --pp 2 --out FILE [--vpp 2] [--placement cross-rank] \\
        [--sequence-parallel] [--ep 2]

Modes: ``m1`` (every tree fits a micro-batch: 1F1B, interleaved with virtual stages), ``m2`` (micro-batches
a tenth of the largest tree: cached prefixes, graphs kept), ``m2-recompute`` (a KV budget so
small that producers drop their graph and recompute it).
"""

import argparse
import json

import torch
import torch.distributed as dist
from helpers.actor_steps import logprobs_and_step

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.model import ModelArchitecture
from megatron_psrl.model.logits import loss_head_peak_bytes

p = argparse.ArgumentParser()
p.add_argument("--hf-dir", action="append", required=True, help="NAME=DIR")
p.add_argument("--records", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=2)
p.add_argument("--vpp-layers", type=int, default=None, help="--num-layers-per-virtual-pipeline-stage")
p.add_argument("--first-layers", type=int, default=None, help="--decoder-first-pipeline-num-layers")
p.add_argument("--ep", type=int, default=1, help="--expert-model-parallel-size (MoE; the alltoall dispatcher)")
p.add_argument("--sequence-parallel", action="store_true", help="--sequence-parallel (with --tp > 1)")
p.add_argument("--recompute", action="store_true", help="full activation recomputation, one layer per unit")
p.add_argument("--modes", default="m1,m2,m2-recompute",
               help="modes, each run with every --hf-dir, or NAME:MODE pairs (each mode with that family only)")
p.add_argument("--placement", default="auto", help="--placement (cross-rank: trees split over pipelines)")
p.add_argument("--m1-budget", type=int, default=72, help="every tree fits, several micro-batches")
p.add_argument("--m2-budget", type=int, default=16)
p.add_argument("--recompute-kv-budget", type=int, default=120000,
               help="bytes of K/V blocks and graphs; the loss head every memory plan charges is added")
p.add_argument("--out", required=True)
args = p.parse_args()



def modes_of(family: str):
    """The modes ``--modes`` runs with ``family``: all of them, or those given as ``family:MODE``."""
    modes = args.modes.split(",")
    if ":" not in args.modes:
        return modes
    return [m.split(":", 1)[1] for m in modes if m.startswith(f"{family}:")]


records = json.load(open(args.records))
longest = max(len(r["tokens"]) for r in records)
results = {}
for spec in args.hf_dir:
    name, hf_dir = spec.split("=", 1)
    head = loss_head_peak_bytes(ModelArchitecture.from_hf_dir(hf_dir).padded_vocab_size(args.tp) // args.tp,
                                args.m2_budget)
    MODES = {"m1": dict(micro_batch_tokens=args.m1_budget),
             "m2": dict(micro_batch_tokens=args.m2_budget),
             "m2-recompute": dict(micro_batch_tokens=args.m2_budget, kv_cache_budget=args.recompute_kv_budget + head)}
    for mode in modes_of(name):
        actor = PolicyActor(hf_dir, ActorConfig(
            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, device="cpu",
            sequence_parallel=args.sequence_parallel, expert_model_parallel_size=args.ep,
            **(dict(moe_token_dispatcher_type="alltoall") if args.ep > 1 else {}),
            num_layers_per_virtual_pipeline_stage=args.vpp_layers, decoder_first_pipeline_num_layers=args.first_layers,
            **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
               if args.recompute else {}),
            placement=args.placement, optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0),
            loss=LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean"),
            **MODES[mode]))
        res = logprobs_and_step(actor, records)
        metrics = res.pop("metrics")
        results[(name, mode)] = dict(res, **{
            "micro_batches": metrics["micro_batches"], "tokens_recomputed": metrics["tokens_recomputed"],
            "tokens_computed": metrics["tokens_computed"], "tokens_total": metrics["tokens_total"],
            "tokens_recomputed_across_groups": metrics["tokens_recomputed_across_groups"],
            "placement": metrics["placement"], "exchanged_bytes": metrics["exchanged_bytes"],
            "plan_rank_cost": metrics["plan_rank_cost"], "kv_hit_rate": metrics.get("kv_hit_rate"),
            "bubble": metrics.get("pipeline_bubble"), "schedule": metrics.get("pipeline_schedule"), "longest": longest})
if dist.get_rank() == 0:
    torch.save(results, args.out)
actor.close()
