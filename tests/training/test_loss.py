"""The policy loss per claim and the global-batch aggregation coefficients."""

import numpy as np
import pytest
import torch

from megatron_psrl.data import samples_from_dicts
from megatron_psrl.rl.loss import LossConfig, claim_coefficients, gather_claims, policy_loss
from megatron_psrl.tree import build_prefix_tree


def _batch():
    return samples_from_dicts([
        {"id": "a", "tokens": [1, 2, 3, 4], "advantage": 1.0, "old_logprobs": [0, -1.0, -2.0, -0.5],
         "ref_logprobs": [0, -1.2, -2.1, -0.4], "weight": 2.0},
        {"id": "b", "tokens": [1, 2, 3, 5], "advantage": [0, -1.0, 0.5, 2.0], "loss_mask": [0, 0, 1, 1],
         "ref_logprobs": [0, -1.0, -1.9, -0.7]},
        {"id": "c", "tokens": [7, 8], "advantage": 0.3, "loss_mask": [0, 0], "ref_logprobs": [0, -1.0]},
    ])


def test_coefficients_follow_the_original_samples():
    tree = build_prefix_tree(_batch())
    # claims: a -> 3 tokens, b -> 2 tokens (token 3 shared with a), c -> none
    c = claim_coefficients(tree, "token-mean")
    assert np.allclose(c, 1 / 5)
    c = claim_coefficients(tree, "seq-mean-token-mean")
    per_sample = {0: 1 / (2 * 3), 1: 1 / (2 * 2)}
    assert np.allclose(c, [per_sample[int(s)] for s in tree.claim_sample])
    assert np.allclose(claim_coefficients(tree, "seq-mean-token-sum"), 1 / 3)  # all samples, c included


def test_policy_loss_matches_the_formula_per_claim():
    tree = build_prefix_tree(_batch())
    cfg = LossConfig(clip_eps=0.2, kl_coef=0.1, entropy_coef=0.01, loss_agg="token-mean")
    coef = claim_coefficients(tree, cfg.loss_agg)
    targets = np.flatnonzero(tree.claim_offsets[1:] > tree.claim_offsets[:-1])
    claims = gather_claims(tree, coef, targets, cfg, torch.device("cpu"))
    logp = torch.tensor([-0.9, -2.5, -0.1, -0.6], dtype=torch.float32)[: len(targets)].requires_grad_()
    ent = torch.tensor([1.0, 2.0, 3.0, 4.0])[: len(targets)]
    total, metrics = policy_loss(logp, ent, claims, cfg)
    # independent evaluation, claim by claim, from the batch
    b = tree.batch
    expected = 0.0
    for k in range(len(tree.claim_token)):
        s, flat = int(tree.claim_sample[k]), int(tree.claim_flat[k])
        row = int(np.searchsorted(targets, tree.claim_token[k]))
        lp = float(logp[row].detach())
        old = float(b.old_logprobs[flat]) if b.has_old_logprobs[s] else lp
        r = np.exp(lp - old)
        a = float(b.advantages[flat])
        pg = -min(r * a, np.clip(r, 0.8, 1.2) * a)
        d = float(b.ref_logprobs[flat]) - lp
        kl = np.exp(d) - d - 1
        expected += coef[k] * float(b.weights[s]) * (pg + 0.1 * kl - 0.01 * float(ent[row]))
    assert float(total.detach()) == pytest.approx(expected, rel=1e-6)
    assert set(metrics) == {"pg_loss", "kl", "entropy", "clip_frac", "ratio_clamped"}
    assert float(metrics["ratio_clamped"]) == 0.0
    assert 0.0 <= float(metrics["clip_frac"]) <= 1.0
    assert float(metrics["entropy"]) == pytest.approx(float(ent[np.searchsorted(targets, tree.claim_token)].mean()))


def test_weight_zero_sample_does_not_train():
    batch = samples_from_dicts([
        {"id": "a", "tokens": [1, 2, 3], "advantage": 1.0, "ref_logprobs": [0, -1.0, -2.0], "weight": 0.0},
    ])
    tree = build_prefix_tree(batch)
    cfg = LossConfig(kl_coef=0.5, entropy_coef=0.5)
    targets = np.array([1, 2])
    claims = gather_claims(tree, claim_coefficients(tree, cfg.loss_agg), targets, cfg, torch.device("cpu"))
    logp = torch.tensor([-1.5, -0.5], requires_grad=True)
    ent = torch.tensor([2.0, 3.0], requires_grad=True)
    total, _ = policy_loss(logp, ent, claims, cfg)
    total.backward()
    assert float(total.detach()) == 0.0 and torch.all(logp.grad == 0) and torch.all(ent.grad == 0)


def test_missing_ref_logprobs_with_kl_names_the_sample():
    batch = samples_from_dicts([{"id": "x", "tokens": [1, 2, 3], "advantage": 1.0}], source="f.jsonl")
    tree = build_prefix_tree(batch)
    cfg = LossConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="sample id 'x'.*ref_logprobs"):
        gather_claims(tree, claim_coefficients(tree, cfg.loss_agg), np.array([1, 2]), cfg, torch.device("cpu"))


def test_invalid_aggregation():
    with pytest.raises(ValueError, match="loss_agg"):
        LossConfig(loss_agg="mean")
