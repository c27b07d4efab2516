"""One rank's micro-batches: the trees placed on it whole, packed (mechanism 1), streamed in
budget-sized chunks with cached prefix sources (mechanism 2) or cut with duplicated ancestors
(``tree-dup``), in depth-first order; then the rank's plan and schedule.

Called by the planner (:func:`megatron_psrl.schedule.planner.plan_step`) for every rank of a
group that places trees whole (its docstring, step 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.plan import (
    CachedSource,
    MicroBatchSpec,
    PlanningError,
    RankPlan,
    build_schedule,
    export_head,
)
from megatron_psrl.tree.chunks import chunk_dependencies, split_chains
from megatron_psrl.tree.index import TreeIndex
from megatron_psrl.tree.prefix_tree import PrefixTree


@dataclass
class _Bin:
    """A micro-batch under construction."""

    ranges: List[Tuple[int, int]] = field(default_factory=list)  # owned tree-token ranges
    context: List[np.ndarray] = field(default_factory=list)  # duplicated tokens (not owned)
    size: int = 0
    small_trees: int = 0  # whole small trees packed in
    role: Optional[str] = None  # "import" (receives heads: ranges not owned) or "export" (computes them)
    heads: List[Tuple[int, int, int, int]] = field(default_factory=list)  # (transfer, import, start, length)


@dataclass
class RankHeads:
    """One rank's part in the group's head sends (:class:`GroupHeads`)."""

    imports: Dict[int, Tuple[int, int, int]] = field(default_factory=dict)
    """Top-level node of a copy on this rank -> ``(transfer, import, head length)`` it receives."""

    local: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    """The home copy on its home rank -> ``(transfer, head length)``: its head is the export."""

    exports: List[Tuple[int, int, int]] = field(default_factory=list)
    """``(transfer, start, length)`` of every head this rank computes and sends."""

    computed_elsewhere: List[Tuple[int, int]] = field(default_factory=list)
    """Token ranges of the group's exported heads that this rank's micro-batches hold as
    context only (duplication, ``tree-dup``: the export computes and owns them)."""


def layout_rank(index: TreeIndex, units: np.ndarray, config: PlannerConfig, heads: Optional[RankHeads] = None):
    """The micro-batches of one rank as token ranges (bins) and its mechanism-2 streams: all
    the whole-tree placement's predicted cost needs (the number of micro-batches).

    A copy whose head this rank receives (or, on the home rank, exports) is a stream whose
    first chunk is the head, in the import bin (or its export bin): its pieces become sources
    the rest reads."""
    tree = index.tree
    heads = heads or RankHeads()
    budget = config.micro_batch_tokens
    unit_start = tree.node_offset[units]
    unit_end = tree.node_offset[tree.node_subtree_end[units]]
    unit_size = unit_end - unit_start
    bins: List[_Bin] = []
    export_bin = _export_bins(bins, heads, budget)
    import_bin: List[Optional[int]] = [None]  # made when the first copy's head is received
    with_head = np.array([int(u) in heads.imports or int(u) in heads.local for u in units], dtype=bool)
    small = (unit_size <= budget) & ~with_head
    streams: List[List[int]] = []  # chunk boundaries of every mechanism-2 stream
    stream_bins: List[List[int]] = []
    for u in np.flatnonzero(~small):
        root = int(units[u])
        a, z = int(unit_start[u]), int(unit_end[u])
        if with_head[u]:
            head_bin, length = _head_bin(bins, heads, root, a, export_bin, import_bin)
            bounds = [a] + _stream_chunks(index, a + length, z, budget, config.snap_fraction,
                                          config.cut_at_branch_switches, config.cut_after_shared_prefixes)
            streams.append(bounds)
            stream_bins.append([head_bin] + _chunk_bins(bins, bounds[1:]))
        elif _choose_mechanism(index, root, config) == "stream":
            bounds = _stream_chunks(index, a, z, budget, config.snap_fraction, config.cut_at_branch_switches,
                                    config.cut_after_shared_prefixes)
            streams.append(bounds)
            stream_bins.append(_chunk_bins(bins, bounds))
        else:
            bins.extend(_duplication_bins(index, root, budget))
    # First-fit decreasing of the small trees into the free space of all micro-batches.
    max_trees = config.max_trees_per_micro_batch or len(units) + 1
    for u in sorted(np.flatnonzero(small), key=lambda u: (-unit_size[u], u)):
        size = int(unit_size[u])
        target = next((b for b in bins if b.role is None and b.size + size <= budget and b.small_trees < max_trees),
                      None)
        if target is None:
            target = _Bin()
            bins.append(target)
        target.ranges.append((int(unit_start[u]), int(unit_end[u])))
        target.size += size
        target.small_trees += 1
    for lo, hi in heads.computed_elsewhere:
        for b in bins:
            if b.role is None:
                _disown(b, lo, hi)
    return bins, streams, stream_bins, bool(heads.computed_elsewhere)


def _export_bins(bins: List[_Bin], heads: RankHeads, budget: int) -> Dict[int, int]:
    """The exported heads, first-fit into export micro-batches: transfer -> its bin."""
    export_bin: Dict[int, int] = {}
    for t, start, length in heads.exports:
        target = next((i for i, b in enumerate(bins) if b.size + length <= budget), None)
        if target is None:
            bins.append(_Bin(role="export"))
            target = len(bins) - 1
        bins[target].ranges.append((start, start + length))
        bins[target].size += length
        bins[target].heads.append((t, 0, start, length))
        export_bin[t] = target
    return export_bin


def _head_bin(bins: List[_Bin], heads: RankHeads, root: int, a: int, export_bin: Dict[int, int],
              import_bin: List[Optional[int]]) -> Tuple[int, int]:
    """``(bin, head length)`` of the head of the copy rooted at ``root`` (first token ``a``): its
    export bin on the home rank, else the rank's one import bin (made on first use)."""
    if root in heads.local:
        t, length = heads.local[root]
        return export_bin[t], length
    t, j, length = heads.imports[root]
    if import_bin[0] is None:
        bins.append(_Bin(role="import"))
        import_bin[0] = len(bins) - 1
    bins[import_bin[0]].ranges.append((a, a + length))
    bins[import_bin[0]].heads.append((t, j, a, length))
    return import_bin[0], length


def _chunk_bins(bins: List[_Bin], bounds: List[int]) -> List[int]:
    """One new bin per chunk ``bounds[k] .. bounds[k + 1]`` of a stream: their indices."""
    ids = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        bins.append(_Bin(ranges=[(lo, hi)], size=hi - lo))
        ids.append(len(bins) - 1)
    return ids


def _disown(b: _Bin, lo: int, hi: int) -> None:
    """Tokens ``lo .. hi - 1`` of the bin's owned ranges become context (computed, owned elsewhere)."""
    kept = []
    for a, z in b.ranges:
        if z <= lo or a >= hi:
            kept.append((a, z))
            continue
        b.context.append(np.arange(max(a, lo), min(z, hi), dtype=np.int64))
        kept += [r for r in ((a, lo), (hi, z)) if r[1] > r[0]]
    b.ranges = kept


def materialize_rank(index: TreeIndex, layout) -> RankPlan:
    """The rank plan of a layout (:func:`layout_rank`): specs, cached sources, order, schedule."""
    bins, streams, stream_bins, duplicating = layout
    micro_batches = [_bin_to_spec(i, b) for i, b in enumerate(bins)]
    sources: Dict[int, CachedSource] = {}
    for bounds, ids in zip(streams, stream_bins):
        _link_stream(index, bounds, ids, micro_batches, sources)
    _mark_transfers(bins, micro_batches, sources, predicts_next=not duplicating)
    order = _forward_order(bins)
    micro_batches, sources = _renumber(micro_batches, sources, order)
    exports = [i for i, mb in enumerate(micro_batches) if any(sources[s].exported is not None for s in mb.produces)]
    return RankPlan(micro_batches=micro_batches, sources=sources,
                    schedule=build_schedule(micro_batches, sources, last=exports))


def _mark_transfers(bins: List[_Bin], mbs: List[MicroBatchSpec], sources: Dict[int, CachedSource],
                    predicts_next: bool = True) -> None:
    """Sources of an import bin are imported (each from the head it lies in; an import computes
    no log-prob), and every export bin produces one exported source per head it computes and
    (``predicts_next``, unless its home copy is duplicated) the log-prob of the token after it."""
    for i, b in enumerate(bins):
        if b.role == "import":
            mbs[i].remote_targets = np.zeros(0, np.int64)  # the home copy predicts the token after a head
            for s in mbs[i].produces:
                first = int(sources[s].tokens[0])
                t, j, _, _ = next(h for h in b.heads if h[2] <= first < h[2] + h[3])
                sources[s].imported = (t, j)
        elif b.role == "export":
            for t, _, start, length in b.heads:
                export_head(mbs[i], sources, max(sources, default=-1) + 1, i, t, start, length, predicts_next)


def _bin_to_spec(i: int, b: _Bin) -> MicroBatchSpec:
    owned_tokens = np.concatenate([np.arange(a, z, dtype=np.int64) for a, z in b.ranges]) if b.ranges else np.zeros(0, np.int64)
    if b.role == "import":
        tokens = np.sort(owned_tokens)
        return MicroBatchSpec(index=i, tokens=tokens, owned=np.zeros(len(tokens), bool), role="import")
    if b.context:
        ctx = np.setdiff1d(np.concatenate(b.context), owned_tokens)
        tokens = np.concatenate([owned_tokens, ctx])
        owned = np.concatenate([np.ones(len(owned_tokens), bool), np.zeros(len(ctx), bool)])
        order = np.argsort(tokens, kind="stable")
        return MicroBatchSpec(index=i, tokens=tokens[order], owned=owned[order])
    order = np.argsort(owned_tokens, kind="stable")
    return MicroBatchSpec(index=i, tokens=owned_tokens[order], owned=np.ones(len(owned_tokens), bool))


# ---------------------------------------------------------------------- mechanism choice
def _path_length_max(index: TreeIndex, root: int) -> int:
    """Longest sample through the tree of ``root`` (= deepest position + 1)."""
    tree = index.tree
    end = int(tree.node_subtree_end[root])
    offset = tree.node_offset
    return int((tree.node_depth[root:end] + offset[root + 1:end + 1] - offset[root:end]).max())


def _choose_mechanism(index: TreeIndex, root: int, config: PlannerConfig) -> str:
    """``stream`` (mechanism 2) or ``dup`` (duplicate the prefix) for an oversized tree.

    Mechanism 2 computes every token exactly once; duplication recomputes the ancestor path
    of every piece. So in ``tree`` mode mechanism 2 is always at least as cheap in FLOPs; the
    KV cache manager may still turn a cached prefix into a recomputation when memory is short.
    """
    longest = _path_length_max(index, root)
    if config.sharing == "none":
        raise PlanningError(
            f"a sample of {longest} tokens does not fit --micro-batch-tokens {config.micro_batch_tokens} "
            "(without prefix sharing every sample must fit one micro-batch)"
        )
    if config.sharing == "tree-dup":
        if longest > config.micro_batch_tokens:
            raise PlanningError(
                f"a sample of {longest} tokens does not fit --micro-batch-tokens {config.micro_batch_tokens}; "
                "mechanism 1 alone cannot split a sample (use --prefix-sharing tree)"
            )
        return "dup"
    return "stream"


# ---------------------------------------------------------------------- mechanism 2: streams
def _stream_chunks(index: TreeIndex, start: int, end: int, budget: int, snap: float,
                   branch_switch_cuts: bool = False, shared_prefix_cuts: bool = False) -> List[int]:
    """Chunk boundaries of the depth-first token range [start, end): at most ``budget`` tokens
    each, ending at a node boundary when one keeps the chunk >= ``snap * budget`` full, and
    (``branch_switch_cuts``) at every node that does not continue the node before it,
    (``shared_prefix_cuts``) after every node with more than one child."""
    tree = index.tree
    node_starts = tree.node_offset[:-1]
    lo_node = np.searchsorted(node_starts, start)
    hi_node = np.searchsorted(node_starts, end)
    boundaries = node_starts[lo_node:hi_node]
    nodes = np.arange(lo_node, hi_node)
    # nodes are numbered in depth-first order: node n continues the stream's branch when its
    # parent is node n - 1; otherwise it starts a sibling subtree
    continues = tree.node_parent[nodes] == nodes - 1
    forced = (nodes > lo_node) & ~continues if branch_switch_cuts else np.zeros(len(nodes), dtype=bool)
    if shared_prefix_cuts:  # (the first child of a node with several starts right after it)
        parents = tree.node_parent[nodes] - lo_node  # (a stream holds whole subtrees: children in range)
        children = np.bincount(parents[parents >= 0], minlength=len(nodes))
        forced |= (nodes > lo_node) & continues & (children[np.maximum(parents, 0)] > 1)
    switches = node_starts[nodes[forced]]
    bounds = [start]
    while True:
        a = bounds[-1]
        j = np.searchsorted(switches, a, side="right")
        if j < len(switches) and switches[j] - a <= budget:
            bounds.append(int(switches[j]))
            continue
        if end - a <= budget:
            break
        limit = a + budget
        i = np.searchsorted(boundaries, limit, side="right") - 1
        cut = int(boundaries[i]) if i >= 0 and boundaries[i] > a and boundaries[i] - a >= snap * budget else limit
        bounds.append(cut)
    bounds.append(end)
    return bounds


def _ancestor_path(index: TreeIndex, token: int) -> np.ndarray:
    """Tree tokens on the path from the root to ``token`` (inclusive), ascending."""
    tree = index.tree
    m = int(index.token_node[token])
    pieces = [np.arange(tree.node_offset[m], token + 1, dtype=np.int64)]
    m = int(tree.node_parent[m])
    while m >= 0:
        pieces.append(np.arange(tree.node_offset[m], tree.node_offset[m + 1], dtype=np.int64))
        m = int(tree.node_parent[m])
    return np.concatenate(pieces[::-1])


def _link_stream(
    index: TreeIndex, bounds: List[int], bin_ids: List[int], mbs: List[MicroBatchSpec], sources: Dict[int, CachedSource]
) -> None:
    """Create the cached sources of a chunked tree and record reads / remote targets."""
    n = len(bounds) - 1
    deps = chunk_dependencies(index, [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])])
    for j in range(n):
        mb = mbs[bin_ids[j]]
        if j in deps.remote:
            mb.remote_targets = np.concatenate([mb.remote_targets, deps.remote[j]])
        if j not in deps.needed:
            continue
        for piece in split_chains(index, deps.needed[j], deps.attach[j]):
            sid = len(sources)
            src = CachedSource(source_id=sid, producer=bin_ids[j], tokens=piece)
            last = src.last_token
            # Consumers: chunks whose first token descends from the piece's last token.
            firsts = np.asarray(bounds[j + 1 : n], dtype=np.int64)
            hit = (firsts > last) & (firsts < index.subtree_end[last])
            src.consumers = [bin_ids[j + 1 + k] for k in np.flatnonzero(hit)]
            sources[sid] = src
            mb.produces.append(sid)
            for c in src.consumers:
                mbs[c].reads.append(sid)


# ---------------------------------------------------------------------- duplication
def _duplication_bins(index: TreeIndex, root: int, budget: int) -> List[_Bin]:
    """Cut a tree at nodes; every piece carries its ancestor path as duplicated context."""
    tree = index.tree
    sub_tokens = tree.subtree_tokens()
    children = _children_lists(tree)
    pieces: List[Tuple[List[Tuple[int, int]], np.ndarray]] = []

    def place(m: int, s: int, context: np.ndarray) -> None:
        avail = budget - len(context)
        start = int(tree.node_offset[m]) + s
        end = int(tree.node_offset[tree.node_subtree_end[m]])
        if end - start <= avail:
            pieces.append(([(start, end)], context))
            return
        if avail <= 0:
            raise PlanningError(f"a path of {len(context)} tokens does not fit --micro-batch-tokens {budget}")
        node_end = int(tree.node_offset[m + 1])
        if node_end - start > avail:  # a node longer than the room: chunk it
            pieces.append(([(start, start + avail)], context))
            place(m, s + avail, np.concatenate([context, np.arange(start, start + avail)]))
            return
        room = avail - (node_end - start)
        ranges = [(start, node_end)]
        rest = []
        for c in sorted(children[m], key=lambda c: (-sub_tokens[c], c)):
            size = int(sub_tokens[c])
            if size <= room:
                ranges.append((int(tree.node_offset[c]), int(tree.node_offset[c]) + size))
                room -= size
            else:
                rest.append(c)
        pieces.append((ranges, context))
        inner = np.concatenate([context, np.arange(start, node_end)])
        for c in sorted(rest):
            place(c, 0, inner)

    place(root, 0, np.zeros(0, np.int64))
    # Next-fit in depth-first order: neighbouring pieces share most of their context.
    bins: List[_Bin] = []
    for ranges, context in pieces:
        owned = sum(b - a for a, b in ranges)
        cur = bins[-1] if bins else None
        if cur is not None:
            have = np.concatenate([np.arange(a, b) for a, b in cur.ranges] + cur.context)
            extra_ctx = len(np.setdiff1d(context, have))
            if cur.size + owned + extra_ctx <= budget:
                cur.ranges.extend(ranges)
                cur.context.append(context)
                cur.size += owned + extra_ctx
                continue
        bins.append(_Bin(ranges=list(ranges), context=[context], size=owned + len(context)))
    return bins


def _children_lists(tree: PrefixTree) -> List[List[int]]:
    cache = tree.__dict__.get("_children_cache")
    if cache is None:
        cache = [[] for _ in range(tree.num_nodes)]
        for c in np.flatnonzero(tree.node_parent >= 0):
            cache[int(tree.node_parent[c])].append(int(c))
        tree.__dict__["_children_cache"] = cache
    return cache


# ---------------------------------------------------------------------- order and schedule
def _forward_order(bins: List[_Bin]) -> List[int]:
    """Depth-first order of the micro-batches' primary content (a chunk, or the first tree
    packed), so producers come before readers; small trees added later do not reorder.
    Exported heads first (other ranks wait for them), an import before the heads it receives."""
    def key(i: int):
        b = bins[i]
        first = min(a for a, _ in b.ranges) if b.role == "import" else (b.ranges[0][0] if b.ranges else math.inf)
        return (b.role != "export", first, i)

    return sorted(range(len(bins)), key=key)


def _renumber(mbs, sources, order):
    new_of = {old: new for new, old in enumerate(order)}
    out = []
    for new, old in enumerate(order):
        mb = mbs[old]
        mb.index = new
        out.append(mb)
    for src in sources.values():
        src.producer = new_of[src.producer]
        src.consumers = sorted(new_of[c] for c in src.consumers)
    for mb in out:
        mb.reads = sorted(mb.reads, key=lambda s: sources[s].last_token)
    return out, sources
