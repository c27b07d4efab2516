"""One training step with cross-rank placement under torchrun; rank 0 saves the loss, the full
gradients, the log-probs and what the plan did.

    torchrun --nproc_per_node N cross_rank_step.py --hf-dir DIR --batch KIND --out FILE
        [--tp T] [--cp C] [--budget N] [--kv-budget BYTES] [--ignore-imported-states]

A hybrid model (linear-attention layers) keeps its layers' prefix states (the cache geometry of
its family); ``--ignore-imported-states`` zeroes every linear-layer state a rank receives (the
comparison must then fail).

The exchange group is megatron's context-parallel group when --cp > 1, else the data-parallel
group; gradients are summed over data x context parallel ranks, as megatron does.
"""

import argparse

import torch
import torch.distributed as dist
from helpers.batches import cross_rank_batch
from megatron.core import parallel_state

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.checkpoint.sharding import merge_state_dicts
from megatron_psrl.distributed.setup import exchange_group_of, initialize_parallel, shutdown_parallel
from megatron_psrl.engine.logprobs import compute_logprobs
from megatron_psrl.engine.optimizer import OptimizerSettings, TrainingOptimizer
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory_group
from megatron_psrl.schedule.with_memory import plan_with_memory
from megatron_psrl.tree import build_prefix_tree

p = argparse.ArgumentParser()
p.add_argument("--hf-dir", required=True)
p.add_argument("--batch", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--cp", type=int, default=1)
p.add_argument("--budget", type=int, default=64)
p.add_argument("--kv-budget", type=int, default=1 << 30)
p.add_argument("--out", required=True)
p.add_argument("--ignore-imported-states", action="store_true", help="zero the linear states received")
args = p.parse_args()
if args.ignore_imported_states:
    from megatron_psrl.distributed.state_exchange import StateLink

    def zeroed(method):
        def run(self, *a, **kw):
            got = method(self, *a, **kw)
            for t in got.values():
                t.zero_()
            return got
        return run

    StateLink.receive_before = zeroed(StateLink.receive_before)
    StateLink.send_after = zeroed(StateLink.send_after)

layout = initialize_parallel(args.tp, 1, seed=0, device="cpu", context_parallel_size=args.cp)
arch, model, _ = load_model(ModelSource(hf_dir=args.hf_dir))
batch = cross_rank_batch(args.batch, vocab_size=arch.vocab_size)
cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
group, group_size = exchange_group_of(layout)
config = PlannerConfig(micro_batch_tokens=args.budget, sharing="tree",
                       data_parallel_size=layout.data_parallel_size * layout.context_parallel_size,
                       exchange_group_size=group_size, placement="cross-rank", cost_model=CostModel.named("tiny"))
# the family's states: softmax K/V (latent attention's values narrower), a hybrid's fixed one per linear layer
geom = KVGeometry.for_model(arch, args.tp, 1, torch.float32, torch.device("cpu"))
act = activation_bytes_per_token(arch, args.tp, 4)
plan, memories, mode = plan_with_memory(build_prefix_tree(batch), config,
                                        lambda ranks: plan_memory_group(ranks, geom, args.kv_budget, act))
me = layout.placement_rank
cache = BlockKVCache(geom, args.kv_budget)
runner = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=cache, exchange_group=group)
# megatron's DDP before the backward: its hooks accumulate the gradients in main_grad
optimizer = TrainingOptimizer(model, OptimizerSettings(lr=0.0))
out = runner.train(plan, me, cfg, memories[me])
optimizer.reduce_gradients()  # the real reduction: data x context parallel sum, TP-partial sums
loss = torch.tensor([out.loss, float(out.tokens_recomputed)], dtype=torch.float64)
dist.all_reduce(loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
shards = [None] * args.tp
dist.all_gather_object(shards, grads, group=parallel_state.get_tensor_model_parallel_group())
logprobs = compute_logprobs(model, arch, batch, micro_batch_tokens=args.budget, exchange_group=group,
                            cost_model=CostModel.named("tiny"), placement="cross-rank")
if layout.rank == 0:
    full = merge_state_dicts({(r, 0): shards[r] for r in range(args.tp)}, arch, args.tp, 1)
    torch.save({"loss": float(loss[0]), "recomputed": int(loss[1]), "grads": full, "logprobs": logprobs,
                "mode": mode, "placements": plan.placements,
                "steps": [len(r.micro_batches) for r in plan.ranks],
                "peer_reads": sum(len(mb.peer_reads) for r in plan.ranks for mb in r.micro_batches),
                "replicas": sum(s.replica_of is not None for r in plan.ranks for s in r.sources.values()),
                "exchanged_tokens": plan.exchanged_tokens(), "imbalance": plan.imbalance(),
                "cached_reads": sum(len(mb.reads) for r in plan.ranks for mb in r.micro_batches),
                # rows of cached sources a sliding window's pool does not keep (no reader reaches them)
                "window_cut_rows": sum(p.state.unread_rows(s.length, *s.reach) for r in plan.ranks
                                       for s in r.sources.values() for p in geom.pools),
                # rows of exchanged chains a sliding window's layers do not send (per layer kind)
                "window_unsent_rows": sum(p.state.unread_rows(len(c), *reach) for r in plan.ranks
                                          for mb in r.micro_batches if mb.exchange is not None
                                          for dst, chains in mb.exchange.send.items()
                                          for c, reach in zip(chains, mb.exchange.send_reach.get(dst, []))
                                          for p in geom.pools)}, args.out)
shutdown_parallel()
