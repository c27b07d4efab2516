"""The Python API in one page: what an RL framework calls, in memory, no files.

    python examples/library_api.py        # about 15 s on 2 CPU cores

Run under ``torchrun --nproc_per_node N`` with ``tensor_model_parallel_size`` set and every rank
does the same calls on the same batch.
"""

import numpy as np
import torch

from megatron_psrl import ActorConfig, GSPOLoss, OptimizerSettings, PolicyActor, log_likelihood_loss
from megatron_psrl.data import make_workload
from megatron_psrl.tree import build_prefix_tree, tree_stats

config = ActorConfig(micro_batch_tokens=1024, device="cpu", optimizer=OptimizerSettings(lr=1e-5))
actor = PolicyActor("tiny-llama", config)  # or an HF folder, a checkpoint, a transformers model

# A batch is a list of dicts (lists, numpy arrays or torch tensors), as a rollout worker makes it.
trace = make_workload("stepwise", vocab_size=actor.arch.vocab_size, seed=0)
batch = [dict(tokens=trace.tokens[trace.sample_slice(s)], loss_mask=trace.loss_mask[trace.sample_slice(s)],
              advantage=float(trace.advantages[trace.sample_slice(s)][-1])) for s in range(trace.num_samples)]
stats = tree_stats(build_prefix_tree(actor.as_batch(batch)), actor.cost_model)
print(f"{len(batch)} step-wise samples, {stats.tokens_total} tokens, {stats.tokens_in_tree} in the prefix tree "
      f"(ideal speedup {stats.ideal_speedup:.2f}x)")

# 1. log-probs of the rollouts (the 'old' policy), prefix-shared.
old = actor.compute_logprobs(batch)
plain = PolicyActor("tiny-llama", ActorConfig(micro_batch_tokens=1024, device="cpu", prefix_sharing="none"),
                    for_training=False).compute_logprobs(batch)
print(f"log-probs with prefix sharing equal the per-sample computation: max |diff| "
      f"{max(float(np.abs(a - b).max()) for a, b in zip(old, plain)):.1e}")
for sample, lp in zip(batch, old):
    sample["old_logprobs"] = lp

# 2. one PPO/GRPO step; it returns the log-probs it computed (no second pass).
metrics = actor.train_step(batch, clip_eps=0.2)
print(f"train_step: loss {metrics['loss']:.4e}, grad norm {metrics['grad_norm']:.4f}, "
      f"{metrics['tokens_total']} tokens in {metrics['micro_batches']} micro-batches, "
      f"log-probs returned for {len(metrics['logprobs'])} samples")

# 3. other losses: SFT on trajectories (a per-claim function), GSPO (sequence-level ratios).
sft = actor.train_step(batch, loss_fn=log_likelihood_loss)
gspo = actor.train_step(batch, loss_fn=GSPOLoss(clip_eps=3e-4))
print(f"SFT loss (mean NLL of trained tokens) {sft['loss']:.4f}; GSPO loss {gspo['loss']:.4e}")

# 4. gradients without the optimizer step (accumulate over calls, or use your own optimizer).
actor.zero_grad()
actor.forward_backward(batch[: len(batch) // 2])
actor.forward_backward(batch[len(batch) // 2:])
outcome = actor.optimizer_step()
print(f"two forward_backward calls + optimizer_step: grad norm {outcome.grad_norm:.4f}")

# 5. weights for the inference engine, with Hugging Face names.
weights = actor.state_dict_hf()
print(f"state_dict_hf: {len(weights)} tensors, e.g. {next(iter(weights))} {tuple(next(iter(weights.values())).shape)}")
actor.load_hf_state_dict(weights)  # and back (e.g. a reference policy's weights)
assert torch.equal(actor.state_dict_hf()["lm_head.weight"], weights["lm_head.weight"])
print("load_hf_state_dict(state_dict_hf()) restores every weight bit for bit")
