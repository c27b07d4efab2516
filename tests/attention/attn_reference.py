"""Independent references for the attention tests.

Nothing here uses ``AttentionPlan``'s own mask or key lists: a random segment forest is
described by its segment lengths, parents and the external (cached prefix) sources each root
descends from, and every query's key set is derived from that description directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import hypothesis.strategies as st
import numpy as np
import torch

from megatron_psrl.attention.plan import AttentionPlan, tree_plan


@dataclass
class Forest:
    """A depth-first packed forest of segments, plus external prefix sources per root."""

    lengths: List[int]
    parents: List[int]
    ext_lengths: List[int] = field(default_factory=list)
    root_sources: Dict[int, List[int]] = field(default_factory=dict)

    @property
    def starts(self) -> List[int]:
        return [int(x) for x in np.concatenate([[0], np.cumsum(self.lengths)[:-1]])]

    @property
    def ends(self) -> List[int]:
        return [int(x) for x in np.cumsum(self.lengths)]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    def ancestors(self, s: int) -> List[int]:
        out = []
        p = self.parents[s]
        while p >= 0:
            out.append(p)
            p = self.parents[p]
        return out

    def root(self, s: int) -> int:
        chain = [s] + self.ancestors(s)
        return chain[-1]

    def subtree_end(self, s: int) -> int:
        """One past the last token of s's subtree (its descendants, by the parent links)."""
        desc = [c for c in range(len(self.lengths)) if c == s or s in self.ancestors(c)]
        return max(self.ends[c] for c in desc)

    def external_blocks(self) -> List[Tuple[int, int, int]]:
        """(q_start, q_end, source): one block per maximal run of consecutive roots sharing a source."""
        roots = [s for s in range(len(self.lengths)) if self.parents[s] < 0]
        blocks = []
        for src in range(len(self.ext_lengths)):
            run = None
            for r in roots + [None]:
                uses = r is not None and src in self.root_sources.get(r, [])
                if uses:
                    run = (self.starts[r] if run is None else run[0], self.subtree_end(r))
                elif run is not None:
                    blocks.append((run[0], run[1], src))
                    run = None
        return blocks

    def plan(self) -> AttentionPlan:
        return tree_plan(
            self.starts, self.ends, self.parents, external_blocks=self.external_blocks(),
            external_lengths=self.ext_lengths,
        )

    def key_sets(self) -> List[List[int]]:
        """For every query token: the indices of its keys in [pack keys, external 0, 1, ...]."""
        t = self.num_tokens
        ext_offset = [t + int(x) for x in np.concatenate([[0], np.cumsum(self.ext_lengths)])]
        starts, ends = self.starts, self.ends
        out = []
        for s in range(len(self.lengths)):
            shared = []
            for src in self.root_sources.get(self.root(s), []):
                shared += list(range(ext_offset[src], ext_offset[src] + self.ext_lengths[src]))
            for a in self.ancestors(s):
                shared += list(range(starts[a], ends[a]))
            for i in range(starts[s], ends[s]):
                out.append(sorted(shared + list(range(starts[s], i + 1))))
        return out

    def reference_mask(self) -> np.ndarray:
        t = self.num_tokens
        mask = np.zeros((t, t + sum(self.ext_lengths)), dtype=bool)
        for i, keys in enumerate(self.key_sets()):
            mask[i, keys] = True
        return mask


@st.composite
def forests(draw, max_segments: int = 7, max_len: int = 6, max_sources: int = 2, with_external: bool = True):
    """Random depth-first segment forests (parent is always on the current root path)."""
    g = draw(st.integers(1, max_segments))
    lengths = [draw(st.integers(1, max_len)) for _ in range(g)]
    parents: List[int] = []
    path: List[int] = []
    for s in range(g):
        d = draw(st.integers(0, len(path)))
        parents.append(path[d - 1] if d > 0 else -1)
        path = path[:d] + [s]
    n_src = draw(st.integers(0, max_sources)) if with_external else 0
    ext_lengths = [draw(st.integers(1, max_len)) for _ in range(n_src)]
    root_sources = {}
    if n_src:
        for r in (s for s in range(g) if parents[s] < 0):
            root_sources[r] = sorted(draw(st.sets(st.integers(0, n_src - 1))))
    return Forest(lengths, parents, ext_lengths, root_sources)


def random_forest(rng: np.random.Generator, max_segments=7, max_len=6, max_sources=2) -> Forest:
    """Seeded-random variant of :func:`forests` (for parametrised, non-hypothesis tests)."""
    g = int(rng.integers(1, max_segments + 1))
    lengths = [int(x) for x in rng.integers(1, max_len + 1, g)]
    parents, path = [], []
    for s in range(g):
        d = int(rng.integers(0, len(path) + 1))
        parents.append(path[d - 1] if d > 0 else -1)
        path = path[:d] + [s]
    n_src = int(rng.integers(0, max_sources + 1))
    ext_lengths = [int(x) for x in rng.integers(1, max_len + 1, n_src)]
    root_sources = {
        r: sorted(int(x) for x in np.flatnonzero(rng.random(n_src) < 0.6))
        for r in range(g) if parents[r] < 0
    }
    return Forest(lengths, parents, ext_lengths, root_sources)


def make_qkv(forest: Forest, np_: int, ng: int, hn: int, dtype, seed: int = 0, hv: int = None):
    """Random q [t, np, hn], k [t, ng, hn], v [t, ng, hv] (``hv`` defaults to ``hn``; latent
    attention's values are narrower) and external (k, v) pairs, requiring grad."""
    g = torch.Generator().manual_seed(seed)
    t = forest.num_tokens
    hv = hn if hv is None else hv

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)

    q, k, v = r(t, np_, hn), r(t, ng, hn), r(t, ng, hv)
    external = [(r(n, ng, hn), r(n, ng, hv)) for n in forest.ext_lengths]
    return q, k, v, external


def per_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_sets: Sequence[Sequence[int]],
    external: Sequence[Tuple[torch.Tensor, torch.Tensor]] = (), scale: float = None, sink: torch.Tensor = None,
) -> torch.Tensor:
    """For every query: softmax over exactly its keys, in float64 (differentiable); ``sink``
    ``[np]``: a logit per head as one more softmax column that has no value (Hugging Face's
    gpt-oss eager attention)."""
    keys = torch.cat([k] + [e[0] for e in external], 0).double()
    values = torch.cat([v] + [e[1] for e in external], 0).double()
    t, np_, hn = q.shape
    rep = np_ // k.shape[1]
    scale = hn**-0.5 if scale is None else scale
    outs = []
    for i, ks in enumerate(key_sets):
        idx = torch.as_tensor(list(ks), dtype=torch.long)
        kk = keys[idx].repeat_interleave(rep, dim=1)  # [n, np, hn]: head h uses group h // rep
        vv = values[idx].repeat_interleave(rep, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale
        if sink is not None:
            s = torch.cat([s, sink.double()[:, None]], dim=1)
        p = torch.softmax(s, -1)[:, :len(ks)]
        outs.append(torch.einsum("hn,nhd->hd", p, vv))
    return torch.stack(outs)


# ---------------------------------------------------------------------- sliding windows and sinks
def chain_forest(rng: np.random.Generator, max_segments=7, max_len=9, max_sources=3) -> Forest:
    """A random forest whose external sources are one chain of cached prefixes (source ``j``
    continues source ``j - 1``, as mechanism 2's nested prefixes): every root reads the first
    few sources of the chain, so every key has one depth."""
    forest = random_forest(rng, max_segments, max_len, 0)
    n_src = int(rng.integers(0, max_sources + 1))
    forest.ext_lengths = [int(x) for x in rng.integers(1, max_len + 1, n_src)]
    forest.root_sources = {r: list(range(int(rng.integers(0, n_src + 1))))
                           for r in range(len(forest.lengths)) if forest.parents[r] < 0}
    return forest


def depths(forest: Forest) -> Tuple[np.ndarray, np.ndarray]:
    """``(depth of every query, depth of every key in [pack, external 0, 1, ...])`` of a
    :func:`chain_forest`: a token's depth is the number of tokens before it on its path."""
    ext_first = np.concatenate([[0], np.cumsum(forest.ext_lengths)]).astype(np.int64)
    start = {}
    for s in range(len(forest.lengths)):
        p = forest.parents[s]
        start[s] = start[p] + forest.lengths[p] if p >= 0 else int(ext_first[len(forest.root_sources.get(s, []))])
    queries = np.concatenate([start[s] + np.arange(n) for s, n in enumerate(forest.lengths)]).astype(np.int64)
    ext = [ext_first[j] + np.arange(n) for j, n in enumerate(forest.ext_lengths)]
    return queries, np.concatenate([queries] + ext).astype(np.int64)


def windowed_key_sets(forest: Forest, window: int) -> List[List[int]]:
    """Every query's keys (its ancestors and itself) fewer than ``window`` tokens before it on its path."""
    queries, keys = depths(forest)
    return [[j for j in ks if queries[i] - keys[j] < window] for i, ks in enumerate(forest.key_sets())]


def plan_with_depths(forest: Forest) -> AttentionPlan:
    """The forest's plan with its tokens' and external sources' depths (what a pack has)."""
    queries, _ = depths(forest)
    first = np.concatenate([[0], np.cumsum(forest.ext_lengths)[:-1]]).astype(np.int64)
    return tree_plan(forest.starts, forest.ends, forest.parents, external_blocks=forest.external_blocks(),
                     external_lengths=forest.ext_lengths, positions=queries,
                     external_positions=[int(x) for x in first[:len(forest.ext_lengths)]])
