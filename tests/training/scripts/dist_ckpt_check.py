"""Under torchrun: resume a torch_dist checkpoint with this run's layout (optimizer included),
check every rank's weights and optimizer state against the checkpoint's global tensors, then
train one more step; rank 0 writes what it compared.

    torchrun --nproc_per_node 2 dist_ckpt_check.py --load CKPT --tp T --pp P --out FILE.json
"""

import argparse
import json

import torch.distributed as dist
from helpers.dist_ckpt import check_rank_against_checkpoint, plain_tensors

from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor
from megatron_psrl.checkpoint.layout import read_checkpoint_info
from megatron_psrl.data import make_workload

p = argparse.ArgumentParser()
p.add_argument("--load", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--out", required=True)
args = p.parse_args()

actor = PolicyActor(args.load, ActorConfig(
    tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, device="cpu", micro_batch_tokens=512,
    optimizer=OptimizerSettings(optimizer="adam", lr=1e-3)))
it_dir, info = read_checkpoint_info(args.load)
counts = check_rank_against_checkpoint(actor, it_dir, plain_tensors(it_dir))
lr_before = actor.optimizer.lr
metrics = actor.train_step(make_workload("grpo", num_tokens_target=1500, vocab_size=actor.arch.vocab_size, seed=9),
                           return_logprobs=False)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, counts)
if dist.get_rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"counts": gathered, "iteration": actor.iteration, "saved_iteration": info.iteration,
                   "lr_before": lr_before, "grad_norm": float(metrics["grad_norm"]),
                   "skipped": bool(metrics["skipped"]), "world": dist.get_world_size()}, f)
actor.close()
