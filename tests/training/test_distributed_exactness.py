"""Under torchrun (gloo): data parallelism (DP=2, trees split over ranks, gradients summed) and
tensor parallelism (TP=2, vocab-parallel loss) give the per-sample reference's loss, log-probs
and gradients, with mechanism 2 active (micro-batch budget smaller than the trees); TP = 2 also
on DeepSeek-V3's latent attention (every rank's heads, the latents whole on both ranks, the
shared RoPE key's gradient summed over them; its prefixes cached as the latent, whose readers'
gradients are summed over the ranks' heads, and as per-head K/V; its DP = 2 runs cross-rank,
tests/training/test_cross_rank_exactness.py)."""

import os

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_batch
from helpers.families import PARALLEL_CONFIGS
from helpers.hf_reference import (
    assert_grads_close,
    hf_grads_to_mcore,
    load_hf_model,
    make_hf_checkpoint,
    per_sample_logprobs,
    per_sample_loss_and_grads,
)
from helpers.torchrun import SharedLaunches, selected_test_names

from megatron_psrl.model import ModelArchitecture

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "distributed_step.py")
LAYOUTS = {  # name: (family, TP): DP = 2 / TP = 2 on Llama / Qwen3, TP = 2 on DeepSeek-V3 (its prefixes
    # cached as the latent, and as per-head K/V)
    "dp2": ("llama", 1), "tp2": ("qwen3", 2), "tp2-latent": ("deepseek", 2), "tp2-latent-per-head": ("deepseek", 2)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``reference(name)``: ``(tp, HF dir, loss, gradients by megatron name, log-probs)``."""
    cache = {}

    def reference(name):
        if name not in cache:
            family, tp = LAYOUTS[name]
            if name.endswith("-per-head"):  # (the same checkpoint and reference)
                cache[name] = reference(name[:-len("-per-head")])
                return cache[name]
            hf_dir = make_hf_checkpoint(PARALLEL_CONFIGS[family], seed=1, directory=str(tmp_path_factory.mktemp("hf")))
            hf = load_hf_model(hf_dir)
            batch = random_tree_batch(seed=7, num_roots=4, vocab_size=251)
            loss, grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
            arch = ModelArchitecture.from_hf_dir(hf_dir)
            cache[name] = tp, hf_dir, loss, hf_grads_to_mcore(grads, arch), per_sample_logprobs(hf, batch)
        return cache[name]

    return reference


@pytest.fixture(scope="module")
def launches(references, tmp_path_factory, request):
    """Every layout (2 ranks each) in one torchrun launch; ``result(name)`` loads what rank 0 saved."""
    shared = SharedLaunches(selected_test_names(request))
    outs = {}
    for name, (_, tp) in LAYOUTS.items():
        outs[name] = out = tmp_path_factory.mktemp(name) / "result.pt"
        extra = ["--latent-cache", "per-head"] if name.endswith("-per-head") else []
        shared.add(f"test_two_ranks_match_reference[{name}]", 2, SCRIPT, lambda name=name, tp=tp, out=out, extra=extra: [
            "--hf-dir", references(name)[1], "--tp", str(tp), "--budget", "20", "--out", str(out), *extra])

    def result(name, case_id):
        shared.check(case_id)
        return torch.load(outs[name], weights_only=False)

    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_ranks_match_reference(references, launches, request, name):
    tp, hf_dir, ref_loss, ref_grads, ref_logprobs = references(name)
    res = launches(name, request.node.name)
    assert sum(res["sources"]) > 0, "mechanism 2 must be exercised"
    if tp == 1:
        assert all(n > 0 for n in res["micro_batches"]), "both data-parallel ranks must get work"
    assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(res["grads"], ref_grads, rtol=1e-5)
    for a, b in zip(res["logprobs"], ref_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-4)
