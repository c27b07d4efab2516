"""verl's ``ppo_loss`` as a per-claim loss of this project, for the verl engine's one-pass update.

verl's PPO loss (``verl.workers.utils.losses.ppo_loss``) is, for most of its policy-loss modes,
a sum over response tokens of a function of that token's log-prob, old log-prob, advantage (and
reference log-prob, entropy, rollout correction weight), each weighted by an aggregation
coefficient that depends only on the token's sample and on global counts. Such a loss can be
evaluated claim by claim inside the engine's own forward and backward (a
:class:`~megatron_psrl.rl.loss.ClaimLoss`), so the engine needs no separate log-prob pass.

What is accepted (:func:`one_pass_config`), read from verl 0.9's ``core_algos``:

- policy-loss modes that are per-token functions: ``vanilla`` (PPO clip with verl's asymmetric
  ``clip_ratio_low`` / ``clip_ratio_high`` and dual-clip ``clip_ratio_c``), ``dppo_tv``,
  ``dppo_kl``, ``sapo``, ``gpg``, ``dro``, ``cispo``;
- every ``loss_agg_mode`` (``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
  ``seq-mean-token-sum-norm``, ``seq-mean-token-mean``), the entropy term and the KL loss
  (``use_kl_loss``, every ``kl_loss_type`` verl computes per token, ``+`` variants included),
  ``rollout_is_weights``.

Refused (the engine keeps its exact two-pass path for them): ``gspo`` and ``geo_mean`` (a
sequence's ratio depends on all its tokens), ``clip_cov`` and ``kl_cov`` (tokens picked by
batch statistics, ``clip_cov`` at random), ``bypass_mode`` (batch-normalised correction
weights), and any other registered mode or loss function.

Exactness: the per-token terms are verl's own elementwise operations, in verl's order; the
aggregation sums the same terms with the same coefficients in a different order (fp32 rounding
of the sums only). verl's engines average gradients over data-parallel ranks, each rank's loss
scaled by ``dp_size``; the engine sums gradients, so a token's coefficient here is verl's
coefficient divided by ``dp_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from verl.trainer.ppo.core_algos import kl_penalty
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.integrations.verl_batch import GatheredSequences, VerlSequences, gather_flat
from megatron_psrl.rl.loss import ClaimBatch

Tensor = torch.Tensor

ONE_PASS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "sapo", "gpg", "dro", "cispo")
"""verl policy-loss modes evaluated in one pass (per-token functions)."""

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
"""verl's ``loss_agg_mode`` values."""

_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def one_pass_config(loss_function: Optional[Callable], data) -> Tuple[Optional[Any], str]:
    """``(verl actor config, why)`` when ``loss_function`` is verl's ``ppo_loss`` with a
    configuration this module evaluates exactly in one pass; ``(None, why not)`` otherwise."""
    if not (isinstance(loss_function, partial) and loss_function.func is ppo_loss):
        return None, "the loss function is not verl's ppo_loss"
    config = loss_function.keywords.get("config", loss_function.args[0] if loss_function.args else None)
    if config is None or set(loss_function.keywords) - {"config"} or len(loss_function.args) > 1:
        return None, "ppo_loss is bound to arguments other than its config"
    mode = _loss_mode(config)
    if mode not in ONE_PASS_MODES:
        return None, f"policy loss mode {mode!r} is not a per-token function"
    if config.loss_agg_mode not in AGGREGATIONS:
        return None, f"loss_agg_mode {config.loss_agg_mode!r} is not one verl 0.9 defines"
    if mode == "vanilla" and not config.get("clip_ratio_c", 3.0) > 1.0:
        return None, "clip_ratio_c <= 1 (verl refuses it)"
    if mode == "dro" and not (config.policy_loss.dro_beta or 0) > 0:
        return None, "dro without a positive dro_beta (verl refuses it)"
    if config.use_kl_loss and (config.kl_loss_type.rstrip("+") not in _KL_TYPES or "ref_log_prob" not in data.keys()):
        return None, f"KL loss type {config.kl_loss_type!r} or no ref_log_prob in the batch"
    if data["global_batch_size"] is None or data["batch_num_tokens"] is None:
        return None, "the batch carries no global_batch_size / batch_num_tokens"
    return config, f"verl's ppo_loss, policy loss mode {mode!r}, {config.loss_agg_mode}"


def _loss_mode(config) -> str:
    return config.policy_loss.get("loss_mode", "vanilla")


# ---------------------------------------------------------------------- per-token terms
def _clip_range(config) -> Tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _vanilla(logp: Tensor, old: Tensor, adv: Tensor, config) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``compute_policy_loss_vanilla`` per token (PPO clip, dual-clip below ``-A * clip_ratio_c``)."""
    low, high = _clip_range(config)
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return pg_losses, {"actor/pg_clipfrac": torch.gt(pg_losses2, pg_losses1).float(),
                       "actor/ppo_kl": -negative_approx_kl,
                       "actor/pg_clipfrac_lower": torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).float()}


def _dppo(logp: Tensor, old: Tensor, adv: Tensor, config, binary_kl: bool) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` per token."""
    low, high = _clip_range(config)
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clip_ratio_c = config.get("clip_ratio_c", 20.0)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if binary_kl:
        kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive, valid_negative = (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)
    else:
        valid_positive, valid_negative = (prob - old_prob) <= high, (prob - old_prob) >= -low
    valid = torch.where(adv > 0, valid_positive, valid_negative).detach().float()
    pg_losses = -adv * truncated_ratio * logp * valid
    return pg_losses, {"actor/pg_clipfrac": (1.0 - valid).float(), "actor/ppo_kl": -negative_approx_kl,
                       "actor/pg_clipfrac_lower": (ratio > clip_ratio_c).float() * valid}


def _sapo(logp: Tensor, old: Tensor, adv: Tensor, config) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``compute_policy_loss_sapo`` per token (its aggregation is always seq-mean-token-mean)."""
    tau_pos = torch.as_tensor(config.tau_pos, dtype=adv.dtype, device=adv.device)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=adv.dtype, device=adv.device)
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(adv > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    zero = torch.zeros_like(logp)
    return -gates * adv, {"actor/pg_clipfrac": zero, "actor/ppo_kl": -negative_approx_kl,
                          "actor/pg_clipfrac_lower": zero}


def _gpg(logp: Tensor, old: Tensor, adv: Tensor, config) -> Tuple[Tensor, Dict[str, Tensor]]:
    return -logp * adv, {}


def _dro(logp: Tensor, old: Tensor, adv: Tensor, config) -> Tuple[Tensor, Dict[str, Tensor]]:
    log_ratio = logp - old
    pg_losses = -(logp * adv - 0.5 * config.policy_loss.dro_beta * log_ratio.square())
    return pg_losses, {"actor/ppo_kl": -log_ratio}


def _cispo(logp: Tensor, old: Tensor, adv: Tensor, config) -> Tuple[Tensor, Dict[str, Tensor]]:
    low, high = _clip_range(config)
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = -clipped_ratio.detach() * adv * logp
    return pg_losses, {"actor/pg_clipfrac": (ratio != clipped_ratio).float(), "actor/ppo_kl": -negative_approx_kl,
                       "actor/pg_clipfrac_lower": torch.zeros_like(logp)}


_POLICY_METRICS = {mode: ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
                   for mode in ("vanilla", "dppo_tv", "dppo_kl", "sapo", "cispo")}
_POLICY_METRICS.update(gpg=(), dro=("actor/ppo_kl",))
"""The metrics each mode's verl function reports (masked means over the rank's response tokens)."""

_POLICY_TERMS = {"vanilla": _vanilla, "dppo_tv": partial(_dppo, binary_kl=False),
                 "dppo_kl": partial(_dppo, binary_kl=True), "sapo": _sapo, "gpg": _gpg, "dro": _dro, "cispo": _cispo}


# ---------------------------------------------------------------------- aggregation
@dataclass
class RankShares:
    """Per data-parallel rank of verl's split: what its ``ppo_loss`` call normalises by."""

    response_tokens: np.ndarray
    """int64 ``[dp]``: tokens of the rank's ``response_mask`` (its masked means' denominator)."""

    horizon: np.ndarray
    """int64 ``[dp]``: width of the rank's padded response (``seq-mean-token-sum-norm``)."""


def sample_coefficients(mode: str, sample_tokens: np.ndarray, sample_rank: np.ndarray, shares: RankShares,
                        info: Dict[str, Any]) -> np.ndarray:
    """float64 ``[S]``: the weight of each token of every sample in verl's ``agg_loss`` with
    ``mode``, over the whole mini-batch, divided by ``dp_size`` (verl averages its ranks'
    gradients; the engine sums them). ``sample_tokens``: response-mask tokens per sample."""
    n = len(sample_tokens)
    if mode == "token-mean":
        return np.full(n, 1.0 / info["batch_num_tokens"])
    if mode == "token-sum":
        return np.ones(n)
    base = 1.0 / info["global_batch_size"]
    if mode == "seq-mean-token-sum":
        return np.full(n, base)
    if mode == "seq-mean-token-sum-norm":
        scale = info["loss_scale_factor"]
        return base / (shares.horizon[sample_rank] if scale is None else np.full(n, float(scale)))
    # seq-mean-token-mean (a sample without tokens has no claim to weigh)
    return base / np.maximum(sample_tokens, 1)


@dataclass
class VerlPolicyLoss:
    """verl's ``ppo_loss`` over the claims of the whole mini-batch (a ``ClaimLoss``): the loss
    whose gradient is verl's (summed over its data-parallel ranks), and, beside it, every rank's
    share of verl's loss and metrics (the step returns every token's log-prob and entropy)."""

    config: Any
    """verl's actor config (``ppo_loss``'s ``config``)."""

    coef_pg: Tensor
    """float32 ``[S]``: aggregation coefficient of the policy term, per sample."""

    coef_other: Tensor
    """float32 ``[S]``: of the entropy and KL terms (``sapo`` aggregates its policy term its own way)."""

    sample_rank: Tensor
    """int64 ``[S]``: the verl data-parallel rank that holds each sample."""

    num_ranks: int
    """verl's data-parallel size."""

    needs_entropy: bool = False
    needs_ref: bool = False
    needs_advantage = True
    records_every_row = True
    """verl's engines return the log-prob (entropy) of every token, trained or not: the step
    computes the unclaimed ones forward only (``megatron_psrl.rl.loss.records_every_row``)."""

    is_weights: Optional[Tensor] = None
    """float32 ``[N]``: verl's ``rollout_is_weights`` per token of the batch, or None."""

    sums: Optional[Tensor] = field(default=None, init=False)
    """float64 ``[dp, K]``: per verl rank, the sums behind its loss and metrics (:data:`_SUM_KEYS`)."""

    def __post_init__(self) -> None:
        self.sums = torch.zeros(self.num_ranks, len(_SUM_KEYS), dtype=torch.float64, device=self.coef_pg.device)

    @property
    def mode(self) -> str:
        return _loss_mode(self.config)

    def __call__(self, logprobs: Tensor, entropy: Optional[Tensor], claims: ClaimBatch):
        logp = logprobs[claims.row]
        pg_losses, token_metrics = _POLICY_TERMS[self.mode](logp, claims.old_logprob, claims.advantage, self.config)
        if self.is_weights is not None:
            pg_losses = pg_losses * self.is_weights[claims.token]
        coef_pg, coef_other = self.coef_pg[claims.sample], self.coef_other[claims.sample]
        pg = coef_pg * pg_losses
        loss = pg.sum()
        columns = {"pg": pg, **token_metrics}
        if self.needs_entropy:
            ent = entropy[claims.row]
            columns["entropy"] = coef_other * ent
            loss = loss - self.config.entropy_coeff * columns["entropy"].sum()
        if self.needs_ref:
            kld = kl_penalty(logprob=logp, ref_logprob=claims.ref_logprob, kl_penalty=self.config.kl_loss_type)
            columns["kl"] = coef_other * kld
            loss = loss + columns["kl"].sum() * self.config.kl_loss_coef
        rank = self.sample_rank[claims.sample]
        for key, values in columns.items():
            self.sums[:, _SUM_KEYS.index(key)].index_add_(0, rank, values.detach().to(torch.float64))
        return loss, {}

    def rank_result(self, rank: int, shares: RankShares, info: Dict[str, Any]) -> Tuple[float, Dict[str, Any]]:
        """``(loss, metrics)`` as verl's ``ppo_loss`` returns them on data-parallel rank ``rank``
        (once ``sums`` holds the sums of every rank of the engine's gradient group)."""
        sums = dict(zip(_SUM_KEYS, self.sums[rank].tolist()))
        scale = float(info["dp_size"])  # verl's agg_loss multiplies each rank's share by dp_size
        tokens = float(shares.response_tokens[rank]) + 1e-8  # verl's masked_mean
        metrics: Dict[str, Any] = {}
        names = _POLICY_METRICS[self.mode]
        metrics.update(Metric.from_dict({k: sums[k] / tokens for k in names}, aggregation=AggregationType.MEAN))
        summed = (info["dp_size"] > 1 or info["batch_num_tokens"] is not None
                  or info["global_batch_size"] is not None or info["loss_scale_factor"] is not None)
        aggregation = AggregationType.SUM if summed else AggregationType.MEAN
        loss = pg_loss = sums["pg"] * scale
        metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=aggregation)
        if self.needs_entropy:
            entropy_loss = sums["entropy"] * scale
            loss -= self.config.entropy_coeff * entropy_loss
            metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=aggregation)
        if self.needs_ref:
            kl_loss = sums["kl"] * scale
            loss += kl_loss * self.config.kl_loss_coef
            metrics["kl_loss"] = Metric(value=kl_loss, aggregation=aggregation)
            metrics["kl_coef"] = self.config.kl_loss_coef
        return loss, metrics


def one_pass_batch(data, config, seqs: VerlSequences, every: GatheredSequences, group, dp: int, device,
                   vocab_size: int, entropy_wanted: bool) -> Tuple[SampleBatch, VerlPolicyLoss, RankShares]:
    """The mini-batch as the engine trains it in one pass (every rank's share, claims on verl's
    ``response_mask``, with advantages, old and reference log-probs), the loss over it, and
    what each rank's ``ppo_loss`` would normalise by."""
    index = seqs.response_index()
    columns = {"loss_mask": seqs.per_token(data["response_mask"], index, dtype=bool),
               "advantages": seqs.per_token(data["advantages"], index),
               "old_logprobs": seqs.per_token(data["old_log_probs"], index)}
    if config.use_kl_loss:
        columns["ref_logprobs"] = seqs.per_token(data["ref_log_prob"], index)
    if "rollout_is_weights" in data.keys():
        columns["is_weights"] = seqs.per_token(data["rollout_is_weights"], index)
    columns = {k: gather_flat(v, group, dp, device) for k, v in columns.items()}
    response_mask = data["response_mask"]
    width = (int((np.diff(seqs.starts) - seqs.prompt_lengths).max()) if getattr(response_mask, "is_nested", False)
             else response_mask.shape[1])  # verl pads the response to this width (seq-mean-token-sum-norm)
    local = np.array([int(columns["loss_mask"][every.my_tokens].sum()), width], dtype=np.int64)
    per_rank = gather_flat(local, group, dp, device).reshape(-1, 2)
    shares = RankShares(response_tokens=per_rank[:, 0], horizon=per_rank[:, 1])
    is_weights = columns.pop("is_weights", None)
    batch = every.batch(columns.pop("loss_mask"), vocab_size, **columns)
    sample_tokens = np.add.reduceat(batch.loss_mask.astype(np.int64), batch.offsets[:-1])
    sample_rank = every.sample_rank()
    info = config.global_batch_info
    agg = config.loss_agg_mode
    coef = lambda mode: torch.from_numpy(  # noqa: E731
        sample_coefficients(mode, sample_tokens, sample_rank, shares, info).astype(np.float32)).to(device)
    loss = VerlPolicyLoss(config=config, coef_pg=coef("seq-mean-token-mean" if _loss_mode(config) == "sapo" else agg),
                          coef_other=coef(agg), sample_rank=torch.from_numpy(sample_rank).to(device),
                          num_ranks=dp, needs_entropy=entropy_wanted,
                          needs_ref=bool(config.use_kl_loss),
                          is_weights=None if is_weights is None else torch.from_numpy(is_weights).to(device))
    return batch, loss, shares


_SUM_KEYS: List[str] = ["pg", "entropy", "kl", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"]


__all__ = ["AGGREGATIONS", "ONE_PASS_MODES", "RankShares", "VerlPolicyLoss", "one_pass_batch", "one_pass_config", "sample_coefficients"]
