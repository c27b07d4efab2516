"""The per-sample Hugging Face reference of the cross-rank tests, built once per session.

``cross_rank_reference(family, kind, tmp_path_factory)``: ``(HF dir, loss, gradients by
megatron name, log-probs)`` of the ``cross_rank_batch(kind)`` batch on a ``PARALLEL_CONFIGS``
checkpoint of ``family`` (one checkpoint per family, shared by every batch kind and every test
module that asks)."""

from __future__ import annotations

from helpers.batches import cross_rank_batch
from helpers.families import PARALLEL_CONFIGS
from helpers.hf_reference import (
    hf_grads_to_mcore,
    load_hf_model,
    make_hf_checkpoint,
    per_sample_logprobs,
    per_sample_loss_and_grads,
)
from megatron_psrl.model import ModelArchitecture

_REFS: dict = {}


def cross_rank_reference(family: str, kind: str, tmp_path_factory):
    key = (family, kind)
    if key not in _REFS:
        hf_dir = _REFS.get(family) or make_hf_checkpoint(PARALLEL_CONFIGS[family], seed=1,
                                                         directory=str(tmp_path_factory.mktemp(family)))
        _REFS[family] = hf_dir
        hf = load_hf_model(hf_dir)
        batch = cross_rank_batch(kind)
        loss, grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
        arch = ModelArchitecture.from_hf_dir(hf_dir)
        _REFS[key] = (hf_dir, loss, hf_grads_to_mcore(grads, arch), per_sample_logprobs(hf, batch))
    return _REFS[key]
