"""The attention hook of one micro-batch forward: prefix K/V into and out of the KV cache.

Mechanism 2's per-layer work happens here, called by the core attention for every layer
(``PrefixKVHook``): a producer's sources' post-RoPE K/V are written into the KV cache (and, when
its graph is kept, captured as differentiable rows for the dK/dV its readers will inject); a
reader gets the cached K/V of the sources it reads as extra keys/values, whose gradients hooks
add to the source's dK/dV blocks; in a cross-rank step every layer exchanges the rows other
ranks need (:mod:`megatron_psrl.distributed.kv_exchange`). A linear-attention layer
(``TreeGatedDeltaNet``) calls the same hook for its fixed-size state
(``LinearPrefixHook``: the recurrent state and conv tail of a source, one slot per layer,
stored, captured, read and its gradient accumulated as K/V rows are), and a latent-attention
layer (``TreeMLASelfAttention``) for its latent and RoPE key (``LatentPrefixHook``: rows
stored, captured, exchanged as K/V rows are, and projected up to K/V by the layer for every
reader).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from megatron_psrl.attention.metadata import PrefixCopies
from megatron_psrl.attention.window import RowsFrom
from megatron_psrl.distributed.kv_exchange import ReceivedKV, exchange_kv, exchange_kv_start
from megatron_psrl.distributed.state_exchange import StateLink, received_leaf, send_states
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.kvcache.manager import BlockKVCache
from megatron_psrl.kvcache.prefix_state import VALUES, PrefixState, Tap
from megatron_psrl.model.architecture import UnsupportedModelError
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.latent_attention import TreeMLASelfAttention
from megatron_psrl.model.linear_attention import LinearState, SegmentStates, TreeGatedDeltaNet
from megatron_psrl.schedule.packing import PackedMicroBatch
from megatron_psrl.schedule.plan import ChainUse, RankPlan, StepExchange

Tensor = torch.Tensor


class CapturedRows(NamedTuple):
    """A produced source's rows of one layer, kept with the producer's graph: its backward
    injects the gradients every reader accumulated into them."""

    source: int
    """Cached source id."""
    layer: int
    """megatron layer number."""
    fields: Tuple[Tensor, ...]
    """The layer's prefix-state fields of the source's rows (K and V; a sliding-window layer's kept rows,
    ``BlockKVCache.first_kept_row`` on), or of its fixed state
    (a linear layer's recurrent state and conv tail), in the graph."""


class ReceivedChain(NamedTuple):
    """Where one chain received in a layer's exchange lies, and what it is for."""

    offset: int
    """First row in the synchronous exchange's (unpadded) received rows."""
    src: int
    """Sending rank (in the exchange group)."""
    within: int
    """First row within that rank's split (the overlapped exchange's padded buffer)."""
    length: int
    """Rows of the chain."""
    peer: Optional[int]
    """Index among the micro-batch's peer reads (attended to now), or None."""
    replica: Optional[int]
    """Cached source that stores it for later steps, or None."""
    skip: int = 0
    """Leading rows of the chain not sent (a sliding-window layer's: no reader's window reaches
    them); the received rows are the chain's from here on."""


class LayerExchange(NamedTuple):
    """What a micro-batch sends and receives in a layer: the same in every layer of one kind
    (full attention; each sliding window: the rows its readers' windows reach only)."""

    send_rows: Tensor
    """Pack rows sent, destinations in rank order."""
    send_counts: List[int]
    recv_counts: List[int]
    received: List[ReceivedChain]
    group: object
    """The exchange's process group."""


class LinearExchange(NamedTuple):
    """What a micro-batch's linear layers send and receive in every layer: one state per chain
    (:mod:`megatron_psrl.distributed.state_exchange`)."""

    link: StateLink
    send_last_rows: np.ndarray
    """Host pack row of every sent chain's last token (its state is taken there), destinations
    in rank order, chains in the plan's order."""
    received: List[Tuple[int, int, ChainUse]]
    """``(sending rank, row in its message, use)`` of every received chain."""
    last_row: int
    """The pack's last row (a cut there makes the layer hand over its states: replica-only
    messages are received after the layer computed)."""


def layer_exchange(ex: StepExchange, pack_rows, group, group_size: int, state: Optional[PrefixState] = None
                   ) -> LayerExchange:
    """The K/V exchange of a micro-batch whose step exchange is ``ex`` (``pack_rows``: tree
    tokens -> pack rows) in layers that keep ``state``: with a sliding window, every chain
    from the first row its receiver's readers reach (``ChainUse.reach``; sender and receiver
    cut alike), else whole."""
    def skip(length: int, reach) -> int:
        return state.unread_rows(length, *reach) if state is not None and state.window is not None else 0

    sent, send_counts = [], []
    for dst in range(group_size):
        reach = ex.send_reach.get(dst, [(0, None)] * len(ex.send.get(dst, [])))
        cut = [c[skip(len(c), r):] for c, r in zip(ex.send.get(dst, []), reach)]
        sent += cut
        send_counts.append(int(sum(len(c) for c in cut)))
    device = pack_rows(np.zeros(0, np.int64)).device
    send_rows = pack_rows(np.concatenate(sent)) if sent else torch.zeros(0, dtype=torch.int64, device=device)
    layout, offset, recv_counts = [], 0, []
    for src in range(group_size):
        within = 0
        for use in ex.recv.get(src, []):
            k = skip(use.length, use.reach)
            layout.append(ReceivedChain(offset, src, within, use.length - k, use.peer, use.replica, k))
            offset += use.length - k
            within += use.length - k
        recv_counts.append(within)
    return LayerExchange(send_rows, send_counts, recv_counts, layout, group)


def linear_exchange(ex: StepExchange, tree_tokens: np.ndarray, group, device) -> LinearExchange:
    """The state exchange of a micro-batch whose step exchange is ``ex`` (the K/V exchange's
    chains, one state each)."""
    dsts = sorted(r for r, chains in ex.send.items() if chains)
    last = [int(c[-1]) for r in dsts for c in ex.send[r]]
    received = [(src, i, use) for src in sorted(ex.recv) for i, use in enumerate(ex.recv[src])]
    link = StateLink(group, {r: len(ex.send[r]) for r in dsts}, ex.reads_now,
                     {src: len(uses) for src, uses in ex.recv.items()},
                     sorted({src for src, _, use in received if use.peer is not None}), device)
    return LinearExchange(link, np.searchsorted(tree_tokens, np.asarray(last, np.int64)).astype(np.int64),
                          received, len(tree_tokens) - 1)


def _rows_from(source, skip: int):
    """A received chain as the attention takes it: whole, or (a sliding window's exchange sent
    its rows from ``skip`` on) the rows from there (:class:`~megatron_psrl.attention.window.RowsFrom`)."""
    return RowsFrom(source, skip) if skip else source


class InjectCachedGrad(torch.autograd.Function):
    """Identity on a layer's K (or V) whose backward adds the dK (dV) the KV cache accumulated
    for the rows of the sources this micro-batch produces.

    Used with activation recomputation: the layer's forward may run twice (megatron's
    reentrant checkpoint runs it without a graph, then again inside the backward pass), so
    rows captured in the first pass have no graph to inject into. Placed on K/V in every pass
    that builds a graph, it injects exactly once, whenever autograd reaches the layer."""

    @staticmethod
    def forward(ctx, x: Tensor, cache: BlockKVCache, layer: int, index: int, sources):
        ctx.cache, ctx.layer, ctx.index, ctx.sources = cache, layer, index, sources
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        for s, rows in ctx.sources:  # (a fixed state's one row: [*shape] -> [1, *shape])
            cached = ctx.cache.read_grad(s, ctx.layer)[ctx.index].reshape((-1,) + tuple(grad.shape[1:]))
            skip = ctx.cache.first_kept_row(s, ctx.layer)  # (the kept rows' gradients only)
            grad.index_add_(0, rows[skip:] if skip else rows, cached.to(grad.dtype))
        return grad, None, None, None, None


class PrefixKV:
    """The attention hook of one micro-batch forward (implements ``PrefixKVHook``).

    Mechanism 2: writes (``store``) and captures (``capture``) the K/V rows of the sources this
    micro-batch produces, and supplies the cached K/V of the sources it reads. Cross-rank: in
    a step with an exchange, it sends the rows other ranks need and receives theirs in every
    layer; received *replica* chains are written into this rank's cache, received *peer*
    chains are attended to now (after the cached reads, in the plan's order)."""

    def __init__(self, cache: BlockKVCache, rank_plan: RankPlan, i: int, pack: PackedMicroBatch,
                 store: bool, capture: bool, track_grads: bool, group=None, group_size: int = 1,
                 inject: bool = False, gather_in_backward: bool = False, overlap: bool = True):
        mb = rank_plan.micro_batches[i]
        self.cache = cache
        self.inject = inject
        """Activation recomputation: inject dK/dV inside the graph (:class:`InjectCachedGrad`)
        instead of capturing K/V rows; writes and read metrics happen once per layer."""
        self._written: set = set()
        self._counted: set = set()
        self.reads = list(mb.reads)
        self.store = store
        self.capture = capture
        self.track_grads = track_grads
        self.gather_in_backward = gather_in_backward
        """Hand the attention :class:`CachedRead` readers (gathered again in its backward, no
        copy kept by the graph) instead of gathered copies; the memory plan decided it."""
        device = cache.geometry.device

        def pack_rows(tokens: np.ndarray) -> Tensor:
            return host_to_device(np.searchsorted(pack.tree_tokens, tokens), device)

        # Pack rows of every source this rank computes here (replicas arrive by exchange).
        own = [s for s in mb.produces if rank_plan.sources[s].replica_of is None]
        self.rows = {s: pack_rows(rank_plan.sources[s].tokens) for s in own}
        self.last_rows = {s: int(np.searchsorted(pack.tree_tokens, rank_plan.sources[s].last_token)) for s in own}
        """Host pack row of every own source's last token (a linear layer's state is taken there)."""
        self.stored = [s for s in own if VALUES in rank_plan.sources[s].kinds]
        self.captured: List[CapturedRows] = []
        self.exchanges: Dict[PrefixState, LayerExchange] = {}
        """The row exchange of every kind of layer that keeps rows (K/V of full or windowed
        attention, a latent), by what the layer keeps (its window cuts the rows sent)."""
        self.overlap = overlap
        """Overlap the exchange with the attention over local keys (``--no-overlap-kv-exchange``
        turns it off): the peers are handed over in flight (:class:`ReceivedKV`)."""
        self.num_peers = len(mb.peer_reads)
        self.peers: Dict[int, List[Union[Tuple[Tensor, Tensor], ReceivedKV]]] = {}
        self.up_projections: Dict[int, object] = {}
        """Latent layers: the layer's ``up_project(latent, rope_key) -> (k, v)`` (:meth:`on_latent`)."""
        self.in_flight: Dict[int, object] = {}
        """Overlapped exchange: the layer's exchange until its attention ran (:meth:`after_attention`)."""
        ex = mb.exchange
        self.state_exchange: Optional[LinearExchange] = None
        """Linear layers: the states of the exchanged chains (one per chain, point to point)."""
        if ex is not None and cache.geometry.fixed_bytes_per_source and (ex.send or ex.recv):
            self.state_exchange = linear_exchange(ex, pack.tree_tokens, group, device)
        if ex is not None and ex.forward_collective:
            self.exchanges = {p.state: layer_exchange(ex, pack_rows, group, group_size, p.state)
                              for p in cache.geometry.pools if p.state.per_token}

    @property
    def injects(self) -> bool:
        """This forward injects cached dK/dV inside its graph (recomputation, a producer's
        graph-building pass)."""
        return self.inject and self.capture and bool(self.rows)

    def _latent_layer(self, layer_number: int) -> bool:
        """The layer keeps its prefix before the K/V up-projection (latent attention)."""
        return self.cache.geometry.state_of(layer_number).tap is Tap.BEFORE_UP_PROJECTION

    def on_kv(self, layer_number: int, key: Tensor, value: Tensor):
        if self._latent_layer(layer_number):  # (its rows passed :meth:`on_latent`)
            return None
        return self._on_rows(layer_number, key, value, self.overlap)

    def on_latent(self, layer_number: int, latent: Tensor, rope_key: Tensor, up_project):
        """``LatentPrefixHook``: a latent-attention layer's normalised K/V latent ``[t, r]`` and
        rotated RoPE key ``[t, rope]``, before its up-projection. Where the layer's cached prefix
        keeps them, they are stored, captured, injected into and exchanged as K/V rows are
        (the exchange not overlapped: a reader projects its peers' rows up before the
        attention), and ``up_project(latent, rope_key) -> (k, v)`` makes the keys and values
        of every source the layer reads (:meth:`external_kv`); else nothing (the per-head K/V
        reach :meth:`on_kv`)."""
        if not self._latent_layer(layer_number):
            return None
        self.up_projections[layer_number] = up_project
        return self._on_rows(layer_number, latent, rope_key, overlap=False)

    def _on_rows(self, layer_number: int, key: Tensor, value: Tensor, overlap: bool):
        """A layer's two per-token fields (K and V, or a latent and its RoPE key): into the
        cache, captured or injected into, exchanged (see :meth:`on_kv` in ``PrefixKVHook``)."""
        first_pass = layer_number not in self._written  # a recomputation calls again: write once
        self._written.add(layer_number)
        for s, rows in self.rows.items():
            # (a sliding-window layer keeps the rows from the first some reader's window reaches)
            skip = self.cache.first_kept_row(s, layer_number)
            rows = rows[skip:] if skip else rows
            if self.store and s in self.stored and first_pass:
                self.cache.write(s, layer_number, key.detach().index_select(0, rows),
                                 value.detach().index_select(0, rows), start=skip)
            if self.capture and not self.inject:
                self.captured.append(CapturedRows(s, layer_number, (key.index_select(0, rows),
                                                                    value.index_select(0, rows))))
        if self.injects and torch.is_grad_enabled():
            sources = list(self.rows.items())
            key = InjectCachedGrad.apply(key, self.cache, layer_number, 0, sources)
            value = InjectCachedGrad.apply(value, self.cache, layer_number, 1, sources)
            if not self.exchanges:
                return key, value
        if not self.exchanges:
            return None
        if overlap:
            return self._start_exchange(layer_number, key, value)
        state = self.cache.geometry.state_of(layer_number)
        ex = self.exchanges[state]
        key, value, received = exchange_kv(key, value, ex.send_rows, ex.send_counts, ex.recv_counts, ex.group,
                                           differentiable=self.track_grads, state=state)
        peers = [None] * self.num_peers
        for chain in ex.received:
            fields = state.unpack_rows(received[chain.offset:chain.offset + chain.length])
            if chain.replica is not None and self.store:
                self.cache.write(chain.replica, layer_number, *fields, start=chain.skip)
            if chain.peer is not None:
                # Copies: the attention saves them for backward, and a view would keep the whole
                # received buffer (replica rows included) alive with a kept graph.
                peers[chain.peer] = _rows_from(tuple(f.clone() for f in fields), chain.skip)
        self.peers[layer_number] = peers
        # The attention reads these (the exchange's outputs), so its backward runs on every rank.
        return key, value

    def _start_exchange(self, layer_number: int, key: Tensor, value: Tensor):
        """The overlapped exchange: start the all-to-all, hand the peers to the attention in
        flight (it attends to its other keys first), write the replicas once the rows are here."""
        state = self.cache.geometry.state_of(layer_number)
        ex = self.exchanges[state]
        key, value, buffer, exchange = exchange_kv_start(key, value, ex.send_rows, ex.send_counts, ex.recv_counts,
                                                         ex.group, differentiable=self.track_grads, state=state)
        peers = [None] * self.num_peers
        for chain in ex.received:
            offset = exchange.offsets[chain.src] + chain.within  # the buffer keeps the padding rows
            if chain.replica is not None and self.store:
                # (the cache, not the hook: the exchange lives in the graph, see CachedRead)
                exchange.on_arrival(lambda buf, cache=self.cache, s=chain.replica, o=offset, n=chain.length,
                                    layer=layer_number, unpack=exchange.unpack, skip=chain.skip:
                                    cache.write(s, layer, *unpack(buf[o:o + n]), start=skip))
            if chain.peer is not None:
                peers[chain.peer] = _rows_from(ReceivedKV(exchange, buffer, offset, chain.length), chain.skip)
        self.peers[layer_number] = peers
        self.in_flight[layer_number] = exchange
        return key, value

    def after_attention(self, layer_number: int) -> None:
        """The layer's attention ran: its exchange is complete (waits only where no attention
        read a received row: replicas only), and the received rows are let go (the attention
        and the cache keep copies), so a kept graph holds none of them."""
        exchange = self.in_flight.pop(layer_number, None)
        if exchange is not None:
            exchange.release()

    # ------------------------------------------------------------------ linear-attention layers
    def linear_cuts(self) -> np.ndarray:
        """``LinearPrefixHook``: the last pack row of every source this micro-batch computes and
        of every chain whose state it sends (and its last row when it receives states after the
        layer computed: the layer then hands over its states)."""
        rows = list(self.last_rows.values())
        lx = self.state_exchange
        if lx is not None:
            rows += list(lx.send_last_rows) + ([lx.last_row] if lx.link.after_compute else [])
        return np.unique(np.asarray(rows, dtype=np.int64))

    def external_linear_state(self, layer_number: int) -> LinearState:
        """``LinearPrefixHook``: the cached state and conv tail of every source this micro-batch
        reads (``[E, ...]``, in read order); with a graph, leaves whose gradients hooks add to
        the source's gradient slots (fp32, summed over every reader)."""
        count = layer_number not in self._counted  # a recomputation reads again: count once
        self._counted.add(layer_number)
        fields = [CachedRead(self.cache, s, layer_number, count).leaves(self.track_grads) for s in self.reads]
        if self.num_peers:
            fields += self._peer_states(layer_number)
        recurrent = torch.stack([f[0] for f in fields])
        if len(fields[0]) > 1:
            conv_tail = torch.stack([f[1] for f in fields])
        else:  # a kernel of 1 keeps no conv tail
            conv_tail = recurrent.new_zeros((len(fields), 0, 1))
        return LinearState(recurrent=recurrent, conv_tail=conv_tail)

    def _peer_states(self, layer_number: int) -> List[Tuple[Tensor, ...]]:
        """The states of the chains of other ranks this micro-batch continues now (received
        before the layer computes; with a graph, leaves whose gradient goes back to the sender),
        in peer order; replica chains of the same messages go into the cache."""
        lx, state = self.state_exchange, self.cache.geometry.state_of(layer_number)
        got = lx.link.receive_before(state)
        if self.track_grads and torch.is_grad_enabled():
            got = {src: received_leaf(rows, lx.link, src) for src, rows in got.items()}
        peers: List[Tuple[Tensor, ...]] = [()] * self.num_peers
        for src, i, use in lx.received:
            if src not in got:
                continue
            fields = tuple(f[i] for f in state.unpack_rows(got[src]))
            if use.peer is not None:
                peers[use.peer] = fields
            if use.replica is not None and self.store:
                self.cache.write(use.replica, layer_number, *(f.detach() for f in fields))
        return peers

    def _send_states(self, layer_number: int, segments: SegmentStates) -> Optional[Tensor]:
        """Send the states of the chains other ranks read (and receive the replica-only
        messages); a zero anchor in the graph whose backward takes the readers' gradients."""
        lx, state = self.state_exchange, self.cache.geometry.state_of(layer_number)
        states = segments.states
        picked = [segments.segment_ending_after(int(r)) for r in lx.send_last_rows]
        index = host_to_device(np.asarray(picked, np.int64), states.recurrent.device)
        fields = (states.recurrent.index_select(0, index), states.conv_tail.index_select(0, index))
        rows = state.pack_rows(tuple(f.to(state.dtype) for f in fields[:len(state.fields)]))
        anchor, late = send_states(rows, lx.link, state, differentiable=self.track_grads)
        for src, i, use in lx.received:
            if src in late and use.replica is not None and self.store:
                self.cache.write(use.replica, layer_number, *(f[i] for f in state.unpack_rows(late[src])))
        return anchor

    def on_linear_states(self, layer_number: int, segments: SegmentStates) -> Optional[Tensor]:
        """``LinearPrefixHook``: the final state of every source this micro-batch computes (the
        state of the segment its last token ends) into the cache, and captured with a kept
        graph for the backward to inject the gradient its readers accumulated; with
        recomputation, injected in the graph instead (the returned zero anchor keeps the
        injecting functions in it)."""
        first_pass = layer_number not in self._written  # a recomputation calls again: write once
        self._written.add(layer_number)
        states = segments.states
        picked = {s: segments.segment_ending_after(row) for s, row in self.last_rows.items()}
        state_of = self.cache.geometry.state_of(layer_number)
        for s, g in picked.items():
            fields = (states.recurrent[g], states.conv_tail[g])[:len(state_of.fields)]
            if self.store and s in self.stored and first_pass:
                self.cache.write(s, layer_number, *(f.detach() for f in fields))
            if self.capture and not self.inject:
                self.captured.append(CapturedRows(s, layer_number, fields))
        sent = None
        if self.state_exchange is not None and self.state_exchange.link.after_compute:
            sent = self._send_states(layer_number, segments)
        if not (self.injects and torch.is_grad_enabled()):
            return sent
        device = states.recurrent.device
        sources = [(s, host_to_device(np.array([g], np.int64), device)) for s, g in picked.items()]
        anchor = InjectCachedGrad.apply(states.recurrent, self.cache, layer_number, 0, sources).sum() * 0.0
        if len(state_of.fields) > 1:
            anchor = anchor + InjectCachedGrad.apply(states.conv_tail, self.cache, layer_number, 1, sources).sum() * 0.0
        return anchor if sent is None else anchor + sent

    def external_kv(self, layer_number: int) -> Sequence[Union[Tuple[Tensor, Tensor], PrefixCopies, "CachedRead",
                                                                ReceivedKV]]:
        out: List[Union[Tuple[Tensor, Tensor], PrefixCopies, CachedRead, ReceivedKV]] = []
        count = layer_number not in self._counted  # a recomputation reads again: count once
        self._counted.add(layer_number)
        if self._latent_layer(layer_number):  # every source's rows projected up to K/V (leaves: see leaves)
            up_project = self.up_projections.pop(layer_number)
            rows = [CachedRead(self.cache, s, layer_number, count).leaves(self.track_grads) for s in self.reads]
            return [up_project(*fields) for fields in rows + self.peers.pop(layer_number, [])]
        for s in self.reads:
            reader = CachedRead(self.cache, s, layer_number, count)
            # copies are gathered by the attention: a sliding window's layer gathers only its rows
            out.append(reader if self.track_grads and self.gather_in_backward else PrefixCopies(reader, self.track_grads))
        out += self.peers.pop(layer_number, [])
        return out


class CachedRead:
    """A cached prefix's K/V of one layer as the attention reads it (``CachedPrefixKV``).

    It holds the cache only, never the hook: the hook holds tensors of the graph (captured
    K/V rows), and a graph -> reader -> hook -> graph cycle would keep the whole graph alive
    after its backward (autograd's C++ references are invisible to Python's GC)."""

    __slots__ = ("cache", "source", "layer", "count")

    def __init__(self, cache: BlockKVCache, source: int, layer: int, count: bool):
        self.cache, self.source, self.layer, self.count = cache, source, layer, count

    def read(self, again: bool = False, start: int = 0) -> Tuple[Tensor, Tensor]:
        # (``start`` only when a sliding window skips rows: the cache's plain call otherwise)
        rows = {"start": start} if start else {}
        return self.cache.read(self.source, self.layer, count=self.count and not again, **rows)

    def add_grad(self, grad_key: Tensor, grad_value: Tensor, start: int = 0) -> None:
        rows = {"start": start} if start else {}
        self.cache.accumulate_grad(self.source, self.layer, grad_key, grad_value, **rows)

    def leaves(self, track_grads: bool) -> Tuple[Tensor, ...]:
        """Every field (a fixed state's too) as read; with ``track_grads``, leaves whose
        gradients hooks add to the source's gradient slots."""
        fields = self.read()
        if not track_grads:
            return fields
        cache, s, layer, n = self.cache, self.source, self.layer, len(fields)
        for i, f in enumerate(fields):
            f.requires_grad_(True)
            f.register_hook(lambda g, i=i: cache.accumulate_grad(s, layer, *(g if j == i else None for j in range(n))))
        return fields

    def materialize(self, start: int = 0) -> Tuple[Tensor, Tensor]:
        """Leaf copies (of the rows from ``start`` on) whose gradients hooks add to the source's
        dK/dV (kernels that take tensors)."""
        cache, s, layer = self.cache, self.source, self.layer
        k, v = self.read(start=start)
        k.requires_grad_(True)
        v.requires_grad_(True)
        rows = {"start": start} if start else {}
        k.register_hook(lambda g: cache.accumulate_grad(s, layer, g, None, **rows))
        v.register_hook(lambda g: cache.accumulate_grad(s, layer, None, g, **rows))
        return k, v


_TAP_MIXERS = {Tap.RECURRENT_MIXER: (TreeGatedDeltaNet, "a recurrent prefix state"),
               Tap.BEFORE_UP_PROJECTION: (TreeMLASelfAttention, "a latent prefix state")}
"""The taps :class:`PrefixKV` serves inside a mixer (the third, post-RoPE K/V, is megatron's
core-attention slot): the module that reads and writes each, and what it keeps."""


def check_prefix_taps(arch, geometry, model=None) -> None:
    """Refuse, before any step, a layer whose prefix state the engine cannot reach: its hook
    (:class:`PrefixKV`) sits in megatron's core-attention slot (post-RoPE K/V), in the
    tree-packed Gated DeltaNet (its recurrent state) and in the tree-packed latent attention
    (its latent): with ``model``, the layer's mixer must be the module of :data:`_TAP_MIXERS`,
    and a latent one not sequence-parallel."""
    mixers = {}
    if model is not None:
        mixers = {m.layer_number: m for chunk in model_chunks(model) for m in chunk.modules()
                  if isinstance(m, (TreeGatedDeltaNet, TreeMLASelfAttention))}
    for layer, state in zip(geometry.layers, geometry.layer_states):
        if model is None or state.tap not in _TAP_MIXERS:
            continue
        cls, what = _TAP_MIXERS[state.tap]
        mixer = mixers.get(layer)
        if not isinstance(mixer, cls):
            raise UnsupportedModelError(f"model type {arch.model_type!r}: layer {layer} keeps {what} but its mixer "
                                        f"is not a {cls.__name__}, the layer that reads and writes it")
        if state.tap is Tap.BEFORE_UP_PROJECTION and mixer.config.sequence_parallel \
                and mixer.config.tensor_model_parallel_size > 1:
            raise UnsupportedModelError("a latent prefix cache (--latent-cache latent) under sequence parallelism is "
                                        "not supported (a rank holds only its rows' latent): use --latent-cache "
                                        "per-head")
