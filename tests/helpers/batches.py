"""Random trajectory batches with every structure the tree and the loss must handle."""

from __future__ import annotations

from typing import List

import numpy as np

from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.samples import SampleBatch


def random_tree_batch(seed: int, **kwargs) -> SampleBatch:
    """:func:`random_tree_records` (same keyword arguments) as a validated :class:`SampleBatch`."""
    return samples_from_dicts(random_tree_records(seed, **kwargs), source="random_tree_batch")


def random_tree_records(
    seed: int,
    vocab_size: int = 256,
    num_roots: int = 2,
    max_len: int = 60,
    with_old: bool = True,
    with_ref: bool = True,
) -> List[dict]:
    """Samples (dicts of the data format, Python lists) built by branching from shared prefixes, plus the adversarial cases:

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
    return [records[i] for i in order]


def cross_rank_batch(kind: str, vocab_size: int = 251, seed: int = 5) -> SampleBatch:
    """Small batches for the cross-rank tests (old and reference log-probs included):

    - ``one-tree``: one rollout tree several times larger than the test's micro-batch budget;
    - ``chain``: one step-wise trajectory (every sample a prefix of the next: one long chain);
    - ``stepwise``: a few step-wise trajectories sharing a system prompt;
    - ``mixed``: GRPO groups, step-wise trajectories and trees together.
    """
    from megatron_psrl.data.synthetic import make_mixed, make_stepwise, make_tree_rollouts

    if kind == "one-tree":
        return make_tree_rollouts(num_roots=1, branching=2, depth=3, segment_len=(6, 16), prompt_len=(40, 60),
                                  obs_len=(8, 20), vocab_size=vocab_size, seed=seed, with_logprobs=True)
    if kind == "chain":
        return make_stepwise(num_trajectories=1, turns=6, obs_len=(20, 40), action_len=(5, 10), system_len=30,
                             task_len=(20, 30), vocab_size=vocab_size, seed=seed, with_logprobs=True)
    if kind == "stepwise":
        return make_stepwise(num_trajectories=3, turns=(3, 6), obs_len=(10, 30), action_len=(4, 8), system_len=20,
                             task_len=(10, 20), vocab_size=vocab_size, seed=seed, with_logprobs=True)
    if kind == "mixed":
        return make_mixed(grpo=dict(num_prompts=2, group_size=3, prompt_len=(20, 40), response_len=(5, 15)),
                          stepwise=dict(num_trajectories=1, turns=4, obs_len=(10, 20), action_len=(4, 8),
                                        task_len=(5, 10)),
                          tree=dict(num_roots=1, branching=2, depth=2, segment_len=(4, 10), prompt_len=(20, 30),
                                    obs_len=(5, 10)),
                          vocab_size=vocab_size, seed=seed, with_logprobs=True)
    raise ValueError(kind)
