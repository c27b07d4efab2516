#!/usr/bin/env python
"""Training numerics of each attention kernel: a few bf16 steps against an fp32 run.

    python benchmarks/gpu_train_check.py [--device cuda] [--backends torch flash te] [--steps 3]

For every attention backend (``flash`` / ``te`` skipped, with the reason, where the engine's
start-up check refuses them: a missing package, or no thd kernel for Transformer Engine), a
bf16 ``PolicyActor`` on the tiny Llama trains ``--steps`` SGD steps on a step-wise workload
whose trajectories exceed the micro-batch budget (mechanism 2: cached prefix K/V, injected
dK/dV), with the log-likelihood loss of the trained tokens (every log-prob moves it), and an fp32 actor with the torch backend trains the same steps from the same
(bf16-rounded) weights. Every step's loss and gradient norm must agree within the stated
tolerances (bf16 rounding of activations and weights; fp32 accumulation everywhere it sums).
Prints ``PASS`` / ``FAIL`` / ``SKIP`` per backend; exits 1 if any failed.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOSS_TOLERANCE = 2e-2
"""Relative difference of the loss, per step."""

GRAD_NORM_TOLERANCE = 5e-2
"""Relative difference of the gradient norm, per step."""

PACKAGES = {"flash": "flash_attn", "te": "transformer_engine.pytorch", "torch": None}
"""The backends and the packages their kernels come from."""


def run(backend: str, dtype: str, device: str, steps: int, weights=None):
    from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor, log_likelihood_loss
    from megatron_psrl.data import make_workload

    actor = PolicyActor("tiny-llama", ActorConfig(
        device=device, dtype=dtype, attention_backend=backend, micro_batch_tokens=512, seed=7,
        optimizer=OptimizerSettings(optimizer="sgd", lr=1e-2, clip_grad=0.0)))
    if weights is not None:
        actor.load_hf_state_dict(weights)
    batch = make_workload("stepwise", vocab_size=actor.arch.vocab_size, seed=3, num_tokens_target=4000)
    out = []
    for _ in range(steps):
        # the trained tokens' mean negative log-likelihood: every log-prob moves the loss
        m = actor.train_step(batch, loss_fn=log_likelihood_loss, return_logprobs=False)
        out.append((float(m["loss"]), float(m["grad_norm"]), int(m.get("kv_hit_rate", 0) > 0)))
    return actor, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backends", nargs="+", default=["torch", "flash", "te"], choices=list(PACKAGES))
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP train-bf16: no CUDA device")
        return 0
    # the bf16-rounded weights, for both runs
    bf16, _ = run("torch", "bfloat16", args.device, 0)
    weights = {k: v.float() for k, v in bf16.state_dict_hf().items()}
    bf16.close()
    _, reference = run("torch", "float32", args.device, args.steps, weights)
    failed = False
    from megatron_psrl.attention.backends import attention_backend_problem, kernel_facts

    facts = kernel_facts(args.device, torch.bfloat16)
    for backend in args.backends:
        # the engine's start-up check: a missing package, or (te) no thd bottom-right kernel
        problem = attention_backend_problem(backend, facts)
        if problem is not None:
            print(f"SKIP train-bf16 {backend}: {problem}", flush=True)
            continue
        _, got = run(backend, "bfloat16", args.device, args.steps, weights)
        worst_loss = max(abs(g[0] - r[0]) / max(abs(r[0]), 1e-6) for g, r in zip(got, reference))
        worst_norm = max(abs(g[1] - r[1]) / max(abs(r[1]), 1e-6) for g, r in zip(got, reference))
        m2 = all(g[2] for g in got)
        ok = worst_loss <= LOSS_TOLERANCE and worst_norm <= GRAD_NORM_TOLERANCE and m2
        failed |= not ok
        print(f"{'PASS' if ok else 'FAIL'} train-bf16 {backend}: {args.steps} steps, loss rel diff {worst_loss:.2e} "
              f"(<= {LOSS_TOLERANCE:g}), grad norm rel diff {worst_norm:.2e} (<= {GRAD_NORM_TOLERANCE:g}), "
              f"mechanism 2 {'on' if m2 else 'OFF'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
