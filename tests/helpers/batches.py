"""Random trajectory batches with every structure the tree and the loss must handle."""

from __future__ import annotations

from typing import List

import numpy as np

from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.samples import SampleBatch


def random_tree_batch(
    seed: int,
    vocab_size: int = 256,
    num_roots: int = 2,
    max_len: int = 60,
    with_old: bool = True,
    with_ref: bool = True,
) -> SampleBatch:
    """Samples built by branching from shared prefixes, plus the adversarial cases:

    exact duplicates (with different advantages), a sample that is a prefix of another,
    loss on shared tokens (tree rollouts: each sample claims the whole action path with its
    own advantage), per-token advantages, sample weights, samples without old log-probs,
    an empty loss mask, and a sample sharing nothing.
    """
    rng = np.random.default_rng(seed)
    records: List[dict] = []

    def add(tokens, loss_mask=None, per_token=False):
        n = len(tokens)
        rec = {"id": f"s{len(records)}", "tokens": [int(t) for t in tokens]}
        if loss_mask is not None:
            rec["loss_mask"] = [int(x) for x in loss_mask]
        rec["advantage"] = rng.normal(size=n).tolist() if per_token else float(rng.normal())
        if with_old and rng.random() < 0.8:
            rec["old_logprobs"] = (rng.normal(size=n) * 0.3 - 5.5).tolist()
        if with_ref:
            rec["ref_logprobs"] = (rng.normal(size=n) * 0.3 - 5.5).tolist()
        if rng.random() < 0.5:
            rec["weight"] = float(rng.uniform(0.2, 2.0))
        records.append(rec)

    for _ in range(num_roots):
        prompt = rng.integers(0, vocab_size, int(rng.integers(8, 20))).tolist()
        mids = [prompt + rng.integers(0, vocab_size, int(rng.integers(3, 12))).tolist() for _ in range(2)]
        for mid in mids:
            for _ in range(int(rng.integers(1, 3))):
                tail = rng.integers(0, vocab_size, int(rng.integers(2, 10))).tolist()
                toks = (mid + tail)[:max_len]
                # Tree rollout: the whole action path after the prompt is claimed.
                add(toks, [0] * len(prompt) + [1] * (len(toks) - len(prompt)), per_token=rng.random() < 0.5)
        add(list(records[-1]["tokens"]))  # exact duplicate, default mask, new advantage
        add(prompt[: max(2, len(prompt) // 2)])  # a prefix of others
    lone = rng.integers(0, vocab_size, 12).tolist()
    add(lone, [0] * 12)  # empty loss mask
    add(rng.integers(0, vocab_size, 9).tolist())  # shares (almost surely) nothing
    order = rng.permutation(len(records))
    return samples_from_dicts([records[i] for i in order], source="random_tree_batch")
