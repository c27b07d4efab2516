"""PolicyActor under torchrun: log-probs and one SGD step on every rank; rank 0 saves them.

    torchrun --nproc_per_node 2 actor_step.py --hf-dir DIR --records FILE.json --tp T --out FILE
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from helpers.actor_steps import logprobs_and_step

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor

p = argparse.ArgumentParser()
p.add_argument("--hf-dir", required=True)
p.add_argument("--records", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--micro-batch-tokens", type=int, default=32)
p.add_argument("--lr", type=float, default=1.0)
p.add_argument("--out", required=True)
p.add_argument("--different-batches", action="store_true", help="rank 1 drops a sample (must be refused)")
args = p.parse_args()

records = json.load(open(args.records))
if args.different_batches and int(os.environ["RANK"]) == 1:
    records = records[:-1]
actor = PolicyActor(args.hf_dir, ActorConfig(
    tensor_model_parallel_size=args.tp, device="cpu", micro_batch_tokens=args.micro_batch_tokens,
    optimizer=OptimizerSettings(optimizer="sgd", lr=args.lr, clip_grad=0.0),
    loss=LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")))
# Every rank must return the same log-probs and hold the same full weights.
res = logprobs_and_step(actor, records)
if dist.get_rank() == 0:
    metrics = res.pop("metrics")
    torch.save(dict(res, micro_batches=metrics["micro_batches"], world=dist.get_world_size()), args.out)
actor.close()
