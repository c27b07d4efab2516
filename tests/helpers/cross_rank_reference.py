"""The per-sample Hugging Face reference of the cross-rank tests, built once per session.

``cross_rank_reference(family, kind, tmp_path_factory)``: ``(HF dir, loss, gradients by
megatron name, log-probs)`` of the ``cross_rank_batch(kind)`` batch on a ``PARALLEL_CONFIGS``
checkpoint of ``family`` (one checkpoint per family, shared by every batch kind and every test
module that asks); ``family`` ``"qwen3.5"``: a tiny hybrid model (``debug-qwen3.5-text``: Gated
DeltaNet linear layers and a softmax layer), ``"glm4-moe"``: GLM-4.5's debug model (a dense
layer, then grouped sigmoid routing), each batch drawn from the model's own vocabulary."""

from __future__ import annotations

from helpers.batches import cross_rank_batch
from helpers.families import PARALLEL_CONFIGS, make_family_checkpoint
from helpers.hf_reference import (
    hf_grads_to_mcore,
    load_hf_model,
    make_hf_checkpoint,
    per_sample_logprobs,
    per_sample_loss_and_grads,
)
from helpers.hybrid import make_hybrid_checkpoint
from megatron_psrl.model import ModelArchitecture
from megatron_psrl.model.tiny import tiny_config

HYBRID_FAMILIES = {"qwen3.5": "debug-qwen3.5-text"}
MOE_FAMILIES = {"glm4-moe": "debug-glm4-moe"}
"""Mixture-of-experts families by their debug config (``make_family_checkpoint``: its expert bias set)."""

_REFS: dict = {}


def cross_rank_reference(family: str, kind: str, tmp_path_factory):
    key = (family, kind)
    if key not in _REFS:
        hf_dir = _REFS.get(family)
        if hf_dir is None and family in HYBRID_FAMILIES:
            hf_dir = make_hybrid_checkpoint(tiny_config(HYBRID_FAMILIES[family]), str(tmp_path_factory.mktemp(family)))
        elif hf_dir is None and family in MOE_FAMILIES:
            hf_dir = make_family_checkpoint(tiny_config(MOE_FAMILIES[family]), str(tmp_path_factory.mktemp(family)))
        elif hf_dir is None:
            hf_dir = make_hf_checkpoint(PARALLEL_CONFIGS[family], seed=1, directory=str(tmp_path_factory.mktemp(family)))
        _REFS[family] = hf_dir
        hf = load_hf_model(hf_dir)
        arch = ModelArchitecture.from_hf_dir(hf_dir)
        batch = cross_rank_batch(kind, vocab_size=arch.vocab_size)  # (the step script draws it alike)
        loss, grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
        _REFS[key] = (hf_dir, loss, hf_grads_to_mcore(grads, arch), per_sample_logprobs(hf, batch))
    return _REFS[key]
