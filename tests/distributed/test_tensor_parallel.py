"""Tensor parallelism (TP = 2 under torchrun, gloo) equals TP = 1 and Hugging Face.

One torchrun launch runs every case (see scripts/tp_equivalence.py); the TP = 1 model and the
HF reference run in this process on the same tree-packed micro-batch. Models have GQA (4 query
heads over 2 key/value groups) and an odd vocabulary (251 -> padded to 252 under TP = 2).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.families import family_config, make_family_checkpoint
from helpers.hf_reference import load_hf_model
from helpers.torchrun import run_torchrun

from megatron_psrl.attention import TreeAttentionMetadata, tree_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.checkpoint.convert import hf_to_mcore
from megatron_psrl.model import vocab_parallel_logprobs

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "tp_equivalence.py")
VOCAB = 251
# qwen2: q/k/v bias (column-parallel biases), tied embeddings (vocab-parallel embedding used as
# the output layer); llama: untied vocab-parallel output layer, llama3 RoPE; qwen3: q/k norms.
CASES = ("qwen2-yarn", "llama-llama3", "qwen3-tied")
ENTROPY_COEF = 0.3


def _pack():
    """Prefix (8) with children A (6) and B (5), B with child C (4), plus an unrelated root D (7)."""
    g = torch.Generator().manual_seed(0)
    lengths = [8, 6, 5, 4, 7]
    tokens = torch.randint(0, VOCAB, (sum(lengths),), generator=g)
    starts = [0, 8, 14, 19, 23]
    ends = [8, 14, 19, 23, 30]
    parents = [-1, 0, 0, 2, -1]
    positions = torch.cat([torch.arange(8), 8 + torch.arange(6), 8 + torch.arange(5), 13 + torch.arange(4),
                           torch.arange(7)])
    r = lambda a, b: torch.arange(a, b)  # noqa: E731
    samples = {
        "PA": torch.cat([r(0, 8), r(8, 14)]),
        "PB": torch.cat([r(0, 8), r(14, 19)]),
        "PBC": torch.cat([r(0, 8), r(14, 19), r(19, 23)]),
        "D": r(23, 30),
    }
    return dict(tokens=tokens, positions=positions, seg_start=starts, seg_end=ends, seg_parent=parents,
                samples=samples, entropy_coef=ENTROPY_COEF)


def _tp1(hf_dir, pack):
    from megatron_psrl.distributed.setup import initialize_parallel

    initialize_parallel(1, 1, device="cpu")
    arch, model, _ = load_model(ModelSource(hf_dir=hf_dir))
    plan = tree_plan(pack["seg_start"], pack["seg_end"], pack["seg_parent"])
    hidden = model(pack["tokens"], pack["positions"], TreeAttentionMetadata(plan=plan))[:, 0]
    out = {}
    for name, rows in pack["samples"].items():
        out[name] = vocab_parallel_logprobs(
            model.output_logits(hidden[rows[:-1]]), pack["tokens"][rows[1:]], arch.vocab_size, with_entropy=True
        )
    loss = sum(lp.sum() + ENTROPY_COEF * ent.sum() for lp, ent in out.values())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return arch, {k: (v[0].detach(), v[1].detach()) for k, v in out.items()}, grads


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    pack = _pack()
    cases = []
    for i, name in enumerate(CASES):
        hf_dir = make_family_checkpoint(family_config(name, vocab_size=VOCAB), str(root / f"hf-{name}"), seed=i)
        ckpt = str(root / f"ckpt-{name}")
        hf_to_mcore(hf_dir, ckpt, tp=2, pp=1, progress=False)
        cases.append(dict(name=name, hf_dir=hf_dir, ckpt=ckpt))
    torch.save(dict(cases=cases, pack=pack), root / "inputs.pt")
    run_torchrun(SCRIPT, ["--inputs", str(root / "inputs.pt"), "--out", str(root / "out.pt")], nproc=2, timeout=300)
    return pack, {c["name"]: c for c in cases}, torch.load(root / "out.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_tp2_equals_tp1_and_hf(name, tp_run):
    pack, cases, results = tp_run
    res = results[name]
    assert res["padded_vocab"] == 252
    arch, tp1_out, tp1_grads = _tp1(cases[name]["hf_dir"], pack)
    hf = load_hf_model(cases[name]["hf_dir"])

    for sample, rows in pack["samples"].items():
        toks = pack["tokens"][rows]
        with torch.no_grad():
            logsm = torch.log_softmax(hf(toks[None]).logits[0, :-1].float(), -1)
        ref_lp = logsm.gather(1, toks[1:, None])[:, 0]
        ref_ent = -(logsm.exp() * logsm).sum(-1)
        lp1, ent1 = tp1_out[sample]
        for label, lp in (("tp2", res["logprobs"][sample]), ("tp1", lp1), ("tp2 from checkpoint", res["ckpt_logprobs"][sample])):
            assert (lp - ref_lp).abs().max().item() <= 1e-4, f"{name} {sample} {label} vs HF"
        assert (res["entropy"][sample] - ref_ent).abs().max().item() <= 1e-4
        torch.testing.assert_close(res["logprobs"][sample], lp1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["entropy"][sample], ent1, atol=1e-5, rtol=1e-5)

    # Gradients: TP shards merged back to full tensors equal TP = 1's, parameter by parameter.
    shards = res["grad_shards"]
    merged = dict(res["grads"])
    for pname in [n for n in merged if "q_layernorm" in n or "k_layernorm" in n]:
        # Per-head q/k norms see only the rank's own heads: before the reduction each rank holds
        # a partial gradient; allreduce_tensor_parallel_partial_gradients (what the optimizer
        # runs, like megatron's finalize_model_grads) makes every rank hold the full one.
        raw = res["raw_grad_shards"]
        assert not torch.allclose(raw[0][pname], tp1_grads[pname], atol=1e-7, rtol=1e-3), pname
        torch.testing.assert_close(shards[0][pname], shards[1][pname])
    assert set(merged) == set(tp1_grads)
    for pname, g1 in tp1_grads.items():
        g2 = merged[pname]
        assert g2.shape == g1.shape, pname
        scale = g1.abs().max().item()
        assert scale > 0, pname
        err = (g2 - g1).abs().max().item()
        assert err <= 1e-7 + 1e-5 * scale, f"{name} {pname}: max abs err {err:.3e} vs max |grad| {scale:.3e}"
    # Replicated parameters (norms) get the full gradient on every rank.
    for pname in shards[0]:
        if "layernorm" in pname and "q_layernorm" not in pname and "k_layernorm" not in pname:
            torch.testing.assert_close(shards[0][pname], shards[1][pname], atol=1e-6, rtol=1e-5)
    # The padded vocabulary row (index 251, last row of rank 1) gets exactly zero gradient.
    emb1 = shards[1]["embedding.word_embeddings.weight"]
    assert torch.all(emb1[-1] == 0)
    if not arch.tie_word_embeddings:
        assert torch.all(shards[1]["output_layer.weight"][-1] == 0)
