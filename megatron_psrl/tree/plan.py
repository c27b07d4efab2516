"""The step plan: what every data-parallel rank computes in an update step, and in which order.

The planners (:mod:`megatron_psrl.tree.planner` for whole trees, :mod:`megatron_psrl.tree.cross_rank`
for one tree's fragments on several ranks) make a :class:`StepPlan`; the KV memory plan
(:mod:`megatron_psrl.kvcache.memory_plan`) and the step runner (:mod:`megatron_psrl.engine.step`)
consume it. This module holds the plan's data types, the forward/backward schedule builder
(:func:`build_schedule`) and the plan's invariants (:func:`check_plan`):

- every tree token is owned (computed as a trained row) exactly once over all ranks, and every
  log-prob target (a token with a predecessor), so every loss claim, is computed exactly once;
- every micro-batch fits the token budget and sees exactly its ancestors: in the micro-batch,
  in the cached sources it reads, or in the peer chains of its exchange step;
- every cached source is computed (or received) by its producer before any reader runs forward,
  and every reader's backward runs before the producer's (the readers' dK/dV are accumulated
  in the KV cache and injected into the producer's backward);
- every rank's schedule runs each micro-batch's forward and backward exactly once, forwards in
  micro-batch order;
- inside a cross-rank group every rank runs the same schedule, and every exchange matches on
  both sides: what one rank sends the other receives (same chains, same lengths, put to the
  use the receiver's plan names), and replica gradients go back to the source they copy;
- a prefix head sent between ranks (:class:`PrefixTransfer`, a tree split between exchange
  groups) is computed once, by its home rank, into one exported source; every source imported
  from it lies inside the head of the copy that reads it, and on every rank the forwards of
  exported heads come before any import, the backwards of imports before any exported head's
  (so no rank waits for another that waits for it).

Whether the KV cache holds the plan is the memory plan's business: ``plan_memory`` raises
:class:`~megatron_psrl.kvcache.CacheBudgetError` when no decision fits ``--kv-cache-budget``.

The planners check every plan they make when the environment variable ``PSRL_CHECK_PLANS``
is ``1`` (the test suite sets it): :func:`maybe_check_plan`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_psrl.errors import PsrlError
from megatron_psrl.tree.packing import ExternalSource, PackedMicroBatch, TreeIndex, pack_tokens
from megatron_psrl.tree.prefix_tree import PrefixTree


class PlanningError(PsrlError, ValueError):
    """The batch cannot be planned under the given budgets."""


class PlanInvariantError(AssertionError):
    """A step plan breaks one of its invariants (:func:`check_plan`).

    A planner bug, not a problem of the input: not a :class:`~megatron_psrl.errors.PsrlError`,
    so the entry points print its traceback."""


@dataclass
class CachedSource:
    """A chain of tree tokens whose K/V one micro-batch produces for later ones."""

    source_id: int
    """Rank-local id (the KV cache's key)."""

    producer: int
    """Micro-batch computing the tokens."""

    tokens: np.ndarray
    """int64 tree tokens of the chain (ascending; each the predecessor of the next)."""

    consumers: List[int] = field(default_factory=list)
    """Micro-batches that read the source (attend to its K/V)."""

    replica_of: Optional[Tuple[int, int]] = None
    """Cross-rank: ``(owner rank, owner's source id)`` when this is a copy of another rank's
    prefix, received at ``producer`` (the owner's step) and read here later; its gradients go
    back to the owner before the owner's deferred backward. None: this rank computes it."""

    kinds: Tuple[str, ...] = ("k", "v", "gk", "gv")
    """Cache blocks it needs: an owner whose prefix only other ranks read keeps dK/dV only."""

    exported: Optional[int] = None
    """Prefix transfer (index in ``StepPlan.transfers``) whose head this is, on the home rank:
    after the producer's forward its K/V go to the ranks that import the head; their dK/dV
    come back and are added before the producer's backward."""

    imported: Optional[Tuple[int, int]] = None
    """``(transfer, import)``: K/V received from the transfer's home rank by ``producer`` (an
    ``import`` micro-batch) instead of computed; its dK/dV go back in that micro-batch's backward."""

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def last_token(self) -> int:
        return int(self.tokens[-1])


@dataclass
class MicroBatchSpec:
    """One micro-batch of a rank: the input of :func:`pack_tokens`, plus dependencies."""

    index: int
    """Position in the rank's list."""

    tokens: np.ndarray
    """int64 sorted tree tokens."""

    owned: np.ndarray
    """bool, aligned with ``tokens``: claims and log-probs belong here (False = duplicate)."""

    reads: List[int] = field(default_factory=list)
    """Sources this micro-batch attends to (outermost first)."""

    produces: List[int] = field(default_factory=list)
    """Sources this micro-batch computes for later micro-batches."""

    remote_targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Tree tokens in later micro-batches whose predecessor is here (their log-prob is
    computed here)."""

    peer_reads: List["PeerRead"] = field(default_factory=list)
    """Cross-rank: prefix chains other ranks compute in this same step, attended to through the
    per-layer exchange (after ``reads`` in the attention plan's external sources)."""

    exchange: Optional["StepExchange"] = None
    """Cross-rank: what this rank sends and receives in this step (None: no exchange)."""

    role: Optional[str] = None
    """None: runs the model. ``import``: runs no model; receives the K/V of prefix heads that
    other ranks compute (:class:`PrefixTransfer`) into the sources it produces (its tokens, none
    owned), and sends their dK/dV back in its backward. ``idle``: nothing (a rank of a
    cross-rank group in a transfer step that is not its own)."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def computes(self) -> bool:
        """The model runs on this micro-batch (not an ``import`` or ``idle`` one)."""
        return self.role is None

    @property
    def computed_tokens(self) -> np.ndarray:
        """The tokens the model runs on here (none for a transfer role)."""
        return self.tokens if self.role is None else self.tokens[:0]


@dataclass
class PeerRead:
    """A prefix chain computed by another rank in the same step (cross-rank)."""

    src_rank: int
    """The rank (in the exchange group) that computes it."""

    length: int
    """Tokens in the chain."""

    last_token: int
    """Tree index of its last token: pack tokens descending from it see all of it."""


@dataclass
class ChainUse:
    """What a receiver does with one chain it receives in an exchange step."""

    length: int
    """Rows of the chain (received in order)."""

    peer: Optional[int] = None
    """Index in the step's ``peer_reads`` if the receiver attends to it in this step."""

    replica: Optional[int] = None
    """Source id of the receiver's replica to store it in, if read in later steps."""


@dataclass
class StepExchange:
    """One rank's transfers in one cross-rank step (all ranks of the group know all of them).

    Forward (every layer): ``send[dst]`` chains of this rank's fragment go to ``dst``;
    ``recv[src]`` says what each chain received from ``src`` is for. Deferred backward of the
    step: ``grad_send[owner]`` replica source ids whose dK/dV go back to ``owner``;
    ``grad_recv[src]`` this rank's source ids that ``src`` returns gradients for, in order."""

    send: Dict[int, List[np.ndarray]] = field(default_factory=dict)
    recv: Dict[int, List[ChainUse]] = field(default_factory=dict)
    grad_send: Dict[int, List[int]] = field(default_factory=dict)
    grad_recv: Dict[int, List[int]] = field(default_factory=dict)
    forward_collective: bool = False
    """Some rank of the group sends K/V in this step: every rank takes part, per layer."""

    backward_collective: bool = False
    """Some rank returns replica gradients at this step's backward: every rank takes part."""

    def send_counts(self, group_size: int) -> List[int]:
        return [int(sum(len(c) for c in self.send.get(r, []))) for r in range(group_size)]

    def recv_counts(self, group_size: int) -> List[int]:
        return [int(sum(u.length for u in self.recv.get(r, []))) for r in range(group_size)]


@dataclass
class HeadImport:
    """One copy of a split tree that receives the tree's head (:class:`PrefixTransfer`)."""

    group: int
    """Exchange group holding the copy. Each of its ranks but the home rank tells the home
    whether it imports the head (it does when a micro-batch of its own reads it)."""

    start: int
    """Tree token at position 0 of the copy: its tokens ``start .. start + length - 1`` are the
    head (position i mirrors row i of the export)."""

    length: int
    """Head tokens imported (at most the export's)."""

    def tokens(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.length, dtype=np.int64)


@dataclass
class PrefixTransfer:
    """The head of a tree split between exchange groups, computed once and sent, not recomputed.

    Splitting a tree gives every group that holds a part its own copy of the shared root path
    (:mod:`megatron_psrl.tree.hierarchical`). For a transferred head, the home rank
    (:attr:`home_rank`) computes the first ``length`` tokens of its copy in an
    *exported* source, and every other rank whose micro-batches read the head of a copy (the
    home copy's other ranks included) receives their K/V (all layers) instead of computing
    them; the readers' dK/dV go back to the home rank, which adds them before the exported
    source's backward. The loss claims (and log-probs) of an importing copy's head tokens, and of
    the token after it, were moved to the home copy's tokens (they predict the same tokens from
    the same prefix), since the importer has no hidden states there."""

    home_rank: int
    """Placement rank that computes and sends the head: the first rank of the home copy's group,
    or, where that group places trees whole, the rank holding the home copy."""

    start: int
    """Tree token at position 0 of the home copy (the export is ``start .. start + length - 1``)."""

    length: int
    """Tokens of the exported head (the longest imported one)."""

    imports: List[HeadImport] = field(default_factory=list)
    """Every copy that receives the head (the home copy first, for its group's other ranks)."""

    def tokens(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.length, dtype=np.int64)

    def aliases(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(copy tokens, home tokens)``: the tokens of other copies whose log-probs the home copy
        computes (positions 1 .. length of each importing copy: its head and the token after)."""
        pairs = [(np.arange(h.start + 1, h.start + h.length + 1), np.arange(self.start + 1, self.start + h.length + 1))
                 for h in self.imports if h.start != self.start]
        if not pairs:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return (np.concatenate([p[0] for p in pairs]).astype(np.int64),
                np.concatenate([p[1] for p in pairs]).astype(np.int64))


def export_head(mb: "MicroBatchSpec", sources: Dict[int, "CachedSource"], source_id: int, producer: int,
                transfer: int, start: int, length: int, predicts_next: bool = True) -> "CachedSource":
    """Make micro-batch ``producer`` (``mb``) export the head ``start .. start + length - 1`` of
    ``transfer`` as source ``source_id``; with ``predicts_next`` it also computes the log-prob of
    the token after the head, which no rank that receives the head can (its predecessor's hidden
    state is here only)."""
    src = CachedSource(source_id=source_id, producer=producer,
                       tokens=np.arange(start, start + length, dtype=np.int64), exported=transfer)
    sources[source_id] = src
    mb.produces.append(source_id)
    if predicts_next:
        mb.remote_targets = np.union1d(mb.remote_targets, [start + length]).astype(np.int64)
    return src


def token_aliases(transfers: List[PrefixTransfer]) -> Tuple[np.ndarray, np.ndarray]:
    """``(copy tokens, home tokens)`` of every transfer (:meth:`PrefixTransfer.aliases`)."""
    parts = [t.aliases() for t in transfers]
    parts = [p for p in parts if len(p[0])]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@dataclass
class RankPlan:
    """Everything one data-parallel rank computes in the step."""

    micro_batches: List[MicroBatchSpec]
    """In forward order."""

    sources: Dict[int, CachedSource]
    """Cached sources by id."""

    schedule: List[Tuple[str, int]]
    """``("forward", i)``, ``("backward", i)`` or ``("forward_backward", i)`` steps."""

    planned_cost: float = 0.0
    """Cost-model FLOPs of the rank's work."""

    group_rank: int = 0
    """This rank's index in its exchange group."""

    cross_rank: bool = False
    """Part of a cross-rank plan: every rank of the group runs the same schedule in lockstep,
    exchanging prefix K/V (``MicroBatchSpec.exchange``)."""

    def pack(self, index: TreeIndex, i: int) -> PackedMicroBatch:
        """The packed micro-batch i (built on demand: packing is cheap next to the model).

        External sources: the cached prefixes it reads, then the peer chains of this step."""
        mb = self.micro_batches[i]
        external = [ExternalSource(s, self.sources[s].length, self.sources[s].last_token) for s in mb.reads]
        external += [ExternalSource(-1 - j, p.length, p.last_token) for j, p in enumerate(mb.peer_reads)]
        return pack_tokens(index, mb.tokens, mb.owned, external, mb.remote_targets)


@dataclass
class StepPlan:
    """The plan of one update step over all data-parallel ranks."""

    config: Any
    """The :class:`~megatron_psrl.tree.planner.PlannerConfig` the plan was made with."""

    tree: PrefixTree
    """The tree the token indices refer to (the unshared tree in ``none`` mode)."""

    index: TreeIndex
    ranks: List[RankPlan]
    groups: List[List[int]] = field(default_factory=list)
    """Ranks whose memory is planned together (a cross-rank group runs one schedule)."""

    placements: List[str] = field(default_factory=list)
    """Per exchange group: ``whole-tree`` or ``cross-rank``."""

    predicted_makespan: List[float] = field(default_factory=list)
    """Per exchange group: the cost-model makespan of the chosen placement (and of the other
    one, for the log: see :attr:`alternative_makespan`)."""

    alternative_makespan: List[float] = field(default_factory=list)

    planned_groups: Optional[List[int]] = None
    """Exchange groups planned in full (``PlannerConfig.local_rank``); the others' rank plans
    are empty, their placement ``unplanned``. None: every group."""

    split_tokens_recomputed: int = 0
    """Tree tokens computed more than once because trees were split between exchange groups
    (:mod:`megatron_psrl.tree.hierarchical`): each part's shared prefix, once per extra part
    that does not import it."""

    transfers: List[PrefixTransfer] = field(default_factory=list)
    """Heads of split trees sent between ranks instead of recomputed (the same list on every
    rank, from the assignment of trees to groups)."""

    def head_tokens_sent(self) -> int:
        """Tokens of the heads the step's copies receive instead of computing, over every group
        (each copy's head once; the transfers are the same on every rank)."""
        return int(sum(h.length for t in self.transfers for h in t.imports if h.start != t.start))

    def transferred_tokens(self) -> int:
        """Tokens of heads that copies in the planned groups import instead of computing (each
        copy's head once; a copy on its home rank computes its head)."""
        entries = {src.imported for r in self.ranks for src in r.sources.values() if src.imported is not None}
        return int(sum(self.transfers[t].imports[j].length for t, j in entries
                       if self.transfers[t].imports[j].start != self.transfers[t].start))

    def tokens_computed(self, rank: Optional[int] = None) -> int:
        ranks = self.ranks if rank is None else [self.ranks[rank]]
        return int(sum(len(mb.computed_tokens) for r in ranks for mb in r.micro_batches))

    def num_micro_batches(self, rank: Optional[int] = None) -> int:
        ranks = self.ranks if rank is None else [self.ranks[rank]]
        return int(sum(len(r.micro_batches) for r in ranks))

    def rank_costs(self) -> np.ndarray:
        """Planned cost of every rank (cost-model units)."""
        return np.array([r.planned_cost for r in self.ranks], dtype=np.float64)

    def imbalance(self) -> float:
        """max / mean planned rank cost (1.0 = perfect balance)."""
        costs = self.rank_costs()
        return float(costs.max() / costs.mean()) if costs.size and costs.mean() > 0 else 1.0

    def exchanged_tokens(self) -> int:
        """Tokens of prefix K/V sent between ranks per layer in the forward pass."""
        return int(sum(len(c) for r in self.ranks for mb in r.micro_batches if mb.exchange
                       for chains in mb.exchange.send.values() for c in chains))

    def exchanged_bytes(self, kv_bytes_per_token: float) -> int:
        """Bytes sent between ranks in the step: prefix K/V forward, their gradients back (the
        exchange's backward), and the replicas' gradients returned to their owners."""
        replica = sum(r.sources[s].length for r in self.ranks for mb in r.micro_batches if mb.exchange
                      for ids in mb.exchange.grad_send.values() for s in ids)
        return int((2 * self.exchanged_tokens() + replica) * kv_bytes_per_token)

    def transfer_bytes(self, kv_bytes_per_token: float) -> int:
        """Bytes the planned ranks receive as imported heads (each rank the whole head of every copy
        it reads) and send back as their gradients."""
        rows = sum(self.transfers[t].imports[j].length for r in self.ranks
                   for t, j in {src.imported for src in r.sources.values() if src.imported is not None})
        return int(2 * rows * kv_bytes_per_token)

    def mechanism_counts(self) -> Dict[str, int]:
        """How many cached sources / duplicated tokens the plan uses (for logs)."""
        duplicated = sum(int((~mb.owned).sum()) for r in self.ranks for mb in r.micro_batches if mb.computes)
        return {
            "cached_sources": sum(len(r.sources) for r in self.ranks),
            "cached_source_tokens": sum(s.length for r in self.ranks for s in r.sources.values()),
            "duplicated_tokens": duplicated,
        }


# ---------------------------------------------------------------------- schedule
def build_schedule(mbs: List[MicroBatchSpec], sources: Dict[int, CachedSource],
                   last: Sequence[int] = ()) -> List[Tuple[str, int]]:
    """Forward in order; backward of a producer as soon as all its readers are done.

    A micro-batch nobody reads from runs ``forward_backward``; a producer runs ``forward``, and
    its ``backward`` follows the backward of its last reader (cross-rank plans pass one pseudo
    source per producer step, read by the steps that read any of its sources on any rank).
    ``last``: micro-batches whose backward waits for everything else (an exported prefix head,
    whose readers on other ranks return its gradients when they are done): they run
    ``forward``, and their backwards close the schedule (then whatever waited for them)."""
    readers: Dict[int, set] = {}
    for src in sources.values():
        readers.setdefault(src.producer, set()).update(src.consumers)
    for p, r in readers.items():
        if any(c <= p for c in r):
            raise PlanningError("a cached source is read before it is computed")
    deferred = set(last)
    done: set = set()
    waiting: List[int] = []
    steps: List[Tuple[str, int]] = []

    def flush() -> None:
        progressed = True
        while progressed:
            progressed = False
            for p in sorted(waiting, reverse=True):
                if p not in deferred and readers.get(p, set()) <= done:
                    steps.append(("backward", p))
                    done.add(p)
                    waiting.remove(p)
                    progressed = True

    for i in range(len(mbs)):
        if readers.get(i) or i in deferred:
            steps.append(("forward", i))
            waiting.append(i)
            continue
        steps.append(("forward_backward", i))
        done.add(i)
        flush()
    for p in sorted(deferred, reverse=True):
        if p in waiting and readers.get(p, set()) <= done:
            steps.append(("backward", p))
            done.add(p)
            waiting.remove(p)
    deferred = set()
    flush()
    if waiting:
        raise PlanningError(f"micro-batches {waiting} never became ready for backward")
    return steps


# ---------------------------------------------------------------------- invariants
CHECK_PLANS_ENV = "PSRL_CHECK_PLANS"
"""Environment variable: ``1`` makes the planners check every plan they make (:func:`check_plan`)."""

FORWARD_OPS = ("forward", "forward_backward")
BACKWARD_OPS = ("backward", "forward_backward")


def plan_checks_enabled() -> bool:
    """Whether the planners check their plans (``PSRL_CHECK_PLANS=1``, read at every call)."""
    return os.environ.get(CHECK_PLANS_ENV) == "1"


def maybe_check_plan(plan: StepPlan) -> StepPlan:
    """:func:`check_plan` when :func:`plan_checks_enabled`; returns the plan."""
    if plan_checks_enabled() and plan.planned_groups is None:
        check_plan(plan)
    return plan


def check_plan(plan: StepPlan) -> None:
    """Verify the plan's invariants (the module docstring lists them); vectorised per micro-batch.

    Raises :class:`PlanInvariantError` naming the first invariant broken, with the rank,
    micro-batch, source or tree token concerned."""
    index = plan.index
    budget = int(plan.config.micro_batch_tokens)
    num_ranks = int(plan.config.data_parallel_size)
    _require(index.tree is plan.tree, "the plan's token index is not over the plan's tree")
    _require(len(plan.ranks) == num_ranks, f"{len(plan.ranks)} rank plans for {num_ranks} data-parallel ranks")
    grouped = sorted(r for group in plan.groups for r in group)
    _require(grouped == list(range(num_ranks)), f"the groups {plan.groups} do not partition the {num_ranks} ranks")
    owned: List[np.ndarray] = []
    targets: List[np.ndarray] = []
    for r, rank_plan in enumerate(plan.ranks):
        _check_rank(index, rank_plan, budget, f"rank {r}", owned, targets)
    for group in plan.groups:
        _check_group(plan, group)
    _check_transfers(plan)
    _check_coverage(plan, owned, targets)


def _require(ok, message: str) -> None:
    if not ok:
        raise PlanInvariantError(message)


def _contains(sorted_tokens: np.ndarray, values: np.ndarray) -> np.ndarray:
    """bool per value: it is in ``sorted_tokens`` (ascending, not empty); faster than ``np.isin``."""
    pos = np.minimum(np.searchsorted(sorted_tokens, values), len(sorted_tokens) - 1)
    return sorted_tokens[pos] == values


def _in_pack_predecessor(index: TreeIndex, tokens: np.ndarray) -> np.ndarray:
    """bool per token of a sorted token set: its predecessor is in the set."""
    pred = index.pred[tokens]
    return (pred >= 0) & _contains(tokens, pred)


def _check_rank(index: TreeIndex, rank_plan: RankPlan, budget: int, where: str,
                owned: List[np.ndarray], targets: List[np.ndarray]) -> None:
    """One rank: micro-batches, sources, schedule order, the keys every micro-batch sees.
    Appends every micro-batch's owned tokens and log-prob targets to ``owned`` / ``targets``."""
    mbs, sources = rank_plan.micro_batches, rank_plan.sources
    n, num_tokens = len(mbs), index.tree.num_tree_tokens
    for i, mb in enumerate(mbs):
        at = f"{where} micro-batch {i}"
        tok = mb.tokens
        _require(mb.index == i, f"{at} has index {mb.index}")
        if not mb.computes:
            _check_transfer_micro_batch(rank_plan, i, at, num_tokens)
            continue
        _require(tok.ndim == 1 and 0 < len(tok) <= budget,
                 f"{at} holds {len(tok)} tokens (the budget is 1 to {budget})")
        _require(tok[0] >= 0 and tok[-1] < num_tokens, f"{at} holds tokens outside the tree's {num_tokens}")
        _require(bool((np.diff(tok) > 0).all()), f"{at}: its tokens are not strictly ascending (sorted, no repeats)")
        _require(mb.owned.shape == tok.shape and mb.owned.dtype == bool,
                 f"{at}: owned is not a bool mask of its tokens")
        present = _in_pack_predecessor(index, tok)
        remote = mb.remote_targets
        if len(remote):
            pred = index.pred[remote]
            bad = np.flatnonzero((pred < 0) | ~_contains(tok, pred))
            if len(bad):
                raise PlanInvariantError(f"{at}: the predecessor of its remote target {int(remote[bad[0]])} is not "
                                         "in the micro-batch")
            _require(not _contains(tok, remote).any(), f"{at}: a remote target is in the micro-batch itself")
        owned.append(tok[mb.owned])
        targets.append(tok[mb.owned & present])
        targets.append(remote)
        _require(len(set(mb.reads)) == len(mb.reads) and len(set(mb.produces)) == len(mb.produces),
                 f"{at} lists a source twice (reads {mb.reads}, produces {mb.produces})")
        for s in mb.reads:
            _require(s in sources and i in sources[s].consumers,
                     f"{at} reads source {s}, which does not list it as a consumer")
        for s in mb.produces:
            _require(s in sources and sources[s].producer == i, f"{at} produces source {s}, whose producer is another")
        lasts = [sources[s].last_token for s in mb.reads]
        _require(all(a < b for a, b in zip(lasts, lasts[1:])), f"{at} reads its sources {mb.reads} not outermost first")
    for s, src in sources.items():
        at = f"{where} source {s}"
        _require(src.source_id == s, f"{at} has id {src.source_id}")
        _require(0 <= src.producer < n and s in mbs[src.producer].produces,
                 f"{at}: its producer micro-batch {src.producer} does not list it")
        chain = src.tokens
        _require(len(chain) > 0 and bool((index.pred[chain[1:]] == chain[:-1]).all()),
                 f"{at} is not a chain (every token the successor of the one before)")
        if src.replica_of is None:
            _require(bool(_contains(mbs[src.producer].tokens, chain).all()),
                     f"{at}: its producer micro-batch {src.producer} does not compute its tokens")
        _require((src.imported is not None) == (mbs[src.producer].role == "import"),
                 f"{at}: imported {src.imported}, but its producer micro-batch {src.producer} has role "
                 f"{mbs[src.producer].role!r}")
        if src.exported is not None:
            _require(not src.consumers and src.replica_of is None and src.imported is None,
                     f"{at} is an exported head, read on this rank (or a copy)")
        for c in src.consumers:
            _require(0 <= c < n and s in mbs[c].reads, f"{at}: its consumer {c} does not read it")
    _check_schedule(rank_plan, where)
    for i, mb in enumerate(mbs):
        if mb.computes:
            _check_keys(index, rank_plan, i, f"{where} micro-batch {i}")


def _check_transfer_micro_batch(rank_plan: RankPlan, i: int, at: str, num_tokens: int) -> None:
    """An ``import`` micro-batch receives (owns nothing, reads nothing, computes no log-prob);
    an ``idle`` one is empty."""
    mb = rank_plan.micro_batches[i]
    _require(mb.role in ("import", "idle"), f"{at} has the role {mb.role!r}")
    _require(not mb.reads and not mb.peer_reads and mb.exchange is None and not len(mb.remote_targets),
             f"{at} ({mb.role}) reads, exchanges or computes log-probs")
    _require(not mb.owned.any() and mb.owned.shape == mb.tokens.shape, f"{at} ({mb.role}) owns tokens")
    if mb.role == "idle":
        _require(not len(mb.tokens) and not mb.produces, f"{at} is idle but holds tokens or produces sources")
        return
    tok = mb.tokens
    _require(len(tok) > 0 and bool((np.diff(tok) > 0).all()) and tok[0] >= 0 and tok[-1] < num_tokens,
             f"{at}: its imported tokens are not ascending tree tokens")
    _require(bool(mb.produces), f"{at} imports but produces no source")
    for s in mb.produces:
        src = rank_plan.sources.get(s)
        _require(src is not None and src.imported is not None and bool(_contains(tok, src.tokens).all()),
                 f"{at} produces source {s}, which is not imported into its tokens")


def _check_schedule(rank_plan: RankPlan, where: str) -> None:
    """Each micro-batch forward once and backward once (or ``forward_backward``), forwards in
    order; a source's readers run forward after its producer, and backward before it."""
    n = len(rank_plan.micro_batches)
    fwd: Dict[int, int] = {}
    bwd: Dict[int, int] = {}
    for t, step in enumerate(rank_plan.schedule):
        op, i = step
        _require(op in FORWARD_OPS + BACKWARD_OPS and 0 <= i < n, f"{where}: schedule step {t} is {step!r}")
        if op in FORWARD_OPS:
            _require(i not in fwd, f"{where}: micro-batch {i} runs forward twice (schedule steps {fwd.get(i)}, {t})")
            fwd[i] = t
        if op in BACKWARD_OPS:
            _require(i not in bwd, f"{where}: micro-batch {i} runs backward twice (schedule steps {bwd.get(i)}, {t})")
            _require(i in fwd, f"{where}: micro-batch {i} runs backward (schedule step {t}) before its forward")
            bwd[i] = t
    missing = sorted(set(range(n)) - set(fwd))
    _require(not missing, f"{where}: micro-batches {missing} never run forward")
    missing = sorted(set(range(n)) - set(bwd))
    _require(not missing, f"{where}: micro-batches {missing} never run backward")
    for s, src in rank_plan.sources.items():
        p = src.producer
        for c in src.consumers:
            _require(c > p and fwd[c] > fwd[p],
                     f"{where}: micro-batch {c} reads source {s} (forward at schedule step {fwd[c]}) before its "
                     f"producer micro-batch {p} runs forward (schedule step {fwd[p]})")
            _require(bwd[c] < bwd[p],
                     f"{where}: the backward of micro-batch {p} (schedule step {bwd[p]}) runs before that of "
                     f"micro-batch {c} (schedule step {bwd[c]}), which reads its source {s}: the reader's dK/dV "
                     "would miss the producer's backward")
    order = [i for i, _ in sorted(fwd.items(), key=lambda kv: kv[1])]
    _require(order == list(range(n)),
             f"{where}: the schedule runs forwards in the order {order}, not micro-batch order")


def _check_keys(index: TreeIndex, rank_plan: RankPlan, i: int, at: str) -> None:
    """Every token whose predecessor is not in the micro-batch (a root segment's first token)
    sees exactly its ancestors in the chains it reads (cached sources, then peer chains): the
    chains visible to it cover positions ``0 .. position - 1`` once each."""
    mb = rank_plan.micro_batches[i]
    tok = mb.tokens
    pred = index.pred[tok]
    dangling = tok[(pred >= 0) & ~_in_pack_predecessor(index, tok)]
    if not len(dangling):
        return
    chains = [(rank_plan.sources[s].length, rank_plan.sources[s].last_token) for s in mb.reads]
    chains += [(p.length, p.last_token) for p in mb.peer_reads]
    _require(bool(chains), f"{at}: tree token {int(dangling[0])} (position {int(index.position[dangling[0]])}) has "
                           "no predecessor in the micro-batch and it reads no chains")
    length = np.array([c[0] for c in chains], dtype=np.int64)
    last = np.array([c[1] for c in chains], dtype=np.int64)
    hi = index.position[last]  # positions a chain covers: hi - length + 1 .. hi
    lo = hi - length + 1
    visible = (dangling[None, :] > last[:, None]) & (dangling[None, :] < index.subtree_end[last][:, None])
    position = index.position[dangling]
    seen = (visible * length[:, None]).sum(axis=0)
    bad = np.flatnonzero(seen != position)
    if len(bad):
        x = int(dangling[bad[0]])
        raise PlanInvariantError(f"{at}: tree token {x} (position {int(position[bad[0]])}) sees {int(seen[bad[0]])} "
                                 "ancestor keys in the chains it reads: its predecessors are neither in the "
                                 "micro-batch nor all in its cached sources and peer chains")
    for d in np.flatnonzero(visible.sum(axis=0) > 1):  # several chains: no position covered twice
        rows = np.flatnonzero(visible[:, d])
        rows = rows[np.argsort(hi[rows])]
        _require(bool((lo[rows][1:] > hi[rows][:-1]).all()),
                 f"{at}: tree token {int(dangling[d])} sees overlapping chains (the same ancestor twice)")


def _check_group(plan: StepPlan, group: List[int]) -> None:
    """A whole-tree rank exchanges nothing; a cross-rank group runs one schedule in lockstep and
    every send has its receive (and every replica's gradients go back to their owner)."""
    ranks = [plan.ranks[r] for r in group]
    if len(group) == 1:
        rank_plan, where = ranks[0], f"rank {group[0]}"
        _require(not rank_plan.cross_rank, f"{where} is part of a cross-rank plan but alone in its group")
        for i, mb in enumerate(rank_plan.micro_batches):
            _require(mb.exchange is None and not mb.peer_reads,
                     f"{where} micro-batch {i} exchanges with other ranks, but the rank plans alone")
        replicas = [s for s, src in rank_plan.sources.items() if src.replica_of is not None]
        _require(not replicas, f"{where} holds replicas {replicas} of other ranks' sources, but plans alone")
        return
    g = len(group)
    names = [f"rank {r}" for r in group]
    steps = len(ranks[0].micro_batches)
    for q, rp in enumerate(ranks):
        _require(rp.cross_rank and rp.group_rank == q,
                 f"{names[q]} is not group rank {q} of the cross-rank group {group}")
        _require(len(rp.micro_batches) == steps and rp.schedule == ranks[0].schedule,
                 f"{names[q]} does not run the same steps and schedule as {names[0]} (the group runs in lockstep)")
    for m in range(steps):
        mbs = [rp.micro_batches[m] for rp in ranks]
        ex = [mb.exchange for mb in mbs]
        forward = any(e is not None and any(e.send.values()) for e in ex)
        backward = any(e is not None and any(e.grad_send.values()) for e in ex)
        used_peers: List[List[int]] = [[] for _ in range(g)]
        for q in range(g):
            at = f"{names[q]} step {m}"
            e = ex[q]
            if e is None:
                _require(not forward and not backward,
                         f"{at} takes no part in the step's exchange, which other ranks of {group} run")
                continue
            _require((e.forward_collective, e.backward_collective) == (forward, backward),
                     f"{at}: its exchange says forward/backward collective {e.forward_collective}/"
                     f"{e.backward_collective}, the group's transfers say {forward}/{backward}")
            for table in (e.send, e.recv, e.grad_send, e.grad_recv):
                _require(all(0 <= k < g and k != q for k in table), f"{at} exchanges with ranks {sorted(table)}")
        for q in range(g):
            for r in range(g):
                if q == r:
                    continue
                sent = ex[q].send.get(r, []) if ex[q] is not None else []
                got = ex[r].recv.get(q, []) if ex[r] is not None else []
                at = f"step {m}: {names[q]} -> {names[r]}"
                _require([len(c) for c in sent] == [u.length for u in got],
                         f"{at}: the sender sends chains of {[len(c) for c in sent]} tokens, the receiver expects "
                         f"{[u.length for u in got]}")
                for chain, use in zip(sent, got):
                    _require(bool(_contains(mbs[q].tokens, chain).all()),
                             f"{at}: a sent chain is not in the sender's fragment")
                    _require(use.peer is not None or use.replica is not None, f"{at}: a chain is received for no use")
                    if use.peer is not None:
                        peers = mbs[r].peer_reads
                        _require(0 <= use.peer < len(peers), f"{at}: a chain goes to peer read {use.peer}, which "
                                                             f"the receiver does not have")
                        peer = peers[use.peer]
                        _require((peer.src_rank, peer.length, peer.last_token) == (q, len(chain), int(chain[-1])),
                                 f"{at}: a chain goes to peer read {use.peer}, which is another chain")
                        used_peers[r].append(use.peer)
                    if use.replica is not None:
                        src = ranks[r].sources.get(use.replica)
                        _require(src is not None and src.replica_of is not None and src.replica_of[0] == q
                                 and src.producer == m and np.array_equal(src.tokens, chain),
                                 f"{at}: a chain goes to replica {use.replica}, which is not a copy of it made "
                                 "at this step")
                back = ex[r].grad_send.get(q, []) if ex[r] is not None else []
                into = ex[q].grad_recv.get(r, []) if ex[q] is not None else []
                _require([ranks[r].sources[s].replica_of if s in ranks[r].sources else None for s in back]
                         == [(q, s) for s in into],
                         f"step {m}: {names[r]} returns the gradients of replicas {back} to {names[q]}, which "
                         f"expects those of its sources {into}")
        for r in range(g):
            _require(sorted(used_peers[r]) == list(range(len(mbs[r].peer_reads))),
                     f"{names[r]} step {m}: its {len(mbs[r].peer_reads)} peer reads are received as "
                     f"{sorted(used_peers[r])}")
    for r, rp in enumerate(ranks):
        for s, src in rp.sources.items():
            if src.replica_of is None:
                continue
            at = f"{names[r]} replica {s}"
            q, sid = src.replica_of
            owner = ranks[q].sources.get(sid) if 0 <= q < g and q != r else None
            _require(owner is not None and owner.replica_of is None and owner.producer == src.producer
                     and np.array_equal(owner.tokens, src.tokens) and "gk" in owner.kinds,
                     f"{at} copies source {sid} of group rank {q}, which is not the same chain made at its step")
            e = ranks[r].micro_batches[src.producer].exchange
            received = [u.replica for u in e.recv.get(q, [])] if e is not None else []
            returned = e.grad_send.get(q, []) if e is not None else []
            _require(received.count(s) == 1 and returned.count(s) == 1,
                     f"{at} is received {received.count(s)} times and its gradients returned {returned.count(s)} "
                     f"times at step {src.producer} (once each)")


def _check_coverage(plan: StepPlan, owned: List[np.ndarray], targets: List[np.ndarray]) -> None:
    """Every loss claim and every log-prob target computed once, every tree token owned once."""
    tree, index = plan.tree, plan.index
    num_tokens = tree.num_tree_tokens
    computed = np.bincount(np.concatenate(targets), minlength=num_tokens) if targets else np.zeros(num_tokens, np.int64)
    claimed = np.diff(tree.claim_offsets) > 0
    bad = np.flatnonzero(claimed & (computed != 1))
    if len(bad):
        t = int(bad[0])
        sample = int(tree.claim_sample[tree.claim_offsets[t]])
        raise PlanInvariantError(f"the loss claims of tree token {t} (sample {sample}, position "
                                 f"{int(index.position[t])}) are computed {int(computed[t])} times, not once"
                                 f"{_where_computed(plan, t)}")
    expected = (index.pred >= 0).astype(np.int64)
    imported = _imported_tokens(plan)
    if len(imported):  # computed by the home copy instead (their claims moved there)
        after = np.flatnonzero(np.isin(index.pred, imported))  # the token after a head: its predecessor is not here
        expected[imported] = 0
        expected[after] = 0
    bad = np.flatnonzero(computed != expected)
    if len(bad):
        t = int(bad[0])
        raise PlanInvariantError(f"the log-prob of tree token {t} (position {int(index.position[t])}) is computed "
                                 f"{int(computed[t])} times, not {int(expected[t])}{_where_computed(plan, t)}")
    count = np.bincount(np.concatenate(owned), minlength=num_tokens) if owned else np.zeros(num_tokens, np.int64)
    count[imported] += 1  # received, not computed
    bad = np.flatnonzero(count != 1)
    if len(bad):
        t = int(bad[0])
        raise PlanInvariantError(f"tree token {t} is owned (computed as a trained row) by {int(count[t])} "
                                 "micro-batches, not one")


def _where_computed(plan: StepPlan, t: int) -> str:
    """``" (rank r micro-batch i, ...)"``: where tree token t's log-prob is computed (for errors)."""
    index = plan.index
    places = []
    for r, rank_plan in enumerate(plan.ranks):
        for i, mb in enumerate(rank_plan.micro_batches):
            local = mb.tokens[mb.owned & _in_pack_predecessor(index, mb.tokens)]
            if t in local or t in mb.remote_targets:
                places.append(f"rank {r} micro-batch {i}")
    return f" ({', '.join(places)})" if places else ""


def _imported_tokens(plan: StepPlan) -> np.ndarray:
    """Tree tokens of the heads that copies other than the home copy import (nobody computes
    them: the home copy's tokens stand for them), each once."""
    entries = {src.imported for r in plan.ranks for src in r.sources.values() if src.imported is not None}
    parts = [plan.transfers[t].imports[j].tokens() for t, j in sorted(entries)
             if plan.transfers[t].imports[j].start != plan.transfers[t].start]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _check_transfers(plan: StepPlan) -> None:
    """Every transfer's head is exported once, by its home rank; every imported source lies in
    the head of a copy its rank's group holds; and on every rank exported heads run forward
    before any import and backward after every import's backward (no waiting cycle)."""
    g = int(plan.config.exchange_group_size)
    for t, transfer in enumerate(plan.transfers):
        at = f"transfer {t}"
        _require(0 <= transfer.home_rank < len(plan.ranks), f"{at}: home rank {transfer.home_rank}")
        exported = [s for s in plan.ranks[transfer.home_rank].sources.values() if s.exported == t]
        _require(len(exported) == 1 and np.array_equal(exported[0].tokens, transfer.tokens()),
                 f"{at}: its home rank {transfer.home_rank} exports {len(exported)} sources, not its head")
        for r, rank_plan in enumerate(plan.ranks):
            if r != transfer.home_rank:
                _require(not any(s.exported == t for s in rank_plan.sources.values()),
                         f"{at}: rank {r} exports it, but rank {transfer.home_rank} is its home")
        _require(bool(transfer.imports) and transfer.imports[0].start == transfer.start,
                 f"{at}: its first import is not the home copy")
        for h in transfer.imports:
            _require(0 < h.length <= transfer.length, f"{at}: a copy imports {h.length} of {transfer.length} tokens")
    for r, rank_plan in enumerate(plan.ranks):
        fwd = {i: k for k, (op, i) in enumerate(rank_plan.schedule) if op in FORWARD_OPS}
        bwd = {i: k for k, (op, i) in enumerate(rank_plan.schedule) if op in BACKWARD_OPS}
        imports = {src.producer for src in rank_plan.sources.values() if src.imported is not None}
        exports = {src.producer for src in rank_plan.sources.values() if src.exported is not None}
        for s, src in rank_plan.sources.items():
            if src.imported is None:
                continue
            t, j = src.imported
            _require(0 <= t < len(plan.transfers) and 0 <= j < len(plan.transfers[t].imports),
                     f"rank {r} source {s} imports {src.imported}, which is not a transfer")
            head = plan.transfers[t].imports[j]
            _require(head.group == r // g and r != plan.transfers[t].home_rank,
                     f"rank {r} source {s} imports the head of a copy of group {head.group}")
            _require(bool(((src.tokens >= head.start) & (src.tokens < head.start + head.length)).all()),
                     f"rank {r} source {s} is imported but lies outside the head it imports")
        for e in exports:
            for i in imports:
                _require(fwd[e] < fwd[i] and bwd[i] < bwd[e],
                         f"rank {r}: the exported head of micro-batch {e} and the import of micro-batch {i} are "
                         "not ordered export forward, import forward, import backward, export backward")
