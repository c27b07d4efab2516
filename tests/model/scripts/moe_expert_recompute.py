"""Under torchrun (2 ranks, gloo): a Qwen3-MoE model with expert parallelism (EP = DP = 2, the
alltoall dispatcher) and activation recomputation, prefix sharing with cached prefixes
(mechanism 2: its kept graphs' backwards inject prefix gradients, its dropped graphs are
recomputed), against the per-sample Hugging Face reference on every rank: log-probs, the loss
and the gradient of every parameter this rank holds. A recomputed layer repeats its forward's
all-to-alls inside the backward, so the lockstep's empty passes recompute theirs the same way;
ranks get different numbers of micro-batches, so empty passes run (counted and printed). Then
the same with router replay (the rollout's routes) against the replayed reference.

Usage: moe_expert_recompute.py HF_DIR MICRO_BATCH_TOKENS KV_CACHE_BUDGET GRANULARITY [METHOD NUM_LAYERS]
(KV_CACHE_BUDGET: bytes, 0 for the default; a small one drops graphs, whose backward recomputes them)
"""

import sys
import warnings
from collections import Counter

import torch

warnings.filterwarnings("ignore")

from helpers.batches import random_tree_records  # noqa: E402
from helpers.expert_parallel import assert_logprobs_match, assert_step_grads_match  # noqa: E402
from helpers.hf_reference import load_hf_model, per_sample_loss_and_grads  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from model.test_moe_router_losses import replayed, with_routes  # noqa: E402

from megatron_psrl import ActorConfig, LossConfig, PolicyActor  # noqa: E402
from megatron_psrl.data.loader import samples_from_dicts  # noqa: E402
from megatron_psrl.model.moe import ExpertLockstep  # noqa: E402


def main() -> None:
    hf_dir = sys.argv[1]
    micro_batch, budget, granularity = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    method, num_layers = (sys.argv[5], int(sys.argv[6])) if granularity == "full" else (None, None)
    empty_kinds = Counter()  # the lockstep's empty ticks by kind (P, N, K and its B)
    run_empty = ExpertLockstep._empty
    ExpertLockstep._empty = lambda self, kind, tick, ref: (empty_kinds.update(kind), run_empty(self, kind, tick, ref))[1]
    records = random_tree_records(seed=5, num_roots=3)
    batch = samples_from_dicts(records, source="records")
    loss = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=micro_batch, prefix_sharing="tree", loss=loss, expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall", recompute_granularity=granularity, recompute_method=method,
        recompute_num_layers=num_layers, **(dict(kv_cache_budget=budget) if budget else {})))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    hf = load_hf_model(hf_dir)

    lp_err = assert_logprobs_match(actor, records, hf, batch)

    ref_loss, ref_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    empty_kinds.clear()
    result, worst = assert_step_grads_match(actor, records, ref_loss, ref_grads, ep_rank, 2)
    empty = actor.engine.runner.last_empty_expert_passes
    m, first_loss = result.metrics, result.loss
    kinds = "".join(sorted(empty_kinds.elements()))

    # router replay: a recomputing backward routes its tokens again as their forward did, an
    # empty pass's recomputation the zero token by the routers' own top-k
    routed = with_routes(records)
    routed_batch = samples_from_dicts(routed, source="records")
    with replayed(hf, routed_batch):
        replay_loss, replay_grads = per_sample_loss_and_grads(hf, routed_batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    actor.zero_grad()
    result, replay_worst = assert_step_grads_match(actor, routed, replay_loss, replay_grads, ep_rank, 2)
    worst = max(worst, replay_worst)
    print(f"rank {torch.distributed.get_rank()} ep_rank {ep_rank}: recompute {granularity} {method} {num_layers}, "
          f"logprob err {lp_err:.2e}, loss {first_loss:.6f} (ref {ref_loss:.6f}), replayed {result.loss:.6f}, worst grad rel err {worst:.2e}, "
          f"micro-batches {m['micro_batches']}, tokens recomputed {m.get('tokens_recomputed', 0)}, "
          f"empty passes {empty}, empty ticks {kinds}", flush=True)
    actor.close()


if __name__ == "__main__":
    main()
