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

    positions: Optional[np.ndarray] = None
    """int64 ``[num_pack_keys]``: every pack row's depth on its root-to-leaf path (its position
    id). Only windowed attention reads it (:meth:`windowed`); None: derived from the plan where
    the plan alone implies it (no external source: a token sees exactly its ancestors and itself)."""

    query_positions: Optional[np.ndarray] = None
    """int64 ``[num_tokens]``: the queries' depths where they are not the pack rows' (a
    query-subset plan, :meth:`select_queries`); None: ``positions``."""

    external_positions: Optional[List[int]] = None
    """Depth of the first key of every external source (a source is a chain: its keys follow on)."""

    window: Optional[int] = None
    """Set on the plan :meth:`windowed` returns: a query sees only keys fewer than ``window``
    positions before it on its own path (``q_pos - k_pos < window``); None: every ancestor."""

    block_masked: Optional[np.ndarray] = None
    """bool ``[A]``, windowed plans: the block's queries see per-query suffixes of its keys (the
    backends mask ``q_pos - k_pos >= window``); other blocks are seen whole."""

    external_starts: Optional[np.ndarray] = None
    """int64 ``[sources]``, windowed plans: rows of every external source older than any query's
    window, dropped from the plan (its blocks' keys and ``external_lengths`` count from there):
    the attention reads rows ``external_starts[j]:`` of source ``j`` only."""

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
        if self.positions is not None:
            self.positions = as64(self.positions)
        if self.query_positions is not None:
            self.query_positions = as64(self.query_positions)
        if self.external_positions is not None:
            self.external_positions = [int(p) for p in self.external_positions]
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
        if self.positions is not None and len(self.positions) != self.num_pack_keys:
            raise ValueError(f"positions must give every pack key's depth ({self.num_pack_keys})")
        if self.query_positions is not None and len(self.query_positions) != t:
            raise ValueError(f"query_positions must give every query's depth ({t})")
        if self.external_positions is not None and len(self.external_positions) != len(self.external_lengths):
            raise ValueError("external_positions must give every external source's first depth")
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
        if self.window is not None:
            queries, keys = self._query_and_key_depths()
            mask &= queries[:, None] - keys[None, :] < self.window
        return mask

    # ------------------------------------------------------------------ sliding windows
    def depths(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(queries [num_tokens], pack keys [num_pack_keys], external sources' first keys)``:
        the depths a sliding window counts. ``positions`` (and its companions) where given;
        else derived, for a plan without external sources: a token sees exactly its ancestors
        and itself, so its depth is the number of keys it sees minus one."""
        if self.positions is not None:
            queries = self.positions if self.query_positions is None else self.query_positions
            if self.external_lengths and self.external_positions is None:
                raise ValueError("windowed attention over external sources needs their depths (external_positions)")
            return queries, self.positions, np.asarray(self.external_positions or [], dtype=np.int64)
        if self.external_lengths or self.is_query_subset:
            raise ValueError("windowed attention needs the plan's positions (tree_plan(..., positions=...))")
        if "_depths" not in self.__dict__:  # (derived once)
            self.__dict__["_depths"] = self._derived_depths()
        return self.__dict__["_depths"]

    def _derived_depths(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`depths` of a plan without positions or external sources."""
        t = self.num_tokens
        seg = np.repeat(np.arange(self.num_segments), self.seg_end - self.seg_start)
        seen = np.zeros(t + 1, dtype=np.int64)  # keys of the ancestor blocks over each token
        sizes = self.block_k_end - self.block_k_start
        np.add.at(seen, self.block_q_start, sizes)
        np.add.at(seen, self.block_q_end, -sizes)
        depth = np.arange(t, dtype=np.int64) - self.seg_start[seg] + np.cumsum(seen)[:t]
        return depth, depth, np.zeros(0, dtype=np.int64)

    def _query_and_key_depths(self) -> Tuple[np.ndarray, np.ndarray]:
        """Depths of the queries and of every key of [pack keys, external 0, 1, ...]."""
        queries, pack, first = self.depths()
        ext = [f + np.arange(n, dtype=np.int64) for f, n in zip(first, self.external_lengths)]
        return queries, np.concatenate([pack] + ext) if ext else pack

    def key_depths(self, block: int) -> np.ndarray:
        """int64: the depths of block ``block``'s keys (a chain: consecutive)."""
        _, pack, first = self.depths()
        ka, kb, src = int(self.block_k_start[block]), int(self.block_k_end[block]), int(self.block_source[block])
        return pack[ka:kb] if src < 0 else first[src] + np.arange(ka, kb, dtype=np.int64)

    def windowed(self, window: int) -> "AttentionPlan":
        """This plan with a sliding window: a query sees a key of its own path only if
        ``depth(query) - depth(key) < window`` (Hugging Face's sliding-window mask, counted along
        the root-to-leaf path: another branch's tokens are never keys). Cached per window (built
        once per micro-batch, shared by the windowed layers).

        - a segment longer than ``window`` is cut into pieces of ``window`` tokens (causal, and
          within the window whole); piece ``m > 0`` sees the last ``window - 1`` keys of the
          piece before through a masked block;
        - an ancestor block no query's window reaches is dropped; a kept block's keys start at
          the first one its nearest query reaches, its queries run from the first to the last
          segment that sees any; where some query sees only part of its keys it is
          ``block_masked``;
        - an external source's rows older than every reader's window are not read at all
          (``external_starts``; its blocks and length count from there)."""
        cache = self.__dict__.setdefault("_windowed", {})
        if window in cache:
            return cache[window]
        if window < 1:
            raise ValueError(f"a sliding window must be at least one token, got {window}")
        if self.window is not None:
            raise ValueError("the plan is windowed already")
        queries, pack, first = self.depths()
        # Segments in pieces of at most `window` tokens; a band block per later piece.
        lens = self.seg_end - self.seg_start
        pieces = (lens + window - 1) // window
        g = np.repeat(np.arange(self.num_segments), pieces)
        j = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        seg_start = self.seg_start[g] + j * window
        seg_end = np.minimum(self.seg_end[g], seg_start + window)
        seg_key = self.segment_key_start[g] + j * window
        band = (j > 0) & (window > 1)
        blocks = [(seg_start[band], seg_end[band], seg_key[band] - window + 1, seg_key[band],
                   np.full(int(band.sum()), -1, np.int64), np.ones(int(band.sum()), bool))]
        blocks.append(self._windowed_blocks(window, queries, seg_start, seg_end))
        qa, qb, ka, kb, src, masked = (np.concatenate(parts) for parts in zip(*blocks))
        # External sources: rows before the first any kept block reads are not read.
        starts = np.array([int(ka[src == s].min()) if np.any(src == s) else n
                           for s, n in enumerate(self.external_lengths)], dtype=np.int64)
        ext = src >= 0
        ka[ext] -= starts[src[ext]]
        kb[ext] -= starts[src[ext]]
        plan = AttentionPlan(
            num_tokens=self.num_tokens, seg_start=seg_start, seg_end=seg_end,
            block_q_start=qa, block_q_end=qb, block_k_start=ka, block_k_end=kb, block_source=src,
            external_lengths=[n - int(s) for n, s in zip(self.external_lengths, starts)],
            seg_key_start=seg_key if self.is_query_subset else None, num_keys=self.num_keys,
            positions=pack, query_positions=queries if self.is_query_subset else None,
            external_positions=[int(f + s) for f, s in zip(first, starts)] if self.external_lengths else None,
            window=window, block_masked=masked, external_starts=starts)
        cache[window] = plan
        return plan

    def _windowed_blocks(self, window: int, queries: np.ndarray, seg_start: np.ndarray, seg_end: np.ndarray):
        """The ancestor blocks some query's window reaches, cut as :meth:`windowed` says:
        ``(q_start, q_end, k_start, k_end, source, masked)`` arrays."""
        kept = []
        for b in range(self.num_blocks):
            qa, qb, ka = int(self.block_q_start[b]), int(self.block_q_end[b]), int(self.block_k_start[b])
            keys = self.key_depths(b)
            seeing = np.flatnonzero(queries[qa:qb] - keys[-1] < window) + qa
            if not len(seeing):
                continue
            # whole pieces (the varlen kernels give every query of a segment the same keys)
            qa = int(seg_start[np.searchsorted(seg_start, seeing[0], side="right") - 1])
            qb = int(seg_end[np.searchsorted(seg_start, seeing[-1], side="right") - 1])
            nearest, farthest = queries[qa:qb].min(), queries[qa:qb].max()
            skip = int(max(0, nearest - window + 1 - keys[0]))
            kept.append((qa, qb, ka + skip, int(self.block_k_end[b]), int(self.block_source[b]),
                         bool(farthest - keys[skip] >= window)))
        cols = list(zip(*kept)) if kept else [()] * 6
        return tuple(np.asarray(c, dtype=bool if i == 5 else np.int64) for i, c in enumerate(cols))

    def block_mask(self, block: int) -> np.ndarray:
        """bool ``[queries, keys]`` of a masked block of a windowed plan: which of its keys each
        of its queries sees."""
        queries, _, _ = self.depths()
        qa, qb = int(self.block_q_start[block]), int(self.block_q_end[block])
        return queries[qa:qb, None] - self.key_depths(block)[None, :] < self.window

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
        # that the bottom-right-aligned causal mask hits exactly its tokens. A windowed plan's
        # keys are in depth order, from the first the segment's first query reaches: a kernel's
        # window of `window - 1` keys to the left, aligned bottom right, is then exact.
        parts, lens = [], []
        for a, b, own in zip(self.seg_start, self.seg_end, self.segment_key_start):
            covering = np.flatnonzero((self.block_q_start <= a) & (self.block_q_end >= b))
            if self.window is not None:
                covering = self._window_order(covering, int(a))
            pieces = [
                np.arange(offsets[s + 1] + ka, offsets[s + 1] + kb)
                for ka, kb, s in zip(
                    self.block_k_start[covering], self.block_k_end[covering], self.block_source[covering]
                )
            ]
            if self.window is not None:
                pieces = self._window_cut(covering, pieces, int(a))
            pieces.append(np.arange(own, own + (b - a)))
            idx = np.concatenate(pieces)
            parts.append(idx)
            lens.append(len(idx))
        key_index = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        cu_q = np.concatenate([self.seg_start, [self.num_tokens]]).astype(np.int64)
        self._gather_cache = (key_index.astype(np.int64), cu_q, cu_k)
        return self._gather_cache

    def _window_order(self, covering: np.ndarray, query: int) -> np.ndarray:
        """The covering blocks of a windowed plan's segment (first query ``query``) in depth order."""
        return covering[np.argsort([self.key_depths(int(c))[0] for c in covering], kind="stable")]

    def _window_cut(self, covering: np.ndarray, pieces: List[np.ndarray], query: int) -> List[np.ndarray]:
        """The covering blocks' keys from the first one query ``query`` (a segment's first)
        reaches: the segment's keys are then one run of depths ending at its own."""
        oldest = self.depths()[0][query] - self.window + 1
        return [p[max(0, int(oldest - self.key_depths(int(c))[0])):] for c, p in zip(covering, pieces)]

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
        if self.is_query_subset or self.window is not None:
            raise ValueError("select_queries takes a pack's plan, not a query subset or a windowed plan")
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
        # (the rows' depths, for a sliding window: given, or implied by a plan of the pack alone)
        depths = self.positions if self.positions is not None or self.external_lengths else self.depths()[1]
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
            positions=depths,
            query_positions=None if depths is None else depths[rows],
            external_positions=self.external_positions,
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
    positions: Optional[Sequence[int]] = None,
    external_positions: Optional[Sequence[int]] = None,
) -> AttentionPlan:
    """Build the plan of a depth-first pack from its segment forest.

    Args:
        seg_start, seg_end: token range of every segment, in depth-first order.
        seg_parent: parent segment (index into the segments, smaller than the child's) or -1.
        external_blocks: ``(q_start, q_end, source)``: pack tokens ``q_start:q_end`` descend
            from external source ``source`` (a cached prefix) and see all of its keys.
        external_lengths: tokens of every external source.
        positions, external_positions: every token's depth and every external source's first
            depth (read by sliding windows, :meth:`AttentionPlan.windowed`).
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
        positions=None if positions is None else np.asarray(positions, dtype=np.int64),
        external_positions=None if external_positions is None else list(external_positions),
    )
