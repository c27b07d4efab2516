"""Synthetic agentic-RL workloads with the prefix structure of real ones.

Token ids are random (the structure, not the text, is what sharing depends on); every
generator is deterministic given its seed and returns a validated :class:`SampleBatch` with
per-sample advantages (and, with ``with_logprobs=True``, old/ref log-probs that agree on
shared tokens, as a real rollout's would).

- ``grpo``: G responses per prompt; loss on the responses.
- ``stepwise``: every turn t of a multi-turn trajectory is a sample whose tokens are the whole
  history up to and including action t, with loss on action t only (so sample t is a prefix
  of sample t+1). Defaults follow public SWE-agent statistics: tens of turns, tool outputs of
  hundreds to thousands of tokens, actions of tens of tokens.
- ``tree``: tree-structured rollouts that branch at every turn; each root-to-leaf path is a
  sample with loss on all its action segments, so shared actions carry claims of several
  samples with different advantages.
- ``mixed``: all three in one (shuffled) batch.

Lengths are given as an int (constant) or a ``(lo, hi)`` range sampled log-uniformly, which
gives the long tail of real traces (most tool outputs short, a few very long).

``make_workload(name, num_tokens_target=...)`` keeps drawing units (prompt groups,
trajectories, roots) until the batch holds at least ``num_tokens_target`` tokens.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import WORKLOAD_NAMES

LengthSpec = Union[int, Tuple[int, int]]
"""A length: an int, or an inclusive range ``(lo, hi)`` sampled log-uniformly."""

DEFAULT_VOCAB_SIZE = 1024
"""The vocabulary of the tiny debug model; pass the real one for real models."""

Record = Dict[str, Any]


# ---------------------------------------------------------------------- helpers
def sample_lengths(rng: np.random.Generator, spec: LengthSpec, size: int) -> np.ndarray:
    """int64 ``[size]`` lengths drawn from ``spec`` (log-uniform over ``[lo, hi]``)."""
    if isinstance(spec, (int, np.integer)):
        if spec < 0:
            raise ConfigurationError(f"a length must be >= 0, got {spec}")
        return np.full(size, int(spec), dtype=np.int64)
    lo, hi = (int(v) for v in spec)
    if not 0 <= lo <= hi:
        raise ConfigurationError(f"a length range must satisfy 0 <= lo <= hi, got {spec}")
    if lo == hi:
        return np.full(size, lo, dtype=np.int64)
    # log-uniform on [lo, hi + 1) (shifted by one so that lo = 0 works), floored.
    draw = np.exp(rng.uniform(np.log(lo + 1), np.log(hi + 2), size)) - 1
    return np.clip(np.floor(draw).astype(np.int64), lo, hi)


def _sample_length(rng: np.random.Generator, spec: LengthSpec) -> int:
    return int(sample_lengths(rng, spec, 1)[0])


class _Segment:
    """The tokens of one piece of text: a prompt, an action or an observation."""

    __slots__ = ("tokens",)

    def __init__(self, rng: np.random.Generator, length: int, vocab_size: int):
        self.tokens = rng.integers(0, vocab_size, length, dtype=np.int32)


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F),
        np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def pseudo_logprobs(tokens: np.ndarray, seed: int, salt: int) -> np.ndarray:
    """float32 log-probs that are a hash of (seed, salt, token, position): exponential with
    mean 0.7 (mostly near 0, sometimes very negative).

    Being a function of the token and its position, they agree on every shared prefix (as a
    real rollout's would: same context, same policy) even when two independently drawn
    siblings happen to start with the same token, and they draw nothing from the token RNG,
    so a seed gives the same tokens with and without log-probs.
    """
    x = tokens.astype(np.uint64) * _MIX[0]
    x ^= np.arange(tokens.shape[0], dtype=np.uint64) * _MIX[1]
    x ^= np.uint64((seed * 0x632BE5AB + salt * 0x85157AF5) % (1 << 64))
    # splitmix64 finaliser: every input bit affects every output bit.
    x ^= x >> np.uint64(30)
    x *= _MIX[2]
    x ^= x >> np.uint64(27)
    x *= _MIX[3]
    x ^= x >> np.uint64(31)
    uniform = (x >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return (0.7 * np.log1p(-uniform)).astype(np.float32)


def _record(
    sample_id: str,
    segments: List[_Segment],
    trained: List[bool],
    advantage: float,
    logprob_seed: Optional[int],
) -> Record:
    """A sample made of ``segments``; ``trained[k]`` puts the loss on segment k; with a
    ``logprob_seed`` it carries old/ref log-probs too."""
    tokens = np.concatenate([seg.tokens for seg in segments])
    loss_mask = np.concatenate(
        [np.full(seg.tokens.shape[0], flag, dtype=np.bool_) for seg, flag in zip(segments, trained)]
    )
    loss_mask[0] = False  # token 0 has no context (only matters if segment 0 is trained)
    record: Record = {"id": sample_id, "tokens": tokens, "loss_mask": loss_mask,
                      "advantage": float(advantage)}
    if logprob_seed is not None:
        old = pseudo_logprobs(tokens, logprob_seed, salt=1)
        old[0] = 0.0
        record["old_logprobs"] = old
        # The reference policy differs a little from the rollout policy (zero-mean noise).
        noise = pseudo_logprobs(tokens, logprob_seed, salt=2) + np.float32(0.7)
        ref = old + np.float32(0.05) * noise
        ref[0] = 0.0
        record["ref_logprobs"] = ref
    return record


def _normalised(rng: np.random.Generator, count: int) -> np.ndarray:
    """GRPO-style advantages: random rewards normalised within the group."""
    rewards = rng.normal(size=count)
    if count == 1:
        return rewards
    return (rewards - rewards.mean()) / (rewards.std() + 1e-6)


def _system_prompt(seed: int, system_len: int, vocab_size: int) -> Optional[_Segment]:
    """The system prompt every sample of a batch starts with (None if ``system_len`` is 0).
    It has its own RNG stream, so its length does not shift the other draws."""
    if not system_len:
        return None
    return _Segment(np.random.default_rng([seed, 0x5157]), system_len, vocab_size)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < 1:
        raise ConfigurationError(f"vocab_size must be >= 1, got {vocab_size}")


# ---------------------------------------------------------------------- units
def _grpo_units(
    rng: np.random.Generator, *, group_size: int, prompt_len: LengthSpec,
    response_len: LengthSpec, system: Optional[_Segment], vocab_size: int,
    logprob_seed: Optional[int], prefix: str = "",
) -> Iterator[List[Record]]:
    """One GRPO group (a prompt and ``group_size`` responses) per unit."""
    if group_size < 1:
        raise ConfigurationError(f"group_size must be >= 1, got {group_size}")
    for p in itertools.count():
        prompt = _Segment(rng, max(_sample_length(rng, prompt_len), 1), vocab_size)
        advantages = _normalised(rng, group_size)
        group = []
        for g in range(group_size):
            response = _Segment(rng, max(_sample_length(rng, response_len), 1), vocab_size)
            segments = ([system] if system is not None else []) + [prompt, response]
            trained = [False] * (len(segments) - 1) + [True]
            group.append(_record(f"{prefix}p{p}-r{g}", segments, trained, advantages[g],
                                 logprob_seed))
        yield group


def _stepwise_units(
    rng: np.random.Generator, *, turns: LengthSpec, obs_len: LengthSpec,
    action_len: LengthSpec, task_len: LengthSpec, system: Optional[_Segment], vocab_size: int,
    logprob_seed: Optional[int], prefix: str = "",
) -> Iterator[List[Record]]:
    """One multi-turn trajectory per unit; turn t is the sample ``history + action_t``."""
    for j in itertools.count():
        num_turns = max(_sample_length(rng, turns), 1)
        history: List[_Segment] = [] if system is None else [system]
        history.append(_Segment(rng, max(_sample_length(rng, task_len), 1), vocab_size))
        # Step-wise returns: a trajectory reward, discounted towards the end, plus noise.
        reward = rng.normal()
        samples = []
        for t in range(num_turns):
            action = _Segment(rng, max(_sample_length(rng, action_len), 1), vocab_size)
            segments = history + [action]
            trained = [False] * len(history) + [True]
            advantage = reward * 0.97 ** (num_turns - 1 - t) + 0.1 * rng.normal()
            samples.append(_record(f"{prefix}traj{j}-turn{t}", segments, trained, advantage,
                                   logprob_seed))
            observation = _Segment(rng, _sample_length(rng, obs_len), vocab_size)
            history = segments + [observation]
        yield samples


def _tree_units(
    rng: np.random.Generator, *, branching: LengthSpec, depth: int, prompt_len: LengthSpec,
    segment_len: LengthSpec, obs_len: LengthSpec, system: Optional[_Segment], vocab_size: int,
    logprob_seed: Optional[int], prefix: str = "",
) -> Iterator[List[Record]]:
    """One rollout tree per unit: from a prompt, every turn branches into ``branching``
    continuations (action, then observation except after the last action)."""
    if depth < 1:
        raise ConfigurationError(f"depth must be >= 1, got {depth}")
    for r in itertools.count():
        root = ([] if system is None else [system]) + [
            _Segment(rng, max(_sample_length(rng, prompt_len), 1), vocab_size)
        ]
        # Paths as (segments, trained flags, name), expanded level by level.
        paths: List[Tuple[List[_Segment], List[bool], str]] = [(root, [False] * len(root), "")]
        for level in range(depth):
            expanded = []
            for segments, trained, name in paths:
                for b in range(max(_sample_length(rng, branching), 1)):
                    action = _Segment(rng, max(_sample_length(rng, segment_len), 1), vocab_size)
                    new_segments, new_trained = segments + [action], trained + [True]
                    if level < depth - 1:
                        obs = _Segment(rng, _sample_length(rng, obs_len), vocab_size)
                        new_segments, new_trained = new_segments + [obs], new_trained + [False]
                    expanded.append((new_segments, new_trained, f"{name}.{b}"))
            paths = expanded
        advantages = _normalised(rng, len(paths))
        yield [
            _record(f"{prefix}root{r}-leaf{name}", segments, trained, advantages[k],
                    logprob_seed)
            for k, (segments, trained, name) in enumerate(paths)
        ]


def _collect(
    units: Iterator[List[Record]], num_units: Optional[int], num_tokens_target: Optional[int]
) -> List[Record]:
    """Records of the first ``num_units`` units, or of as many units as it takes to reach
    ``num_tokens_target`` tokens."""
    records: List[Record] = []
    if num_tokens_target is not None:
        if num_tokens_target < 1:
            raise ConfigurationError(f"num_tokens_target must be >= 1, got {num_tokens_target}")
        total = 0
        while total < num_tokens_target:
            unit = next(units)
            records.extend(unit)
            total += sum(rec["tokens"].shape[0] for rec in unit)
        return records
    if num_units is None or num_units < 1:
        raise ConfigurationError(f"the number of units must be >= 1, got {num_units}")
    for unit in itertools.islice(units, num_units):
        records.extend(unit)
    return records


def _finish(records: List[Record], vocab_size: int, name: str, params: dict) -> SampleBatch:
    return samples_from_dicts(
        records,
        source=f"<synthetic {name}>",
        vocab_size=vocab_size,
        metadata={"workload": name, "params": params},
    )


# ---------------------------------------------------------------------- public generators
def make_grpo(
    num_prompts: int = 8,
    group_size: int = 8,
    prompt_len: LengthSpec = (128, 1024),
    response_len: LengthSpec = (64, 512),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    system_len: int = 0,
    with_logprobs: bool = False,
    num_tokens_target: Optional[int] = None,
) -> SampleBatch:
    """GRPO groups: ``num_prompts`` prompts with ``group_size`` responses each; loss on the
    responses, advantage = group-normalised random reward. With ``num_tokens_target`` the
    number of prompts is whatever reaches that many tokens."""
    _check_vocab(vocab_size)
    params = dict(num_prompts=num_prompts, group_size=group_size, prompt_len=prompt_len,
                  response_len=response_len, system_len=system_len, seed=seed,
                  with_logprobs=with_logprobs, num_tokens_target=num_tokens_target)
    rng = np.random.default_rng([seed, 1])
    system = _system_prompt(seed, system_len, vocab_size)
    units = _grpo_units(rng, group_size=group_size, prompt_len=prompt_len,
                        response_len=response_len, system=system, vocab_size=vocab_size,
                        logprob_seed=seed if with_logprobs else None)
    return _finish(_collect(units, num_prompts, num_tokens_target), vocab_size, "grpo", params)


def make_stepwise(
    num_trajectories: int = 2,
    turns: LengthSpec = (16, 64),
    obs_len: LengthSpec = (100, 3000),
    action_len: LengthSpec = (10, 100),
    system_len: int = 1000,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    task_len: LengthSpec = (200, 1000),
    with_logprobs: bool = False,
    num_tokens_target: Optional[int] = None,
) -> SampleBatch:
    """Step-wise RL over multi-turn trajectories (SWE-agent-like defaults).

    Trajectory = system prompt (shared by all trajectories), task description, then
    alternating actions and tool outputs (observations). Turn t is a sample whose tokens are
    the history up to and including action t, with the loss on action t only; its advantage is
    the trajectory reward discounted to turn t plus noise.
    """
    _check_vocab(vocab_size)
    params = dict(num_trajectories=num_trajectories, turns=turns, obs_len=obs_len,
                  action_len=action_len, system_len=system_len, task_len=task_len, seed=seed,
                  with_logprobs=with_logprobs, num_tokens_target=num_tokens_target)
    rng = np.random.default_rng([seed, 2])
    system = _system_prompt(seed, system_len, vocab_size)
    units = _stepwise_units(rng, turns=turns, obs_len=obs_len, action_len=action_len,
                            task_len=task_len, system=system, vocab_size=vocab_size,
                            logprob_seed=seed if with_logprobs else None)
    records = _collect(units, num_trajectories, num_tokens_target)
    return _finish(records, vocab_size, "stepwise", params)


def make_tree_rollouts(
    num_roots: int = 2,
    branching: LengthSpec = 2,
    depth: int = 3,
    segment_len: LengthSpec = (16, 128),
    prompt_len: LengthSpec = (256, 1024),
    obs_len: LengthSpec = (32, 512),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    system_len: int = 0,
    with_logprobs: bool = False,
    num_tokens_target: Optional[int] = None,
) -> SampleBatch:
    """Tree-structured rollouts: every root (a prompt) branches ``branching`` ways at each of
    ``depth`` turns (an action of ``segment_len`` tokens, then an observation of ``obs_len``
    tokens except after the last action). Each leaf path is a sample with the loss on all its
    actions and the leaf's normalised reward as advantage."""
    _check_vocab(vocab_size)
    params = dict(num_roots=num_roots, branching=branching, depth=depth,
                  segment_len=segment_len, prompt_len=prompt_len, obs_len=obs_len,
                  system_len=system_len, seed=seed, with_logprobs=with_logprobs,
                  num_tokens_target=num_tokens_target)
    rng = np.random.default_rng([seed, 3])
    system = _system_prompt(seed, system_len, vocab_size)
    units = _tree_units(rng, branching=branching, depth=depth, prompt_len=prompt_len,
                        segment_len=segment_len, obs_len=obs_len, system=system,
                        vocab_size=vocab_size, logprob_seed=seed if with_logprobs else None)
    return _finish(_collect(units, num_roots, num_tokens_target), vocab_size, "tree", params)


def make_mixed(
    grpo: Optional[dict] = None,
    stepwise: Optional[dict] = None,
    tree: Optional[dict] = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    system_len: int = 0,
    with_logprobs: bool = False,
    num_tokens_target: Optional[int] = None,
) -> SampleBatch:
    """GRPO groups, step-wise trajectories and rollout trees in one batch, in shuffled order.

    ``grpo``, ``stepwise`` and ``tree`` are keyword arguments of the corresponding generator
    (without vocab_size/seed/system_len/with_logprobs, which are shared). With
    ``num_tokens_target`` each kind gets a third of the tokens. Sample ids are prefixed with
    ``grpo/``, ``step/`` and ``tree/``.
    """
    _check_vocab(vocab_size)
    kinds = {"grpo": dict(grpo or {}), "step": dict(stepwise or {}), "tree": dict(tree or {})}
    defaults = {
        "grpo": dict(num_prompts=2, group_size=4, prompt_len=(64, 256), response_len=(16, 128)),
        "step": dict(num_trajectories=1, turns=(4, 8), obs_len=(16, 256), action_len=(8, 32),
                     task_len=(32, 128)),
        "tree": dict(num_roots=1, branching=2, depth=3, segment_len=(8, 32),
                     prompt_len=(64, 256), obs_len=(8, 64)),
    }
    system = _system_prompt(seed, system_len, vocab_size)
    records: List[Record] = []
    for k, (kind, overrides) in enumerate(kinds.items()):
        params = {**defaults[kind], **overrides}
        count_key = {"grpo": "num_prompts", "step": "num_trajectories", "tree": "num_roots"}[kind]
        count = params.pop(count_key)
        rng = np.random.default_rng([seed, 4, k])
        common = dict(system=system, vocab_size=vocab_size,
                      logprob_seed=seed if with_logprobs else None, prefix=f"{kind}/")
        if kind == "grpo":
            units = _grpo_units(rng, **params, **common)
        elif kind == "step":
            units = _stepwise_units(rng, **params, **common)
        else:
            units = _tree_units(rng, **params, **common)
        target = None if num_tokens_target is None else max(num_tokens_target // 3, 1)
        records.extend(_collect(units, count, target))
        kinds[kind] = {count_key: count, **params}
    shuffle = np.random.default_rng([seed, 5]).permutation(len(records))
    records = [records[i] for i in shuffle]
    params = dict(kinds, system_len=system_len, seed=seed, with_logprobs=with_logprobs,
                  num_tokens_target=num_tokens_target)
    return _finish(records, vocab_size, "mixed", params)


# ---------------------------------------------------------------------- registry
WORKLOAD_DEFAULTS: Dict[str, dict] = {
    # A few thousand tokens each: enough structure for a quick CPU training run.
    "grpo": dict(num_prompts=4, group_size=4, prompt_len=(64, 256), response_len=(16, 128)),
    "stepwise": dict(num_trajectories=2, turns=(4, 8), obs_len=(16, 256), action_len=(8, 32),
                     system_len=64, task_len=(32, 128)),
    "tree": dict(num_roots=2, branching=2, depth=3, segment_len=(8, 32), prompt_len=(64, 256),
                 obs_len=(8, 64)),
    "mixed": dict(),
}
"""Default parameters of :func:`make_workload` per workload name (overridable)."""

WORKLOADS: Dict[str, Callable[..., SampleBatch]] = {
    "grpo": make_grpo,
    "stepwise": make_stepwise,
    "tree": make_tree_rollouts,
    "mixed": make_mixed,
}
"""Workload name -> generator."""
assert tuple(WORKLOADS) == WORKLOAD_NAMES, "megatron_psrl.options.WORKLOAD_NAMES lists the workloads"


def make_workload(
    name: str,
    num_tokens_target: Optional[int] = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    **overrides: Any,
) -> SampleBatch:
    """A named synthetic workload ("grpo", "stepwise", "tree", "mixed").

    Without ``num_tokens_target`` it has the small default size of :data:`WORKLOAD_DEFAULTS`
    (a few thousand tokens); with it, as many units of the same shape as it takes to reach
    that many tokens. ``overrides`` are keyword arguments of the generator.
    """
    if name not in WORKLOADS:
        raise ConfigurationError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    generator = WORKLOADS[name]
    params = {**WORKLOAD_DEFAULTS[name], **overrides}
    try:
        return generator(num_tokens_target=num_tokens_target, vocab_size=vocab_size, seed=seed,
                         **params)
    except TypeError as exc:  # an unknown or missing parameter of the generator
        raise ConfigurationError(f"workload {name!r}: {exc}") from None
