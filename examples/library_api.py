"""The Python API in one page: samples -> prefix tree -> plan -> log-probs (and what sharing saves)."""

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.data import make_workload
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.training.logprobs import compute_logprobs
from megatron_psrl.training.trainer import cost_model_for
from megatron_psrl.tree import build_prefix_tree, tree_stats
from megatron_psrl.tree.planner import PlannerConfig, plan_step

initialize_parallel(tensor_parallel_size=1, device="cpu")
arch, model, _ = load_model(ModelSource(tiny="tiny-llama"))

batch = make_workload("stepwise", vocab_size=arch.vocab_size, seed=0)  # or load_samples("rollouts.jsonl")
tree = build_prefix_tree(batch)
stats = tree_stats(tree, cost_model_for(arch))
print(f"{batch.num_samples} samples, {stats.tokens_total} tokens, {stats.tokens_in_tree} in the tree, "
      f"ideal speedup {stats.ideal_speedup:.2f}x")

plan = plan_step(tree, PlannerConfig(micro_batch_tokens=256, sharing="tree"))  # trees > 256 tokens: mechanism 2
rank = plan.ranks[0]
print(f"{len(rank.micro_batches)} micro-batches, {len(rank.sources)} cached prefix sources, schedule {rank.schedule[:6]}...")

logprobs = compute_logprobs(model, arch, batch, micro_batch_tokens=256)
print(f"sample 0: {len(logprobs[0])} log-probs, mean {logprobs[0][1:].mean():.3f}")
