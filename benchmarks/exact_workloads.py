"""Batches of exact shapes, the ones other prefix-sharing trainers were measured on
(docs/benchmarks.md); shared by bench_update_step.py and bench_peers.py."""

from __future__ import annotations

import numpy as np

from megatron_psrl.data import samples_from_dicts
from megatron_psrl.data.samples import SampleBatch


def grpo_exact(prompt: int, group: int, response: int, vocab: int, seed: int = 0) -> SampleBatch:
    """One prompt of ``prompt`` tokens with ``group`` responses of exactly ``response`` tokens."""
    rng = np.random.default_rng(seed)
    p = rng.integers(0, vocab, prompt).tolist()
    recs = [{"id": i, "tokens": p + rng.integers(0, vocab, response).tolist(),
             "loss_mask": [0] * prompt + [1] * response, "advantage": float(rng.normal())} for i in range(group)]
    return samples_from_dicts(recs, source=f"grpo-{prompt}x{group}x{response}")


def stepwise_exact(turns: int, turn_len: int, action_len: int, vocab: int, seed: int = 0) -> SampleBatch:
    """One trajectory of ``turns`` turns of ``turn_len`` tokens; sample t = history up to turn t,
    trained on turn t's action (its last ``action_len`` tokens)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, turns * turn_len).tolist()
    recs = []
    for t in range(1, turns + 1):
        n = t * turn_len
        recs.append({"id": t, "tokens": toks[:n], "loss_mask": [0] * (n - action_len) + [1] * action_len,
                     "advantage": float(rng.normal())})
    return samples_from_dicts(recs, source=f"stepwise-{turns}x{turn_len}")
