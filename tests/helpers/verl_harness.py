"""verl-format batches and the per-sample reference through verl's own loss, for the verl
engine's tests (single process and the torchrun script).

The reference is Hugging Face transformers, one sample at a time, no sharing: its log-probs (and
entropies) in verl's nested layout go through verl's ``ppo_loss`` exactly as verl's own engines
hand them over; its parameter gradients are the ground truth for the engine's.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.config import ActorConfig as VerlActorConfig
from verl.workers.config import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from helpers.tolerance import rounding_tolerance
from megatron_psrl.integrations.verl import training_batch

VOCAB = 96


def multi_turn_samples(seed: int = 0) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(prompt, response, response_mask)`` per sample: two GRPO groups of three responses to
    one prompt each; the responses of the first group share their first turn (a tool call
    whose output, mask 0, is part of the response), as an agent loop's multi-turn rollouts do."""
    rng = np.random.default_rng(seed)
    out = []
    for group in range(2):
        prompt = rng.integers(1, VOCAB, size=20 + 3 * group)
        turn = rng.integers(1, VOCAB, size=6)      # the model's first turn (shared in group 0)
        tool = rng.integers(1, VOCAB, size=5)      # the tool's output (not trained)
        for _ in range(3):
            if group == 0:
                tail = rng.integers(1, VOCAB, size=int(rng.integers(4, 9)))
                response = np.concatenate([turn, tool, tail])
                mask = np.concatenate([np.ones(6), np.zeros(5), np.ones(len(tail))])
            else:
                response = rng.integers(1, VOCAB, size=int(rng.integers(8, 14)))
                mask = np.ones(len(response))
            out.append((prompt, response, mask.astype(np.int64)))
    return out


def verl_batch(samples, *, global_batch_size: int, calculate_entropy: bool = False, seed: int = 0) -> TensorDict:
    """verl's training batch of ``samples`` with random GRPO advantages (one per sample) and old
    log-probs (``megatron_psrl.integrations.verl.training_batch``)."""
    rng = np.random.default_rng(seed + 1)
    b, r_max = len(samples), max(len(r) for _, r, _ in samples)
    advantages = torch.from_numpy(rng.normal(size=(b, 1)).astype(np.float32))
    old = torch.from_numpy(rng.normal(-2.5, 0.3, size=(b, r_max)).astype(np.float32))
    return training_batch(samples, advantages, old, global_batch_size=global_batch_size,
                          calculate_entropy=calculate_entropy)


def verl_loss_config(loss_agg_mode: str = "token-mean", entropy_coeff: float = 0.0, loss_mode: str = "vanilla",
                     **fields) -> VerlActorConfig:
    """verl's actor config as its PPO trainer builds it (clip 0.2, the given aggregation and
    policy-loss mode; ``fields``: more of its fields, ``dro_beta`` into its policy-loss config)."""
    policy = {"loss_mode": loss_mode}
    if "dro_beta" in fields:
        policy["dro_beta"] = fields.pop("dro_beta")
    fields = dict(dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2), **fields)
    return VerlActorConfig(strategy="megatron", rollout_n=3, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                           use_dynamic_bsz=False, loss_agg_mode=loss_agg_mode, entropy_coeff=entropy_coeff,
                           policy_loss=PolicyLossConfig(**policy), **fields)


ONE_PASS_CASES: Dict[str, dict] = {
    "vanilla-token-mean-entropy": dict(entropy_coeff=0.01, clip_ratio_high=0.28),
    "vanilla-seq-mean-token-sum-k3-is": dict(loss_agg_mode="seq-mean-token-sum", use_kl_loss=True,
                                             kl_loss_type="low_var_kl", kl_loss_coef=0.1, is_weights=True),
    "vanilla-seq-mean-token-sum-norm-k1plus": dict(loss_agg_mode="seq-mean-token-sum-norm", use_kl_loss=True,
                                                   kl_loss_type="k1+", kl_loss_coef=0.05),
    "vanilla-seq-mean-token-mean-mse": dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_type="mse",
                                            entropy_coeff=0.02),
    "vanilla-token-sum-abs": dict(loss_agg_mode="token-sum", use_kl_loss=True, kl_loss_type="abs", clip_ratio_c=2.0),
    "dppo_tv": dict(loss_mode="dppo_tv"),
    "dppo_kl-seq-mean-token-mean": dict(loss_mode="dppo_kl", loss_agg_mode="seq-mean-token-mean"),
    "sapo-entropy": dict(loss_mode="sapo", entropy_coeff=0.01),
    "gpg-k2": dict(loss_mode="gpg", use_kl_loss=True, kl_loss_type="k2", kl_loss_coef=0.1),
    "dro-seq-mean-token-sum": dict(loss_mode="dro", dro_beta=0.5, loss_agg_mode="seq-mean-token-sum"),
    "cispo-k3plus": dict(loss_mode="cispo", use_kl_loss=True, kl_loss_type="k3+", kl_loss_coef=0.1,
                         is_weights=True),
}
"""verl ``ppo_loss`` configurations the engine runs in one pass, each a config and batch
(``calculate_entropy`` when ``entropy_coeff`` is set; ``is_weights``: rollout correction weights)."""

TWO_PASS_CASES: Dict[str, dict] = {"gspo-seq-mean-token-mean": dict(loss_mode="gspo",
                                                                    loss_agg_mode="seq-mean-token-mean")}
"""A configuration the engine refuses to run in one pass (the two-pass path, exact all the same)."""


def case_config(case: dict) -> VerlActorConfig:
    return verl_loss_config(**{k: v for k, v in case.items() if k != "is_weights"})


def case_batch(samples, case: dict, *, global_batch_size: int, seed: int = 0) -> TensorDict:
    """verl's batch for a case: old log-probs around the model's (ratios on both sides of every
    clip, dual-clip included), reference log-probs and rollout weights where the case needs them."""
    data = verl_batch(samples, global_batch_size=global_batch_size, seed=seed,
                      calculate_entropy=case.get("entropy_coeff", 0.0) != 0.0)
    rng = np.random.default_rng(seed + 7)
    mask = data["response_mask"].float()
    data["old_log_probs"] = torch.from_numpy(rng.normal(-4.6, 1.2, size=mask.shape).astype(np.float32)) * mask
    if case.get("use_kl_loss"):
        data["ref_log_prob"] = torch.from_numpy(rng.normal(-4.6, 0.8, size=mask.shape).astype(np.float32)) * mask
    if case.get("is_weights"):
        data["rollout_is_weights"] = torch.from_numpy(rng.uniform(0.5, 1.5, size=mask.shape).astype(np.float32)) * mask
    return data


def reference(model, shards: List[TensorDict], config, entropy: bool) -> Dict[str, object]:
    """verl's loss of every data-parallel shard from per-sample HF log-probs, and the gradient of
    their mean (verl's engines average over data-parallel ranks): ``{"losses", "metrics", "grads",
    "log_probs", "entropy"}`` (metrics as floats; the last two per shard, verl's nested layout,
    as flat tensors)."""
    model.zero_grad(set_to_none=True)
    dp = len(shards)
    num_tokens = sum(int(s["loss_mask"].sum()) for s in shards)
    losses, metrics, log_probs, entropies = [], [], [], []
    total = 0.0
    for data in shards:
        data = data.clone()
        tu.assign_non_tensor(data, batch_num_tokens=num_tokens, dp_size=dp)
        ids, offsets = data["input_ids"].values(), data["input_ids"].offsets()
        lps, ents = [], []
        for i in range(len(offsets) - 1):
            toks = ids[offsets[i]:offsets[i + 1]]
            logits = model(toks[None]).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            label = torch.roll(toks, -1)
            lps.append(logp.gather(1, label[:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(lps), offsets=offsets)}
        if entropy:
            out["entropy"] = torch.nested.nested_tensor_from_jagged(torch.cat(ents), offsets=offsets)
        loss, shard_metrics = ppo_loss(config, out, data)
        metrics.append(metric_values(shard_metrics))
        total = total + loss / dp
        losses.append(float(loss.detach()))
        log_probs.append(torch.cat(lps).detach())
        entropies.append(torch.cat(ents).detach())
    total.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"losses": losses, "metrics": metrics, "grads": grads, "log_probs": log_probs, "entropy": entropies}


def metric_values(metrics: Dict[str, object]) -> Dict[str, float]:
    """verl's loss metrics as floats (``Metric`` objects aggregated)."""
    return {k: float(v.aggregate() if isinstance(v, Metric) else v) for k, v in metrics.items()}


def trained_metric_values(trained: Dict[str, object]) -> Dict[str, float]:
    """The loss metrics of one ``train_batch`` call as floats: verl's engines return a ``Metric``
    as it is and anything else in a list of one value per micro-batch call (``append_to_dict``)."""
    return metric_values({k: v if isinstance(v, Metric) else v[0] for k, v in trained["metrics"].items()
                          if k != "grad_norm"})


def response_positions(data: TensorDict) -> torch.Tensor:
    """Bool over the flat jagged layout: positions whose log-prob verl's loss reads (the
    response's tokens are predicted from the position before each)."""
    offsets = data["input_ids"].offsets()
    keep = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    response_lens = data["attention_mask"][:, data["prompts"].shape[1]:].sum(1)
    for i in range(len(offsets) - 1):
        end = int(offsets[i + 1])
        keep[end - int(response_lens[i]) - 1:end - 1] = True
    return keep


LOGPROB_ULPS = 16
"""Units of float32 rounding (at the magnitude of the largest value) between the engine's
log-probs / entropies and Hugging Face's: the two models reduce the hidden size and the
vocabulary in different orders, through every layer (3.5 units measured here, entropies; a
position filled wrongly is off by nats)."""


def assert_every_position(got, want: torch.Tensor, data, key: str) -> None:
    """Every position of verl's nested ``got`` (``log_probs`` / ``entropy``) equals the per-sample
    reference ``want`` (verl's layout: position t predicts token t + 1) up to float32 rounding;
    the last position of each sample, which predicts no token of it, holds 0."""
    got = got.values().detach().float()
    expected = want.clone()
    expected[data["input_ids"].offsets()[1:] - 1] = 0.0
    scale = float(expected.abs().max())
    tol = rounding_tolerance(torch.float32, scale, LOGPROB_ULPS)
    worst = (got - expected).abs()
    assert got.shape == expected.shape and bool(torch.all(worst <= tol)), (
        f"{key}: {int((worst > tol).sum())} of {len(worst)} positions differ by more than {tol:.2e} "
        f"(worst {float(worst.max()):.3e} at {int(worst.argmax())})")


def psrl_engine(hf_dir: str, **engine_fields):
    """verl's engine registry building the psrl engine on the CPU over ``hf_dir`` (fp32, SGD with
    lr 1, micro-batches of 48 tokens unless ``engine_fields`` say otherwise), initialised."""
    from verl.workers.config import HFModelConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig

    fields = dict(dtype="float32", device="cpu", micro_batch_tokens=48)
    fields.update(engine_fields)
    engine = EngineRegistry.new("language_model", backend=BACKEND,
                                model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
                                engine_config=PsrlEngineConfig(**fields),
                                optimizer_config=McoreOptimizerConfig(optimizer="sgd", lr=1.0, clip_grad=0.0,
                                                                      weight_decay=0.0),
                                checkpoint_config=None)
    engine.initialize()
    return engine


def spy_step_metrics(engine) -> dict:
    """A dict that fills with the metrics of every step the engine's actor runs (the tokens it
    computed, the KV cache's hit rate, ...): its ``forward_backward`` wrapped."""
    seen: dict = {}
    original = engine.actor.forward_backward

    def spy(batch, **kwargs):
        result = original(batch, **kwargs)
        seen.update(result.metrics)
        return result

    engine.actor.forward_backward = spy
    return seen
