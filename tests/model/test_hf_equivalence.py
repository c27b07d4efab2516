"""PsrlGPTModel (megatron-core GPT + prefix-sharing attention + per-token RoPE) loaded from a
random HF checkpoint reproduces Hugging Face transformers' log-probs and entropies, for every
supported family; position ids, packing and tree packing behave as the math says.

Reference: transformers' own model (eager attention, fp32), one sample at a time.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers.families import FAMILIES, LATENT_FAMILIES, family_config
from helpers.hf_reference import assert_grads_close, hf_grads_to_mcore, load_hf_model
from helpers.tolerance import assert_equal_up_to_rounding

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan, tree_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.model import vocab_parallel_logprobs

ATOL = 1e-4
LENGTHS = (2, 9, 40)


def _tokens(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _ours(model, arch, tokens, positions=None, plan=None, with_entropy=False):
    """log-probs (and entropies) of tokens[1:] given the pack, for one sequence."""
    n = len(tokens)
    positions = torch.arange(n) if positions is None else positions
    meta = TreeAttentionMetadata(plan=plan or causal_plan([n]))
    hidden = model(tokens, positions, meta)[:, 0]  # [t, h]
    return vocab_parallel_logprobs(model.output_logits(hidden[:-1]), tokens[1:], arch.vocab_size, with_entropy)


def _hf(hf, tokens, positions=None):
    with torch.no_grad():
        kwargs = {} if positions is None else dict(position_ids=positions[None])
        logsm = torch.log_softmax(hf(tokens[None], **kwargs).logits[0, :-1].float(), -1)
    return logsm.gather(1, tokens[1:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    cache = {}

    def get(name):
        from megatron_psrl.distributed.setup import initialize_parallel

        initialize_parallel(1, 1, device="cpu")
        if name not in cache:
            d = hf_checkpoints(name)
            arch, model, _ = load_model(ModelSource(hf_dir=d))
            cache[name] = (arch, model, load_hf_model(d))
        return cache[name]

    return get


@pytest.mark.parametrize("family", FAMILIES + LATENT_FAMILIES)
def test_logprobs_and_entropy_match_hf(family, models):
    arch, model, hf = models(family)
    cfg = family_config(family)
    assert arch.model_type == cfg["model_type"]
    for i, n in enumerate(LENGTHS):
        tokens = _tokens(n, arch.vocab_size, seed=i)
        with torch.no_grad():
            lp, ent = _ours(model, arch, tokens, with_entropy=True)
        ref_lp, ref_ent = _hf(hf, tokens)
        assert lp.dtype == torch.float32 and lp.shape == (n - 1,)
        assert (lp - ref_lp).abs().max().item() <= ATOL, f"{family} n={n} log-probs"
        assert (ent - ref_ent).abs().max().item() <= ATOL, f"{family} n={n} entropy"
        assert (lp <= 0).all() and (ent >= 0).all()


def test_the_comparison_sees_rope_scaling(hf_checkpoints, tmp_path):
    """The families' log-probs depend on the RoPE variant by far more than ATOL, so a model that
    ignored llama3 / yarn / linear scaling (DeepSeek-V3: YaRN's cos/sin scale and the softmax
    correction of mscale_all_dim) would fail test_logprobs_and_entropy_match_hf."""
    tokens = _tokens(40, 256, seed=2)
    for family in ("llama-llama3", "qwen2-yarn", "mistral-linear", "deepseek-v3"):
        d = hf_checkpoints(family)
        ref, _ = _hf(load_hf_model(d), tokens)
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg["rope_parameters"] = dict(rope_type="default", rope_theta=cfg["rope_parameters"]["rope_theta"])
        plain = tmp_path / family
        plain.mkdir()
        for f in os.listdir(d):
            if f != "config.json":
                os.symlink(os.path.join(d, f), plain / f)
        (plain / "config.json").write_text(json.dumps(cfg))
        unscaled, _ = _hf(load_hf_model(str(plain)), tokens)
        assert (unscaled - ref).abs().max().item() > 100 * ATOL, family


@pytest.mark.parametrize("family", ["llama-llama3", "qwen3-tied", "deepseek-v3"])
def test_position_ids_matter(family, models):
    """Per-token positions reach RoPE: a gap in the positions changes the log-probs, and ours
    equal HF's with the same position_ids. (A uniform shift changes nothing: RoPE is relative.)"""
    arch, model, hf = models(family)
    n = 24
    tokens = _tokens(n, arch.vocab_size, seed=7)
    gap = torch.arange(n)
    gap[10:] += 13
    with torch.no_grad():
        base, _ = _ours(model, arch, tokens)
        with_gap, _ = _ours(model, arch, tokens, positions=gap)
        shifted, _ = _ours(model, arch, tokens, positions=torch.arange(n) + 100)
    ref_gap, _ = _hf(hf, tokens, gap)
    assert (with_gap - ref_gap).abs().max().item() <= ATOL
    assert (with_gap[10:] - base[10:]).abs().max().item() > 100 * ATOL  # after the gap
    torch.testing.assert_close(with_gap[:9], base[:9], atol=1e-5, rtol=0)  # before it: causal
    assert (shifted - base).abs().max().item() <= ATOL


@pytest.mark.parametrize("family", ["qwen2-yarn", "mistral"])
def test_packing_with_restarted_positions_equals_separate_runs(family, models):
    arch, model, hf = models(family)
    a, b = _tokens(13, arch.vocab_size, seed=3), _tokens(21, arch.vocab_size, seed=4)
    pack = torch.cat([a, b])
    positions = torch.cat([torch.arange(13), torch.arange(21)])
    meta = TreeAttentionMetadata(plan=causal_plan([13, 21]))
    with torch.no_grad():
        hidden = model(pack, positions, meta)[:, 0]
        ha = model(a, torch.arange(13), TreeAttentionMetadata(plan=causal_plan([13])))[:, 0]
        hb = model(b, torch.arange(21), TreeAttentionMetadata(plan=causal_plan([21])))[:, 0]
        torch.testing.assert_close(hidden, torch.cat([ha, hb]), atol=1e-5, rtol=1e-5)
        lp_a, _ = vocab_parallel_logprobs(model.output_logits(hidden[:12]), a[1:], arch.vocab_size)
        lp_b, _ = vocab_parallel_logprobs(model.output_logits(hidden[13:-1]), b[1:], arch.vocab_size)
        # a pack read as one causal sequence is different (b would see a)
        wrong = model(pack, positions, TreeAttentionMetadata(plan=causal_plan([34])))[:, 0]
    assert (lp_a - _hf(hf, a)[0]).abs().max().item() <= ATOL
    assert (lp_b - _hf(hf, b)[0]).abs().max().item() <= ATOL
    assert (wrong[13:] - hidden[13:]).abs().max().item() > 1e-2


def _tree_pack(vocab):
    """Prefix P (7 tokens) with children A (5) and B (6); B has a child C (4) - three samples."""
    P, A, B, C = (_tokens(n, vocab, seed=s) for n, s in ((7, 10), (5, 11), (6, 12), (4, 13)))
    pack = torch.cat([P, A, B, C])
    positions = torch.cat([torch.arange(7), 7 + torch.arange(5), 7 + torch.arange(6), 13 + torch.arange(4)])
    plan = tree_plan([0, 7, 12, 18], [7, 12, 18, 22], [-1, 0, 0, 2])
    rows = {  # pack rows of every sample (root-to-leaf)
        "PA": torch.cat([torch.arange(7), torch.arange(7, 12)]),
        "PB": torch.cat([torch.arange(7), torch.arange(12, 18)]),
        "PBC": torch.cat([torch.arange(7), torch.arange(12, 18), torch.arange(18, 22)]),
    }
    return pack, positions, plan, rows


@pytest.mark.parametrize("family", ["llama-llama3", "qwen3-tied", "gpt-oss", *LATENT_FAMILIES])
def test_tree_pack_logprobs_and_gradients_equal_per_sample_hf(family, models):
    """M1 exactness at the model level: one tree-packed forward gives every sample's HF
    log-probs, and the gradient of the summed per-sample log-likelihood equals HF's, summed
    over samples run separately (the shared prefix gets the sum of its samples' gradients).
    gpt-oss: its 8-token window is shorter than the paths (12 to 17 tokens), so a token of B's
    child C sees B's last tokens and never A's; the sinks' gradients included."""
    arch, model, hf = models(family)
    pack, positions, plan, rows = _tree_pack(arch.vocab_size)
    model.zero_grad(set_to_none=True)
    hidden = model(pack, positions, TreeAttentionMetadata(plan=plan))[:, 0]
    total = 0.0
    for name, r in rows.items():
        lp, _ = vocab_parallel_logprobs(model.output_logits(hidden[r[:-1]]), pack[r[1:]], arch.vocab_size)
        ref, _ = _hf(hf, pack[r])
        assert (lp.detach() - ref).abs().max().item() <= ATOL, name
        total = total + lp.sum()
    total.backward()
    ours = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    hf.zero_grad(set_to_none=True)
    for r in rows.values():
        toks = pack[r]
        logsm = torch.log_softmax(hf(toks[None]).logits[0, :-1].float(), -1)
        logsm.gather(1, toks[1:, None]).sum().backward()
    hf_grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
    if arch.tie_word_embeddings:
        hf_grads.pop("lm_head.weight", None)
    ref = hf_grads_to_mcore(hf_grads, arch)
    assert_grads_close(ours, ref, rtol=1e-5, atol=1e-7)
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)


def test_entropy_with_padded_vocab_rows_is_unchanged(models):
    """vocab_parallel_logprobs masks columns past vocab_size (TP padding): appending junk
    columns to the logits changes neither log-probs nor entropy (beyond the rounding of a
    reduction over a wider row, which depends on the CPU's SIMD width)."""
    arch, model, hf = models("mistral")
    tokens = _tokens(12, arch.vocab_size, seed=5)
    with torch.no_grad():
        hidden = model(tokens, torch.arange(12), TreeAttentionMetadata(plan=causal_plan([12])))[:, 0]
        logits = model.output_logits(hidden[:-1])
        padded = torch.cat([logits, 50 + torch.randn(11, 3)], 1)
        lp, ent = vocab_parallel_logprobs(logits, tokens[1:], arch.vocab_size, with_entropy=True)
        lp2, ent2 = vocab_parallel_logprobs(padded, tokens[1:], arch.vocab_size, with_entropy=True)
    # log-sum-exp works at the magnitude of the largest logit plus log(vocab)
    scale = float(logits.abs().max()) + math.log(arch.vocab_size)
    assert_equal_up_to_rounding(lp, lp2, scale)
    assert_equal_up_to_rounding(ent, ent2, scale)
    ref_lp, ref_ent = _hf(hf, tokens)
    assert (lp - ref_lp).abs().max() <= ATOL and (ent - ref_ent).abs().max() <= ATOL


def test_logprob_gradient_matches_log_softmax():
    """d/dlogits of (logprob + entropy) equals autograd through torch.log_softmax (padded columns
    receive exactly zero gradient)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 12, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 10, (6,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, 10, with_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    ref_logits = logits.detach()[:, :10].clone().requires_grad_(True)
    logsm = torch.log_softmax(ref_logits, -1)
    (logsm.gather(1, targets[:, None]).sum() - 0.5 * (logsm.exp() * logsm).sum()).backward()
    torch.testing.assert_close(logits.grad[:, :10], ref_logits.grad, atol=1e-6, rtol=1e-5)
    assert torch.all(logits.grad[:, 10:] == 0)
