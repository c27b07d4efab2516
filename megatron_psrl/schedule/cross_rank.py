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

from megatron_psrl.kvcache.prefix_state import ALL_ROLES, GRADS_ONLY
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
    """A group's part in the step's head sends (the tree tokens of its copies)."""

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
    trees have fewer tokens than the group has ranks. ``heads``: the group's head sends."""
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
    """Every rank's plan from the group's fragments ``stream[bounds[f]:bounds[f + 1]]``."""
    build = _GroupBuild(index, stream, bounds, g, heads or CrossRankHeads(), budget)
    build.link()
    build.finish_transfers()
    schedule = build.schedule()
    fragment_cost = np.array([cost[bounds[f]:bounds[f + 1]].sum() for f in range(build.num)])
    export_cost = float(sum(token_cost(build.mbs[0][m].tokens).sum() for m in range(len(build.export_bins))))
    return [RankPlan(micro_batches=build.mbs[r], sources=build.sources[r], schedule=list(schedule),
                     planned_cost=float(fragment_cost[r::g].sum()) + (export_cost if r == 0 else 0.0)
                     + micro_batch_cost * build.steps, group_rank=r, cross_rank=True)
            for r in range(g)]


class _GroupBuild:
    """One group's cross-rank plan under construction: every rank's micro-batches (one per
    lockstep step), cached sources, exchanges, and the steps that read each producer step."""

    def __init__(self, index: TreeIndex, stream: np.ndarray, bounds: np.ndarray, g: int, heads: CrossRankHeads,
                 budget: int):
        self.index, self.stream, self.bounds, self.g, self.heads = index, stream, bounds, g, heads
        self.num = len(bounds) - 1
        self._transfer_steps(budget)
        self.rank_of = np.arange(self.num) % g
        self.step_of = np.arange(self.num) // g + self.first_step
        self._chunks()
        self.mbs = [[self._spec(m, r) for m in range(self.steps)] for r in range(g)]
        self.sources: List[Dict[int, CachedSource]] = [{} for _ in range(g)]
        self.exchanges = [[StepExchange() for _ in range(self.steps)] for _ in range(g)]
        self.readers: Dict[int, set] = {}  # producer step -> steps reading its sources (any rank)
        self.imported: Dict[Tuple[int, int, int], Tuple[int, int]] = {}  # (rank, transfer, import) -> head received

    def _transfer_steps(self, budget: int) -> None:
        """Transfer steps first: the exported heads (on group rank 0, first-fit into micro-batches),
        then one import step if any copy's head is received."""
        heads = self.heads
        self.export_bins: List[List[Tuple[int, int, int]]] = []
        for t, start, length in heads.exports:
            target = next((b for b in self.export_bins if sum(x[2] for x in b) + length <= budget), None)
            if target is None:
                self.export_bins.append([])
                target = self.export_bins[-1]
            target.append((t, start, length))
        self.export_step = {t: m for m, b in enumerate(self.export_bins) for t, _, _ in b}
        self.local = {u for u, (t, j, _) in heads.imports.items() if j == 0 and t in self.export_step}
        self.import_step = len(self.export_bins) if heads.imports else None
        self.first_step = len(self.export_bins) + (1 if heads.imports else 0)
        self.steps = self.num // self.g + self.first_step

    def _chunks(self) -> None:
        """What every fragment needs from earlier fragments or heads (all on the path to its first
        token): the heads are chunks of the stream too, ahead of their trees' fragments. A
        fragment that runs into a tree whose head it does not hold has outside ancestors that are
        not on the path to its first token: dependencies are found per tree piece of it."""
        tree, stream, bounds = self.index.tree, self.stream, self.bounds
        self.head_chunks = {int(tree.node_offset[u]): (u, t, j, length)  # first token -> (unit, transfer, import, length)
                            for u, (t, j, length) in self.heads.imports.items()}
        pieces = []  # (first token, ("fragment", f), tokens)
        starts = np.sort(np.asarray(list(self.head_chunks), dtype=np.int64))
        for f in range(self.num):
            c = stream[bounds[f]:bounds[f + 1]]
            cut = np.flatnonzero(np.diff(np.searchsorted(starts, c, side="right"))) + 1 if len(starts) else []
            for part in np.split(c, cut):
                pieces.append((int(part[0]), ("fragment", f), part))
        chunks = sorted(pieces + [(a, ("head", a), np.arange(a, a + h[3], dtype=np.int64))
                                  for a, h in self.head_chunks.items()], key=lambda x: x[0])
        self.deps = chunk_dependencies(self.index, [part for _, _, part in chunks])
        self.first = np.array([a for a, _, _ in chunks], dtype=np.int64)
        self.kind_of = [k for _, k, _ in chunks]
        self.fragment_at = np.array([k[1] if k[0] == "fragment" else -1 for k in self.kind_of], dtype=np.int64)

    def _spec(self, m: int, r: int) -> MicroBatchSpec:
        idle = dict(tokens=np.zeros(0, np.int64), owned=np.zeros(0, bool), role="idle")
        if m < len(self.export_bins):
            if r == 0:
                tok = np.concatenate([np.arange(a, a + n, dtype=np.int64) for _, a, n in self.export_bins[m]])
                return MicroBatchSpec(index=m, tokens=tok, owned=np.ones(len(tok), bool))
            return MicroBatchSpec(index=m, **idle)
        if m == self.import_step:  # becomes an import where the rank receives a head
            return MicroBatchSpec(index=m, **idle)
        f = (m - self.first_step) * self.g + r
        lo, hi = self.bounds[f], self.bounds[f + 1]
        return MicroBatchSpec(index=m, tokens=self.stream[lo:hi].copy(), owned=np.ones(int(hi - lo), bool))

    def new_source(self, r: int, **kw) -> CachedSource:
        src = CachedSource(source_id=len(self.sources[r]), **kw)
        self.sources[r][src.source_id] = src
        return src

    def _read(self, r: int, src: CachedSource, steps: List[int]) -> None:
        """``src`` (on rank ``r``, made by its producer step) read by ``steps`` of that rank."""
        self.mbs[r][src.producer].produces.append(src.source_id)
        for st in steps:
            self.mbs[r][st].reads.append(src.source_id)
        self.readers.setdefault(src.producer, set()).update(steps)

    def link(self) -> None:
        """Every chunk's chains to the fragments that read them: cached sources, replicas and
        peer reads (fragments), or local / imported sources (heads)."""
        deps = self.deps
        for p, kind in enumerate(self.kind_of):
            if kind[0] == "head":
                self._link_head(p, self.head_chunks[kind[1]])
                continue
            q, mp = int(self.rank_of[kind[1]]), int(self.step_of[kind[1]])
            if p in deps.remote:
                mb = self.mbs[q][mp]
                mb.remote_targets = np.concatenate([mb.remote_targets, deps.remote[p]])
            if p in deps.needed:
                for chain in split_chains(self.index, deps.needed[p], deps.attach[p]):
                    self._link_chain(p, chain, q, mp)

    def _link_chain(self, p: int, chain: np.ndarray, q: int, mp: int) -> None:
        """A chain of fragment ``p`` (rank ``q``, step ``mp``) to its readers: a cached source on
        its rank; on other ranks, peer rows in the same step and replicas for later steps."""
        last = int(chain[-1])
        consumers = _reading_fragments(p, last, self.first, self.index.subtree_end, self.fragment_at)
        local_steps = sorted(int(self.step_of[f]) for f in consumers if self.rank_of[f] == q)
        by_rank: Dict[int, List[int]] = {}
        for f in consumers:
            if self.rank_of[f] != q:
                by_rank.setdefault(int(self.rank_of[f]), []).append(int(self.step_of[f]))
        owner = None
        if local_steps or any(st > mp for steps_r in by_rank.values() for st in steps_r):
            owner = self.new_source(q, producer=mp, tokens=chain, consumers=local_steps,
                                    kinds=ALL_ROLES if local_steps else GRADS_ONLY)
            self._read(q, owner, local_steps)
        for r in sorted(by_rank):
            later_steps = sorted(st for st in by_rank[r] if st > mp)
            use = ChainUse(length=len(chain))
            if mp in by_rank[r]:
                use.peer = len(self.mbs[r][mp].peer_reads)
                if r not in self.exchanges[q][mp].reads_now:
                    self.exchanges[q][mp].reads_now.append(r)
                self.mbs[r][mp].peer_reads.append(PeerRead(src_rank=q, length=len(chain), last_token=last))
            if later_steps:
                replica = self.new_source(r, producer=mp, tokens=chain, consumers=later_steps,
                                          replica_of=(q, owner.source_id))
                use.replica = replica.source_id
                self._read(r, replica, later_steps)
                self.exchanges[r][mp].grad_send.setdefault(q, []).append(replica.source_id)
                self.exchanges[q][mp].grad_recv.setdefault(r, []).append(owner.source_id)
            self.exchanges[q][mp].send.setdefault(r, []).append(chain)
            self.exchanges[r][mp].recv.setdefault(q, []).append(use)

    def _link_head(self, p: int, head) -> None:
        """The sources a head chunk gives the fragments that read it: on the home rank the home
        copy's head is local (made by its export step); every other reading rank imports it."""
        u, t, j, length = head
        if p not in self.deps.needed:
            return
        for chain in split_chains(self.index, self.deps.needed[p], self.deps.attach[p]):
            by_rank: Dict[int, List[int]] = {}
            for f in _reading_fragments(p, int(chain[-1]), self.first, self.index.subtree_end, self.fragment_at):
                by_rank.setdefault(int(self.rank_of[f]), []).append(int(self.step_of[f]))
            for r, steps in sorted(by_rank.items()):
                if r == 0 and u in self.local:
                    producer, kw = self.export_step[t], {}
                else:
                    producer, kw = self.import_step, {"imported": (t, j)}
                    self.imported[(r, t, j)] = (int(self.index.tree.node_offset[u]), length)
                src = self.new_source(r, producer=producer, tokens=chain, consumers=sorted(steps), **kw)
                self._read(r, src, sorted(steps))

    def finish_transfers(self) -> None:
        """Rank 0's exported sources (and the log-prob of each head's next token); an import
        micro-batch receives the whole head of every copy it reads."""
        for m, b in enumerate(self.export_bins):
            for t, start, length in b:
                export_head(self.mbs[0][m], self.sources[0], len(self.sources[0]), m, t, start, length)
        for r, (start, length) in self.imported.items():
            mb = self.mbs[r[0]][self.import_step]
            mb.role = "import"
            mb.tokens = np.union1d(mb.tokens, np.arange(start, start + length, dtype=np.int64)).astype(np.int64)
            mb.owned = np.zeros(len(mb.tokens), bool)

    def schedule(self) -> List[Tuple[str, int]]:
        """One schedule for the whole group: a step whose sources anyone reads later defers its
        backward (on every rank) until all those readers are done; exported heads' backwards
        close it (their readers in other groups return the gradients when they are done). Every
        rank's micro-batches get the step's exchange and their reads in prefix order."""
        pseudo = {i: CachedSource(source_id=i, producer=m, tokens=np.zeros(1, np.int64), consumers=sorted(rs))
                  for i, (m, rs) in enumerate(sorted(self.readers.items())) if rs}
        schedule = build_schedule(self.mbs[0], pseudo, last=list(range(len(self.export_bins))))
        g, steps, exchanges = self.g, self.steps, self.exchanges
        forward = [any(exchanges[x][m].send for x in range(g)) for m in range(steps)]
        backward = [any(exchanges[x][m].grad_send for x in range(g)) for m in range(steps)]
        for r in range(g):
            srcs = self.sources[r]
            for m in range(steps):
                ex = exchanges[r][m]
                ex.forward_collective, ex.backward_collective = forward[m], backward[m]
                self.mbs[r][m].exchange = ex if (forward[m] or backward[m]) else None
                self.mbs[r][m].reads = sorted(set(self.mbs[r][m].reads), key=lambda s: srcs[s].last_token)
        return schedule


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
