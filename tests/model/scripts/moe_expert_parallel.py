"""Under torchrun (2 ranks, gloo): a Qwen3-MoE model with expert parallelism (EP = DP = 2, the
alltoall dispatcher), prefix sharing with cached prefixes, against the per-sample Hugging Face
reference on every rank: log-probs, the loss, the gradient of every parameter this rank holds
(the dense ones summed over both ranks, its own experts', which saw the tokens of both ranks
through the all-to-all), and one SGD step through megatron's optimizer (lr 1: the update is
minus the gradient). Ranks get different numbers of micro-batches: the empty passes that keep
their all-to-alls in step are counted and printed.

Usage: moe_expert_parallel.py HF_DIR [MICRO_BATCH_TOKENS] [SHARING] [NUM_ROOTS]
"""

import sys
import warnings

import torch

warnings.filterwarnings("ignore")

from helpers.batches import random_tree_records  # noqa: E402
from helpers.expert_parallel import (  # noqa: E402
    assert_logprobs_match,
    assert_sgd_step_matches,
    assert_step_grads_match,
)
from helpers.hf_reference import load_hf_model, per_sample_loss_and_grads  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor  # noqa: E402
from megatron_psrl.data.loader import samples_from_dicts  # noqa: E402


def main() -> None:
    hf_dir = sys.argv[1]
    micro_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    sharing = sys.argv[3] if len(sys.argv) > 3 else "tree"
    num_roots = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    records = random_tree_records(seed=5, num_roots=num_roots)
    batch = samples_from_dicts(records, source="records")
    loss = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=micro_batch, prefix_sharing=sharing, loss=loss, expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall", optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0)))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    hf = load_hf_model(hf_dir)

    lp_err = assert_logprobs_match(actor, records, hf, batch)

    ref_loss, ref_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")

    # the gradients, summed as megatron's DDP sums them (dense: over DP; experts: over expert-DP)
    result, worst = assert_step_grads_match(actor, records, ref_loss, ref_grads, ep_rank, 2)
    empty = actor.engine.runner.last_empty_expert_passes
    actor.zero_grad()

    # one SGD step (lr 1) through megatron's optimizer: the update is minus those gradients
    metrics = assert_sgd_step_matches(actor, records, ref_loss, ref_grads, ep_rank, 2)
    print(f"rank {torch.distributed.get_rank()} ep_rank {ep_rank}: logprob err {lp_err:.2e}, loss {metrics['loss']:.6f} "
          f"(ref {ref_loss:.6f}), worst grad rel err {worst:.2e}, micro-batches {metrics['micro_batches']}, "
          f"tokens computed {metrics['tokens_computed']} of {metrics['tokens_total']}, empty passes {empty}",
          flush=True)
    actor.close()


if __name__ == "__main__":
    main()
