"""One prefix-shared training step under torchrun; rank 0 saves the loss and full gradients.

    torchrun --nproc_per_node 2 distributed_step.py --hf-dir DIR --tp T --out FILE [--budget N]
"""

import argparse
import dataclasses

import torch
import torch.distributed as dist
from helpers.batches import random_tree_batch
from megatron.core import parallel_state

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.checkpoint.sharding import merge_state_dicts
from megatron_psrl.distributed.setup import initialize_parallel, shutdown_parallel
from megatron_psrl.engine.logprobs import compute_logprobs
from megatron_psrl.engine.optimizer import OptimizerSettings, TrainingOptimizer
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

p = argparse.ArgumentParser()
p.add_argument("--hf-dir", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--budget", type=int, default=4096)
p.add_argument("--seed", type=int, default=7)
p.add_argument("--out", required=True)
p.add_argument("--latent-cache", default="latent", help="latent attention: what a cached prefix keeps")
args = p.parse_args()

layout = initialize_parallel(args.tp, 1, seed=0, device="cpu")
arch, model, _ = load_model(ModelSource(hf_dir=args.hf_dir))
if arch.multi_latent_attention:
    arch = dataclasses.replace(arch, latent_cache=args.latent_cache)
batch = random_tree_batch(seed=args.seed, num_roots=4, vocab_size=arch.vocab_size)
cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=args.budget, sharing="tree",
                                                        data_parallel_size=layout.data_parallel_size))
rank = plan.ranks[layout.dp_rank]
geom = KVGeometry.for_model(arch, args.tp, 1, torch.float32, torch.device("cpu"))
memory = plan_memory(rank, geom, 1 << 30, activation_bytes_per_token(arch, args.tp, 4)) if rank.sources else None
# megatron's DDP before the backward: its hooks accumulate the gradients in main_grad
optimizer = TrainingOptimizer(model, OptimizerSettings(lr=0.0))
out = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=BlockKVCache(geom, 1 << 30)).train(
    plan, layout.dp_rank, cfg, memory)
optimizer.reduce_gradients()  # the real data-parallel reduction
loss = torch.tensor([out.loss], dtype=torch.float64)
dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
shards = [None] * args.tp
dist.all_gather_object(shards, grads, group=parallel_state.get_tensor_model_parallel_group())
logprobs = compute_logprobs(model, arch, batch, micro_batch_tokens=args.budget)
if layout.rank == 0:
    full = merge_state_dicts({(r, 0): shards[r] for r in range(args.tp)}, arch, args.tp, 1)
    torch.save({"loss": float(loss), "grads": full, "logprobs": logprobs,
                "micro_batches": [len(r.micro_batches) for r in plan.ranks],
                "sources": [len(r.sources) for r in plan.ranks]}, args.out)
shutdown_parallel()
