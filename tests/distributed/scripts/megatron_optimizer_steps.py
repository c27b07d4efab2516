"""megatron's DDP and optimizer over gloo (2 data-parallel ranks) in the situations prefix sharing
creates; prints one ``OK <case>`` line per case that held, raises on the first that did not.

    torchrun --nproc_per_node 2 megatron_optimizer_steps.py --case calibration|param-gather

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
p.add_argument("--case", required=True, choices=["calibration", "param-gather"])
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

if args.case == "param-gather":
    final = {}
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

dist.barrier()
shutdown_parallel()
