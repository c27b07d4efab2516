"""Under torchrun (2 ranks, gloo): router replay with expert parallelism (EP = DP = 2, the
alltoall dispatcher) and cached prefixes. Samples carry routes (``routed_experts``, one twin
routed differently on a shared prefix, some one route short); every rank checks log-probs, the
loss and the gradient of every parameter it holds (dense ones summed over both ranks, its own
experts' over the tokens of both) against the per-sample Hugging Face reference with the same
routes replayed. The lockstep's empty passes (other ranks' extra micro-batches) route on their
own; their count is printed.

Usage: moe_router_replay.py HF_DIR [MICRO_BATCH_TOKENS]
"""

import sys
import warnings

import torch

warnings.filterwarnings("ignore")

from helpers.expert_parallel import assert_logprobs_match, assert_step_grads_match  # noqa: E402
from helpers.hf_reference import load_hf_model, per_sample_loss_and_grads  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from model.test_router_replay import LOSS, replayed, routed_records  # noqa: E402

from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor  # noqa: E402
from megatron_psrl.data.loader import samples_from_dicts  # noqa: E402


def main() -> None:
    hf_dir = sys.argv[1]
    micro_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    records = routed_records()
    batch = samples_from_dicts(records, source="records")
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=micro_batch, loss=LOSS, expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall", optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0)))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    hf = load_hf_model(hf_dir)

    with replayed(hf, batch):
        lp_err = assert_logprobs_match(actor, records, hf, batch)

    with replayed(hf, batch):
        ref_loss, ref_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")

    result, worst = assert_step_grads_match(actor, records, ref_loss, ref_grads, ep_rank, 2)
    empty = actor.engine.runner.last_empty_expert_passes
    print(f"rank {torch.distributed.get_rank()} replay ok: logprob err {lp_err:.2e}, loss {result.loss:.6f} "
          f"(ref {ref_loss:.6f}), worst grad rel err {worst:.2e}, micro-batches {result.metrics['micro_batches']}, "
          f"empty passes {empty}", flush=True)
    actor.close()


if __name__ == "__main__":
    main()
