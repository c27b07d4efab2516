"""Columnar storage of the trajectory samples of one update step.

A global batch of agentic RL can hold millions of tokens, so samples are not kept as Python
objects: every per-token field is one flat numpy array over the concatenation of all samples,
and ``offsets`` delimits the samples. The fields are exactly those of the data contract
(docs/data-format.md), already validated and with defaults filled in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import numpy as np

SampleId = Union[str, int]


@dataclass
class SampleBatch:
    """The samples of one global batch, concatenated.

    Sample ``s`` owns the token range ``offsets[s]:offsets[s + 1]`` of every per-token array.
    """

    ids: List[SampleId]
    """Sample ids in input order (the ``id`` field, or the line/row index when absent)."""

    offsets: np.ndarray
    """int64 ``[S + 1]``: start of every sample in the per-token arrays; ``offsets[0] == 0``."""

    tokens: np.ndarray
    """int32 ``[N]``: token ids of all samples, concatenated."""

    loss_mask: np.ndarray
    """bool ``[N]``: token i of a sample is trained (its log-prob enters the loss).
    Always False at the first token of every sample."""

    advantages: Optional[np.ndarray] = None
    """float32 ``[N]``: per-token advantage (a per-sample advantage is broadcast over the
    sample). None when the file carries no advantages (forward-only use)."""

    old_logprobs: Optional[np.ndarray] = None
    """float32 ``[N]``: rollout-policy log-probs; entries of samples without the field are 0
    and flagged False in ``has_old_logprobs``. None when no sample has the field."""

    has_old_logprobs: Optional[np.ndarray] = None
    """bool ``[S]``: sample s carried ``old_logprobs``; when False the loss uses the current
    policy's detached log-probs (ratio 1)."""

    ref_logprobs: Optional[np.ndarray] = None
    """float32 ``[N]``: reference-policy log-probs (for the KL term), like ``old_logprobs``."""

    has_ref_logprobs: Optional[np.ndarray] = None
    """bool ``[S]``: sample s carried ``ref_logprobs``."""

    weights: Optional[np.ndarray] = None
    """float32 ``[S]``: sample weights (default 1.0)."""

    source: str = "<memory>"
    """Where the samples came from (file path or workload name), for error messages."""

    source_rows: Optional[np.ndarray] = None
    """int64 ``[S]``: 1-based line (JSONL) or 0-based row (Parquet) of every sample."""

    row_label: str = "row"
    """How ``source_rows`` are called in messages: ``"line"`` (JSONL, 1-based) or ``"row"``
    (Parquet, in-memory records and generated batches, 0-based)."""

    metadata: dict = field(default_factory=dict)
    """Free-form provenance (e.g. the synthetic workload's parameters)."""

    routed_experts: Optional[np.ndarray] = None
    """int16 ``[N, L, k]``: the experts the rollout engine routed every token to (router
    replay, docs/moe.md): per MoE layer (``L``, in layer order) the top-k expert ids. A row of
    -1 is a token without a route (the final token of a sample whose rollout engine returned
    one route less than tokens: no log-prob depends on it). None when the samples carry no
    routes (every MoE layer routes by its own top-k)."""

    def __post_init__(self) -> None:
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        self.tokens = np.asarray(self.tokens, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        num_samples = len(self.ids)
        if self.offsets.shape != (num_samples + 1,) or self.offsets[0] != 0:
            raise ValueError("offsets must have one entry per sample plus one, starting at 0")
        if self.offsets[-1] != self.tokens.shape[0] or self.loss_mask.shape != self.tokens.shape:
            raise ValueError("per-token arrays must all have offsets[-1] entries")
        if self.weights is None:
            self.weights = np.ones(num_samples, dtype=np.float32)
        if self.source_rows is None:
            self.source_rows = np.arange(num_samples, dtype=np.int64)
        # Shapes of the optional columns (values are checked by the loaders, data/validation.py).
        num_tokens = self.tokens.shape[0]
        for name, size in (
            ("advantages", num_tokens),
            ("old_logprobs", num_tokens),
            ("ref_logprobs", num_tokens),
            ("has_old_logprobs", num_samples),
            ("has_ref_logprobs", num_samples),
            ("weights", num_samples),
            ("source_rows", num_samples),
        ):
            value = getattr(self, name)
            if value is not None and np.shape(value) != (size,):
                raise ValueError(f"{name} must have shape ({size},), got {np.shape(value)}")
        for values, flags, name in (
            (self.old_logprobs, self.has_old_logprobs, "old_logprobs"),
            (self.ref_logprobs, self.has_ref_logprobs, "ref_logprobs"),
        ):
            if (values is None) != (flags is None):
                raise ValueError(f"{name} and has_{name} must be given together")
        if self.routed_experts is not None:
            self.routed_experts = np.asarray(self.routed_experts, dtype=np.int16)
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != num_tokens:
                raise ValueError(f"routed_experts must have shape ({num_tokens}, layers, top-k), "
                                 f"got {self.routed_experts.shape}")
        if self.row_label not in ("line", "row"):
            raise ValueError(f"row_label must be 'line' or 'row', got {self.row_label!r}")

    # ------------------------------------------------------------------ accessors
    @property
    def num_samples(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[S]``: length of every sample."""
        return np.diff(self.offsets)

    @property
    def has_advantages(self) -> bool:
        return self.advantages is not None

    def __len__(self) -> int:
        return self.num_samples

    def sample_slice(self, s: int) -> slice:
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))

    def sample_tokens(self, s: int) -> np.ndarray:
        return self.tokens[self.sample_slice(s)]

    def describe_sample(self, s: int) -> str:
        """``file line|row k (sample id ...)`` for messages about sample s."""
        return (
            f"{self.source} {self.row_label} {int(self.source_rows[s])} "
            f"(sample id {self.ids[s]!r})"
        )

    def sample_of_token(self) -> np.ndarray:
        """int32 ``[N]``: the sample owning every token of the per-token arrays."""
        return np.repeat(np.arange(self.num_samples, dtype=np.int32), self.lengths)

    def truncated(self, max_len: int) -> "SampleBatch":
        """A new batch with every sample cut to its first ``max_len`` tokens (e.g. to study how
        sharing depends on context length). Per-sample fields are kept."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        starts = self.offsets[:-1]
        new_lengths = np.minimum(self.lengths, max_len)
        new_offsets = np.zeros(self.num_samples + 1, dtype=np.int64)
        np.cumsum(new_lengths, out=new_offsets[1:])
        gather = np.repeat(starts - new_offsets[:-1], new_lengths) + np.arange(new_offsets[-1])

        def take(arr: Optional[np.ndarray]) -> Optional[np.ndarray]:
            return None if arr is None else arr[gather]

        return SampleBatch(
            ids=list(self.ids),
            offsets=new_offsets,
            tokens=self.tokens[gather],
            loss_mask=self.loss_mask[gather],
            advantages=take(self.advantages),
            old_logprobs=take(self.old_logprobs),
            has_old_logprobs=self.has_old_logprobs,
            ref_logprobs=take(self.ref_logprobs),
            has_ref_logprobs=self.has_ref_logprobs,
            weights=self.weights,
            source=self.source,
            source_rows=self.source_rows,
            row_label=self.row_label,
            metadata=dict(self.metadata, truncated_to=int(max_len)),
            routed_experts=take(self.routed_experts),
        )

    def select(self, indices: Sequence[int]) -> "SampleBatch":
        """A new batch with the samples ``indices`` in that order (e.g. one rank's share)."""
        indices = np.asarray(indices, dtype=np.int64)
        starts, ends = self.offsets[indices], self.offsets[indices + 1]
        lengths = ends - starts
        new_offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_offsets[1:])
        # Token gather index: for each selected sample, its range in the old arrays.
        gather = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])

        def take(arr: Optional[np.ndarray], per_sample: bool) -> Optional[np.ndarray]:
            if arr is None:
                return None
            return arr[indices] if per_sample else arr[gather]

        return SampleBatch(
            ids=[self.ids[i] for i in indices],
            offsets=new_offsets,
            tokens=self.tokens[gather],
            loss_mask=self.loss_mask[gather],
            advantages=take(self.advantages, False),
            old_logprobs=take(self.old_logprobs, False),
            has_old_logprobs=take(self.has_old_logprobs, True),
            ref_logprobs=take(self.ref_logprobs, False),
            has_ref_logprobs=take(self.has_ref_logprobs, True),
            weights=take(self.weights, True),
            source=self.source,
            source_rows=take(self.source_rows, True),
            row_label=self.row_label,
            metadata=dict(self.metadata),
            routed_experts=take(self.routed_experts, False),
        )
