"""The step plan: what every data-parallel rank computes in an update step, and in which order.

The planners (:mod:`megatron_psrl.schedule.planner` for whole trees, :mod:`megatron_psrl.schedule.cross_rank`
for one tree's fragments on several ranks) make a :class:`StepPlan`; the KV memory plan
(:mod:`megatron_psrl.schedule.memory`) and the rank's instruction stream
(:mod:`megatron_psrl.schedule.instructions`, executed by :mod:`megatron_psrl.engine.step`)
consume it. This module holds the plan's data types and the forward/backward schedule builder
(:func:`build_schedule`); the plan's invariants are checked by
:func:`megatron_psrl.schedule.check.check_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_psrl.errors import PsrlError
from megatron_psrl.kvcache.prefix_state import ALL_ROLES, PrefixState
from megatron_psrl.schedule.packing import ExternalSource, PackedMicroBatch, pack_tokens
from megatron_psrl.tree.index import TreeIndex
from megatron_psrl.tree.prefix_tree import PrefixTree


class PlanningError(PsrlError, ValueError):
    """The batch cannot be planned under the given budgets."""


class PlanInvariantError(AssertionError):
    """A step plan breaks one of its invariants (:func:`check_plan`).

    A planner bug, not a problem of the input: not a :class:`~megatron_psrl.errors.PsrlError`,
    so the entry points print its traceback."""


@dataclass
class MemoryPlan:
    """Decisions for one rank and step."""

    block_size: int
    """Tokens per KV block (chosen from the sources' lengths) of the pools that keep whole
    sources (every pool's but a sliding window's: :attr:`pool_block_sizes`)."""

    pool_blocks: int
    """Blocks in the cache's pools together (each pool's simulated peak; never above the budget)."""

    keep_graph: Dict[int, bool]
    """Producer micro-batch -> keep its autograd graph (else recompute its forward)."""

    kv_release_step: Dict[int, int]
    """Source -> index of the schedule step after which its K/V blocks are freed."""

    peak_bytes: int
    """Simulated peak of blocks + retained graphs."""

    recompute_tokens: int = 0
    """Tokens whose forward is recomputed (producers that drop their graph)."""

    timeline_bytes: List[int] = field(default_factory=list)
    """Simulated bytes held after every schedule step."""

    gathers_in_backward: bool = False
    """Readers gather cached K/V again in their backward pass instead of keeping copies (the
    runner reads the cache that way, and K/V blocks stay until the last such re-read)."""

    pool_sizes: Tuple[int, ...] = ()
    """Blocks of each of the cache's pools (``KVGeometry.pools`` order): its simulated peak."""

    pool_states: Tuple[PrefixState, ...] = ()
    """The prefix state of each of those pools (the planning geometry's: a pipeline stage's
    cache may hold fewer of them; it sizes its own pools by state)."""

    pool_block_sizes: Tuple[int, ...] = ()
    """Tokens per block of each of those pools, chosen from the rows each keeps (a sliding
    window's pool keeps a few rows of each source); empty: :attr:`block_size` in every pool."""

    step_timeline_bytes: List[int] = field(default_factory=list)
    """:attr:`timeline_bytes` plus what the running micro-batch holds beyond it at every step (its
    own graph, its loss head, the parameters' gradients): the step's predicted memory above
    the weights (:func:`megatron_psrl.schedule.memory.step_peak_bytes`)."""

    offloaded_bytes: List[int] = field(default_factory=list)
    """With host offload: bytes copied to or from host memory at every step (kept graphs and K/V
    blocks that the running and the next step do not use); empty without."""

    host_offload: bool = False
    """Kept graphs and cached K/V blocks that the running and the next step do not use live in
    host memory (the step's instructions say when: ``schedule.instructions.Residency``); the
    pools hold the blocks on the device only (:attr:`pool_sizes`)."""


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

    kinds: Tuple[str, ...] = ALL_ROLES
    """Roles of the cache blocks it needs (``megatron_psrl.kvcache.prefix_state``: values and
    gradients): an owner whose prefix only other ranks read keeps its gradients only."""

    exported: Optional[int] = None
    """Head send (index in ``StepPlan.head_sends``) whose head this is, on the home rank:
    after the producer's forward its K/V go to the ranks that import the head; their dK/dV
    come back and are added before the producer's backward."""

    imported: Optional[Tuple[int, int]] = None
    """``(transfer, import)``: K/V received from the transfer's home rank by ``producer`` (an
    ``import`` micro-batch) instead of computed; its dK/dV go back in that micro-batch's backward."""

    first_depth: int = 0
    """Depth of its first token on its root-to-leaf path (:func:`note_reader_depths`)."""

    reader_depth: Optional[int] = None
    """Depth of the shallowest token of its readers that descends from it (every query that
    reads it sits at least this deep): a sliding-window layer keeps only the rows such a
    window reaches (``PrefixState.unread_rows``). None: every row is kept (its readers are not
    all on this rank, or not noted)."""

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def last_token(self) -> int:
        return int(self.tokens[-1])

    @property
    def reach(self) -> Tuple[int, Optional[int]]:
        """``(first_depth, reader_depth)``: what a windowed layer's kept rows follow."""
        return self.first_depth, self.reader_depth


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
    other ranks compute (:class:`HeadSend`) into the sources it produces (its tokens, none
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

    reach: Tuple[int, Optional[int]] = (0, None)
    """``(first depth, reader depth)``: the chain's first depth and the shallowest depth of the
    receiver's tokens that read it, now or through the replica (:func:`note_exchange_depths`;
    reader depth None: every row). A sliding-window layer's exchange sends only the rows from
    the first such a reader's window reaches (``PrefixState.unread_rows``)."""


@dataclass
class StepExchange:
    """One rank's K/V exchanges in one cross-rank step (all ranks of the group know all of them).

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

    send_reach: Dict[int, List[Tuple[int, Optional[int]]]] = field(default_factory=dict)
    """``send[dst][j]``'s :attr:`ChainUse.reach` on ``dst`` (sender and receiver cut a
    sliding-window layer's rows alike); absent: every row."""

    reads_now: List[int] = field(default_factory=list)
    """Ranks of ``send`` that attend to (continue) a chain sent to them in this step (a peer
    read): a linear layer's state goes to them before they compute, and its gradient comes
    back in this step's backward."""

    def send_counts(self, group_size: int) -> List[int]:
        return [int(sum(len(c) for c in self.send.get(r, []))) for r in range(group_size)]

    def recv_counts(self, group_size: int) -> List[int]:
        return [int(sum(u.length for u in self.recv.get(r, []))) for r in range(group_size)]


@dataclass
class HeadImport:
    """One copy of a split tree that receives the tree's head (:class:`HeadSend`)."""

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
class HeadSend:
    """The head of a tree split between exchange groups, computed once and sent, not recomputed.

    Splitting a tree gives every group that holds a part its own copy of the shared root path
    (:mod:`megatron_psrl.schedule.group_split`). For a transferred head, the home rank
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


def token_aliases(head_sends: List[HeadSend]) -> Tuple[np.ndarray, np.ndarray]:
    """``(copy tokens, home tokens)`` of every transfer (:meth:`HeadSend.aliases`)."""
    parts = [t.aliases() for t in head_sends]
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

    segment_shapes: Optional[Dict[int, Tuple[int, int, int]]] = None
    """Per micro-batch that runs the model: ``(segments, longest segment, gathered keys)``, what
    the memory plan of a varlen attention backend needs (set by
    :func:`megatron_psrl.schedule.memory.add_segment_shapes`; None: not computed)."""

    row_counts: Optional[Dict[int, Tuple[int, int, int]]] = None
    """Per micro-batch that runs the model: ``(tokens, output rows, claimed rows)``, what its
    autograd graph and loss head hold (set by :func:`megatron_psrl.schedule.step_charge.add_row_counts`;
    None: not computed)."""

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
    """The :class:`~megatron_psrl.schedule.config.PlannerConfig` the plan was made with."""

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
    (:mod:`megatron_psrl.schedule.group_split`): each part's shared prefix, once per extra part
    that does not import it."""

    head_sends: List[HeadSend] = field(default_factory=list)
    """Heads of split trees sent between ranks instead of recomputed (the same list on every
    rank, from the assignment of trees to groups)."""

    def head_tokens_sent(self) -> int:
        """Tokens of the heads the step's copies receive instead of computing, over every group
        (each copy's head once; the head sends are the same on every rank)."""
        return int(sum(h.length for t in self.head_sends for h in t.imports if h.start != t.start))

    def transferred_tokens(self) -> int:
        """Tokens of heads that copies in the planned groups import instead of computing (each
        copy's head once; a copy on its home rank computes its head)."""
        entries = {src.imported for r in self.ranks for src in r.sources.values() if src.imported is not None}
        return int(sum(self.head_sends[t].imports[j].length for t, j in entries
                       if self.head_sends[t].imports[j].start != self.head_sends[t].start))

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
        rows = sum(self.head_sends[t].imports[j].length for r in self.ranks
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


def note_reader_depths(index: TreeIndex, plan: RankPlan) -> None:
    """Set every cached source's :attr:`CachedSource.first_depth` and, where every reader is a
    micro-batch of this rank, :attr:`CachedSource.reader_depth`: the shallowest of the reading
    micro-batches' tokens that descend from the source's last token (a windowed layer's
    queries that see it). Sources other ranks read keep every row: an exported head, and an
    owner's prefix whose replicas return gradients (``StepExchange.grad_recv``)."""
    remote = {s for mb in plan.micro_batches if mb.exchange is not None
              for ids in mb.exchange.grad_recv.values() for s in ids}
    readers: Dict[int, List[int]] = {}
    for i, mb in enumerate(plan.micro_batches):
        for s in mb.reads:
            readers.setdefault(s, []).append(i)
    for src in plan.sources.values():
        if not src.length:
            continue
        src.first_depth = int(index.position[src.last_token]) - src.length + 1
        if src.exported is not None or src.source_id in remote:
            src.reader_depth = None
            continue
        depths = [_shallowest_below(index, plan.micro_batches[i].computed_tokens, src.last_token)
                  for i in readers.get(src.source_id, [])]
        depths = [d for d in depths if d is not None]
        src.reader_depth = min(depths) if depths else None


def note_exchange_depths(index: TreeIndex, ranks: List[RankPlan]) -> None:
    """Set :attr:`ChainUse.reach` and the senders' :attr:`StepExchange.send_reach` of every chain
    a cross-rank group exchanges (``ranks``: the group's plans, in group order, their sources'
    reader depths noted): its reader depth on the receiver is the shallowest of the receiving
    micro-batch's tokens below it (a peer read) and of its replica's readers (None, every row,
    when either is unknown)."""
    for r, plan in enumerate(ranks):
        for i, mb in enumerate(plan.micro_batches):
            for src, uses in (mb.exchange.recv.items() if mb.exchange is not None else ()):
                sender = ranks[src].micro_batches[i].exchange
                for j, use in enumerate(uses):
                    chain = sender.send[r][j]
                    depths: List[Optional[int]] = []
                    if use.peer is not None:
                        depths.append(_shallowest_below(index, mb.computed_tokens, int(chain[-1])))
                    if use.replica is not None:
                        depths.append(plan.sources[use.replica].reader_depth)
                    depth = None if not depths or None in depths else min(depths)
                    use.reach = (int(index.position[chain[0]]), depth)
                    sender.send_reach.setdefault(r, [(0, None)] * len(sender.send[r]))[j] = use.reach


def _shallowest_below(index: TreeIndex, tokens: np.ndarray, last: int) -> Optional[int]:
    """The smallest depth among ``tokens`` (sorted tree tokens) that descend from ``last``."""
    below = tokens[np.searchsorted(tokens, last, side="right"):np.searchsorted(tokens, index.subtree_end[last])]
    return int(index.position[below].min()) if len(below) else None


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
