"""Execute one rank's share of a step plan: forward/backward of every micro-batch.

Mechanism 1 is just the model run on a tree-packed micro-batch. Mechanism 2 adds three steps
around it, driven by the plan's schedule:

- ``forward`` of a producer: its sources' K/V are written into the KV cache (the attention
  hook sees every layer's post-RoPE K/V); the graph is either kept (its loss and the
  differentiable K/V rows of its sources are held) or dropped (forward under no_grad);
- readers attend to cached K/V read through the block tables as extra (leaf) keys/values;
  hooks on those leaves add their gradients into the source's dK/dV blocks;
- ``backward`` of a producer, once every reader is done: (recompute the forward if the graph
  was dropped, then) ``torch.autograd.backward([loss, K_rows, V_rows, ...],
  [1, dK, dV, ...])`` injects the accumulated gradients, so the prefix's parameters receive
  exactly the sum over all its descendants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.attention.metadata import TreeAttentionMetadata
from megatron_psrl.distributed.kv_exchange import ReceivedKV, exchange_kv, exchange_kv_start, return_replica_grads
from megatron_psrl.engine.head_sends import HeadSends
from megatron_psrl.engine.host_copy import DeviceSums, host_to_device
from megatron_psrl.kvcache.manager import BlockKVCache
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.logits import DEFAULT_CHUNK_BYTES, chunk_rows, chunked_logprobs
from megatron_psrl.rl.loss import ClaimLoss, ClaimView, SequenceLoss, claim_coefficients, gather_claims
from megatron_psrl.schedule.memory import MemoryPlan
from megatron_psrl.schedule.packing import PackedMicroBatch
from megatron_psrl.schedule.plan import RankPlan, StepPlan

Tensor = torch.Tensor


class _InjectCachedGrad(torch.autograd.Function):
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
        for s, rows in ctx.sources:
            grad.index_add_(0, rows, ctx.cache.read_grad(s, ctx.layer)[ctx.index].to(grad.dtype))
        return grad, None, None, None, None


class _PrefixKV:
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
        """Activation recomputation: inject dK/dV inside the graph (:class:`_InjectCachedGrad`)
        instead of capturing K/V rows; writes and read metrics happen once per layer."""
        self._written: set = set()
        self._counted: set = set()
        self.reads = list(mb.reads)
        self.store = store
        self.capture = capture
        self.track_grads = track_grads
        self.gather_in_backward = gather_in_backward
        """Hand the attention :class:`_CachedRead` readers (gathered again in its backward, no
        copy kept by the graph) instead of gathered copies; the memory plan decided it."""
        device = cache.geometry.device

        def pack_rows(tokens: np.ndarray) -> Tensor:
            return host_to_device(np.searchsorted(pack.tree_tokens, tokens), device)

        # Pack rows of every source this rank computes here (replicas arrive by exchange).
        own = [s for s in mb.produces if rank_plan.sources[s].replica_of is None]
        self.rows = {s: pack_rows(rank_plan.sources[s].tokens) for s in own}
        self.stored = [s for s in own if "k" in rank_plan.sources[s].kinds]
        self.captured: List[Tuple[int, int, Tensor, Tensor]] = []
        self.exchange = None
        self.overlap = overlap
        """Overlap the exchange with the attention over local keys (``--no-overlap-kv-exchange``
        turns it off): the peers are handed over in flight (:class:`ReceivedKV`)."""
        self.num_peers = len(mb.peer_reads)
        self.peers: Dict[int, List[Union[Tuple[Tensor, Tensor], ReceivedKV]]] = {}
        self.in_flight: Dict[int, object] = {}
        """Overlapped exchange: the layer's transfer until its attention ran (:meth:`after_attention`)."""
        ex = mb.exchange
        if ex is not None and ex.forward_collective:
            send = [c for dst in range(group_size) for c in ex.send.get(dst, [])]
            send_rows = pack_rows(np.concatenate(send)) if send else torch.zeros(0, dtype=torch.int64, device=device)
            layout, offset = [], 0
            for src in range(group_size):
                within = 0
                for use in ex.recv.get(src, []):
                    layout.append((offset, src, within, use.length, use.peer, use.replica))
                    offset += use.length
                    within += use.length
            self.exchange = (send_rows, ex.send_counts(group_size), ex.recv_counts(group_size), layout, group)

    @property
    def injects(self) -> bool:
        """This forward injects cached dK/dV inside its graph (recomputation, a producer's
        graph-building pass)."""
        return self.inject and self.capture and bool(self.rows)

    def on_kv(self, layer_number: int, key: Tensor, value: Tensor):
        first_pass = layer_number not in self._written  # a recomputation calls again: write once
        self._written.add(layer_number)
        for s, rows in self.rows.items():
            if self.store and s in self.stored and first_pass:
                self.cache.write(s, layer_number, key.detach().index_select(0, rows), value.detach().index_select(0, rows))
            if self.capture and not self.inject:
                self.captured.append((s, layer_number, key.index_select(0, rows), value.index_select(0, rows)))
        if self.injects and torch.is_grad_enabled():
            sources = list(self.rows.items())
            key = _InjectCachedGrad.apply(key, self.cache, layer_number, 0, sources)
            value = _InjectCachedGrad.apply(value, self.cache, layer_number, 1, sources)
            if self.exchange is None:
                return key, value
        if self.exchange is None:
            return None
        send_rows, send_counts, recv_counts, layout, group = self.exchange
        if self.overlap:
            return self._start_exchange(layer_number, key, value)
        key, value, received = exchange_kv(key, value, send_rows, send_counts, recv_counts, group,
                                           differentiable=self.track_grads)
        peers = [None] * self.num_peers
        for offset, _, _, length, peer, replica in layout:
            chunk = received[offset:offset + length]  # [n, 2, ng, hn]
            if replica is not None and self.store:
                self.cache.write(replica, layer_number, chunk[:, 0], chunk[:, 1])
            if peer is not None:
                # Copies: the attention saves them for backward, and a view would keep the whole
                # received buffer (replica rows included) alive with a kept graph.
                peers[peer] = (chunk[:, 0].clone(), chunk[:, 1].clone())
        self.peers[layer_number] = peers
        # The attention reads these (the exchange's outputs), so its backward runs on every rank.
        return key, value

    def _start_exchange(self, layer_number: int, key: Tensor, value: Tensor):
        """The overlapped exchange: start the all-to-all, hand the peers to the attention in
        flight (it attends to its other keys first), write the replicas once the rows are here."""
        send_rows, send_counts, recv_counts, layout, group = self.exchange
        key, value, buffer, transfer = exchange_kv_start(key, value, send_rows, send_counts, recv_counts, group,
                                                         differentiable=self.track_grads)
        peers = [None] * self.num_peers
        for _, src, within, length, peer, replica in layout:
            offset = transfer.offsets[src] + within  # the buffer keeps the padding rows
            if replica is not None and self.store:
                # (the cache, not the hook: the transfer lives in the graph, see _CachedRead)
                transfer.on_arrival(lambda buf, cache=self.cache, s=replica, o=offset, n=length, layer=layer_number:
                                    cache.write(s, layer, buf[o:o + n, 0], buf[o:o + n, 1]))
            if peer is not None:
                peers[peer] = ReceivedKV(transfer, buffer, offset, length)
        self.peers[layer_number] = peers
        self.in_flight[layer_number] = transfer
        return key, value

    def after_attention(self, layer_number: int) -> None:
        """The layer's attention ran: its transfer is complete (waits only where no attention
        read a received row: replicas only), and the received rows are let go (the attention
        and the cache keep copies), so a kept graph holds none of them."""
        transfer = self.in_flight.pop(layer_number, None)
        if transfer is not None:
            transfer.release()

    def external_kv(self, layer_number: int) -> Sequence[Union[Tuple[Tensor, Tensor], "_CachedRead", ReceivedKV]]:
        out: List[Union[Tuple[Tensor, Tensor], _CachedRead, ReceivedKV]] = []
        count = layer_number not in self._counted  # a recomputation reads again: count once
        self._counted.add(layer_number)
        for s in self.reads:
            reader = _CachedRead(self.cache, s, layer_number, count)
            if not self.track_grads:
                out.append(reader.read())
            elif self.gather_in_backward:
                out.append(reader)
            else:
                out.append(reader.materialize())
        out += self.peers.pop(layer_number, [])
        return out


class _CachedRead:
    """A cached prefix's K/V of one layer as the attention reads it (``CachedPrefixKV``).

    It holds the cache only, never the hook: the hook holds tensors of the graph (captured
    K/V rows), and a graph -> reader -> hook -> graph cycle would keep the whole graph alive
    after its backward (autograd's C++ references are invisible to Python's GC)."""

    __slots__ = ("cache", "source", "layer", "count")

    def __init__(self, cache: BlockKVCache, source: int, layer: int, count: bool):
        self.cache, self.source, self.layer, self.count = cache, source, layer, count

    def read(self, again: bool = False) -> Tuple[Tensor, Tensor]:
        return self.cache.read(self.source, self.layer, count=self.count and not again)

    def add_grad(self, grad_key: Tensor, grad_value: Tensor) -> None:
        self.cache.accumulate_grad(self.source, self.layer, grad_key, grad_value)

    def materialize(self) -> Tuple[Tensor, Tensor]:
        """Leaf copies whose gradients hooks add to the source's dK/dV (kernels that take tensors)."""
        cache, s, layer = self.cache, self.source, self.layer
        k, v = self.read()
        k.requires_grad_(True)
        v.requires_grad_(True)
        k.register_hook(lambda g: cache.accumulate_grad(s, layer, g, None))
        v.register_hook(lambda g: cache.accumulate_grad(s, layer, None, g))
        return k, v


@dataclass
class StepOutput:
    """What one rank's share of a step produced (all sums are local to this rank)."""

    loss: float = 0.0
    """Sum of this rank's claim losses (already normalised globally: ranks add up)."""

    metrics: Dict[str, float] = field(default_factory=dict)
    """Sums of pg_loss / kl / entropy / clip_frac contributions."""

    tokens_computed: int = 0
    """Tokens run through the model, recomputations included."""

    tokens_recomputed: int = 0
    """Tokens whose forward ran twice (producers that dropped their graph)."""

    num_micro_batches: int = 0
    key_pairs: int = 0
    """(query, key) pairs attended, external keys included."""

    logprobs: Optional["ComputedLogprobs"] = None
    """The log-probs of every tree token this rank computed (training: the claimed tokens;
    forward-only: all)."""


class ComputedLogprobs:
    """Tree-token log-probs a call computed (and, ``with_entropy``, the entropy of each
    predicting distribution), kept where they were computed (on the device, no host sync per
    micro-batch) until :meth:`arrays` reads them all at once."""

    def __init__(self, with_entropy: bool = False) -> None:
        self.with_entropy = with_entropy
        self._parts: List[Tuple[np.ndarray, Tensor]] = []
        self._entropy: List[Tensor] = []

    def add(self, tree_tokens: np.ndarray, logp: Tensor, entropy: Optional[Tensor] = None) -> None:
        self._parts.append((tree_tokens, logp.detach()))
        if self.with_entropy:
            self._entropy.append(entropy.detach())

    def arrays(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(tree token indices int64, log-probs float32)``."""
        if not self._parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        index = np.concatenate([t for t, _ in self._parts]).astype(np.int64)
        values = torch.cat([v.float() for _, v in self._parts]).cpu().numpy()
        return index, values

    def entropy_array(self) -> np.ndarray:
        """float32 entropies aligned with :meth:`arrays`' indices (``with_entropy`` only)."""
        if not self.with_entropy:
            raise RuntimeError("entropies were not recorded (ComputedLogprobs(with_entropy=True))")
        if not self._entropy:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([e.float() for e in self._entropy]).cpu().numpy()


def _expert_parallel_group(model):
    """The expert-parallel group of an MoE model with EP > 1, else None."""
    from megatron.core import parallel_state

    config = model_chunks(model)[0].config
    if not getattr(config, "num_moe_experts", None) or not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_expert_model_parallel_group()


class StepRunner:
    """Runs micro-batches of a plan through a model on this rank."""

    def __init__(
        self,
        model,
        vocab_size: int,
        device: torch.device,
        attention_backend: Optional[str] = None,
        kv_cache: Optional[BlockKVCache] = None,
        exchange_group=None,
        loss_head_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        inject_kv_grads: bool = False,
    ):
        self.model = model
        self.last_layer_row_skip = True
        """The model's last layer computes only the rows the loss head reads, past its K/V
        projection (``ActorConfig.last_layer_row_skip``; ``TreeAttentionMetadata.output_rows``)."""
        self.overlap_kv_exchange = True
        """Cross-rank: overlap every layer's prefix K/V exchange with the attention over the keys
        this rank has (``ActorConfig.overlap_kv_exchange``; exact either way)."""
        self.inject_kv_grads = inject_kv_grads
        """Activation recomputation is on: cached-prefix gradients are injected inside the graph."""
        self.loss_head_chunk_bytes = loss_head_chunk_bytes
        """fp32 logits of one chunk of claimed rows (the loss head's peak)."""
        self.head = model_chunks(model)[-1]
        """The chunk with the output layer (the model itself without virtual pipeline stages)."""
        self.vocab_size = vocab_size
        self.device = device
        self.attention_backend = attention_backend
        self.kv_cache = kv_cache
        self.exchange_group = exchange_group
        """Process group of the ranks that exchange prefix K/V (cross-rank plans)."""
        self.transfer_group = None
        """The data x context parallel group, over which prefix heads travel between exchange
        groups (:mod:`megatron_psrl.engine.head_sends`; a rank's index in it is its placement
        rank); needed by plans with transfers."""
        self._gather_in_backward = False
        """This step's memory plan has readers gather cached K/V again in backward."""
        self.expert_group = _expert_parallel_group(model)
        """MoE models with expert parallelism: the ranks whose MoE layers exchange tokens in every
        forward and backward pass (their passes run in lockstep, :class:`ExpertLockstep`)."""
        self._lockstep = None
        self._replayer = None
        """Router replay (:class:`~megatron_psrl.model.moe.RouterReplayer`), made at the first batch with routes."""
        self.router_losses = None
        """MoE router z-loss / load-balancing loss (:class:`~megatron_psrl.model.moe_losses.RouterLosses`), or None."""
        self._held_routes: Dict[int, Tuple[Tensor, Optional[np.ndarray]]] = {}
        """Routes of kept graphs whose backward recomputes their forward (activation recomputation)."""
        self.last_empty_expert_passes = 0
        """Empty MoE passes this rank ran in its last call to keep its expert-parallel group in step."""

    # ------------------------------------------------------------------ one forward
    def _forward(
        self,
        plan: StepPlan,
        rank_plan: RankPlan,
        i: int,
        pack: PackedMicroBatch,
        *,
        rows: np.ndarray,
        loss_cfg: Optional[ClaimLoss],
        coefficients: Optional[np.ndarray],
        grad: bool,
        store: bool,
        capture: bool,
        record: Optional[ComputedLogprobs] = None,
    ):
        mb = rank_plan.micro_batches[i]
        hook = None
        exchanging = mb.exchange is not None and mb.exchange.forward_collective
        if mb.reads or mb.produces or exchanging:
            if self.kv_cache is None:
                raise RuntimeError("a plan with cached prefixes needs a KV cache (mechanism 2)")
            group_size = dist.get_world_size(self.exchange_group) if exchanging else 1
            hook = _PrefixKV(self.kv_cache, rank_plan, i, pack, store=store, capture=capture, track_grads=grad,
                             group=self.exchange_group, group_size=group_size, inject=self.inject_kv_grads,
                             gather_in_backward=self._gather_in_backward, overlap=self.overlap_kv_exchange)
        out_rows = self._output_rows(pack, rows)
        meta = TreeAttentionMetadata(plan=pack.plan, backend=self.attention_backend, kv_hook=hook,
                                     output_rows=out_rows)
        ids = host_to_device(pack.input_ids, self.device)
        pos = host_to_device(pack.position_ids, self.device)
        self._replay_routes(plan, i, pack, meta.output_rows, keep=grad and capture)
        if self.router_losses is not None:  # the weights of the rows the routers see
            self.router_losses.set_pack(i, pack)
        with torch.set_grad_enabled(grad):
            hidden = self._stage_forward(i, ids, pos, meta, grad)  # [t, h]; None before the last stage
            if hidden is None:
                return None, {}, None, hook
            if hidden.shape[0] == pack.num_tokens:  # the last layer ran in full (see PsrlTransformerLayer)
                out_rows = None
            # In an exchange step every rank must run a backward through every layer's exchange
            # (a collective), even a rank whose fragment claims nothing: a zero "anchor" loss.
            # Injected prefix gradients (recomputation) need a root that reaches every layer too.
            injecting = hook is not None and hook.injects
            # Expert parallelism: every forward with a graph has its backward (the lockstep's plan).
            # Router losses: every forward's backward reaches every router (a pack without a loss too).
            anchor = (hidden.sum() * 0.0) if ((exchanging or injecting or self.expert_group is not None
                                               or self.router_losses is not None) and grad) else None
            if len(rows) == 0:
                return anchor, {}, None, hook
            loss, metrics, logp = self._loss_head(plan, pack, hidden, rows, loss_cfg, coefficients, record,
                                                  hidden_rows=out_rows)
            if loss is not None and anchor is not None:  # keep every layer's exchange in the graph
                loss = loss + anchor
        return loss, metrics, logp, hook

    def _output_rows(self, pack: PackedMicroBatch, rows: np.ndarray) -> Optional[np.ndarray]:
        """The pack rows whose final hidden states the loss head reads (ascending), for the last
        layer to compute only them; None: every row (the skip is off, or would skip nothing)."""
        if not self.last_layer_row_skip:
            return None
        keep = np.unique(pack.logit_rows[rows])
        if len(keep) == 0:
            # One row still: its attention keeps the last layer's K/V (their hook, exchange and
            # injected dK/dV) in the graph, and an MoE layer gets a token to route.
            keep = np.array([pack.num_tokens - 1], dtype=np.int64)
        return keep if len(keep) < pack.num_tokens else None

    def _loss_head(self, plan: StepPlan, pack: PackedMicroBatch, hidden: Tensor, rows: np.ndarray,
                   loss_cfg: Optional[ClaimLoss], coefficients: Optional[np.ndarray],
                   record: Optional[ComputedLogprobs], hidden_rows: Optional[np.ndarray] = None):
        """``(loss, metrics, logp)`` of the pack rows ``rows`` from final hidden states ``[t, h]``
        (``hidden_rows``: ``hidden`` holds these pack rows only, ascending; ``loss`` None without
        a loss)."""
        sel = pack.logit_rows[rows]
        if hidden_rows is not None:  # the last layer computed hidden_rows only: rows -> their index
            sel = np.searchsorted(hidden_rows, sel)
        sel_rows = host_to_device(sel, self.device)
        targets = pack.logit_targets[rows]
        target_ids = host_to_device(plan.tree.tokens[targets].astype(np.int64), self.device)
        want_entropy = ((loss_cfg is not None and loss_cfg.needs_entropy)
                        or (record is not None and record.with_entropy))
        # [n, V/tp] logits only a chunk of rows at a time (forward and backward)
        logp, ent = chunked_logprobs(self.head.output_logits, hidden.index_select(0, sel_rows), target_ids,
                                     self.vocab_size, with_entropy=want_entropy, rows_per_chunk=self._head_rows())
        if record is not None:  # the log-probs this call computed, returned to the caller
            record.add(targets, logp, ent)
        if loss_cfg is None:
            return None, {}, logp
        claims = gather_claims(plan.tree, coefficients, targets, loss_cfg, self.device)
        loss, metrics = loss_cfg(logp, ent, claims)
        return loss, metrics, logp

    def _replay_routes(self, plan: StepPlan, i: int, pack: PackedMicroBatch, output_rows: Optional[np.ndarray],
                       keep: bool) -> None:
        """Router replay (docs/moe.md): the rollout's routes of the pack's rows, gathered like their
        token ids, into every MoE router before the forward (``output_rows``: the rows the last
        layer may compute alone; ``keep``: a producer's graph, held for its backward if that
        recomputes the forward); samples without routes: the routers' own top-k."""
        if self._replayer is None and plan.tree.batch.routed_experts is None:
            return  # the route-free path: nothing to set
        if self._replayer is None:
            from megatron_psrl.model.moe import RouterReplayer

            self._replayer = RouterReplayer(self.model)
        routes = self._replayer.pack_routes(plan.tree, pack.tree_tokens, self.device)  # [t, L, k]
        self._replayer.set(routes, output_rows)
        if routes is not None and keep and self.inject_kv_grads:
            self._held_routes[i] = (routes, output_rows)

    def _end_replay(self) -> None:
        """The routers' own top-k again after a step (a later forward may carry no routes)."""
        if self._replayer is not None:
            self._replayer.set(None)
        self._held_routes.clear()

    def _head_rows(self) -> int:
        """Claimed rows per loss-head chunk, from this rank's vocabulary slice."""
        head = self.head
        weight = (head.shared_embedding_or_output_weight() if head.share_embeddings_and_output_weights
                  else head.output_layer.weight)
        return chunk_rows(weight.shape[0], self.loss_head_chunk_bytes)

    # ------------------------------------------------------------------ stage hooks
    # One pipeline stage runs the whole model here; PipelineStepRunner overrides these three.
    def _stage_forward(self, i: int, ids: Tensor, pos: Tensor, meta: TreeAttentionMetadata, grad: bool) -> Optional[Tensor]:
        """Hidden states ``[t, h]`` of micro-batch ``i`` (``None`` on a stage without the loss)."""
        return self.model(ids, pos, meta).squeeze(1)  # a view: its backward allocates nothing

    def _stage_backward(self, i: int, loss: Optional[Tensor], kv_grads: Sequence[Tuple[int, Tensor, Tensor]]) -> None:
        """Backward of micro-batch ``i`` from its (scaled) loss and the K/V rows it produced,
        ``(layer, rows, their accumulated gradient)``: injected dK/dV."""
        tensors = [loss] if loss is not None else []
        grads = [torch.ones_like(loss)] if loss is not None else []
        for _, rows, grad in kv_grads:
            tensors.append(rows)
            grads.append(grad)
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _finish(self, out: StepOutput) -> StepOutput:
        """The step's outputs, the same on every stage."""
        return out

    def _from_loss_stage(self, value):
        """``value`` as the stage that computes the loss has it."""
        return value

    def _return_replica_grads(self, rank_plan: RankPlan, i: int) -> None:
        """Cross-rank, before the deferred backward of step ``i``: every rank sends the dK/dV
        its replicas of step ``i``'s prefixes accumulated to their owners, who add them to
        their own gradient blocks (one collective over the exchange group)."""
        ex = rank_plan.micro_batches[i].exchange
        if ex is None or not ex.backward_collective:
            return
        cache, g = self.kv_cache, dist.get_world_size(self.exchange_group)
        geometry = cache.geometry
        layers = geometry.layers

        def stacked(s: int) -> Tensor:  # [n, layers, 2, ng, hn]
            return torch.stack([torch.stack(cache.read_grad(s, layer), dim=1) for layer in layers], dim=1)

        send_ids = [s for owner in range(g) for s in ex.grad_send.get(owner, [])]
        shape = (0, geometry.num_layers, 2, geometry.num_groups, geometry.head_dim)
        send = torch.cat([stacked(s) for s in send_ids]) if send_ids else \
            torch.zeros(shape, dtype=torch.float32, device=geometry.device)  # dK/dV travel in fp32
        length = lambda s: rank_plan.sources[s].length  # noqa: E731
        send_counts = [sum(length(s) for s in ex.grad_send.get(r, [])) for r in range(g)]
        recv_counts = [sum(length(s) for s in ex.grad_recv.get(r, [])) for r in range(g)]
        received = return_replica_grads(send, send_counts, recv_counts, self.exchange_group)
        offset = 0
        for src in range(g):
            for s in ex.grad_recv.get(src, []):
                chunk = received[offset:offset + length(s)]
                offset += length(s)
                for j, layer in enumerate(layers):
                    cache.accumulate_grad(s, layer, chunk[:, j, 0], chunk[:, j, 1])

    def _start_transfers(self, plan: StepPlan, rank: int, with_grads: bool) -> Optional[HeadSends]:
        """This rank's part in the step's prefix transfers (posts its first messages), or None."""
        if not plan.head_sends:
            return None
        if self.transfer_group is None:
            raise RuntimeError("a plan with prefix transfers needs the runner's transfer_group")
        return HeadSends(plan, rank, self.kv_cache, self.transfer_group, with_grads)

    # ------------------------------------------------------------------ expert parallelism
    @staticmethod
    def _train_passes(rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Tuple[str, int]]:
        """This rank's passes of a training step in order (:data:`megatron_psrl.model.moe.Pass`):
        ``P`` forward + backward, ``K`` a kept graph's forward and ``B`` its backward, ``N`` a
        forward whose graph is dropped (recomputed by a ``P`` at its backward)."""
        passes = []
        for op, i in rank_plan.schedule:
            if not rank_plan.micro_batches[i].computes:
                continue  # (a transfer micro-batch runs no model)
            keep = memory.keep_graph.get(i, True) if memory is not None else True
            if op == "forward_backward":
                passes.append(("P", i))
            elif op == "forward":
                passes.append(("K" if keep else "N", i))
            else:
                passes.append(("B" if keep else "P", i))
        return passes

    @staticmethod
    def _lockstep_participant(plan: StepPlan, rank: int):
        """Who runs this rank's passes together, as one participant of the expert lockstep: the
        whole exchange group of a cross-rank plan (its ranks run one schedule and exchange K/V
        inside every pass, so none may run an empty pass while another runs its own: the
        lockstep runs kept forwards and backwards one participant at a time), else the rank
        (with its tensor-parallel peers, which share its placement rank)."""
        if plan.ranks[rank].cross_rank:
            return ("exchange group", min(next(g for g in plan.groups if rank in g)))
        return ("rank", rank)

    def _start_lockstep(self, passes: List[Tuple[str, int]], participant):
        """``lock(kind)``, called before each pass: without expert parallelism it does nothing;
        with it, it first runs the empty passes the group's common schedule puts before it."""
        if self.expert_group is None:
            return lambda symbol: None
        from megatron_psrl.model.moe import ExpertLockstep, moe_layers, recompute_units

        chunks = model_chunks(self.model)
        layers = [layer for chunk in chunks for layer in moe_layers(chunk)]
        config = chunks[0].config
        # (activation recomputation: the empty passes checkpoint the MoE layers as the model does)
        self._lockstep = ExpertLockstep(layers, self.expert_group, passes, config.hidden_size, config.params_dtype,
                                        self.device, units=recompute_units(chunks), peer_key=participant)
        return self._lockstep.own

    def _finish_lockstep(self) -> None:
        if self._lockstep is not None:
            self._lockstep.finish()
            self.last_empty_expert_passes = self._lockstep.empty_passes
            self._lockstep = None

    def _claimed_rows(self, plan: StepPlan, pack: PackedMicroBatch) -> np.ndarray:
        t = pack.logit_targets
        return np.flatnonzero(plan.tree.claim_offsets[t + 1] > plan.tree.claim_offsets[t])

    # ------------------------------------------------------------------ a training step
    def train(
        self,
        plan: StepPlan,
        rank: int,
        loss_cfg: ClaimLoss,
        memory: Optional[MemoryPlan] = None,
        loss_scale: float = 1.0,
    ) -> StepOutput:
        """Forward + backward of every micro-batch of ``rank``; gradients accumulate in the
        model's parameters (the caller reduces them across data-parallel ranks).

        ``loss_scale`` multiplies every loss before its backward (fp16 loss scaling; the
        optimizer unscales). Injected prefix gradients come from scaled losses already."""
        rank_plan = plan.ranks[rank]
        # Normalisation over the whole global batch, from the original samples.
        coefficients = claim_coefficients(plan.tree, getattr(loss_cfg, "loss_agg", None) or "token-mean")
        out = StepOutput(num_micro_batches=sum(mb.computes for mb in rank_plan.micro_batches),
                         logprobs=ComputedLogprobs())
        cache = self.kv_cache
        self._gather_in_backward = memory is not None and memory.gathers_in_backward
        if rank_plan.sources:
            if memory is None:
                raise RuntimeError("a plan with cached prefixes needs a memory plan")
            cache.begin_step(memory.block_size, memory.pool_blocks)
        elif cache is not None:
            cache.release_pool()  # a step without cached prefixes holds no KV memory
        # producer -> (its loss and captured K/V rows if the graph is kept, else its pack to recompute)
        pending: Dict[int, Tuple[Optional[Tensor], Optional[List], Optional[PackedMicroBatch]]] = {}
        release_kv_after: Dict[int, List[int]] = {}  # schedule step -> sources whose K/V go then
        for s, last in (memory.kv_release_step.items() if rank_plan.sources else ()):
            release_kv_after.setdefault(last, []).append(s)
        sums = DeviceSums()  # read once at the end of the step (no host sync per micro-batch)

        def account(loss, metrics):
            sums.add("loss", loss)
            for k, v in metrics.items():
                sums.add(k, v)

        lock = self._start_lockstep(self._train_passes(rank_plan, memory), self._lockstep_participant(plan, rank))
        if self.router_losses is not None:
            self.router_losses.begin_step(plan.tree, loss_scale)
        transfers = self._start_transfers(plan, rank, with_grads=True)
        for step_idx, (op, i) in enumerate(rank_plan.schedule):
            mb = rank_plan.micro_batches[i]
            if not mb.computes:  # an import receives heads (and returns their gradients); idle: nothing
                if mb.role == "import" and op == "forward":
                    for s in mb.produces:
                        cache.allocate(s, rank_plan.sources[s].length, kinds=rank_plan.sources[s].kinds)
                    transfers.receive(i)
                elif mb.role == "import":
                    transfers.return_grads(i)
                    for s in mb.produces:
                        cache.free(s, ("gk", "gv", "k", "v"))
                for s in release_kv_after.get(step_idx, ()):
                    cache.free(s, ("k", "v"))
                continue
            if op in ("forward", "forward_backward"):
                pack = rank_plan.pack(plan.index, i)
                out.tokens_computed += pack.num_tokens
                out.key_pairs += pack.key_pairs()
                rows = self._claimed_rows(plan, pack)
            if op == "forward_backward":
                lock("P")
                loss, metrics, _, _ = self._forward(plan, rank_plan, i, pack, rows=rows, loss_cfg=loss_cfg,
                                                    coefficients=coefficients, grad=True, store=False, capture=False,
                                                    record=out.logprobs)
                account(loss, metrics)
                self._stage_backward(i, loss * loss_scale if loss is not None else None, [])
            elif op == "forward":
                for s in mb.produces:
                    cache.allocate(s, rank_plan.sources[s].length, kinds=rank_plan.sources[s].kinds)
                keep = memory.keep_graph.get(i, True) if memory is not None else True
                lock("K" if keep else "N")
                # A dropped graph computes no loss now: the recomputation at backward does.
                loss, metrics, _, hook = self._forward(plan, rank_plan, i, pack, rows=rows if keep else rows[:0], loss_cfg=loss_cfg,
                                                       coefficients=coefficients, grad=keep, store=True, capture=keep,
                                                       record=out.logprobs)
                if keep:
                    account(loss, metrics)
                    pending[i] = (loss, hook.captured if hook is not None else [], None)
                else:
                    pending[i] = (None, None, pack)
                if transfers is not None:
                    transfers.after_forward(i)
            else:  # backward of a producer
                if transfers is not None:
                    transfers.collect_grads(i)
                self._return_replica_grads(rank_plan, i)
                loss, captured, pack = pending.pop(i)
                lock("P" if captured is None else "B")  # (a recomputation's backward is part of its P pass)
                if captured is None:  # graph was dropped: rebuild it
                    rows = self._claimed_rows(plan, pack)
                    loss, metrics, _, hook = self._forward(plan, rank_plan, i, pack, rows=rows, loss_cfg=loss_cfg,
                                                           coefficients=coefficients, grad=True, store=False, capture=True,
                                                           record=out.logprobs)
                    account(loss, metrics)
                    captured = hook.captured if hook is not None else []
                    out.tokens_computed += pack.num_tokens
                    out.tokens_recomputed += pack.num_tokens
                    cache.metrics.tokens_recomputed += pack.num_tokens
                if i in self._held_routes:  # a recomputing backward routes its tokens as their forward did
                    self._replayer.set(*self._held_routes.pop(i))
                if self.router_losses is not None:  # (and weighs them as their forward did)
                    self.router_losses.select(i)
                kv_grads = []
                for s, layer, k_rows, v_rows in captured:
                    gk, gv = cache.read_grad(s, layer)  # fp32 sums over every reader; rounded once here
                    kv_grads += [(layer, k_rows, gk.to(k_rows.dtype)), (layer, v_rows, gv.to(v_rows.dtype))]
                self._stage_backward(i, loss * loss_scale if loss is not None else None, kv_grads)
                for s in mb.produces:
                    cache.free(s, ("gk", "gv", "k", "v"))
            for s in release_kv_after.get(step_idx, ()):
                cache.free(s, ("k", "v"))
        self._finish_lockstep()
        self._end_replay()
        if transfers is not None:
            transfers.finish()
        if rank_plan.sources:
            cache.end_step()
        totals = sums.read()
        out.loss = totals.pop("loss", 0.0)
        out.metrics = totals
        if self.router_losses is not None:  # once per step: the terms' sums over this rank's micro-batches
            for name, value in self.router_losses.end_step().items():
                out.metrics[name] = float(value)
                out.loss += float(value)
        return self._finish(out)

    # ------------------------------------------------------------------ forward only
    @torch.no_grad()
    def sequence_sums(self, plan: StepPlan, rank: int, loss: SequenceLoss,
                      memory: Optional[MemoryPlan] = None) -> np.ndarray:
        """float64 ``[S]``: this rank's share of every sample's ``loss.token_terms`` sum (forward
        only; the caller sums over ranks). The first pass of a :class:`SequenceLoss`."""
        sums = np.zeros(plan.tree.batch.num_samples)
        coefficients = claim_coefficients(plan.tree, "token-mean")

        class _Collect:
            needs_entropy, needs_ref, needs_advantage = loss.needs_entropy, loss.needs_ref, loss.needs_advantage

            def __call__(self, logprobs, entropy, claims):
                view = ClaimView.of(logprobs, entropy, claims)
                np.add.at(sums, claims.sample.cpu().numpy(), loss.token_terms(view).double().cpu().numpy())
                return logprobs.sum() * 0.0, {}

        self._forward_only(plan, rank, memory, claims_loss=_Collect(), coefficients=coefficients)
        return self._from_loss_stage(sums)

    @torch.no_grad()
    def logprobs(self, plan: StepPlan, rank: int, memory: Optional[MemoryPlan] = None,
                 with_entropy: bool = False) -> StepOutput:
        """Log-prob (and, ``with_entropy``, the predicting distribution's entropy) of every
        tree token this rank computes (forward only, no loss)."""
        return self._forward_only(plan, rank, memory, with_entropy=with_entropy)

    def _forward_only(self, plan: StepPlan, rank: int, memory: Optional[MemoryPlan], claims_loss=None,
                      coefficients=None, with_entropy: bool = False) -> StepOutput:
        """Every micro-batch of ``rank`` forward, in order, K/V of cached prefixes freed after
        their last reader: the log-prob of every row, or (``claims_loss``) only of claimed rows,
        handed to ``claims_loss``."""
        rank_plan = plan.ranks[rank]
        out = StepOutput(num_micro_batches=sum(mb.computes for mb in rank_plan.micro_batches),
                         logprobs=ComputedLogprobs(with_entropy))
        cache = self.kv_cache
        if rank_plan.sources:
            if memory is None:
                raise RuntimeError("a plan with cached prefixes needs a memory plan (plan_forward_memory)")
            cache.begin_step(memory.block_size, memory.pool_blocks)
        last_reader = memory.kv_release_step if rank_plan.sources else {}
        lock = self._start_lockstep([("N", i) for i, mb in enumerate(rank_plan.micro_batches) if mb.computes],
                                    self._lockstep_participant(plan, rank))
        transfers = self._start_transfers(plan, rank, with_grads=False)
        for i in range(len(rank_plan.micro_batches)):
            mb = rank_plan.micro_batches[i]
            for s in mb.produces:
                if s in last_reader:  # read on this rank later (an owner read only elsewhere holds nothing)
                    cache.allocate(s, rank_plan.sources[s].length, kinds=("k", "v"))
            if not mb.computes:
                if mb.role == "import":
                    transfers.receive(i)
                continue
            lock("N")
            pack = rank_plan.pack(plan.index, i)
            out.tokens_computed += pack.num_tokens
            rows = np.arange(len(pack.logit_rows)) if claims_loss is None else self._claimed_rows(plan, pack)
            self._forward(plan, rank_plan, i, pack, rows=rows, loss_cfg=claims_loss, coefficients=coefficients,
                          grad=False, store=True, capture=False, record=out.logprobs)
            if transfers is not None:
                transfers.after_forward(i)
            for s in mb.reads:
                if last_reader[s] == i:
                    cache.free(s, ("k", "v"))
        self._finish_lockstep()
        self._end_replay()
        if transfers is not None:
            transfers.finish()
        if rank_plan.sources:
            cache.end_step()
        return self._finish(out)
