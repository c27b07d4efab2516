"""megatron's DDP and optimizer over gloo (2 data-parallel ranks) in the situations prefix sharing
creates; prints one ``OK <case>`` line per case that held, raises on the first that did not.

    torchrun --nproc_per_node 2 megatron_optimizer_steps.py --case calibration|param-gather|grad-overlap

- ``calibration`` (R1, R5): start-up cost calibration runs its ~20 backward passes after the
  optimizer exists. Afterwards no gradient buffer holds anything, and the first
  ``forward_backward`` + step (without a ``zero_grad`` first, as the split API allows) and the
  steps after it equal a run that never calibrated, with ``--overlap-grad-reduce`` (whose
  first-step gradient counts calibration used to record, so that no bucket launched and
  ``finish_grad_sync`` asserted) and with the distributed optimizer.
- ``param-gather`` (R4): ``--overlap-param-gather`` with a rank that has no micro-batch in a step
  (no forward pass, so no forward pre-hook), a rank that runs an extra no-grad forward, and a
  weight read (``sync_params``) on one rank only: every rank issues the same collectives, and
  the weights equal the synchronous all-gather's, bit for bit, on both ranks.
- ``grad-overlap``: ``--overlap-grad-reduce`` started during a prefix-shared step's last backward
  (a tree plan with cached prefixes: several backward passes per rank, the ranks' plans
  differ). The reduced gradients equal, bit for bit, those of the non-overlapped path (one
  bucket, reduced after the step) and of the same buckets launched after the step; with the
  distributed optimizer too (its reduce-scatter; the weights after a step). Recorded from
  the hooks: no bucket starts before the last backward, every bucket starts once in megatron's
  order, and at least one starts before that backward's last parameter gradient arrives. A
  gradient that reaches a bucket already started raises.
"""

import argparse

import torch
import torch.distributed as dist

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel, shutdown_parallel
from megatron_psrl.engine.calibration import calibrate
from megatron_psrl.engine.optimizer import OptimizerSettings, TrainingOptimizer
from megatron_psrl.model.logits import vocab_parallel_logprobs

p = argparse.ArgumentParser()
p.add_argument("--case", required=True, choices=["calibration", "param-gather", "grad-overlap"])
args = p.parse_args()

layout = initialize_parallel(1, 1, seed=0, device="cpu", timeout_minutes=2)
rank = dist.get_rank()
arch, initial, _ = load_model(ModelSource(tiny="debug-llama"))
weights = {n: p.detach().clone() for n, p in initial.named_parameters()}
del initial


def fresh_model():
    model = load_model(ModelSource(tiny="debug-llama"))[1]
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def backward(model, seed, grad=True):
    """Forward (+ backward) of a small causal pack, different on every rank and step."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    ids = torch.randint(0, arch.vocab_size, (24,), generator=gen)
    with torch.set_grad_enabled(grad):
        hidden = model(ids, torch.cat([torch.arange(16), torch.arange(8)]),
                       TreeAttentionMetadata(plan=causal_plan([16, 8])))[:, 0]
        logp, _ = vocab_parallel_logprobs(model.output_logits(hidden), ids, arch.vocab_size)
        if grad:
            (-logp.sum()).backward()


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a, b, what):
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def assert_ranks_agree(weights_now, what):
    digest = torch.tensor([float(sum(v.double().sum() for v in weights_now.values()))], dtype=torch.float64)
    both = [torch.zeros_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(both, digest)
    assert all(torch.equal(both[0], d) for d in both), f"{what}: ranks disagree {both}"


if args.case == "calibration":
    for overlap, distributed in ((True, False), (True, True), (False, False)):
        settings = OptimizerSettings(optimizer="adam", lr=1e-3, overlap_grad_reduce=overlap,
                                     use_distributed_optimizer=distributed)
        runs = []
        for calibrated in (True, False):
            model = fresh_model()
            opt = TrainingOptimizer(model, settings)
            if calibrated:
                calibrate(model, arch.vocab_size, torch.device("cpu"), 64, exchange_group=dist.group.WORLD,
                          layer_row_bytes=64)
                left = [n for n, p in model.named_parameters() if p.grad is not None or p.main_grad.any()]
                assert not left, f"calibration left gradients in {left[:3]}"
            backward(model, 1)  # the split API: forward_backward, then optimizer_step
            outcome = opt.step()
            assert not outcome.skipped
            trace = [params(model), outcome.grad_norm]
            for step in (2, 3):  # later steps: megatron's buckets after its first batch
                opt.zero_grad()
                backward(model, step)
                trace.append(opt.step().grad_norm)
            trace.append(params(model))
            runs.append(trace)
        (p1, n1, *norms1, last1), (p2, n2, *norms2, last2) = runs
        what = f"overlap_grad_reduce={overlap} distributed={distributed}"
        assert n1 == n2 and norms1 == norms2, f"{what}: gradient norms {n1} {norms1} vs {n2} {norms2}"
        assert_same(p1, p2, f"{what}: first step after calibration")
        assert_same(last1, last2, f"{what}: third step")
        assert_ranks_agree(last1, what)
        print(f"OK calibration {what}", flush=True)

final = {}
if args.case == "param-gather":
    for overlap in (True, False):
        model = fresh_model()
        opt = TrainingOptimizer(model, OptimizerSettings(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                         overlap_param_gather=overlap, overlap_grad_reduce=overlap))
        for step in range(1, 5):
            opt.zero_grad()
            if step == 3 and rank == 0:
                backward(model, 99, grad=False)  # an extra forward (log-probs) on one rank only
            if not (step == 2 and rank == 1):  # rank 1 has no micro-batch in step 2
                backward(model, step)
            opt.step()
            if step == 1 and rank == 0:
                opt.sync_params()  # a weight read (export) on one rank only
        opt.sync_params()
        final[overlap] = params(model)
        assert_ranks_agree(final[overlap], f"overlap_param_gather={overlap}")
    assert_same(final[True], final[False], "overlap_param_gather vs synchronous all-gather")
    print("OK param-gather", flush=True)

if args.case == "grad-overlap":
    import numpy as np
    from helpers.batches import random_tree_batch

    from megatron_psrl.data.loader import samples_from_dicts
    from megatron_psrl.engine.step import StepRunner
    from megatron_psrl.kvcache import BlockKVCache, KVGeometry
    from megatron_psrl.rl.loss import LossConfig
    from megatron_psrl.schedule.config import PlannerConfig
    from megatron_psrl.schedule.instructions import Backward, ForwardBackward, training_instructions
    from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory
    from megatron_psrl.schedule.planner import plan_step
    from megatron_psrl.tree import build_prefix_tree

    geometry = KVGeometry(arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu"))

    def planned(batch, budget):
        """``(plan, this rank's memory plan, its backward passes)`` of a prefix-shared step."""
        plan = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=budget, sharing="tree",
                                                                data_parallel_size=dist.get_world_size()))
        mine = plan.ranks[rank]
        memory = plan_memory(mine, geometry, 1 << 30, activation_bytes_per_token(arch, 1, 4)) if mine.sources else None
        backwards = sum(isinstance(x, (Backward, ForwardBackward)) for x in training_instructions(mine, memory))
        assert mine.sources and backwards > 1, f"rank {rank}: {backwards} backward passes, {len(mine.sources)} sources"
        return plan, memory, backwards

    def grpo_batch():
        """Two groups of 4 responses (6 tokens) to a 40-token prompt without loss: with 32-token
        micro-batches the step's last backward is a prompt's, which only injects its readers'
        dK/dV (the output layer and the top layer's MLP take no part in it)."""
        gen = np.random.default_rng(3)
        records = [{"id": f"g{g}r{k}", "tokens": prompt + gen.integers(0, arch.vocab_size, 6).tolist(),
                    "loss_mask": [0] * 40 + [1] * 6, "advantage": float(gen.normal()),
                    "ref_logprobs": (gen.normal(size=46) * 0.3 - 5.5).tolist()}
                   for g, prompt in enumerate(gen.integers(0, arch.vocab_size, (2, 40)).tolist()) for k in range(4)]
        return samples_from_dicts(records, source="grpo")

    plan, memory, backwards = planned(random_tree_batch(seed=7, num_roots=4, vocab_size=arch.vocab_size), 20)
    loss_cfg = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    bucket = 12000  # parameters per bucket: ~10 buckets of debug-llama's ~110k

    def step(settings, last_of_step, events=None, apply=False):
        """One step of ``plan``: its reduced gradients (``apply``: the weights after the optimizer step)."""
        model = fresh_model()
        opt = TrainingOptimizer(model, settings)
        runner = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=BlockKVCache(geometry, 1 << 30))
        runner.arm_grad_reduce = opt.arm_grad_reduce
        if events is not None:
            record(opt, runner, model, events)
        opt.zero_grad()
        runner.train(plan, rank, loss_cfg, memory, last_of_step=last_of_step)
        if events is not None:
            events.append(("train returned",))
        if apply:
            assert not opt.step().skipped
            return params(model)
        opt.reduce_gradients()
        return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

    def record(opt, runner, model, events):
        """Wrap the bucket groups' trigger and launch, and the arming, to log their order."""
        names = {p: n for n, p in model.named_parameters()}
        for k, group in enumerate(opt.bucket_launches.groups):
            def start(*a, k=k, group=group, f=group.start_grad_sync, **kw):
                if group.grad_reduce_handle is None:  # (megatron's finish_grad_sync calls it again: a no-op)
                    events.append(("launch", k))
                return f(*a, **kw)

            def ready(p, *a, f=group.register_grad_ready, **kw):
                events.append(("grad", names[p]))
                return f(p, *a, **kw)

            group.start_grad_sync, group.register_grad_ready = start, ready
        arm = runner.arm_grad_reduce
        runner.arm_grad_reduce = lambda roots: (events.append(("arm",)), arm(roots))

    plain = OptimizerSettings(optimizer="adam", lr=1e-3, overlap_grad_reduce=False)
    buckets = OptimizerSettings(optimizer="adam", lr=1e-3, overlap_grad_reduce=True, ddp_bucket_size=bucket)
    events = []
    overlapped = step(buckets, True, events)
    assert_same(overlapped, step(plain, False), "overlapped reduce vs one bucket after the step")
    assert_same(overlapped, step(buckets, False), "overlapped reduce vs the same buckets after the step")

    kinds = [e[0] for e in events]
    armed = kinds.index("arm")
    launches = [e[1] for e in events if e[0] == "launch"]
    last_grad = max(j for j, kind in enumerate(kinds) if kind == "grad")
    assert len(launches) > 1 and launches == list(range(len(launches))), f"launch order {launches}"
    assert "grad" in kinds[:armed], "earlier backward passes must have run before the last one"
    assert "launch" not in kinds[:armed], "a bucket started before the step's last backward"
    early = [k for j, (kind, *k) in enumerate(events) if kind == "launch" and j < last_grad]
    assert early, "no bucket started before the last backward's last gradient arrived"
    print(f"grad-overlap rank {rank}: {backwards} backward passes, {len(launches)} buckets, "
          f"{len(early)} started before the last gradient of the last backward", flush=True)

    plan, memory, backwards = planned(grpo_batch(), 32)  # the last backward: a prompt's dK/dV only
    events = []
    assert_same(step(buckets, True, events), step(plain, False), "GRPO step: overlapped vs one bucket after it")
    kinds = [e[0] for e in events]
    after_arm = kinds[kinds.index("arm"):]
    unreached = after_arm.index("grad") if "grad" in after_arm else len(after_arm)
    assert "launch" in after_arm[:unreached], "buckets the prompt's backward cannot reach started only after it"
    print(f"grad-overlap rank {rank}: GRPO, {backwards} backward passes, {after_arm[:unreached].count('launch')} "
          "buckets started before the prompt's backward produced a gradient", flush=True)

    for overlap in (True, False):  # the distributed optimizer: its reduce-scatter, then a step
        sharded = OptimizerSettings(optimizer="adam", lr=1e-3, clip_grad=0.0, use_distributed_optimizer=True,
                                    overlap_grad_reduce=overlap, ddp_bucket_size=bucket if overlap else None)
        final[overlap] = step(sharded, True, apply=True)
    assert_same(final[True], final[False], "distributed optimizer: overlapped reduce-scatter vs after the step")
    assert_ranks_agree(final[True], "distributed optimizer, overlapped")

    model = fresh_model()  # a gradient after its bucket started (a backward past the step's last)
    opt = TrainingOptimizer(model, buckets)
    opt.zero_grad()
    opt.bucket_launches.launch_rest()
    try:
        backward(model, 5)
        raise AssertionError("a gradient after its bucket's reduce started was accepted")
    except RuntimeError as e:
        assert "after its bucket's data-parallel reduce started" in str(e), e
    opt.reduce_gradients()
    print("OK grad-overlap", flush=True)

dist.barrier()
shutdown_parallel()
