"""Under torchrun (2 ranks, gloo): the router z-loss and load-balancing loss with expert
parallelism (EP = DP = 2, the alltoall dispatcher) and cached prefixes, first with router replay
(route counts from the routes), then without (the route-count pre-pass, summed over the ranks).
Every rank checks the loss, the reported router losses and the gradient of every parameter it
holds against the per-sample Hugging Face reference (policy loss + router losses of the whole
batch). The lockstep's empty passes add no router-loss term.

With TP = 2 (sequence parallelism; 2 ranks: EP = TP = 2) each tensor-parallel rank routes a
share of every pack's rows, padding rows included, which weigh nothing.

Usage: moe_router_losses.py HF_DIR [MICRO_BATCH_TOKENS] [TP]
"""

import contextlib
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

from helpers.batches import random_tree_records  # noqa: E402
from helpers.expert_parallel import assert_step_grads_match  # noqa: E402
from helpers.hf_reference import load_hf_model, per_sample_loss_and_grads  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from model.test_moe_router_losses import AUX_COEFF, LOSS, Z_COEFF, reference_router_losses, replayed, with_routes  # noqa: E402

from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor  # noqa: E402
from megatron_psrl.data.loader import samples_from_dicts  # noqa: E402


def main() -> None:
    hf_dir = sys.argv[1]
    micro_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=micro_batch, loss=LOSS, expert_model_parallel_size=2,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        moe_token_dispatcher_type="alltoall", moe_z_loss_coeff=Z_COEFF, moe_aux_loss_coeff=AUX_COEFF,
        optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0)))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    hf = load_hf_model(hf_dir)
    plain = random_tree_records(seed=5, num_roots=3)
    for name, records in (("replay", with_routes(plain)), ("own-routes", plain)):
        batch = samples_from_dicts(records, source="records")
        replay = name == "replay"
        with replayed(hf, batch) if replay else contextlib.nullcontext():
            ref_loss, policy_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
            z, aux = reference_router_losses(hf, batch, Z_COEFF, AUX_COEFF, replay)
        ref_grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if n in policy_grads}
        actor.engine.optimizer.zero_grad()
        result, worst = assert_step_grads_match(actor, records, ref_loss + z + aux, ref_grads, ep_rank, 2)
        m = result.metrics
        assert abs(m["moe_z_loss"] - z) <= 1e-5 * z and abs(m["moe_aux_loss"] - aux) <= 1e-5 * aux, (m, z, aux)
        print(f"rank {torch.distributed.get_rank()} tp {tp} {name} router losses ok: z {m['moe_z_loss']:.6f} (ref {z:.6f}), "
              f"aux {m['moe_aux_loss']:.6f} (ref {aux:.6f}), worst grad rel err {worst:.2e}, micro-batches "
              f"{m['micro_batches']}, empty passes {actor.engine.runner.last_empty_expert_passes}", flush=True)
    actor.close()


if __name__ == "__main__":
    main()
