"""The RL policy loss of docs/loss.md, evaluated per loss claim.

A claim is a (tree token, sample) pair with loss_mask 1. A token shared by several samples
has its log-prob computed once but its loss evaluated once per claim, with that claim's own
advantage, old/ref log-prob and sample weight: PPO/GRPO clipping is non-linear in the
advantage, so claims are never merged. Per claim (token i of sample s)::

    r   = exp(clamp(logp - old_logp, -20, 20))      (old_logp = logp.detach() when absent)
    pg  = -min(r * A, clip(r, 1 - eps, 1 + eps) * A)
    kl  = exp(ref - logp) - (ref - logp) - 1        (k3 estimator; only when kl_coef != 0)
    l   = weight_s * (pg + kl_coef * kl - entropy_coef * H)   (H: entropy of the predicting
                                                                 distribution)

The sample weight multiplies every loss term of the sample (docs/loss.md), so a sample of
weight 0 does not train at all.

and the step loss is ``sum_c coef_c * l_c`` where the coefficients implement the aggregation
over the *whole global batch* (all micro-batches, all ranks), computed from the original
samples, never from the deduplicated tree:

- ``token-mean``: 1 / (claims in the global batch);
- ``seq-mean-token-mean``: 1 / (S' * claims of the claim's sample), S' = samples with at least
  one claim (a sample without trained tokens has no token mean to average);
- ``seq-mean-token-sum``: 1 / S, S = all samples (a sample without claims sums to 0), as
  verl's ``seq-mean-token-sum``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol, Tuple

import numpy as np
import torch

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.options import LOSS_AGGREGATIONS
from megatron_psrl.tree.prefix_tree import PrefixTree

LOG_RATIO_BOUND = 20.0
"""``logp - old_logp`` is clamped to ``[-20, 20]`` before ``exp`` (ratios within about
``[2e-9, 4.9e8]``), as verl does: a rollout log-prob far below the model's own (a wrong or
stale ``old_logprobs``) would otherwise overflow the ratio to inf and the loss to NaN. The
clamp is the identity on every sane claim; clamped claims are counted (``ratio_clamped``) and
carry no gradient through the ratio."""

Tensor = torch.Tensor


@dataclass
class LossConfig:
    """Policy-loss hyper-parameters."""

    clip_eps: float = 0.2
    """PPO clip range epsilon (``--clip-eps``)."""

    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the reference policy (``--kl-coef``)."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus (``--entropy-coef``)."""

    loss_agg: str = "token-mean"
    """Aggregation over the global batch (``--loss-agg``)."""

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ConfigurationError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {self.loss_agg!r}")
        if self.clip_eps < 0:
            raise ConfigurationError(f"clip_eps must be >= 0, got {self.clip_eps}")

    # The ClaimLoss protocol (what the step runner asks of any loss):
    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0

    @property
    def needs_ref(self) -> bool:
        return self.kl_coef != 0.0

    needs_advantage = True

    def __call__(self, logprobs: Tensor, entropy: Optional[Tensor], claims: "ClaimBatch"):
        return policy_loss(logprobs, entropy, claims, self)


def claim_coefficients(tree: PrefixTree, loss_agg: str) -> np.ndarray:
    """float64 ``[C]``: the aggregation weight of every claim of the global batch."""
    num_claims = tree.claim_sample.shape[0]
    if num_claims == 0:
        return np.zeros(0)
    per_sample = np.bincount(tree.claim_sample, minlength=tree.batch.num_samples)
    num_trained_samples = int((per_sample > 0).sum())
    if loss_agg == "token-mean":
        return np.full(num_claims, 1.0 / num_claims)
    if loss_agg == "seq-mean-token-mean":
        return 1.0 / (num_trained_samples * per_sample[tree.claim_sample].astype(np.float64))
    if loss_agg == "seq-mean-token-sum":
        return np.full(num_claims, 1.0 / tree.batch.num_samples)
    raise ConfigurationError(f"unknown loss aggregation {loss_agg!r}")


@dataclass
class ClaimBatch:
    """The claims evaluated by one micro-batch, as tensors aligned with its logit rows."""

    row: Tensor
    """int64 ``[c]``: logit row (into the micro-batch's selected rows) of every claim."""

    coef: Tensor
    """``[c]`` aggregation coefficients."""

    advantage: Tensor
    """``[c]`` advantages."""

    old_logprob: Tensor
    """``[c]`` rollout log-probs (NaN where the sample has none: ratio 1)."""

    ref_logprob: Optional[Tensor]
    """``[c]`` reference log-probs, or None when no KL term is needed."""

    weight: Tensor
    """``[c]`` sample weights."""

    metric_coef: Tensor
    """``[c]`` 1 / (claims in the global batch): metrics are claim means."""

    sample: Optional[Tensor] = None
    """int64 ``[c]``: index of the claim's sample in the batch."""

    sample_claims: Optional[Tensor] = None
    """``[c]``: number of claims of the claim's sample (its trained tokens)."""

    token: Optional[Tensor] = None
    """int64 ``[c]``: index of the claim's token in the batch's per-token arrays (for a loss
    that reads per-token inputs of its own, aligned with the batch)."""

    @property
    def num_claims(self) -> int:
        return int(self.row.shape[0])


def gather_claims(
    tree: PrefixTree,
    coefficients: np.ndarray,
    targets: np.ndarray,
    loss: "ClaimLoss",
    device: torch.device,
) -> ClaimBatch:
    """Claims of the tree tokens ``targets`` (one logit row each, in that order); what the
    ``loss`` needs (advantages, reference log-probs) must be in the batch."""
    b = tree.batch
    starts, ends = tree.claim_offsets[targets], tree.claim_offsets[targets + 1]
    counts = ends - starts
    total = int(counts.sum())
    row = np.repeat(np.arange(len(targets), dtype=np.int64), counts)
    claim = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(total)
    flat = tree.claim_flat[claim]
    sample = tree.claim_sample[claim]
    if b.advantages is None and loss.needs_advantage:
        raise ConfigurationError(f"{b.source}: training needs an 'advantage' for every sample")
    advantages = b.advantages if b.advantages is not None else np.zeros(b.num_tokens, np.float32)
    old = np.full(total, np.nan, dtype=np.float32)
    if b.old_logprobs is not None:
        has = b.has_old_logprobs[sample]
        old[has] = b.old_logprobs[flat[has]]
    ref = None
    if loss.needs_ref:
        if b.ref_logprobs is None or not np.all(b.has_ref_logprobs[sample]):
            missing = sample[0] if b.ref_logprobs is None else sample[~b.has_ref_logprobs[sample]][0]
            raise ConfigurationError(f"{b.describe_sample(int(missing))}: --kl-coef > 0 needs 'ref_logprobs'")
        ref = host_to_device(b.ref_logprobs[flat].astype(np.float32), device)
    as_t = lambda a: host_to_device(np.ascontiguousarray(a, dtype=np.float32), device)  # noqa: E731
    return ClaimBatch(
        row=host_to_device(row, device),
        coef=as_t(coefficients[claim]),
        advantage=as_t(advantages[flat]),
        old_logprob=as_t(old),
        ref_logprob=ref,
        weight=as_t(b.weights[sample]),
        metric_coef=torch.full((total,), 1.0 / max(1, len(tree.claim_token)), dtype=torch.float32, device=device),
        sample=host_to_device(sample.astype(np.int64), device),
        sample_claims=as_t(_claims_per_sample(tree)[sample]),
        token=host_to_device(flat.astype(np.int64), device),
    )


def _claims_per_sample(tree: PrefixTree) -> np.ndarray:
    cache = tree.__dict__.get("_claims_per_sample")
    if cache is None:
        cache = np.bincount(tree.claim_sample, minlength=tree.batch.num_samples)
        tree.__dict__["_claims_per_sample"] = cache
    return cache


def policy_loss(
    logprobs: Tensor, entropy: Optional[Tensor], claims: ClaimBatch, loss: LossConfig
) -> tuple[Tensor, Dict[str, Tensor]]:
    """``sum_c coef_c * l_c`` for one micro-batch, and its metric contributions (detached).

    Args:
        logprobs: ``[n]`` log-probs of the micro-batch's logit rows.
        entropy: ``[n]`` entropies of the rows (required when entropy_coef != 0).
    """
    logp = logprobs[claims.row]
    old = torch.where(torch.isnan(claims.old_logprob), logp.detach(), claims.old_logprob)
    log_ratio = logp - old
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    adv = claims.advantage
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - loss.clip_eps, 1.0 + loss.clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    per_claim = pg
    # Metrics are means over the claims of the global batch, whatever the loss aggregation.
    metrics: Dict[str, Tensor] = {}
    if loss.kl_coef != 0.0:
        diff = claims.ref_logprob - logp
        kl = torch.exp(diff) - diff - 1.0
        per_claim = per_claim + loss.kl_coef * kl
        metrics["kl"] = (claims.metric_coef * kl).sum().detach()
    if loss.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the entropies of the logit rows")
        ent = entropy[claims.row]
        per_claim = per_claim - loss.entropy_coef * ent
        metrics["entropy"] = (claims.metric_coef * ent).sum().detach()
    weighted = claims.coef * claims.weight  # the sample weight scales every term of its claims
    total = (weighted * per_claim).sum()
    metrics["pg_loss"] = (weighted * pg).sum().detach()
    metrics["clip_frac"] = (claims.metric_coef * (clipped < unclipped).float()).sum().detach()
    metrics["ratio_clamped"] = (log_ratio.detach().abs() > LOG_RATIO_BOUND).sum().to(torch.float32)
    return total, metrics


# ====================================================================== custom losses
class ClaimLoss(Protocol):
    """What the step runner asks of a loss. :class:`LossConfig` (PPO/GRPO) is one;
    :class:`PerClaimLoss` wraps any per-claim function; sequence-level losses
    (:class:`SequenceLoss`) are run by ``PolicyActor`` as two passes over per-claim losses."""

    needs_entropy: bool
    """The loss reads the entropy of every claimed row (computed only then)."""

    needs_ref: bool
    """The loss reads reference log-probs (every sample must have them)."""

    needs_advantage: bool
    """The loss reads advantages (every sample must have one; zeros are used otherwise)."""

    def __call__(self, logprobs: Tensor, entropy: Optional[Tensor], claims: ClaimBatch) -> Tuple[Tensor, Dict[str, Tensor]]:
        """``(loss of the micro-batch's claims, metric sums)`` from the rows' log-probs."""


def records_every_row(loss: Optional[ClaimLoss]) -> bool:
    """The loss asks (attribute ``records_every_row``, default False) for the log-prob, and the
    entropy when it ``needs_entropy``, of every token the step predicts, not only of its claims:
    the unclaimed ones are computed forward only, with no graph, in the same pass, and returned
    as the step's per-sample log-probs (and entropies)."""
    return bool(getattr(loss, "records_every_row", False))


@dataclass
class ClaimView:
    """The claims of one micro-batch as a custom loss sees them: ``[c]`` tensors, one entry per
    (token, sample) claim. ``logp`` and ``entropy`` carry gradients; a token shared by several
    samples appears once per sample (its log-prob computed once)."""

    logp: Tensor
    """log p(token | its history) under the current policy."""

    entropy: Optional[Tensor]
    """Entropy of the distribution that predicts the token (when ``needs_entropy``)."""

    advantage: Tensor
    """The sample's (or token's) advantage (zeros if the batch has none)."""

    old_logprob: Tensor
    """Rollout log-prob (NaN where the sample has none)."""

    ref_logprob: Optional[Tensor]
    """Reference log-prob (when ``needs_ref``)."""

    weight: Tensor
    """The sample's weight."""

    coef: Tensor
    """The ``loss_agg`` coefficient of the claim (token-mean: 1 / claims in the global batch)."""

    sample: Tensor
    """int64 index of the claim's sample in the batch."""

    sample_claims: Tensor
    """Number of claims of the claim's sample."""

    @classmethod
    def of(cls, logprobs: Tensor, entropy: Optional[Tensor], claims: ClaimBatch) -> "ClaimView":
        return cls(logp=logprobs[claims.row], entropy=None if entropy is None else entropy[claims.row],
                   advantage=claims.advantage, old_logprob=claims.old_logprob, ref_logprob=claims.ref_logprob,
                   weight=claims.weight, coef=claims.coef, sample=claims.sample, sample_claims=claims.sample_claims)


@dataclass
class PerClaimLoss:
    """A custom loss from a per-claim function: ``loss = sum over all claims of fn(view)``
    (apply ``view.coef`` for the aggregation, ``view.weight`` for sample weights)."""

    fn: Callable[[ClaimView], Tensor]
    """Per-claim losses ``[c]`` from a :class:`ClaimView`."""

    needs_entropy: bool = False
    """Compute ``view.entropy`` (one more pass over the vocabulary per claimed row)."""

    needs_ref: bool = False
    """Every sample must have ``ref_logprobs`` (``view.ref_logprob``)."""

    needs_advantage: bool = False
    """Every sample must have an ``advantage`` (zeros are passed otherwise)."""

    loss_agg: Optional[str] = None
    """The aggregation ``view.coef`` implements; None: the actor's configured ``loss_agg``."""

    def __post_init__(self) -> None:
        if self.loss_agg is not None and self.loss_agg not in LOSS_AGGREGATIONS:
            raise ConfigurationError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {self.loss_agg!r}")

    def __call__(self, logprobs: Tensor, entropy: Optional[Tensor], claims: ClaimBatch):
        return self.fn(ClaimView.of(logprobs, entropy, claims)).sum(), {}


def log_likelihood_loss(view: ClaimView) -> Tensor:
    """Supervised fine-tuning on trajectories: ``-coef * weight * log p`` per claim (the mean
    negative log-likelihood of the trained tokens with ``token-mean``)."""
    return -(view.coef * view.weight * view.logp)


@dataclass
class SequenceInputs:
    """Per-sample inputs of a :class:`SequenceLoss`, ``[S]`` tensors over the batch's samples."""

    advantage: Tensor
    """The advantage of the sample's last trained token (0 for a sample without trained tokens
    or a batch without advantages)."""

    weight: Tensor
    """The sample's weight."""

    trained: Tensor
    """bool: the sample has trained tokens (its sum is 0 otherwise)."""


class SequenceLoss:
    """A loss of per-sample sums: ``L = sequence_loss(S, samples)`` with ``S_s = sum over the
    claims of sample s of token_terms(view)`` (GSPO's sequence ratio, a sequence-level KL, ...).

    A sample's claims can live in several micro-batches and on several ranks, so ``PolicyActor``
    runs it in two passes: a forward pass computes ``S`` (summed over ranks), then the training
    pass back-propagates ``dL/dS_s * token_terms`` per claim, whose gradient is exactly dL/dθ."""

    needs_entropy = False
    needs_ref = False
    needs_advantage = True

    def token_terms(self, view: ClaimView) -> Tensor:
        raise NotImplementedError

    def sequence_loss(self, sums: Tensor, samples: SequenceInputs) -> Tensor:
        """Scalar loss from the per-sample sums ``[S]``."""
        raise NotImplementedError


@dataclass
class GSPOLoss(SequenceLoss):
    """GSPO: the importance ratio of a whole sequence, ``s = exp(mean over its trained tokens of
    (log p - old log p))``, clipped PPO-style with the sample's advantage (its last trained
    token's), weighted by the sample weight, averaged over the samples with trained tokens."""

    clip_eps: float = 3e-4

    def token_terms(self, view: ClaimView) -> Tensor:
        old = torch.where(torch.isnan(view.old_logprob), view.logp.detach(), view.old_logprob)
        return (view.logp - old) / view.sample_claims

    def sequence_loss(self, sums: Tensor, samples: SequenceInputs) -> Tensor:
        ratio = torch.exp(sums.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        clipped = torch.clamp(ratio, 1.0 - self.clip_eps, 1.0 + self.clip_eps)
        adv = samples.advantage
        per_sample = -torch.minimum(ratio * adv, clipped * adv) * samples.weight
        return (per_sample * samples.trained).sum() / samples.trained.sum().clamp(min=1)
