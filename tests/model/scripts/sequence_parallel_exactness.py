"""Under torchrun (gloo): a model with tensor parallelism and sequence parallelism (TP = 2; an
MoE model also with expert parallelism EP, the experts split over the tensor- and
data-parallel ranks), prefix sharing with cached prefixes, against the per-sample Hugging Face
reference on every rank:
log-probs, the loss, the gradient of every parameter this rank holds (its tensor-parallel shard
of the reference's; dense ones summed over the data-parallel ranks, the norms' and the router's
over the tensor-parallel ranks, which each saw a share of the rows), and one SGD step through
megatron's optimizer (lr 1: the update is minus the gradient). Packs whose token count is odd
are padded to a multiple of TP rows: the number of such packs is printed. An MoE model's
reported expert load counts every computed row once per layer (the TP ranks' shares summed,
padding rows not at all).

With PP = 2 (4 ranks) the stages pass each other their TP ranks' shares of the padded rows;
with CP = 2 the context-parallel ranks exchange the prefix K/V of their padded packs.

With ``--placement cross-rank`` and CP = 2 an MoE model's context-parallel ranks split its
trees and exchange prefix K/V inside passes whose MoE layers exchange tokens over the expert
group: the expert lockstep takes each exchange group as one participant. With CP = 1 the
trees are split over the data-parallel ranks instead (one exchange group of them all). TP = 1
runs the same checks without tensor or sequence parallelism. A cross-rank run plans with fixed
costs (:data:`FIXED_COSTS`) instead of the start-up measurement: which trees are split where, and
so which packs come out of odd length, would otherwise follow this machine's timing.

Usage: sequence_parallel_exactness.py HF_DIR EP DISPATCHER [MICRO_BATCH_TOKENS] [PP] [CP] [PLACEMENT] [TP]
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
from megatron_psrl.engine import calibration  # noqa: E402

FIXED_COSTS = dict(seconds_per_token=1.6e-4, seconds_per_key=4.1e-6, seconds_per_row=2.8e-5,
                   seconds_per_micro_batch=0.053, seconds_per_byte=2.75e-9, seconds_per_exchange=4.8e-4,
                   exchange_exposed_fraction=0.8)
"""What a cross-rank run plans with: one start-up measurement of this model on a 2-core CPU (a
plan every rank of every machine makes alike; every case's pack-count checks hold for it)."""


def plan_with_fixed_costs() -> None:
    """The start-up cost measurement replaced by :data:`FIXED_COSTS` (under the run's own key,
    so the run takes them as measured for it)."""
    calibration.measure_costs = lambda *args, key="", **kwargs: calibration.MeasuredCosts(**FIXED_COSTS, key=key)


def main() -> None:
    hf_dir, ep, dispatcher = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    micro_batch = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    pp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    cp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    placement = sys.argv[7] if len(sys.argv) > 7 else "auto"
    tp = int(sys.argv[8]) if len(sys.argv) > 8 else 2
    if placement == "cross-rank":
        plan_with_fixed_costs()
    records = random_tree_records(seed=5, num_roots=3)
    batch = samples_from_dicts(records, source="records")
    loss = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=micro_batch, tensor_model_parallel_size=tp, sequence_parallel=True,
        pipeline_model_parallel_size=pp, context_parallel_size=cp, placement=placement,
        expert_model_parallel_size=ep, moe_token_dispatcher_type=dispatcher, loss=loss,
        optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0)))
    assert parallel_state.get_tensor_model_parallel_world_size() == tp
    assert actor.model.config.sequence_parallel == (tp > 1)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    hf = load_hf_model(hf_dir)

    lp_err = assert_logprobs_match(actor, records, hf, batch)
    ref_loss, ref_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")

    padded = []
    original = actor.model.forward

    def counting_forward(input_ids, position_ids, *args, **kwargs):
        padded.append(position_ids.shape[0] % tp)
        return original(input_ids, position_ids, *args, **kwargs)

    actor.model.forward = counting_forward
    result, worst = assert_step_grads_match(actor, records, ref_loss, ref_grads, ep_rank, ep)
    actor.zero_grad()

    metrics = assert_sgd_step_matches(actor, records, ref_loss, ref_grads, ep_rank, ep)
    # every computed row counted once per layer (summed over the TP ranks' shares, padding not at all)
    arch = actor.arch
    # (without sequence parallelism the last layer may compute only the rows the loss head reads,
    # and counts only those: the rule holds for the layers before it)
    loads = metrics.get("moe_expert_load", [])
    for layer, (_, mean) in enumerate(loads if tp > 1 else loads[:-1]):
        expected = arch.moe_router_topk * metrics["tokens_computed"] / arch.num_experts
        assert abs(mean - expected) <= 1e-3, (layer, mean, expected)
    empty = actor.engine.runner.last_empty_expert_passes
    print(f"rank {torch.distributed.get_rank()} tp_rank {parallel_state.get_tensor_model_parallel_rank()} ep_rank "
          f"{ep_rank}: logprob err {lp_err:.2e}, loss {metrics['loss']:.6f} (ref {ref_loss:.6f}), worst grad rel err "
          f"{worst:.2e}, micro-batches {metrics['micro_batches']}, padded packs {sum(padded)} of {len(padded)}, "
          f"kv hit rate {metrics.get('kv_hit_rate', 0.0):.2f}, placement {metrics['placement']}, exchanged "
          f"{metrics['exchanged_bytes']}, empty passes {empty}", flush=True)
    actor.close()


if __name__ == "__main__":
    main()
