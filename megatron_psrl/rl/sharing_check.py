"""Exactness a user can watch: every N steps, a few samples computed again without sharing.

Prefix sharing is exact by construction (docs/architecture.md, "Exactness"), and the test suite
checks it against per-sample references; but a run in production meets models, kernels, dtypes
and batches no test saw, and silently wrong log-probs are the defect users of tree training
report first. ``--check-sharing-every N`` (``ActorConfig.check_sharing_every``) makes the run
check itself: before the update of every N-th step it takes ``check_sharing_samples`` samples
of the step's batch (drawn from the step's seed, the same on every rank) and runs their
forward and backward twice, with the run's prefix sharing and with none (samples packed back
to back, every prefix computed again: the per-sample computation), then compares

- the log-probs of every token both computed (largest absolute difference, in nats), and
- the subset's loss gradient: its norm (relative difference) and the cosine between the two,
  summed over the data-parallel ranks as the optimizer would.

Above the dtype's tolerance (:func:`tolerances`) the run stops with :class:`SharingCheckError`
naming the samples and the worst difference (``check_sharing_warn_only``: a warning instead).
The step's own gradients are untouched: the check runs before them, on zeroed gradients, and
restores the random state. Cost per checked step: two forward-backward passes over the subset
(its samples' tokens, unshared once) and two all-reduces of a gradient-sized vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.errors import PsrlError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.model.gpt import model_chunks


class SharingCheckError(PsrlError, ArithmeticError):
    """Prefix sharing and the per-sample computation disagree beyond the dtype's tolerance."""


@dataclass(frozen=True)
class SharingTolerance:
    """How far the shared and the per-sample computation may differ in one dtype: the two sum
    the same terms in other orders (one attention over a tree against one per sample), so they
    differ by rounding only."""

    logprob: float
    """Largest absolute log-prob difference, nats."""
    grad_norm: float
    """Largest relative difference of the subset's gradient norms."""
    grad_cosine: float
    """Smallest cosine between the two gradients."""


def tolerances(dtype: torch.dtype) -> SharingTolerance:
    """The tolerance of a model dtype. fp32 rounds at 6e-8: two summation orders of a tiny
    model's forward differ by about 1e-6 nats and their gradients' norms by about 1e-6 relative
    (``tests/training/test_sharing_check.py`` measures it), so 1e-4 leaves room for deep models
    and long contexts while a lost or misplaced key (an error of 1e-2 nats and more) stands out.
    bf16 and fp16 round at 4e-3 and 5e-4 relative per operation, and their log-probs differ by
    a few hundredths of a nat between kernels; their bounds scale with that."""
    if dtype == torch.float32 or dtype == torch.float64:
        return SharingTolerance(logprob=1e-4, grad_norm=1e-4, grad_cosine=1 - 1e-6)
    if dtype == torch.float16:
        return SharingTolerance(logprob=0.05, grad_norm=0.01, grad_cosine=0.999)
    return SharingTolerance(logprob=0.25, grad_norm=0.05, grad_cosine=0.99)


@dataclass
class SharingCheck:
    """The outcome of one check (reported as the step's ``sharing_check`` metric)."""

    samples: List[int]
    """Indices of the checked samples in the step's batch."""
    logprob_max_abs: float
    """Largest log-prob difference over the tokens both computed, nats."""
    grad_norm_rel: float
    """Relative difference of the subset's gradient norms."""
    grad_cosine: float
    """Cosine between the two gradients."""
    tolerance: SharingTolerance
    passed: bool

    def as_dict(self) -> Dict[str, float]:
        return {"samples": list(self.samples), "logprob_max_abs": self.logprob_max_abs,
                "grad_norm_rel": self.grad_norm_rel, "grad_cosine": self.grad_cosine, "passed": self.passed}

    def describe(self) -> str:
        t = self.tolerance
        return (f"prefix sharing check on samples {self.samples}: log-probs differ by up to "
                f"{self.logprob_max_abs:.3g} nats (tolerance {t.logprob:g}), gradient norms by "
                f"{self.grad_norm_rel:.3g} relative (tolerance {t.grad_norm:g}), cosine {self.grad_cosine:.9f} "
                f"(at least {t.grad_cosine:g})")


def choose_samples(batch, count: int, seed: int) -> List[int]:
    """``count`` distinct samples that share prefixes, drawn from ``seed`` (every rank draws the
    same): one at random, then those with the longest common prefix with it (the subset then
    exercises sharing; samples sharing nothing would be computed alike both ways)."""
    n = batch.num_samples
    count = min(count, n)
    rng = np.random.default_rng(seed)
    first = int(rng.integers(n))
    order = rng.permutation(n)  # (ties in the common prefix broken at random)
    tokens, offsets = batch.tokens, batch.offsets
    mine = tokens[offsets[first]:offsets[first + 1]]

    def common(j: int) -> int:
        other = tokens[offsets[j]:offsets[j + 1]]
        m = min(len(mine), len(other))
        differ = np.flatnonzero(mine[:m] != other[:m])
        return int(differ[0]) if len(differ) else m

    others = sorted((j for j in order.tolist() if j != first), key=lambda j: -common(j))
    return sorted([first] + [int(j) for j in others[:count - 1]])


def _flat_grads(engine) -> torch.Tensor:
    """This rank's accumulated gradient of every trainable parameter, as one fp32 vector."""
    parts = []
    for chunk in model_chunks(engine.model):
        for p in chunk.parameters():
            if not p.requires_grad:
                continue
            grad = engine.optimizer.main_grad(p) if engine.optimizer is not None else p.grad
            parts.append(grad.detach().float().reshape(-1) if grad is not None else
                         torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
    return torch.cat(parts)


def _logprob_gap(shared: Sequence[np.ndarray], unshared: Sequence[np.ndarray]) -> float:
    """Largest absolute difference over the tokens both computed (NaN: not computed)."""
    gap = 0.0
    for a, b in zip(shared, unshared):
        both = np.isfinite(a) & np.isfinite(b)
        if both.any():
            gap = max(gap, float(np.abs(a[both].astype(np.float64) - b[both].astype(np.float64)).max()))
    return gap


def check_sharing(engine, batch, loss, samples: Sequence[int], gradient_group, model_parallel_group,
                  dtype: torch.dtype) -> SharingCheck:
    """Run ``samples`` of ``batch`` forward and backward with the engine's prefix sharing and
    with none, and compare (module docstring). Leaves the gradients zeroed."""
    subset = batch.select(list(samples))
    longest = int(np.diff(subset.offsets).max()) if subset.num_samples else 1
    grads, logprobs = [], []
    # (unshared, every sample must fit one micro-batch: the budget grows to the longest if need be)
    for sharing, budget in ((engine.config.prefix_sharing, None),
                            ("none", max(engine.config.micro_batch_tokens, longest))):
        engine.zero_grad()
        result = engine.forward_backward(subset, loss, return_logprobs=True, prefix_sharing=sharing,
                                         micro_batch_tokens=budget)
        grads.append(_flat_grads(engine))
        logprobs.append(result.logprobs)
    engine.zero_grad()
    shared, unshared = grads
    if gradient_group is not None and dist.is_initialized() and dist.get_world_size(gradient_group) > 1:
        for g in (shared, unshared):  # the subset's gradient: summed over the data x context ranks
            dist.all_reduce(g, group=gradient_group)
    dots = torch.stack([shared.double() @ unshared.double(), shared.double() @ shared.double(),
                        unshared.double() @ unshared.double()])
    if model_parallel_group is not None and dist.is_initialized() and dist.get_world_size(model_parallel_group) > 1:
        dist.all_reduce(dots, group=model_parallel_group)  # the shards of tensor and pipeline parallelism
    cross, ss, uu = (float(x) for x in dots.cpu())
    norm_s, norm_u = ss ** 0.5, uu ** 0.5
    cosine = cross / (norm_s * norm_u) if norm_s > 0 and norm_u > 0 else (1.0 if norm_s == norm_u else 0.0)
    rel = abs(norm_s - norm_u) / norm_u if norm_u > 0 else (0.0 if norm_s == 0 else float("inf"))
    gap = _logprob_gap(logprobs[0], logprobs[1])
    if dist.is_initialized() and dist.get_world_size() > 1:
        # every rank takes the same verdict (a rank that stopped alone would leave the others
        # waiting in the next collective): the worst figures of any rank
        worst = host_to_device([gap, rel, -cosine], shared.device, np.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        gap, rel, cosine = float(worst[0]), float(worst[1]), -float(worst[2])
    tol = tolerances(dtype)
    passed = gap <= tol.logprob and rel <= tol.grad_norm and cosine >= tol.grad_cosine
    return SharingCheck(list(samples), gap, rel, cosine, tol, passed)


__all__ = ["SharingCheck", "SharingCheckError", "SharingTolerance", "check_sharing", "choose_samples", "tolerances"]
