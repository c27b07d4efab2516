"""The attention plan of one packed micro-batch: which keys every query token sees.

A tree-packed micro-batch is a depth-first serialisation of a forest of tree fragments. Its
tokens are partitioned into *segments*: maximal chains of the local tree, each attended to
causally by itself. On top of that, every token attends without a mask to the tokens of all
its ancestor segments. Because the pack is depth-first, the descendants of a segment form one
contiguous token range, so "all descendants of segment a see all of a" is a single rectangular
*ancestor block* (query range x key range). Keys may also come from outside the pack: a prefix
computed in an earlier micro-batch (or on another rank) whose K/V live in the KV cache
(mechanism 2); such a block names its external source instead of a local key range.

    pack:    [ P P P P | A A A | B B | C C C ]      P = shared prefix, A, C children of P,
    segments: P (causal)  A (causal)  B (causal)  C (causal)      B child of A
    ancestor blocks: queries A..C over keys P;  queries B over keys A

The exact key set of a query token is therefore: the earlier tokens of its own segment, every
token of its ancestor segments (in the pack or external). This file only describes the plan;
the attention backends (``megatron_psrl.attention.backends``) execute it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclass
class AttentionPlan:
    """Segments and ancestor blocks of a packed micro-batch (all ranges half-open)."""

    num_tokens: int
    """Tokens in the pack (t)."""

    seg_start: np.ndarray
    """int64 ``[G]``: first token of every segment; segments partition ``[0, t)`` in order."""

    seg_end: np.ndarray
    """int64 ``[G]``: one past the last token of every segment."""

    block_q_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 ``[A]``: first query token of every ancestor block."""

    block_q_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 ``[A]``: one past the last query token of every ancestor block."""

    block_k_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 ``[A]``: first key of the block, in the pack or in its external source."""

    block_k_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 ``[A]``: one past the last key of the block."""

    block_source: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 ``[A]``: -1 when the keys are tokens of this pack, else the index of the external
    K/V source (a cached prefix) in ``external_lengths``."""

    external_lengths: List[int] = field(default_factory=list)
    """Number of tokens of every external K/V source read by this micro-batch."""

    seg_key_start: Optional[np.ndarray] = None
    """int64 ``[G]``: first pack key of every segment's causal keys. None (a pack's plan): the
    segment's own tokens, ``seg_start``. A query-subset plan (:meth:`select_queries`) numbers
    its queries ``0..num_tokens`` (a subset of the pack's rows) apart from the pack's
    ``num_keys`` keys: segment g's queries attend causally to pack keys
    ``seg_key_start[g]:seg_key_start[g] + (seg_end[g] - seg_start[g])``."""

    num_keys: Optional[int] = None
    """Keys in the pack (None: ``num_tokens``, queries and keys are the same tokens)."""

    def __post_init__(self) -> None:
        as64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
        self.seg_start, self.seg_end = as64(self.seg_start), as64(self.seg_end)
        if self.seg_key_start is not None:
            self.seg_key_start = as64(self.seg_key_start)
            self.num_keys = self.num_tokens if self.num_keys is None else int(self.num_keys)
        self.block_q_start, self.block_q_end = as64(self.block_q_start), as64(self.block_q_end)
        self.block_k_start, self.block_k_end = as64(self.block_k_start), as64(self.block_k_end)
        self.block_source = as64(self.block_source)
        self.external_lengths = [int(n) for n in self.external_lengths]
        self._validate()
        self._gather_cache: Optional[tuple] = None

    def _validate(self) -> None:
        t = self.num_tokens
        if len(self.seg_start) == 0:
            if t != 0:
                raise ValueError("a non-empty pack needs at least one segment")
            return
        if self.seg_start[0] != 0 or self.seg_end[-1] != t:
            raise ValueError(f"segments must cover [0, {t})")
        if np.any(self.seg_end <= self.seg_start) or np.any(self.seg_start[1:] != self.seg_end[:-1]):
            raise ValueError("segments must be non-empty and contiguous")
        n = len(self.block_q_start)
        for name in ("block_q_end", "block_k_start", "block_k_end", "block_source"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} must have one entry per ancestor block")
        if n == 0:
            return
        if np.any(self.block_q_end <= self.block_q_start) or np.any(self.block_k_end <= self.block_k_start):
            raise ValueError("ancestor blocks must be non-empty")
        if self.block_q_start.min() < 0 or self.block_q_end.max() > t:
            raise ValueError("ancestor block queries outside the pack")
        local = self.block_source < 0
        if self.is_query_subset:  # queries and keys are numbered apart: keys within the pack
            if np.any(self.block_k_end[local] > self.num_keys):
                raise ValueError("a local ancestor block's keys are outside the pack")
        elif np.any(self.block_k_end[local] > self.block_q_start[local]):
            raise ValueError("a local ancestor block's keys must precede its queries")
        ext = ~local
        if np.any(ext):
            lengths = np.asarray(self.external_lengths + [0], dtype=np.int64)
            if self.block_source[ext].max() >= len(self.external_lengths):
                raise ValueError("ancestor block names an unknown external source")
            if np.any(self.block_k_end[ext] > lengths[self.block_source[ext]]):
                raise ValueError("ancestor block keys outside their external source")

    # ------------------------------------------------------------------ views
    @property
    def is_query_subset(self) -> bool:
        """The queries are a subset of the pack's rows (:meth:`select_queries`)."""
        return self.seg_key_start is not None

    @property
    def segment_key_start(self) -> np.ndarray:
        """int64 ``[G]``: first pack key of every segment's causal keys (see ``seg_key_start``)."""
        return self.seg_start if self.seg_key_start is None else self.seg_key_start

    @property
    def num_pack_keys(self) -> int:
        """Keys in the pack (``num_tokens`` unless the queries are a subset)."""
        return self.num_tokens if self.num_keys is None else self.num_keys

    @property
    def num_segments(self) -> int:
        return int(len(self.seg_start))

    @property
    def num_blocks(self) -> int:
        return int(len(self.block_q_start))

    @property
    def num_external_tokens(self) -> int:
        return int(sum(self.external_lengths))

    def key_pairs(self) -> int:
        """Number of (query, key) pairs the plan attends: the true tree attention cost."""
        seg = self.seg_end - self.seg_start
        own = int(np.sum(seg * (seg + 1) // 2))
        blocks = int(np.sum((self.block_q_end - self.block_q_start) * (self.block_k_end - self.block_k_start)))
        return own + blocks

    def key_source_offsets(self) -> np.ndarray:
        """Offset of every key source in the concatenation [pack keys, external 0, 1, ...]."""
        sizes = [self.num_pack_keys] + self.external_lengths
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def dense_mask(self) -> np.ndarray:
        """bool ``[t, keys + external]``: the full mask over [pack keys, external keys...].

        Used by the ``dense`` reference backend and by tests; O(t^2) memory.
        """
        t = self.num_tokens
        offsets = self.key_source_offsets()
        mask = np.zeros((t, int(offsets[-1])), dtype=bool)
        for a, b, ka in zip(self.seg_start, self.seg_end, self.segment_key_start):
            n = b - a
            mask[a:b, ka:ka + n] = np.tril(np.ones((n, n), dtype=bool))
        for qa, qb, ka, kb, src in zip(
            self.block_q_start, self.block_q_end, self.block_k_start, self.block_k_end, self.block_source
        ):
            base = offsets[src + 1]
            mask[qa:qb, base + ka : base + kb] = True
        return mask

    def gathered_keys(self) -> tuple:
        """Per-segment key lists for varlen kernels (flash-attn, TE).

        Returns ``(key_index, cu_seqlens_q, cu_seqlens_k)``: ``key_index`` (int64) indexes the
        concatenation [pack keys, external keys...]; segment g's queries are pack tokens
        ``cu_seqlens_q[g]:cu_seqlens_q[g+1]`` and its keys are
        ``key_index[cu_seqlens_k[g]:cu_seqlens_k[g+1]]``: its ancestors' keys followed by its
        own tokens (its causal keys), so a causal mask aligned to the bottom right is exact.
        Computed once per micro-batch and shared by all layers.
        """
        if self._gather_cache is not None:
            return self._gather_cache
        # A block must cover whole segments: the varlen kernels give every query of a segment
        # the same ancestor keys, so a block that starts or ends inside a segment cannot be
        # expressed (the blockwise and dense backends handle it, these would silently drop it).
        boundaries = np.concatenate([self.seg_start, [self.num_tokens]])
        inside = ~np.isin(self.block_q_start, boundaries) | ~np.isin(self.block_q_end, boundaries)
        if np.any(inside):
            b = int(np.flatnonzero(inside)[0])
            raise ValueError(
                f"ancestor block {b} (queries {int(self.block_q_start[b])}:{int(self.block_q_end[b])}) does not "
                "start and end on segment boundaries; the varlen (flash / te) backends need whole segments"
            )
        offsets = self.key_source_offsets()
        # Softmax does not care about key order, only the own segment must come last so
        # that the bottom-right-aligned causal mask hits exactly its tokens.
        parts, lens = [], []
        for a, b, own in zip(self.seg_start, self.seg_end, self.segment_key_start):
            covering = np.flatnonzero((self.block_q_start <= a) & (self.block_q_end >= b))
            pieces = [
                np.arange(offsets[s + 1] + ka, offsets[s + 1] + kb)
                for ka, kb, s in zip(
                    self.block_k_start[covering], self.block_k_end[covering], self.block_source[covering]
                )
            ]
            pieces.append(np.arange(own, own + (b - a)))
            idx = np.concatenate(pieces)
            parts.append(idx)
            lens.append(len(idx))
        key_index = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        cu_q = np.concatenate([self.seg_start, [self.num_tokens]]).astype(np.int64)
        self._gather_cache = (key_index.astype(np.int64), cu_q, cu_k)
        return self._gather_cache

    def select_queries(self, rows: np.ndarray) -> "AttentionPlan":
        """The plan of the pack's query rows ``rows`` only (ascending, unique), over all its keys.

        Query ``j`` of the result is pack row ``rows[j]``, with exactly the keys it has here.
        Its segments are the runs of consecutive selected rows inside one segment of this
        plan: run ``[r0, r1]`` of segment ``[a, b)`` attends causally to keys ``r0..r1``
        (``seg_key_start``) and, unmasked, to the segment's earlier keys ``a..r0 - 1`` (one
        more block); every ancestor block keeps its keys, over the selected rows among its
        queries. Every backend runs such a plan as it is: it is how the model's last layer
        computes only the rows the loss reads, while every row's K/V stay keys.
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if self.is_query_subset:
            raise ValueError("select_queries takes a pack's plan, not a query subset")
        n = len(rows)
        if n and (rows[0] < 0 or rows[-1] >= self.num_tokens or np.any(np.diff(rows) <= 0)):
            raise ValueError("select_queries needs ascending, unique rows of the pack")
        seg = np.searchsorted(self.seg_end, rows, side="right")  # segment of every selected row
        breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(seg) != 0)) + 1
        run_start = np.concatenate([[0], breaks]).astype(np.int64)
        run_end = np.concatenate([breaks, [n]]).astype(np.int64) if n else np.zeros(0, np.int64)
        run_start = run_start[:len(run_end)]
        first_row = rows[run_start]
        earlier = first_row > self.seg_start[seg[run_start]]  # the run starts inside its segment
        # Ancestor blocks over the selected rows among their queries (empty ones dropped).
        q0 = np.searchsorted(rows, self.block_q_start)
        q1 = np.searchsorted(rows, self.block_q_end)
        kept = q1 > q0
        return AttentionPlan(
            num_tokens=n,
            seg_start=run_start,
            seg_end=run_end,
            block_q_start=np.concatenate([run_start[earlier], q0[kept]]),
            block_q_end=np.concatenate([run_end[earlier], q1[kept]]),
            block_k_start=np.concatenate([self.seg_start[seg[run_start]][earlier], self.block_k_start[kept]]),
            block_k_end=np.concatenate([first_row[earlier], self.block_k_end[kept]]),
            block_source=np.concatenate([np.full(int(earlier.sum()), -1, np.int64), self.block_source[kept]]),
            external_lengths=list(self.external_lengths),
            seg_key_start=first_row,
            num_keys=self.num_tokens,
        )


def causal_plan(segment_lengths: Sequence[int]) -> AttentionPlan:
    """Independent causal sequences packed back to back (the no-sharing baseline / THD)."""
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    return AttentionPlan(num_tokens=int(ends[-1]) if len(ends) else 0, seg_start=ends - lengths, seg_end=ends)


def tree_plan(
    seg_start: Sequence[int],
    seg_end: Sequence[int],
    seg_parent: Sequence[int],
    external_blocks: Sequence[Tuple[int, int, int]] = (),
    external_lengths: Sequence[int] = (),
) -> AttentionPlan:
    """Build the plan of a depth-first pack from its segment forest.

    Args:
        seg_start, seg_end: token range of every segment, in depth-first order.
        seg_parent: parent segment (index into the segments, smaller than the child's) or -1.
        external_blocks: ``(q_start, q_end, source)``: pack tokens ``q_start:q_end`` descend
            from external source ``source`` (a cached prefix) and see all of its keys.
        external_lengths: tokens of every external source.
    """
    seg_start = np.asarray(seg_start, dtype=np.int64)
    seg_end = np.asarray(seg_end, dtype=np.int64)
    parent = np.asarray(seg_parent, dtype=np.int64)
    g = len(seg_start)
    # Subtree end (in tokens) of every segment: depth-first order makes the subtree contiguous.
    if len(parent) != g or len(seg_end) != g:
        raise ValueError("seg_start, seg_end and seg_parent must have one entry per segment")
    subtree_end = seg_end.copy()
    subtree_last = np.arange(g)  # last segment index of every subtree
    subtree_size = np.ones(g, dtype=np.int64)  # segments in every subtree
    for s in range(g - 1, -1, -1):
        p = parent[s]
        if p >= 0:
            if p >= s:
                raise ValueError("segments must be in depth-first order (parent before child)")
            subtree_end[p] = max(subtree_end[p], subtree_end[s])
            subtree_last[p] = max(subtree_last[p], subtree_last[s])
            subtree_size[p] += subtree_size[s]
    # Depth-first order <=> every subtree is a contiguous run of segments; otherwise a
    # subtree's token range would also cover unrelated segments (which would then see it).
    bad = np.flatnonzero(subtree_last - np.arange(g) + 1 != subtree_size)
    if len(bad):
        raise ValueError(
            f"segments must be in depth-first order: the subtree of segment {int(bad[0])} is not a "
            "contiguous run of segments"
        )
    has_desc = subtree_end > seg_end  # its descendants all see this segment
    ext = np.asarray(external_blocks, dtype=np.int64).reshape(-1, 3)
    ext_lengths = np.asarray(list(external_lengths), dtype=np.int64)
    if len(ext) and (ext[:, 2].min() < 0 or ext[:, 2].max() >= len(ext_lengths)):
        raise ValueError(
            f"an external block names an unknown external source (sources 0..{len(ext_lengths) - 1})"
        )
    return AttentionPlan(
        num_tokens=int(seg_end[-1]) if g else 0,
        seg_start=seg_start,
        seg_end=seg_end,
        block_q_start=np.concatenate([seg_end[has_desc], ext[:, 0]]),
        block_q_end=np.concatenate([subtree_end[has_desc], ext[:, 1]]),
        block_k_start=np.concatenate([seg_start[has_desc], np.zeros(len(ext), np.int64)]),
        block_k_end=np.concatenate([seg_end[has_desc], ext_lengths[ext[:, 2]] if len(ext) else ext[:, 2]]),
        block_source=np.concatenate([np.full(int(has_desc.sum()), -1, np.int64), ext[:, 2]]),
        external_lengths=list(ext_lengths),
    )
