"""Synthetic agentic workloads: determinism, prefix structure, sizes."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pytest

from megatron_psrl.data import (
    load_samples,
    make_grpo,
    make_mixed,
    make_stepwise,
    make_tree_rollouts,
    make_workload,
    write_samples,
)
from megatron_psrl.data.synthetic import sample_lengths
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.tree import build_prefix_tree, check_tree

ARRAYS = ("offsets", "tokens", "loss_mask", "advantages", "old_logprobs", "ref_logprobs")


def assert_same(a, b):
    assert a.ids == b.ids
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, name)


@pytest.mark.parametrize("name", ["grpo", "stepwise", "tree", "mixed"])
def test_deterministic_and_valid(name):
    a = make_workload(name, seed=3, with_logprobs=True)
    assert_same(a, make_workload(name, seed=3, with_logprobs=True))
    assert not np.array_equal(a.tokens[:50], make_workload(name, seed=4).tokens[:50])
    # Log-probs draw nothing from the token stream: same tokens and advantages without them.
    plain = make_workload(name, seed=3)
    assert np.array_equal(plain.tokens, a.tokens) and np.array_equal(plain.advantages,
                                                                     a.advantages)
    assert 1000 <= a.num_tokens <= 10000, a.num_tokens  # a few thousand tokens by default
    assert a.advantages is not None and np.isfinite(a.advantages).all()
    assert a.has_old_logprobs.all() and a.has_ref_logprobs.all()
    assert (a.tokens < 1024).all() and not a.loss_mask[a.offsets[:-1]].any()
    assert a.metadata["workload"] == name
    tree = build_prefix_tree(a)
    check_tree(tree)
    assert tree.num_tree_tokens < a.num_tokens  # every workload shares something


def test_log_probs_agree_on_shared_tokens():
    """A shared token was generated once, so every sample through it carries the same rollout
    log-prob (as a real rollout would)."""
    for name in ("grpo", "stepwise", "tree", "mixed"):
        batch = make_workload(name, with_logprobs=True)
        tree = build_prefix_tree(batch)
        first_seen = np.full(tree.num_tree_tokens, np.nan, dtype=np.float32)
        first_seen[tree.sample_token_index] = batch.old_logprobs
        positions = np.arange(batch.num_tokens) - np.repeat(batch.offsets[:-1], batch.lengths)
        later = positions > 0  # position 0 is ignored by the contract and stored as 0
        np.testing.assert_array_equal(first_seen[tree.sample_token_index][later],
                                      batch.old_logprobs[later])


def test_grpo_structure():
    batch = make_grpo(num_prompts=3, group_size=4, prompt_len=(20, 40), response_len=5,
                      vocab_size=50_000, seed=1)
    assert batch.num_samples == 12 and batch.ids[:2] == ["p0-r0", "p0-r1"]
    for p in range(3):
        group = [batch.sample_tokens(4 * p + g) for g in range(4)]
        prompt_len = len(group[0]) - 5
        assert 20 <= prompt_len <= 40
        for g in range(4):
            assert (group[g][:prompt_len] == group[0][:prompt_len]).all()
            mask = batch.loss_mask[batch.sample_slice(4 * p + g)]
            assert mask.tolist() == [False] * prompt_len + [True] * 5
        adv = batch.advantages[batch.offsets[4 * p:4 * p + 4]]
        assert abs(adv.mean()) < 1e-5  # group-normalised


def test_stepwise_structure():
    batch = make_stepwise(num_trajectories=2, turns=(5, 9), obs_len=(100, 1000),
                          action_len=(10, 50), system_len=30, task_len=50, vocab_size=50_000,
                          seed=2)
    trajectories = defaultdict(list)
    for s, sample_id in enumerate(batch.ids):
        traj, turn = re.fullmatch(r"traj(\d+)-turn(\d+)", sample_id).groups()
        trajectories[int(traj)].append((int(turn), s))
    assert sorted(trajectories) == [0, 1]
    system = batch.sample_tokens(0)[:30]
    for turns in trajectories.values():
        turns.sort()
        assert 5 <= len(turns) <= 9
        for (t, s), (_, s_next) in zip(turns, turns[1:]):
            cur, nxt = batch.sample_tokens(s), batch.sample_tokens(s_next)
            assert len(nxt) > len(cur) and (nxt[: len(cur)] == cur).all()  # a prefix
        for t, s in turns:
            tokens, mask = batch.sample_tokens(s), batch.loss_mask[batch.sample_slice(s)]
            assert (tokens[:30] == system).all()  # one system prompt for all trajectories
            trained = np.flatnonzero(mask)
            # Loss on exactly the last action: one run at the end of 10..50 tokens.
            assert trained[-1] == len(tokens) - 1 and 10 <= trained.size <= 50
            assert (np.diff(trained) == 1).all()
    # Turns grow by an observation (100..1000 tokens) plus an action: drawn, not constant.
    growth = [len(batch.sample_tokens(b)) - len(batch.sample_tokens(a))
              for (_, a), (_, b) in zip(turns, turns[1:])]
    assert len(set(growth)) > 1 and min(growth) >= 110 and max(growth) <= 1050


def test_tree_rollout_structure():
    batch = make_tree_rollouts(num_roots=2, branching=3, depth=2, segment_len=4, prompt_len=10,
                               obs_len=6, vocab_size=50_000, seed=5)
    assert batch.num_samples == 2 * 9
    assert all(len(batch.sample_tokens(s)) == 10 + 4 + 6 + 4 for s in range(batch.num_samples))
    mask = batch.loss_mask[batch.sample_slice(0)]
    assert mask.tolist() == [False] * 10 + [True] * 4 + [False] * 6 + [True] * 4
    tree = build_prefix_tree(batch)
    check_tree(tree)
    # Each first-level action is shared by 3 leaves: its tokens carry 3 claims each.
    claims_per_token = np.diff(tree.claim_offsets)
    assert sorted(set(claims_per_token.tolist())) == [0, 1, 3]
    assert (claims_per_token == 3).sum() == 2 * 3 * 4
    # Shared claims carry the different advantages of their samples.
    shared = np.flatnonzero(claims_per_token == 3)[0]
    claims = slice(tree.claim_offsets[shared], tree.claim_offsets[shared + 1])
    assert len(set(batch.advantages[tree.claim_flat[claims]].tolist())) == 3


def test_mixed_has_all_kinds_shuffled():
    batch = make_mixed(seed=1)
    kinds = [i.split("/")[0] for i in batch.ids]
    assert set(kinds) == {"grpo", "step", "tree"}
    assert kinds != sorted(kinds)
    assert len(set(batch.ids)) == batch.num_samples


@pytest.mark.parametrize("name", ["grpo", "stepwise", "tree", "mixed"])
def test_num_tokens_target(name):
    batch = make_workload(name, num_tokens_target=30_000, seed=7)
    assert 30_000 <= batch.num_tokens < 45_000
    assert batch.metadata["params"]["num_tokens_target"] == 30_000


def test_registry_errors_and_overrides():
    with pytest.raises(ValueError, match="unknown workload 'ppo'"):
        make_workload("ppo")
    with pytest.raises(ConfigurationError, match="workload 'grpo'"):
        make_workload("grpo", turns=3)
    batch = make_workload("grpo", group_size=2, num_prompts=1, prompt_len=8, response_len=4)
    assert batch.num_samples == 2 and batch.num_tokens == 24
    with pytest.raises(ValueError, match="0 <= lo <= hi"):
        sample_lengths(np.random.default_rng(0), (5, 2), 3)


def test_log_uniform_lengths():
    lengths = sample_lengths(np.random.default_rng(0), (10, 10_000), 20_000)
    assert lengths.min() >= 10 and lengths.max() <= 10_000
    # Log-uniform: about as many in [10, 100) as in [1000, 10000].
    low, high = (lengths < 100).mean(), (lengths >= 1000).mean()
    assert abs(low - high) < 0.03 and abs(low - 1 / 3) < 0.03


def test_round_trip_through_files(tmp_path):
    batch = make_workload("mixed", with_logprobs=True)
    for suffix in (".jsonl", ".parquet"):
        loaded = load_samples(write_samples(batch, tmp_path / f"t{suffix}"), vocab_size=1024,
                              require_advantage=True, kl_required=True)
        assert_same(loaded, batch)
