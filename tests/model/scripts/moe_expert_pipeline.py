"""Under torchrun (4 ranks, gloo): a Qwen3-MoE model with pipeline parallelism AND expert
parallelism, PP = 2 x DP = 2 x EP = 2 (the expert group of a stage is its two data-parallel
ranks, one per pipeline), prefix sharing with cached prefixes (mechanism 2: micro-batches far
smaller than the trees), against the per-sample Hugging Face reference on every rank: log-probs,
the loss, the gradient of every parameter this rank's stage holds (the dense ones summed over
the two pipelines, its own experts', which saw the tokens of both pipelines through the
all-to-all) and one SGD step (lr 1: the update is minus the gradient). The two pipelines get
different numbers of micro-batches: the empty passes that keep each stage's all-to-alls in step
are counted and printed.

Usage: moe_expert_pipeline.py HF_DIR [MICRO_BATCH_TOKENS] [NUM_ROOTS] [SEED]
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
    micro_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    num_roots = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    records = random_tree_records(seed=seed, num_roots=num_roots)
    batch = samples_from_dicts(records, source="records")
    loss = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=micro_batch, prefix_sharing="tree", loss=loss, pipeline_model_parallel_size=2,
        expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
        optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0)))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    assert parallel_state.get_pipeline_model_parallel_world_size() == 2
    assert parallel_state.get_data_parallel_world_size() == 2
    hf = load_hf_model(hf_dir)

    lp_err = assert_logprobs_match(actor, records, hf, batch)

    ref_loss, ref_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")

    own = {}  # this pipeline's micro-batches in the training step
    train = actor.engine.runner.train

    def counting_train(plan, rank, *args, **kwargs):
        own["micro_batches"] = len(plan.ranks[rank].micro_batches)
        own["cached_prefixes"] = len(plan.ranks[rank].sources)
        return train(plan, rank, *args, **kwargs)

    actor.engine.runner.train = counting_train

    # the gradients, summed as megatron's DDP sums them (dense: over DP; experts: over expert-DP)
    result, worst = assert_step_grads_match(actor, records, ref_loss, ref_grads, ep_rank, 2)
    empty = actor.engine.runner.last_empty_expert_passes
    schedule = actor.engine.runner.last_schedule
    actor.zero_grad()

    # one SGD step (lr 1) through megatron's optimizer: the update is minus those gradients
    metrics = assert_sgd_step_matches(actor, records, ref_loss, ref_grads, ep_rank, 2)
    print(f"rank {torch.distributed.get_rank()} pp_rank {pp_rank} dp_rank {dp_rank} ep_rank {ep_rank}: "
          f"logprob err {lp_err:.2e}, loss {metrics['loss']:.6f} (ref {ref_loss:.6f}), worst grad rel err "
          f"{worst:.2e}, schedule {schedule}, own micro-batches {own['micro_batches']}, cached prefixes {own['cached_prefixes']}, micro-batches {metrics['micro_batches']}, "
          f"tokens computed {metrics['tokens_computed']} of {metrics['tokens_total']}, empty passes {empty}",
          flush=True)
    actor.close()


if __name__ == "__main__":
    main()
