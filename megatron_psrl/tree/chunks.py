"""Dependencies between the chunks of a depth-first token stream (mechanism 2, cross-rank).

A chunk is a contiguous depth-first range of tree tokens, so all its outside ancestors lie on
the path to its first token, in earlier chunks. The whole-tree planner (mechanism 2's chunks
on one rank, :mod:`megatron_psrl.schedule.planner`) and the cross-rank planner (fragments on
several ranks, :mod:`megatron_psrl.schedule.cross_rank`) both turn those path pieces into chains
that later chunks read.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from megatron_psrl.tree.index import TreeIndex, chain_structure


def _union_of_paths(index: TreeIndex, tokens, floor: int) -> np.ndarray:
    """Tree tokens ``>= floor`` on the paths from the root to any of ``tokens``, ascending.

    The marked set is closed under ancestors, so per node it is a prefix of the node's tokens:
    a walk up stops at the first node already marked."""
    tree = index.tree
    marked: Dict[int, int] = {}  # node -> last marked token of the node
    for y in tokens:
        m, hi = int(index.token_node[y]), int(y)
        while m >= 0:
            if m in marked:
                marked[m] = max(marked[m], hi)
                break
            marked[m] = hi
            if tree.node_offset[m] <= floor:
                break
            m = int(tree.node_parent[m])
            hi = int(tree.node_offset[m + 1]) - 1
    return np.concatenate([np.arange(max(int(tree.node_offset[m]), floor), marked[m] + 1, dtype=np.int64)
                           for m in sorted(marked)])


@dataclass
class ChunkDependencies:
    """What later chunks of a depth-first stream need from each chunk (by chunk index)."""

    needed: Dict[int, np.ndarray]
    """Tokens of the chunk that lie on the path of some later chunk (ascending)."""

    attach: Dict[int, np.ndarray]
    """Tokens of the chunk that a later chunk's root segments continue from."""

    remote: Dict[int, np.ndarray]
    """Tokens of later chunks whose predecessor is in the chunk (their log-prob is computed there)."""


def chunk_dependencies(index: TreeIndex, chunks: List[np.ndarray]) -> ChunkDependencies:
    """Dependencies between the chunks (contiguous depth-first ranges of one or more trees, in
    stream order) of a stream: a chunk's outside ancestors all lie on the path to its first
    token, in earlier chunks.

    A later chunk needs, from an earlier chunk p, the path tokens inside p: the ancestors (in
    p) of the deepest path token in p. Only those deepest tokens are collected, walking the
    path node by node (not token by token), and each chunk's needed tokens are built once at
    the end, so a long chain (every chunk reads everything before it) costs linear work."""
    pred, tree = index.pred, index.tree
    first = np.array([int(c[0]) for c in chunks], dtype=np.int64)
    last = np.array([int(c[-1]) for c in chunks], dtype=np.int64)
    first_list, last_list = first.tolist(), last.tolist()
    chunk_of = lambda tok: np.searchsorted(first, tok, side="right") - 1  # noqa: E731
    deepest: Dict[int, set] = {}
    attach: Dict[int, List[np.ndarray]] = {}
    remote: Dict[int, List[np.ndarray]] = {}
    # Nodes whose whole token range an earlier walk recorded: the walk from such a node up is
    # the same for every chunk, so a later walk stops there (linear work for a long chain).
    walked = set()
    node_offset, node_parent, token_node = tree.node_offset, tree.node_parent, index.token_node
    for tokens in chunks:
        a = int(tokens[0])
        if pred[a] < 0:
            continue
        hi = int(pred[a])  # walk the path up, one node piece [lo, hi] at a time
        m = int(token_node[hi])
        while m >= 0:
            full = hi == int(node_offset[m + 1]) - 1
            if full:
                if m in walked:
                    break
                walked.add(m)
            lo = int(node_offset[m])
            for c in range(bisect_right(first_list, hi) - 1, bisect_right(first_list, lo) - 2, -1):
                deepest.setdefault(c, set()).add(min(hi, last_list[c]))
            m = int(node_parent[m])
            if m >= 0:
                hi = int(node_offset[m + 1]) - 1
        roots = tokens[(pred[tokens] >= 0) & (pred[tokens] < a)]
        preds = pred[roots]
        pj = chunk_of(preds)
        for j in np.unique(pj):
            attach.setdefault(int(j), []).append(preds[pj == j])
            remote.setdefault(int(j), []).append(roots[pj == j])
    needed = {p: _union_of_paths(index, ys, int(first[p])) for p, ys in deepest.items()}
    return ChunkDependencies(
        needed=needed,
        attach={j: np.unique(np.concatenate(v)) for j, v in attach.items()},
        remote={j: np.unique(np.concatenate(v)) for j, v in remote.items()},
    )


def split_chains(index: TreeIndex, tokens: np.ndarray, attach_points: np.ndarray) -> List[np.ndarray]:
    """Split a set of path tokens (a union of root paths, ascending) into chains that end at
    attach points or branch points, so every reader sees whole chains."""
    attach_points = np.asarray(attach_points)
    if len(attach_points):  # membership in the sorted attach points (as np.isin, faster)
        ordered = attach_points if bool((attach_points[1:] >= attach_points[:-1]).all()) else np.sort(attach_points)
        pos = np.minimum(np.searchsorted(ordered, tokens), len(ordered) - 1)
        is_attach = ordered[pos] == tokens
    else:
        is_attach = np.zeros(len(tokens), bool)
    _, cont = chain_structure(index, tokens, break_after=is_attach)
    starts = np.flatnonzero(~cont)
    return [tokens[a:b] for a, b in zip(starts, np.append(starts[1:], len(tokens)))]
