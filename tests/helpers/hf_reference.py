"""The independent reference: Hugging Face transformers, one sample at a time, no sharing.

Everything megatron_psrl computes with prefix sharing (log-probs, the RL loss, parameter
gradients) is compared against this plain per-sample computation. It shares no code with the
system under test except the data containers and the claim coefficients' definition (which
is restated here from docs/loss.md, not imported).
"""

from __future__ import annotations

import tempfile
from typing import Dict, List, Tuple

import numpy as np
import torch

from helpers.reference_cache import cached
from megatron_psrl.data.samples import SampleBatch


def make_hf_checkpoint(config: dict, seed: int = 0, dtype=torch.float32, directory: str = None) -> str:
    """Save a randomly initialised HF model of ``config`` (no download) and return its folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    # Random init of HF leaves norms at 1 and biases at 0; perturb them so the test sees them
    # (gpt-oss: the experts' biases too, and sinks that take a visible share of the softmax).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias") or name.endswith("_bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("self_attn.sinks"):
                p.copy_(torch.randn_like(p))
    directory = directory or tempfile.mkdtemp(prefix="hf-")
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_hf_model(hf_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def _batch_parts(batch: SampleBatch) -> list:
    """What a per-sample reference reads of a batch (the key of its cached value)."""
    return [batch.tokens, batch.offsets, batch.loss_mask, batch.advantages, batch.old_logprobs, batch.ref_logprobs,
            batch.has_old_logprobs, batch.weights]


def per_sample_logprobs(model, batch: SampleBatch) -> List[np.ndarray]:
    """logprobs[i] = log p(tokens[i] | tokens[:i]), logprobs[0] = 0, per sample (computed once
    per session for equal model weights and batch: :mod:`helpers.reference_cache`)."""
    return cached("logprobs", [model] + _batch_parts(batch), lambda: _per_sample_logprobs(model, batch))


def _per_sample_logprobs(model, batch: SampleBatch) -> List[np.ndarray]:
    out = []
    with torch.no_grad():
        for s in range(batch.num_samples):
            toks = torch.from_numpy(batch.sample_tokens(s).astype(np.int64))
            logits = model(toks[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, toks[1:, None])[:, 0]
            out.append(np.concatenate([[0.0], lp.numpy()]))
    return out


def _coefficients(batch: SampleBatch, loss_agg: str) -> List[np.ndarray]:
    """Per-sample arrays of claim coefficients (restated from docs/loss.md)."""
    masks = [batch.loss_mask[batch.sample_slice(s)] for s in range(batch.num_samples)]
    counts = np.array([m.sum() for m in masks])
    total, trained = counts.sum(), (counts > 0).sum()
    coefs = []
    for m, n in zip(masks, counts):
        if loss_agg == "token-mean":
            c = 1.0 / total
        elif loss_agg == "seq-mean-token-mean":
            c = 1.0 / (trained * n) if n else 0.0
        else:
            c = 1.0 / len(masks)  # seq-mean-token-sum: mean over all samples
        coefs.append(np.where(m, c, 0.0))
    return coefs


def per_sample_loss_and_grads(
    model, batch: SampleBatch, clip_eps: float, kl_coef: float, entropy_coef: float, loss_agg: str
) -> Tuple[float, Dict[str, torch.Tensor]]:
    """The RL loss summed over samples (one forward/backward per sample) and HF grads, left in
    the model's ``.grad`` too (computed once per session for equal weights, batch and loss
    settings: :mod:`helpers.reference_cache`)."""
    settings = (clip_eps, kl_coef, entropy_coef, loss_agg)
    total, grads = cached("loss-and-grads", [model] + _batch_parts(batch) + [settings],
                          lambda: _per_sample_loss_and_grads(model, batch, *settings))
    params = dict(model.named_parameters())
    for name, grad in grads.items():  # (a cached value: the grads a computation would have left)
        params[name].grad = grad.clone()
    return total, grads


def _per_sample_loss_and_grads(
    model, batch: SampleBatch, clip_eps: float, kl_coef: float, entropy_coef: float, loss_agg: str
) -> Tuple[float, Dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total = 0.0
    coefs = _coefficients(batch, loss_agg)
    for s in range(batch.num_samples):
        sl = batch.sample_slice(s)
        toks = torch.from_numpy(batch.tokens[sl].astype(np.int64))
        logits = model(toks[None]).logits[0].float()[:-1]
        logsm = torch.log_softmax(logits, -1)
        logp = logsm.gather(1, toks[1:, None])[:, 0]
        mask = torch.from_numpy(batch.loss_mask[sl][1:])
        coef = torch.from_numpy(coefs[s][1:]).float()
        adv = torch.from_numpy(batch.advantages[sl][1:]).float()
        if batch.old_logprobs is not None and batch.has_old_logprobs[s]:
            old = torch.from_numpy(batch.old_logprobs[sl][1:]).float()
        else:
            old = logp.detach()
        ratio = torch.exp(logp - old)
        pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
        per_tok = pg
        if kl_coef:
            ref = torch.from_numpy(batch.ref_logprobs[sl][1:]).float()
            d = ref - logp
            per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)
        if entropy_coef:
            ent = -(logsm.exp() * logsm).sum(-1)
            per_tok = per_tok - entropy_coef * ent
        loss = float(batch.weights[s]) * (coef * per_tok * mask).sum()  # the weight scales every term
        if mask.any():
            loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    if "lm_head.weight" in grads and model.config.tie_word_embeddings:
        grads.pop("lm_head.weight")
    return total, grads


def hf_grads_to_mcore(hf_grads: Dict[str, torch.Tensor], arch) -> Dict[str, torch.Tensor]:
    """Map HF gradients to megatron parameter names with the (linear) state-dict adapter; an MoE
    model's experts may be fused as transformers keeps them. Tensors without a gradient (buffers:
    a router's expert bias, ``e_score_correction_bias``) have no megatron parameter either: left
    out."""
    from megatron_psrl.model.adapters import get_adapter, unfuse_experts

    if arch.is_moe:
        hf_grads = unfuse_experts(hf_grads, arch.model_type)
    adapter = get_adapter(arch)
    shapes = adapter.hf_shapes()
    missing = {}

    def get(name: str) -> torch.Tensor:
        if name in hf_grads:
            return hf_grads[name]
        return missing.setdefault(name, torch.zeros(shapes[name]))

    out = dict(adapter.hf_to_mcore(get))
    none = {id(t) for t in missing.values()}
    return {name: t for name, t in out.items() if id(t) not in none}


def assert_grads_close(ours: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-7):
    """Every parameter gradient: max |ours - ref| <= atol + rtol * max |ref|."""
    assert set(ours) == set(ref), (sorted(set(ours) ^ set(ref)))[:5]
    worst = []
    for name in ref:
        a, b = ours[name].float(), ref[name].float()
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        worst.append((err / (scale + 1e-30), name, err, scale))
        assert err <= atol + rtol * scale, f"{name}: max abs err {err:.3e} vs max |ref| {scale:.3e}"
    return max(worst)
