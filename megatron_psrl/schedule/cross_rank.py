"""Cross-rank placement: one tree's fragments on several ranks, prefix K/V exchanged between them.

Whole-tree placement gives every tree to one rank; a tree larger than a rank's fair share of
the step (a 64-turn step-wise trajectory, one search tree per task) then keeps the other ranks
idle. Cross-rank placement cuts the depth-first token stream of the group's trees into
fragments of equal cost and runs them in lockstep *steps* of one fragment per rank:

    stream (depth-first, all trees of the group):  | f0 | f1 | f2 | f3 | f4 | f5 | ...
    step 0:  rank 0 <- f0, rank 1 <- f1      step 1:  rank 0 <- f2, rank 1 <- f3    ...

A fragment is a contiguous depth-first range, so all its outside ancestors lie on the path to
its first token, in earlier fragments. Those path pieces (split into chains at attach and
branch points, as for mechanism 2) reach the fragment in one of three ways:

- computed by the same rank in an earlier step: the rank's KV cache (mechanism 2);
- computed by another rank in the *same* step: the per-layer exchange (*peer* chains): in
  every layer the owner sends the chain's K/V rows, the reader attends to them, and the
  exchange's backward returns dK/dV (``megatron_psrl.distributed.kv_exchange``). This is what
  lets one long sequence run on several ranks at once (context parallelism);
- computed by another rank in an *earlier* step: sent in that step's exchange and kept in the
  reader's KV cache (a *replica*); its dK/dV go back to the owner before the owner's deferred
  backward injects them.

Every tree token is computed once. Every rank of the group runs the same schedule (forward
of step m, or forward+backward, or the deferred backward of a producer step), so collectives
always match.

A tree split between groups (:mod:`megatron_psrl.schedule.group_split`) may receive the head of
its path instead of computing it (:class:`~megatron_psrl.schedule.plan.HeadSend`): the
stream then starts after the head, and the schedule with *transfer steps* that hold no
exchange: first the heads the group's first rank computes and sends (the other ranks idle),
then one step in which every rank that reads a head receives it (an ``import`` micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from megatron_psrl.schedule.plan import (
    CachedSource,
    ChainUse,
    MicroBatchSpec,
    PeerRead,
    RankPlan,
    StepExchange,
    build_schedule,
    export_head,
)
from megatron_psrl.tree.chunks import chunk_dependencies, split_chains
from megatron_psrl.tree.index import TreeIndex

TokenCost = Callable[[np.ndarray], np.ndarray]
"""Cost of computing each given tree token once (its GEMMs and its attention over its keys)."""


@dataclass
class CrossRankHeads:
    """A group's part in the step's prefix transfers (the tree tokens of its copies)."""

    imports: Dict[int, Tuple[int, int, int]] = field(default_factory=dict)
    """Top-level node of a copy -> ``(transfer, import, head length)``: the stream skips the head."""

    exports: List[Tuple[int, int, int]] = field(default_factory=list)
    """``(transfer, start, length)`` of the heads the group's first rank computes and sends
    (the home copy's head is then local on that rank, imported by the others)."""


def group_stream(index: TreeIndex, units: np.ndarray, skip: Optional[Dict[int, int]] = None
                 ) -> Tuple[np.ndarray, np.ndarray]:
    """The depth-first token stream of the trees ``units`` (ascending tree tokens) and the
    stream positions where each tree starts (plus the end). ``skip``: top-level node -> tokens
    at its start left out (a head received instead of computed)."""
    tree = index.tree
    starts = np.sort(tree.node_offset[units])
    ends = tree.node_offset[tree.node_subtree_end[index.token_node[starts]]]
    if skip:
        starts = starts + np.array([skip.get(int(index.token_node[a]), 0) for a in starts], dtype=np.int64)
    stream = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(starts, ends)]) if len(starts) \
        else np.zeros(0, np.int64)
    unit_bounds = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    return stream, unit_bounds


def equal_cost_cuts(cum: np.ndarray, num_fragments: int, unit_bounds: np.ndarray, snap: float) -> np.ndarray:
    """Fragment boundaries (stream positions, ``num_fragments + 1`` of them) cutting the
    cumulative cost ``cum`` into equal parts; a cut moves to a tree boundary (no exchange at
    all) when that changes its fragment's cost by at most ``snap`` of a fragment."""
    n = len(cum) - 1
    total = float(cum[-1])
    per = total / num_fragments
    targets = total * np.arange(1, num_fragments) / num_fragments
    cuts = np.searchsorted(cum, targets).astype(np.int64)
    interior = unit_bounds[1:-1]
    if snap > 0 and len(interior):
        j = np.clip(np.searchsorted(interior, cuts), 0, len(interior) - 1)
        for cand in (interior[j], interior[np.maximum(j - 1, 0)]):
            close = np.abs(cum[cand] - cum[cuts]) <= snap * per
            cuts = np.where(close, cand, cuts)
    cuts = np.clip(cuts, 1, n - 1)
    for i in range(1, len(cuts)):  # strictly increasing, leaving room for the rest
        cuts[i] = max(cuts[i], cuts[i - 1] + 1)
    for i in range(len(cuts) - 1, -1, -1):
        cuts[i] = min(cuts[i], n - (len(cuts) - i))
        if i + 1 < len(cuts):
            cuts[i] = min(cuts[i], cuts[i + 1] - 1)
    return np.concatenate([[0], cuts, [n]]).astype(np.int64)


def plan_group_cross_rank(
    index: TreeIndex, units: np.ndarray, budget: int, group_size: int, token_cost: TokenCost, snap: float = 0.02,
    micro_batch_cost: float = 0.0, heads: Optional[CrossRankHeads] = None,
) -> Optional[List[RankPlan]]:
    """The cross-rank plan of one exchange group (see the module docstring), or None when the
    trees have fewer tokens than the group has ranks. ``heads``: the group's prefix transfers."""
    stream, unit_bounds = group_stream(index, units, {u: h[2] for u, h in heads.imports.items()} if heads else None)
    n, g = len(stream), group_size
    if n < g:
        return None
    cost = token_cost(stream)
    cum = np.concatenate([[0.0], np.cumsum(cost)])
    num = -(-max(1, -(-n // budget)) // g) * g
    while True:
        bounds = equal_cost_cuts(cum, num, unit_bounds, snap)
        if int(np.diff(bounds).max()) <= budget:
            break
        if num + g > n:  # fragments of one token would not fit either: no cross-rank plan
            return None
        num += g
    return _build(index, stream, bounds, g, cost, micro_batch_cost, heads, budget, token_cost)


def _build(index: TreeIndex, stream: np.ndarray, bounds: np.ndarray, g: int, cost: np.ndarray,
           micro_batch_cost: float, heads: Optional[CrossRankHeads] = None, budget: int = 0,
           token_cost: Optional[TokenCost] = None) -> List[RankPlan]:
    subtree_end = index.subtree_end
    heads = heads or CrossRankHeads()
    num = len(bounds) - 1
    # Transfer steps first: the exported heads (on group rank 0, first-fit into micro-batches),
    # then one import step if any copy's head is received.
    export_bins: List[List[Tuple[int, int, int]]] = []
    for t, start, length in heads.exports:
        target = next((b for b in export_bins if sum(x[2] for x in b) + length <= budget), None)
        if target is None:
            export_bins.append([])
            target = export_bins[-1]
        target.append((t, start, length))
    export_step = {t: m for m, b in enumerate(export_bins) for t, _, _ in b}
    local = {u for u, (t, j, _) in heads.imports.items() if j == 0 and t in export_step}
    import_step = len(export_bins) if heads.imports else None
    first_step = len(export_bins) + (1 if heads.imports else 0)
    steps = num // g + first_step
    rank_of = np.arange(num) % g
    step_of = np.arange(num) // g + first_step

    # What every fragment needs from earlier fragments or heads (all on the path to its first
    # token): the heads are chunks of the stream too, ahead of their trees' fragments.
    tree = index.tree
    head_chunks = {}  # first token -> (unit, transfer, import, length)
    for u, (t, j, length) in heads.imports.items():
        a = int(tree.node_offset[u])
        head_chunks[a] = (u, t, j, length)
    # A fragment that runs into a tree whose head it does not hold has outside ancestors that
    # are not on the path to its first token: dependencies are found per tree piece of it.
    pieces = []  # (first token, ("fragment", f), tokens)
    starts = np.sort(np.asarray(list(head_chunks), dtype=np.int64))
    for f in range(num):
        c = stream[bounds[f]:bounds[f + 1]]
        cut = np.flatnonzero(np.diff(np.searchsorted(starts, c, side="right"))) + 1 if len(starts) else []
        for part in np.split(c, cut):
            pieces.append((int(part[0]), ("fragment", f), part))
    chunks = sorted([(a, k, part) for a, k, part in pieces]
                    + [(a, ("head", a), np.arange(a, a + head_chunks[a][3], dtype=np.int64)) for a in head_chunks],
                    key=lambda x: x[0])
    deps = chunk_dependencies(index, [part for _, _, part in chunks])
    chunks = [(a, k) for a, k, _ in chunks]
    first = np.array([a for a, _ in chunks], dtype=np.int64)
    kind_of = [k for _, k in chunks]
    fragment_at = np.array([k[1] if k[0] == "fragment" else -1 for k in kind_of], dtype=np.int64)

    def spec(m: int, r: int) -> MicroBatchSpec:
        if m < len(export_bins):
            if r == 0:
                tok = np.concatenate([np.arange(a, a + n, dtype=np.int64) for _, a, n in export_bins[m]])
                return MicroBatchSpec(index=m, tokens=tok, owned=np.ones(len(tok), bool))
            return MicroBatchSpec(index=m, tokens=np.zeros(0, np.int64), owned=np.zeros(0, bool), role="idle")
        if m == import_step:  # becomes an import where the rank receives a head
            return MicroBatchSpec(index=m, tokens=np.zeros(0, np.int64), owned=np.zeros(0, bool), role="idle")
        f = (m - first_step) * g + r
        return MicroBatchSpec(index=m, tokens=stream[bounds[f]:bounds[f + 1]].copy(),
                              owned=np.ones(int(bounds[f + 1] - bounds[f]), bool))

    mbs = [[spec(m, r) for m in range(steps)] for r in range(g)]
    sources: List[Dict[int, CachedSource]] = [{} for _ in range(g)]
    exchanges = [[StepExchange() for _ in range(steps)] for _ in range(g)]
    readers: Dict[int, set] = {}  # producer step -> steps reading its sources (any rank)
    imported: Dict[Tuple[int, int, int], Tuple[int, int]] = {}  # (rank, transfer, import) -> the head received

    def new_source(r: int, **kw) -> CachedSource:
        src = CachedSource(source_id=len(sources[r]), **kw)
        sources[r][src.source_id] = src
        return src

    for p in range(len(chunks)):
        if kind_of[p][0] == "head":
            _link_head(index, deps, p, first, fragment_at, rank_of, step_of, head_chunks[kind_of[p][1]], local,
                       export_step, import_step, mbs, new_source, readers, imported)
            continue
        fp = kind_of[p][1]
        q, mp = int(rank_of[fp]), int(step_of[fp])
        if p in deps.remote:
            mb = mbs[q][mp]
            mb.remote_targets = np.concatenate([mb.remote_targets, deps.remote[p]])
        if p not in deps.needed:
            continue
        for chain in split_chains(index, deps.needed[p], deps.attach[p]):
            last = int(chain[-1])
            consumers = _reading_fragments(p, last, first, subtree_end, fragment_at)
            local_steps = sorted(int(step_of[f]) for f in consumers if rank_of[f] == q)
            by_rank: Dict[int, List[int]] = {}
            for f in consumers:
                if rank_of[f] != q:
                    by_rank.setdefault(int(rank_of[f]), []).append(int(step_of[f]))
            owner = None
            if local_steps or any(st > mp for steps_r in by_rank.values() for st in steps_r):
                owner = new_source(q, producer=mp, tokens=chain, consumers=local_steps,
                                   kinds=("k", "v", "gk", "gv") if local_steps else ("gk", "gv"))
                mbs[q][mp].produces.append(owner.source_id)
                for st in local_steps:
                    mbs[q][st].reads.append(owner.source_id)
                readers.setdefault(mp, set()).update(local_steps)
            for r in sorted(by_rank):
                later_steps = sorted(st for st in by_rank[r] if st > mp)
                use = ChainUse(length=len(chain))
                if mp in by_rank[r]:
                    use.peer = len(mbs[r][mp].peer_reads)
                    mbs[r][mp].peer_reads.append(PeerRead(src_rank=q, length=len(chain), last_token=last))
                if later_steps:
                    replica = new_source(r, producer=mp, tokens=chain, consumers=later_steps,
                                         replica_of=(q, owner.source_id))
                    use.replica = replica.source_id
                    mbs[r][mp].produces.append(replica.source_id)
                    for st in later_steps:
                        mbs[r][st].reads.append(replica.source_id)
                    exchanges[r][mp].grad_send.setdefault(q, []).append(replica.source_id)
                    exchanges[q][mp].grad_recv.setdefault(r, []).append(owner.source_id)
                    readers.setdefault(mp, set()).update(later_steps)
                exchanges[q][mp].send.setdefault(r, []).append(chain)
                exchanges[r][mp].recv.setdefault(q, []).append(use)

    for m, b in enumerate(export_bins):  # rank 0's exported sources, and the log-prob of each head's next token
        for t, start, length in b:
            export_head(mbs[0][m], sources[0], len(sources[0]), m, t, start, length)
    for r, (start, length) in imported.items():  # an import micro-batch receives the whole head of every copy it reads
        mb = mbs[r[0]][import_step]
        mb.role = "import"
        mb.tokens = np.union1d(mb.tokens, np.arange(start, start + length, dtype=np.int64)).astype(np.int64)
        mb.owned = np.zeros(len(mb.tokens), bool)

    # One schedule for the whole group: a step whose sources anyone reads later defers its
    # backward (on every rank) until all those readers are done; exported heads' backwards
    # close it (their readers in other groups return the gradients when they are done).
    pseudo = {i: CachedSource(source_id=i, producer=m, tokens=np.zeros(1, np.int64), consumers=sorted(rs))
              for i, (m, rs) in enumerate(sorted(readers.items())) if rs}
    schedule = build_schedule(mbs[0], pseudo, last=list(range(len(export_bins))))
    fragment_cost = np.array([cost[bounds[f]:bounds[f + 1]].sum() for f in range(num)])
    export_cost = float(sum(token_cost(mbs[0][m].tokens).sum() for m in range(len(export_bins))))
    plans = []
    forward = [any(exchanges[x][m].send for x in range(g)) for m in range(steps)]
    backward = [any(exchanges[x][m].grad_send for x in range(g)) for m in range(steps)]
    for r in range(g):
        for m in range(steps):
            ex = exchanges[r][m]
            ex.forward_collective, ex.backward_collective = forward[m], backward[m]
            mbs[r][m].exchange = ex if (forward[m] or backward[m]) else None
            srcs = sources[r]
            mbs[r][m].reads = sorted(set(mbs[r][m].reads), key=lambda s: srcs[s].last_token)
        extra = export_cost if r == 0 else 0.0
        plans.append(RankPlan(micro_batches=mbs[r], sources=sources[r], schedule=list(schedule),
                              planned_cost=float(fragment_cost[r::g].sum()) + extra + micro_batch_cost * steps,
                              group_rank=r, cross_rank=True))
    return plans


def _link_head(index: TreeIndex, deps, p: int, first: np.ndarray, fragment_at: np.ndarray, rank_of: np.ndarray,
               step_of: np.ndarray, head, local: set, export_step: Dict[int, int], import_step: Optional[int],
               mbs, new_source, readers: Dict[int, set], imported: Dict) -> None:
    """The sources a head chunk gives the fragments that read it: on the home rank the home
    copy's head is local (made by its export step); every other reading rank imports it."""
    u, t, j, length = head
    if p not in deps.needed:
        return
    for chain in split_chains(index, deps.needed[p], deps.attach[p]):
        by_rank: Dict[int, List[int]] = {}
        for f in _reading_fragments(p, int(chain[-1]), first, index.subtree_end, fragment_at):
            by_rank.setdefault(int(rank_of[f]), []).append(int(step_of[f]))
        for r, steps in sorted(by_rank.items()):
            steps = sorted(steps)
            if r == 0 and u in local:
                producer, kw = export_step[t], {}
            else:
                producer, kw = import_step, {"imported": (t, j)}
                imported[(r, t, j)] = (int(index.tree.node_offset[u]), length)
            src = new_source(r, producer=producer, tokens=chain, consumers=steps, **kw)
            mbs[r][producer].produces.append(src.source_id)
            for st in steps:
                mbs[r][st].reads.append(src.source_id)
            readers.setdefault(producer, set()).update(steps)


def _reading_fragments(p: int, last: int, first: np.ndarray, subtree_end: np.ndarray,
                       fragment_at: np.ndarray) -> List[int]:
    """The fragments whose chunks after chunk ``p`` (in token order) descend from tree token
    ``last``: those that read a chain ending there."""
    later = p + 1 + np.flatnonzero((first[p + 1:] > last) & (first[p + 1:] < subtree_end[last]))
    return [int(fragment_at[c]) for c in later if fragment_at[c] >= 0]


def step_costs(plans: List[RankPlan], token_cost: TokenCost) -> np.ndarray:
    """``[steps, ranks]`` cost of every rank's fragment in every step of a cross-rank plan."""
    return np.array([[float(token_cost(mb.computed_tokens).sum()) for mb in p.micro_batches] for p in plans]).T


def exchange_tokens(plans: List[RankPlan]) -> int:
    """Tokens of prefix K/V sent between ranks in the forward of a cross-rank plan (each layer
    sends them once; replica gradients travel back once more)."""
    return int(sum(len(c) for p in plans for mb in p.micro_batches if mb.exchange
                   for chains in mb.exchange.send.values() for c in chains))
