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
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from megatron_psrl.tree.chunks import chunk_dependencies, split_chains
from megatron_psrl.tree.packing import TreeIndex
from megatron_psrl.tree.plan import (
    CachedSource,
    ChainUse,
    MicroBatchSpec,
    PeerRead,
    RankPlan,
    StepExchange,
    build_schedule,
)

TokenCost = Callable[[np.ndarray], np.ndarray]
"""Cost of computing each given tree token once (its GEMMs and its attention over its keys)."""


def group_stream(index: TreeIndex, units: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The depth-first token stream of the trees ``units`` (ascending tree tokens) and the
    stream positions where each tree starts (plus the end)."""
    tree = index.tree
    starts = np.sort(tree.node_offset[units])
    ends = tree.node_offset[tree.node_subtree_end[index.token_node[starts]]]
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
    micro_batch_cost: float = 0.0,
) -> Optional[List[RankPlan]]:
    """The cross-rank plan of one exchange group (see the module docstring), or None when the
    trees have fewer tokens than the group has ranks."""
    stream, unit_bounds = group_stream(index, units)
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
    return _build(index, stream, bounds, g, cost, micro_batch_cost)


def _build(index: TreeIndex, stream: np.ndarray, bounds: np.ndarray, g: int, cost: np.ndarray,
           micro_batch_cost: float) -> List[RankPlan]:
    subtree_end = index.subtree_end
    num = len(bounds) - 1
    steps = num // g
    rank_of = np.arange(num) % g
    step_of = np.arange(num) // g
    first = stream[bounds[:-1]]

    # What every fragment needs from earlier fragments (all on the path to its first token).
    deps = chunk_dependencies(index, [stream[bounds[f]:bounds[f + 1]] for f in range(num)])

    mbs = [[MicroBatchSpec(index=m, tokens=stream[bounds[m * g + r]:bounds[m * g + r + 1]].copy(),
                           owned=np.ones(int(bounds[m * g + r + 1] - bounds[m * g + r]), bool))
            for m in range(steps)] for r in range(g)]
    sources: List[Dict[int, CachedSource]] = [{} for _ in range(g)]
    exchanges = [[StepExchange() for _ in range(steps)] for _ in range(g)]
    readers: Dict[int, set] = {}  # producer step -> steps reading its sources (any rank)

    def new_source(r: int, **kw) -> CachedSource:
        src = CachedSource(source_id=len(sources[r]), **kw)
        sources[r][src.source_id] = src
        return src

    for p in range(num):
        q, mp = int(rank_of[p]), int(step_of[p])
        if p in deps.remote:
            mb = mbs[q][mp]
            mb.remote_targets = np.concatenate([mb.remote_targets, deps.remote[p]])
        if p not in deps.needed:
            continue
        for chain in split_chains(index, deps.needed[p], deps.attach[p]):
            last = int(chain[-1])
            later_firsts = first[p + 1:]
            consumers = (p + 1 + np.flatnonzero((later_firsts > last) & (later_firsts < subtree_end[last]))).tolist()
            local = sorted(int(step_of[f]) for f in consumers if rank_of[f] == q)
            by_rank: Dict[int, List[int]] = {}
            for f in consumers:
                if rank_of[f] != q:
                    by_rank.setdefault(int(rank_of[f]), []).append(int(step_of[f]))
            owner = None
            if local or any(s > mp for steps_r in by_rank.values() for s in steps_r):
                owner = new_source(q, producer=mp, tokens=chain, consumers=local,
                                   kinds=("k", "v", "gk", "gv") if local else ("gk", "gv"))
                mbs[q][mp].produces.append(owner.source_id)
                for s in local:
                    mbs[q][s].reads.append(owner.source_id)
                readers.setdefault(mp, set()).update(local)
            for r in sorted(by_rank):
                later = sorted(s for s in by_rank[r] if s > mp)
                use = ChainUse(length=len(chain))
                if mp in by_rank[r]:
                    use.peer = len(mbs[r][mp].peer_reads)
                    mbs[r][mp].peer_reads.append(PeerRead(src_rank=q, length=len(chain), last_token=last))
                if later:
                    replica = new_source(r, producer=mp, tokens=chain, consumers=later, replica_of=(q, owner.source_id))
                    use.replica = replica.source_id
                    mbs[r][mp].produces.append(replica.source_id)
                    for s in later:
                        mbs[r][s].reads.append(replica.source_id)
                    exchanges[r][mp].grad_send.setdefault(q, []).append(replica.source_id)
                    exchanges[q][mp].grad_recv.setdefault(r, []).append(owner.source_id)
                    readers.setdefault(mp, set()).update(later)
                exchanges[q][mp].send.setdefault(r, []).append(chain)
                exchanges[r][mp].recv.setdefault(q, []).append(use)

    # One schedule for the whole group: a step whose sources anyone reads later defers its
    # backward (on every rank) until all those readers are done.
    pseudo = {i: CachedSource(source_id=i, producer=m, tokens=np.zeros(1, np.int64), consumers=sorted(rs))
              for i, (m, rs) in enumerate(sorted(readers.items())) if rs}
    schedule = build_schedule(mbs[0], pseudo)
    fragment_cost = np.array([cost[bounds[f]:bounds[f + 1]].sum() for f in range(num)])
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
        plans.append(RankPlan(micro_batches=mbs[r], sources=sources[r], schedule=list(schedule),
                              planned_cost=float(fragment_cost[r::g].sum()) + micro_batch_cost * steps,
                              group_rank=r, cross_rank=True))
    return plans


def step_costs(plans: List[RankPlan], token_cost: TokenCost) -> np.ndarray:
    """``[steps, ranks]`` cost of every rank's fragment in every step of a cross-rank plan."""
    return np.array([[float(token_cost(mb.tokens).sum()) for mb in p.micro_batches] for p in plans]).T


def exchange_tokens(plans: List[RankPlan]) -> int:
    """Tokens of prefix K/V sent between ranks in the forward of a cross-rank plan (each layer
    sends them once; replica gradients travel back once more)."""
    return int(sum(len(c) for p in plans for mb in p.micro_batches if mb.exchange
                   for chains in mb.exchange.send.values() for c in chains))
