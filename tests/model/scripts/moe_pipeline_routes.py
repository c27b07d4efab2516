"""Under torchrun (2 ranks, gloo): MoE router replay and the router losses with pipeline
parallelism, PP = 2 (the debug Qwen3-MoE's two layers, one per stage: stage 1's router is MoE
layer 1 of the routes), against the per-sample Hugging Face reference on every rank.

One actor with the z-loss and the load-balancing loss on (``moe_z_loss_coeff`` /
``moe_aux_loss_coeff``); phases, each a step with the loss, the log-probs it returns and the
gradient of every parameter this rank's stage holds checked (rel 1e-5):

- ``replay``: routes replayed, router losses detached from the runner (so a run without
  them: the last layer's row skip on, its router takes only the loss head's rows' routes);
  the log-prob pass too;
- ``losses-replay``: z + aux with replay (the route counts from the routes);
- ``losses-own-routes``: z + aux without routes (the route-count pre-pass over both stages).

each with micro-batches of ``MICRO_BATCH_TOKENS`` (cached prefixes: the plan-order executor)
and of ``WHOLE_TREE_TOKENS`` (whole trees, mechanism 1 only: 1F1B). The reported
``moe_z_loss`` / ``moe_aux_loss`` are the sums over both stages' layers. Then a second actor
with full activation recomputation: ``recompute-losses-replay``, whose whole-tree step runs in
1F1B too: a backward recomputes its forward after later forwards, and routes (and weighs) its
tokens as its own forward did.

Then, given a GLM-4.5 folder (4 layers: a dense one, then grouped sigmoid routing), z + aux with
the route-count pre-pass and the expert bias's update on (``grouped-losses-bias``, both
budgets): also the stage's routers' biases after megatron's ``finalize_model_grads``, bit for
bit the update of the per-sample route counts.

Usage: moe_pipeline_routes.py HF_DIR [MICRO_BATCH_TOKENS] [WHOLE_TREE_TOKENS] [GLM_HF_DIR]
"""

import contextlib
import sys
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")

from helpers.batches import random_tree_records  # noqa: E402
from helpers.expert_parallel import assert_rank_grads_match  # noqa: E402
from helpers.hf_reference import load_hf_model, per_sample_logprobs, per_sample_loss_and_grads  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from model.test_moe_router_losses import AUX_COEFF, LOSS, Z_COEFF, reference_router_losses, replayed, with_routes  # noqa: E402

from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor  # noqa: E402
from megatron_psrl.data.loader import samples_from_dicts  # noqa: E402


def reference(hf, batch, replay: bool, losses: bool):
    """``(loss, z, aux, grads, logprobs)`` of the per-sample HF computation."""
    with replayed(hf, batch) if replay else contextlib.nullcontext():
        logprobs = per_sample_logprobs(hf, batch)
        ref_loss, policy_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
        z = aux = 0.0
        if losses:  # (their backward adds to the policy gradients in .grad)
            z, aux = reference_router_losses(hf, batch, Z_COEFF, AUX_COEFF, replay)
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if n in policy_grads}
    return ref_loss + z + aux, z, aux, grads, logprobs


def make_actor(hf_dir, micro_batch, **overrides):
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=micro_batch, loss=LOSS, pipeline_model_parallel_size=2,
        moe_z_loss_coeff=Z_COEFF, moe_aux_loss_coeff=AUX_COEFF,
        optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0), **overrides))
    assert parallel_state.get_pipeline_model_parallel_world_size() == 2
    runner = actor.engine.runner
    assert runner.router_losses is not None and not runner.last_layer_row_skip
    train = runner.train

    def recording_train(plan, rank, *args, **kwargs):
        actor.seen = len(plan.ranks[rank].sources)  # this step's cached prefixes
        return train(plan, rank, *args, **kwargs)

    runner.train = recording_train
    return actor


def main() -> None:
    hf_dir = sys.argv[1]
    small = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    whole = int(sys.argv[3]) if len(sys.argv) > 3 else 72
    hf = load_hf_model(hf_dir)
    plain = random_tree_records(seed=5, num_roots=3)
    routed = with_routes(plain)
    refs = {}
    actor = make_actor(hf_dir, small)
    run_phases(actor, hf, refs, small, whole, (("replay", routed, False), ("losses-replay", routed, True),
                                                 ("losses-own-routes", plain, True)), routed)
    actor.close()
    actor = make_actor(hf_dir, small, recompute_granularity="full", recompute_method="uniform",
                       recompute_num_layers=1)
    run_phases(actor, hf, refs, small, whole, (("losses-replay", routed, True),), routed, prefix="recompute-")
    actor.close()
    if len(sys.argv) > 4:
        run_grouped(sys.argv[4], small, whole)


def run_phases(actor, hf, refs, small, whole, phases, routed, prefix="") -> None:
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    runner = actor.engine.runner
    losses = runner.router_losses
    for name, records, with_losses in phases:
        replay = records is routed
        batch = samples_from_dicts(records, source="records")
        if name not in refs:
            refs[name] = reference(hf, batch, replay, with_losses)
        total, z, aux, ref_grads, ref_logprobs = refs[name]
        # without the losses: the runner as an actor without them has it
        runner.router_losses, runner.last_layer_row_skip = (losses, False) if with_losses else (None, True)
        for budget in (small, whole):
            actor.engine.config.micro_batch_tokens = budget  # (the planner reads it every step)
            if name == "replay" and budget == small:
                ours = actor.compute_logprobs(records)
                lp_err = max(float(np.abs(a - b).max()) for a, b in zip(ours, ref_logprobs))
                assert lp_err <= 1e-5, lp_err
            actor.engine.optimizer.zero_grad()
            result = actor.forward_backward(records)
            m = result.metrics
            schedule = m["pipeline_schedule"]
            expected = "plan-order" if budget == small else "1f1b"
            assert schedule == expected, (name, budget, schedule)
            assert (actor.seen > 0) == (budget == small), (name, budget, actor.seen)
            assert abs(result.loss - total) <= 1e-5 * abs(total), (name, budget, result.loss, total)
            lp_err = max(float(np.nanmax(np.abs(a[1:] - b[1:]))) for a, b in zip(result.logprobs, ref_logprobs))
            assert lp_err <= 1e-5, (name, budget, lp_err)
            if with_losses:
                assert abs(m["moe_z_loss"] - z) <= 1e-5 * z, (name, budget, m["moe_z_loss"], z)
                assert abs(m["moe_aux_loss"] - aux) <= 1e-5 * aux, (name, budget, m["moe_aux_loss"], aux)
            else:
                assert "moe_z_loss" not in m and "moe_aux_loss" not in m, m
            actor.engine.optimizer.reduce_gradients()
            worst = assert_rank_grads_match(actor, ref_grads, 0, 1)
            print(f"rank {torch.distributed.get_rank()} pp_rank {pp_rank} {prefix}{name} schedule {schedule} "
                  f"budget {budget} ok: loss "
                  f"{result.loss:.6f} (ref {total:.6f}), z {m.get('moe_z_loss', 0.0):.6f} (ref {z:.6f}), aux "
                  f"{m.get('moe_aux_loss', 0.0):.6f} (ref {aux:.6f}), logprob err {lp_err:.2e}, worst grad rel err "
                  f"{worst:.2e}, micro-batches {m['micro_batches']}, cached prefixes {actor.seen}",
                  flush=True)


BIAS_RATE = 0.01  # the expert bias's step (megatron's moe_router_bias_update_rate)


def run_grouped(hf_dir, small, whole) -> None:
    """GLM-4.5 with 4 layers (stage 0: the dense layer and MoE layer 0; stage 1: MoE layers 1
    and 2), z + aux over sigmoid scores with the route-count pre-pass and the expert bias's
    update on: per budget, the loss, the reported sums, the log-probs, every gradient of the
    stage and the stage's updated biases (megatron's rule on the per-sample counts, bit for bit)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from model.test_glm4_moe import _hf_logprobs_and_route_counts
    from model.test_moe_router_losses import reference_grouped_router_losses

    from megatron_psrl.model.moe import moe_layer_index

    hf = load_hf_model(hf_dir)
    records = random_tree_records(seed=5, num_roots=3)
    batch = samples_from_dicts(records, source="records")
    ref_logprobs, counts = _hf_logprobs_and_route_counts(hf, batch)  # [MoE layers, E] per-sample routes
    policy_loss, policy_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    z, aux = reference_grouped_router_losses(hf, batch, Z_COEFF, AUX_COEFF)  # (adds to .grad)
    ref_grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if n in policy_grads}
    total = policy_loss + z + aux
    actor = make_actor(hf_dir, small, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=BIAS_RATE)
    routers = [m for m in actor.model.modules() if isinstance(m, TopKRouter)]
    start = [router.expert_bias.clone() for router in routers]
    offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts  # megatron's get_updated_expert_bias
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for budget in (small, whole):
        actor.engine.config.micro_batch_tokens = budget
        for router, bias in zip(routers, start):  # (the reference's biases: the previous budget moved them)
            router.expert_bias.copy_(bias)
        actor.zero_grad()  # (and the bias's token counts)
        result = actor.forward_backward(records)
        m = result.metrics
        assert abs(result.loss - total) <= 1e-5 * abs(total), (budget, result.loss, total)
        assert abs(m["moe_z_loss"] - z) <= 1e-5 * z, (budget, m["moe_z_loss"], z)
        assert abs(m["moe_aux_loss"] - aux) <= 1e-5 * aux, (budget, m["moe_aux_loss"], aux)
        lp_err = max(float(np.nanmax(np.abs(a[1:] - b[1:]))) for a, b in zip(result.logprobs, ref_logprobs))
        assert lp_err <= 1e-5, (budget, lp_err)
        actor.engine.optimizer.reduce_gradients()  # megatron's finalize_model_grads: the bias's update too
        worst = assert_rank_grads_match(actor, ref_grads, 0, 1)
        rows = [moe_layer_index(router.config, router.layer_number) for router in routers]
        for router, bias, row in zip(routers, start, rows):
            assert torch.equal(router.expert_bias, bias + torch.sign(offset[row]) * BIAS_RATE), (budget, row)
        print(f"rank {torch.distributed.get_rank()} pp_rank {pp_rank} grouped-losses-bias schedule "
              f"{m['pipeline_schedule']} budget {budget} ok: loss {result.loss:.6f} (ref {total:.6f}), z "
              f"{m['moe_z_loss']:.6f} (ref {z:.6f}), aux {m['moe_aux_loss']:.6f} (ref {aux:.6f}), MoE layers "
              f"{rows} biases updated, worst grad rel err {worst:.2e}, micro-batches {m['micro_batches']}, "
              f"cached prefixes {actor.seen}", flush=True)
    actor.close()


if __name__ == "__main__":
    main()
