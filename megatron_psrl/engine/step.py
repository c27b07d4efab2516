"""Execute one rank's share of a step plan: its instructions, one method per kind.

The rank's plan and memory plan are lowered into typed instructions
(:mod:`megatron_psrl.schedule.instructions`); :meth:`StepRunner.execute` runs them through
:data:`EXECUTE` (one ``run_*`` method per kind) with the step's participants' hooks around them
(:mod:`megatron_psrl.engine.participants`: the expert lockstep, router replay and losses, heads
sent between groups, the KV cache's pool). Training and forward-only passes share it.

Mechanism 1 is just the model run on a tree-packed micro-batch. Mechanism 2 adds three steps
around it:

- the forward of a producer (``ForwardKeep`` / ``ForwardDrop``): its sources' K/V are written
  into the KV cache (the attention hook, :mod:`megatron_psrl.engine.prefix_kv`, sees every
  layer's post-RoPE K/V); the graph is either kept (its loss and the differentiable K/V rows of
  its sources are held) or dropped (forward under no_grad);
- readers attend to cached K/V read through the block tables as extra (leaf) keys/values;
  hooks on those leaves add their gradients into the source's dK/dV blocks;
- the ``Backward`` of a producer, once every reader is done: (recompute the forward if the
  graph was dropped, then) ``torch.autograd.backward([loss, K_rows, V_rows, ...],
  [1, dK, dV, ...])`` injects the accumulated gradients, so the prefix's parameters receive
  exactly the sum over all its descendants.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.attention.metadata import TreeAttentionMetadata
from megatron_psrl.distributed.kv_exchange import return_replica_grads
from megatron_psrl.engine.head_sends import HeadSends
from megatron_psrl.engine.host_offload import HostOffload
from megatron_psrl.engine.participants import step_participants
from megatron_psrl.engine.prefix_kv import PrefixKV
from megatron_psrl.host_copy import DeviceSums, HostLink, host_to_device
from megatron_psrl.kvcache.manager import (
    BlockKVCache,
    accumulate_source_grad_flat,
    source_grad_elems,
    source_grad_flat,
)
from megatron_psrl.kvcache.prefix_state import GRAD_DTYPE
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.logits import DEFAULT_CHUNK_BYTES, chunk_rows, chunked_logprobs
from megatron_psrl.rl.loss import (
    ClaimLoss,
    ClaimView,
    SequenceLoss,
    claim_coefficients,
    gather_claims,
    records_every_row,
)
from megatron_psrl.schedule.instructions import (
    AllocateKV,
    Backward,
    CollectHeadGrads,
    Forward,
    ForwardBackward,
    ForwardDrop,
    ForwardKeep,
    ForwardPass,
    ImportHead,
    Instruction,
    ReleaseKV,
    Residency,
    ReturnHeadGrads,
    ReturnReplicaGrads,
    SendHeads,
    Transfer,
    forward_instructions,
    training_instructions,
)
from megatron_psrl.schedule.memory import MemoryPlan
from megatron_psrl.schedule.packing import PackedMicroBatch
from megatron_psrl.schedule.plan import RankPlan, StepPlan

Tensor = torch.Tensor


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


@dataclass
class StepState:
    """One call's state while the executor runs its instructions (:meth:`StepRunner.execute`)."""

    plan: StepPlan
    rank: int
    """This rank's placement rank (its plan is ``plan.ranks[rank]``)."""
    memory: Optional[MemoryPlan]
    loss_cfg: Optional[ClaimLoss]
    """The loss of claimed rows (None: a log-prob pass, every row recorded)."""
    coefficients: Optional[np.ndarray]
    """Claim aggregation coefficients over the whole global batch (``claim_coefficients``)."""
    loss_scale: float
    out: StepOutput
    sums: DeviceSums = field(default_factory=DeviceSums)
    """Loss and metric sums, kept on the device and read once at the end of the step."""
    pending: Dict[int, Tuple[Optional[Tensor], Optional[List], Optional[PackedMicroBatch]]] = field(default_factory=dict)
    """Producer -> (its loss and captured K/V rows if the graph is kept, else its pack to recompute)."""
    participants: List = field(default_factory=list)
    """The step's participants (:func:`~megatron_psrl.engine.participants.step_participants`)."""
    head_sends: Optional[HeadSends] = None
    """This rank's part in the heads sent between groups (plans that send heads)."""
    extra_losses: Dict[str, Tensor] = field(default_factory=dict)
    """Loss terms of the whole step added at its end (MoE router losses)."""
    last_of_step: bool = False
    """This call's backward is the last before the optimizer step: the gradient reduce may
    start during its last backward pass (:class:`~megatron_psrl.engine.participants.LastBackward`)."""
    gather_in_backward: bool = False
    """The memory plan has readers gather cached prefixes again in backward."""
    held_routes: Dict[int, Tuple[Tensor, Optional[np.ndarray]]] = field(default_factory=dict)
    """Routes of kept graphs whose backward recomputes their forward (activation recomputation)."""
    pending_arm: Optional[Callable[[Sequence[Tensor]], None]] = None
    """Set for the instruction that runs the step's last backward pass (``LastBackward``)."""
    host: Optional[HostOffload] = None
    """Host offload of kept graphs and cached K/V (a memory plan's ``host_offload``; ``HostResidency``)."""

    @property
    def rank_plan(self) -> RankPlan:
        return self.plan.ranks[self.rank]

    def account(self, loss: Optional[Tensor], metrics: Dict[str, Tensor]) -> None:
        self.sums.add("loss", loss)
        for k, v in metrics.items():
            self.sums.add(k, v)

    def scaled(self, loss: Optional[Tensor]) -> Optional[Tensor]:
        return loss * self.loss_scale if loss is not None else None


def _require_memory_plan(rank_plan: RankPlan, memory: Optional[MemoryPlan], hint: str) -> None:
    if rank_plan.sources and memory is None:
        raise RuntimeError(f"a plan with cached prefixes needs a memory plan{hint}")


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
        *,
        last_layer_row_skip: bool = True,
        overlap_kv_exchange: bool = True,
        head_send_group=None,
        router_losses=None,
        arm_grad_reduce: Optional[Callable[[Sequence[Tensor]], None]] = None,
    ):
        self.model = model
        self.last_layer_row_skip = last_layer_row_skip
        """The model's last layer computes only the rows the loss head reads, past its K/V
        projection (``ActorConfig.last_layer_row_skip``; ``TreeAttentionMetadata.output_rows``)."""
        self.overlap_kv_exchange = overlap_kv_exchange
        """Cross-rank: overlap every layer's prefix K/V exchange with the attention over the keys
        this rank has (``ActorConfig.overlap_kv_exchange``; exact either way)."""
        self.inject_kv_grads = inject_kv_grads
        """Activation recomputation is on: cached-prefix gradients are injected inside the graph."""
        self.loss_head_chunk_bytes = loss_head_chunk_bytes
        """fp32 logits of one chunk of claimed rows (the loss head's peak)."""
        self.output_chunk = model_chunks(model)[-1]
        """The chunk with the output layer, the loss head's weights (the model itself without
        virtual pipeline stages)."""
        self.vocab_size = vocab_size
        self.device = device
        self.attention_backend = attention_backend
        self.kv_cache = kv_cache
        self.exchange_group = exchange_group
        """Process group of the ranks that exchange prefix K/V (cross-rank plans)."""
        self.head_send_group = head_send_group
        """The data x context parallel group, over which the heads of trees split between
        exchange groups travel (:mod:`megatron_psrl.engine.head_sends`; a rank's index in it is
        its placement rank); needed by plans that send heads."""
        self.expert_group = _expert_parallel_group(model)
        """MoE models with expert parallelism: the ranks whose MoE layers exchange tokens in every
        forward and backward pass (their passes run in lockstep, :class:`~megatron_psrl.engine.participants.ExpertLockstep`)."""
        self.replayer = None
        """Router replay (:class:`~megatron_psrl.model.moe.RouterReplayer`), made at the first batch with routes."""
        self.router_losses = router_losses
        """MoE router z-loss / load-balancing loss (:class:`~megatron_psrl.model.moe_losses.RouterLosses`), or None."""
        self.last_empty_expert_passes = 0
        """Empty MoE passes this rank ran in its last call to keep its expert-parallel group in step."""
        self.arm_grad_reduce = arm_grad_reduce
        """Called with the roots of a step's last backward pass right before it runs (the
        optimizer's ``arm_grad_reduce``: ``--overlap-grad-reduce``); None: the reduce waits for
        the step."""
        self._host_link: Optional[HostLink] = None
        self.last_host_offload = None
        """What the last step with host offload moved (:class:`~megatron_psrl.engine.host_offload.OffloadRecord`)."""

    @property
    def host_link(self) -> HostLink:
        """Copies to and from host memory for host offload (made at its first use: a side stream on CUDA)."""
        if self._host_link is None:
            self._host_link = HostLink.for_device(self.device)
        return self._host_link

    # ------------------------------------------------------------------ one forward
    def _forward(self, step: "StepState", i: int, pack: PackedMicroBatch, rows: np.ndarray, run: ForwardPass,
                 chunk: Optional[int] = None):
        """One forward of micro-batch ``i`` as ``run`` says (:class:`ForwardPass`, from the
        instruction): ``(loss, metrics, logp, hook)``, the loss of the claimed ``rows``
        (``chunk``: of one model chunk only, a pipeline stage's virtual stage)."""
        rank_plan = step.rank_plan
        mb = rank_plan.micro_batches[i]
        grad = run.graph
        hook = None
        exchanging = mb.exchange is not None and mb.exchange.forward_collective
        if mb.reads or mb.produces or exchanging:
            if self.kv_cache is None:
                raise RuntimeError("a plan with cached prefixes needs a KV cache (mechanism 2)")
            group_size = dist.get_world_size(self.exchange_group) if exchanging else 1
            hook = PrefixKV(self.kv_cache, rank_plan, i, pack, store=run.writes, capture=run.keeps_rows,
                            track_grads=grad, group=self.exchange_group, group_size=group_size,
                            inject=self.inject_kv_grads, gather_in_backward=step.gather_in_backward,
                            overlap=self.overlap_kv_exchange)
        # a loss that records every row: the rows it does not claim, forward only (no graph)
        unclaimed = self._unclaimed_rows(step, pack, rows) if run.loss else rows[:0]
        out_rows = self._output_rows(pack, np.concatenate([rows, unclaimed]) if len(unclaimed) else rows)
        meta = TreeAttentionMetadata(plan=pack.plan, backend=self.attention_backend, kv_hook=hook,
                                     output_rows=out_rows)
        ids = host_to_device(pack.input_ids, self.device)
        pos = host_to_device(pack.position_ids, self.device)
        self._replay_routes(step.plan, i, pack, meta.output_rows,
                            hold=step.held_routes if grad and run.keeps_rows else None)
        if self.router_losses is not None:  # the weights of the rows the routers see
            self.router_losses.set_pack(i, pack)
        with torch.set_grad_enabled(grad):
            hidden = self._stage_forward(i, ids, pos, meta, grad, chunk)  # [t, h]; None before the last stage
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
            if len(unclaimed):
                self._record_rows(step.plan, pack, hidden, unclaimed, step.out.logprobs, out_rows)
            if len(rows) == 0:
                return anchor, {}, None, hook
            loss, metrics, logp = self._loss_head(step.plan, pack, hidden, rows, step.loss_cfg, step.coefficients,
                                                  step.out.logprobs, hidden_rows=out_rows)
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
        logp, ent = chunked_logprobs(self.output_chunk.output_logits, hidden.index_select(0, sel_rows), target_ids,
                                     self.vocab_size, with_entropy=want_entropy,
                                     rows_per_chunk=self._loss_head_rows())
        if record is not None:  # the log-probs this call computed, returned to the caller
            record.add(targets, logp, ent)
        if loss_cfg is None:
            return None, {}, logp
        claims = gather_claims(plan.tree, coefficients, targets, loss_cfg, self.device)
        loss, metrics = loss_cfg(logp, ent, claims)
        return loss, metrics, logp

    def _record_rows(self, plan: StepPlan, pack: PackedMicroBatch, hidden: Tensor, rows: np.ndarray,
                     record: ComputedLogprobs, hidden_rows: Optional[np.ndarray] = None) -> None:
        """The log-probs (and, when ``record`` keeps them, entropies) of pack rows no loss claims,
        into ``record``: no graph, so they add no backward and keep no logits."""
        sel = pack.logit_rows[rows]
        if hidden_rows is not None:
            sel = np.searchsorted(hidden_rows, sel)
        targets = pack.logit_targets[rows]
        target_ids = host_to_device(plan.tree.tokens[targets].astype(np.int64), self.device)
        with torch.no_grad():
            logp, ent = chunked_logprobs(self.output_chunk.output_logits,
                                         hidden.index_select(0, host_to_device(sel, self.device)), target_ids,
                                         self.vocab_size, with_entropy=record.with_entropy,
                                         rows_per_chunk=self._loss_head_rows())
        record.add(targets, logp, ent)

    def _replay_routes(self, plan: StepPlan, i: int, pack: PackedMicroBatch, output_rows: Optional[np.ndarray],
                       hold: Optional[Dict[int, Tuple[Tensor, Optional[np.ndarray]]]] = None) -> None:
        """Router replay (docs/moe.md): the rollout's routes of the pack's rows, gathered like their
        token ids, into every MoE router before the forward (``output_rows``: the rows the last
        layer may compute alone; ``hold``: a producer's graph is kept, its routes go there for its
        backward if that recomputes the forward); samples without routes: the routers' own top-k."""
        if self.replayer is None and plan.tree.batch.routed_experts is None:
            return  # the route-free path: nothing to set
        if self.replayer is None:
            from megatron_psrl.model.moe import RouterReplayer

            self.replayer = RouterReplayer(self.model)
        routes = self.replayer.pack_routes(plan.tree, pack.tree_tokens, self.device)  # [t, L, k]
        self.replayer.set(routes, output_rows)
        if routes is not None and hold is not None and self.inject_kv_grads:
            hold[i] = (routes, output_rows)

    def end_replay(self) -> None:
        """The routers' own top-k again after a step (a later forward may carry no routes)."""
        if self.replayer is not None:
            self.replayer.set(None)

    def _loss_head_rows(self) -> int:
        """Claimed rows per loss-head chunk, from this rank's vocabulary slice."""
        chunk = self.output_chunk
        weight = (chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights
                  else chunk.output_layer.weight)
        return chunk_rows(weight.shape[0], self.loss_head_chunk_bytes)

    # ------------------------------------------------------------------ stage hooks
    # One pipeline stage runs the whole model here; PipelineStepRunner overrides these three.
    def _stage_forward(self, i: int, ids: Tensor, pos: Tensor, meta: TreeAttentionMetadata, grad: bool,
                       chunk: Optional[int] = None) -> Optional[Tensor]:
        """Hidden states ``[t, h]`` of micro-batch ``i`` (``None`` on a stage without the loss;
        ``chunk``: only that model chunk runs, pipeline stages only)."""
        return self.model(ids, pos, meta).squeeze(1)  # a view: its backward allocates nothing

    def _stage_backward(self, step: "StepState", i: int, loss: Optional[Tensor],
                        kv_grads: Sequence[Tuple[int, Tensor, Tensor]]) -> None:
        """Backward of micro-batch ``i`` from its (scaled) loss and the K/V rows it produced,
        ``(layer, rows, their accumulated gradient)``: injected dK/dV."""
        tensors = [loss] if loss is not None else []
        grads = [torch.ones_like(loss)] if loss is not None else []
        for _, rows, grad in kv_grads:
            tensors.append(rows)
            grads.append(grad)
        if tensors:
            self._arm_backward(step, tensors)
            torch.autograd.backward(tensors, grads)

    def runs_no_backward(self, x: ForwardBackward, step: "StepState") -> bool:
        """``x`` certainly makes no autograd call (see ``_forward``): no claimed row, and
        nothing that anchors a zero loss (an exchange, cached prefixes, experts, router losses)."""
        mb = step.rank_plan.micro_batches[x.micro_batch]
        if mb.reads or mb.produces or mb.exchange is not None or self.expert_group is not None \
                or self.router_losses is not None:
            return False
        t = step.rank_plan.pack(step.plan.index, x.micro_batch).logit_targets
        claims = step.plan.tree.claim_offsets
        return not np.any(claims[t + 1] > claims[t])

    def _arm_backward(self, step: "StepState", roots: Sequence[Tensor]) -> None:
        """Right before the autograd call(s) of a pass from ``roots``: if it is the step's last
        backward, the optimizer's gradient reduce starts during it (``step.pending_arm``)."""
        arm, step.pending_arm = step.pending_arm, None
        if arm is not None:
            arm(roots)

    def _finish(self, out: StepOutput) -> StepOutput:
        """The step's outputs, the same on every stage."""
        return out

    def _from_loss_stage(self, value):
        """``value`` as the stage that computes the loss has it."""
        return value

    def _claimed_rows(self, plan: StepPlan, pack: PackedMicroBatch) -> np.ndarray:
        t = pack.logit_targets
        return np.flatnonzero(plan.tree.claim_offsets[t + 1] > plan.tree.claim_offsets[t])

    def _unclaimed_rows(self, step: "StepState", pack: PackedMicroBatch, claimed: np.ndarray) -> np.ndarray:
        """The pack rows whose log-probs are recorded although no loss claims them: every other
        row when the step's loss asks for every row (:attr:`ClaimLoss.records_every_row`)."""
        if not records_every_row(step.loss_cfg):
            return claimed[:0]
        keep = np.ones(len(pack.logit_rows), dtype=bool)
        keep[claimed] = False
        return np.flatnonzero(keep)

    # ------------------------------------------------------------------ a training step
    def train(
        self,
        plan: StepPlan,
        rank: int,
        loss_cfg: ClaimLoss,
        memory: Optional[MemoryPlan] = None,
        loss_scale: float = 1.0,
        last_of_step: bool = False,
    ) -> StepOutput:
        """Forward + backward of every micro-batch of ``rank``; gradients accumulate in the
        model's parameters (the caller reduces them across data-parallel ranks).

        ``loss_scale`` multiplies every loss before its backward (fp16 loss scaling; the
        optimizer unscales). Injected prefix gradients come from scaled losses already.
        ``last_of_step``: no backward follows this call's before the optimizer step, so the
        data-parallel reduce may start during its last backward pass (:attr:`arm_grad_reduce`)."""
        rank_plan = plan.ranks[rank]
        _require_memory_plan(rank_plan, memory, "")
        # Normalisation over the whole global batch, from the original samples.
        coefficients = claim_coefficients(plan.tree, getattr(loss_cfg, "loss_agg", None) or "token-mean")
        step = StepState(plan, rank, memory, loss_cfg, coefficients, loss_scale,
                         StepOutput(num_micro_batches=sum(mb.computes for mb in rank_plan.micro_batches),
                                    logprobs=ComputedLogprobs(records_every_row(loss_cfg) and loss_cfg.needs_entropy)),
                         last_of_step=last_of_step,
                         gather_in_backward=memory is not None and memory.gathers_in_backward)
        return self.execute(step, self._training_stream(rank_plan, memory), training=True)

    def _training_stream(self, rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Instruction]:
        """The instructions of a training step (a pipeline stage may order them its own way)."""
        return training_instructions(rank_plan, memory)

    # ------------------------------------------------------------------ forward only
    @torch.no_grad()
    def sequence_sums(self, plan: StepPlan, rank: int, loss: SequenceLoss,
                      memory: Optional[MemoryPlan] = None) -> np.ndarray:
        """float64 ``[S]``: this rank's share of every sample's ``loss.token_terms`` sum (forward
        only; the caller sums over ranks). The first pass of a :class:`SequenceLoss`."""
        # summed on the device, read once after the pass (not once per micro-batch)
        sums = torch.zeros(plan.tree.batch.num_samples, dtype=torch.float64, device=self.device)
        coefficients = claim_coefficients(plan.tree, "token-mean")

        class _Collect:
            needs_entropy, needs_ref, needs_advantage = loss.needs_entropy, loss.needs_ref, loss.needs_advantage

            def __call__(self, logprobs, entropy, claims):
                view = ClaimView.of(logprobs, entropy, claims)
                sums.index_add_(0, claims.sample, loss.token_terms(view).double())
                return logprobs.sum() * 0.0, {}

        self._forward_only(plan, rank, memory, claims_loss=_Collect(), coefficients=coefficients)
        return self._from_loss_stage(sums.cpu().numpy())

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
        _require_memory_plan(rank_plan, memory, " (plan_forward_memory)")
        step = StepState(plan, rank, memory, claims_loss, coefficients, 1.0,
                         StepOutput(num_micro_batches=sum(mb.computes for mb in rank_plan.micro_batches),
                                    logprobs=ComputedLogprobs(with_entropy)))
        return self.execute(step, forward_instructions(rank_plan, memory), training=False)

    # ------------------------------------------------------------------ the executor
    def execute(self, step: "StepState", instructions: List[Instruction], training: bool) -> StepOutput:
        """Run ``instructions`` (one method per kind, :data:`EXECUTE`) with the step's
        participants' hooks around them (:mod:`megatron_psrl.engine.participants`)."""
        step.participants = self._participants(step, instructions, training)
        for participant in step.participants:
            participant.begin(step)
        for instruction in instructions:
            for participant in step.participants:
                participant.before(instruction, step)
            getattr(self, EXECUTE[type(instruction)])(instruction, step)
        for participant in step.participants:
            participant.end(step)
        return self.close(step)

    def _participants(self, step: "StepState", instructions: List[Instruction], training: bool) -> List:
        """The step's participants (a pipeline stage adds its links)."""
        return step_participants(self, step, instructions, training)

    def close(self, step: "StepState") -> StepOutput:
        """The step's outputs: its device sums read once, the whole-step loss terms added."""
        out = step.out
        totals = step.sums.read()  # the step's one read of its device sums
        out.loss = totals.pop("loss", 0.0)
        out.metrics = totals
        for name, value in step.extra_losses.items():  # (router losses: once per step)
            out.metrics[name] = float(value)
            out.loss += float(value)
        return self._finish(out)

    def _pack(self, step: "StepState", i: int, count_key_pairs: bool = True) -> PackedMicroBatch:
        """Micro-batch ``i`` packed, its tokens (and key pairs) counted."""
        pack = step.rank_plan.pack(step.plan.index, i)
        step.out.tokens_computed += pack.num_tokens
        if count_key_pairs:
            step.out.key_pairs += pack.key_pairs()
        return pack

    def _rows(self, step: "StepState", pack: PackedMicroBatch, run: ForwardPass) -> np.ndarray:
        """The pack rows whose log-probs a forward computes: the claimed ones (none when its loss
        comes later, every row in a log-prob pass without a loss)."""
        if step.loss_cfg is None:
            return np.arange(len(pack.logit_rows))
        rows = self._claimed_rows(step.plan, pack)
        return rows if run.loss else rows[:0]

    def run_forward_backward(self, x: ForwardBackward, step: "StepState") -> None:
        pack = self._pack(step, x.micro_batch)
        loss, metrics, _, _ = self._forward(step, x.micro_batch, pack, self._rows(step, pack, x.forward_pass),
                                            x.forward_pass)
        step.account(loss, metrics)
        self._stage_backward(step, x.micro_batch, step.scaled(loss), [])

    def run_forward_keep(self, x: ForwardKeep, step: "StepState") -> None:
        pack = self._pack(step, x.micro_batch)
        # (host offload: the graph's saved tensors are registered, to move them between steps)
        with step.host.saving(x.micro_batch) if step.host is not None else contextlib.nullcontext():
            loss, metrics, _, hook = self._forward(step, x.micro_batch, pack, self._rows(step, pack, x.forward_pass),
                                                   x.forward_pass)
        step.account(loss, metrics)
        step.pending[x.micro_batch] = (loss, hook.captured if hook is not None else [], None)

    def run_forward_drop(self, x: ForwardDrop, step: "StepState") -> None:
        # A dropped graph computes no loss now: the recomputation at backward does.
        pack = self._pack(step, x.micro_batch)
        self._forward(step, x.micro_batch, pack, self._rows(step, pack, x.forward_pass), x.forward_pass)
        step.pending[x.micro_batch] = (None, None, pack)

    def run_forward(self, x: Forward, step: "StepState") -> None:
        pack = self._pack(step, x.micro_batch, count_key_pairs=False)
        self._forward(step, x.micro_batch, pack, self._rows(step, pack, x.forward_pass), x.forward_pass)

    def run_backward(self, x: Backward, step: "StepState") -> None:
        """A producer's backward, its readers done: (its dropped graph rebuilt, then) autograd from
        its loss and its sources' K/V rows with the dK/dV every reader accumulated injected."""
        i, cache = x.micro_batch, self.kv_cache
        loss, captured, pack = step.pending.pop(i)
        if x.recompute:  # graph was dropped: rebuild it
            loss, metrics, _, hook = self._forward(step, i, pack, self._rows(step, pack, x.forward_pass),
                                                   x.forward_pass)
            step.account(loss, metrics)
            captured = hook.captured if hook is not None else []
            step.out.tokens_computed += pack.num_tokens
            step.out.tokens_recomputed += pack.num_tokens
            cache.metrics.tokens_recomputed += pack.num_tokens
        for participant in step.participants:
            participant.before_graph_backward(x, step)
        kv_grads = []
        for rows in captured:
            grads = cache.read_grad(rows.source, rows.layer)  # fp32 sums over every reader; rounded once here
            kv_grads += [(rows.layer, field, grad.to(field.dtype)) for field, grad in zip(rows.fields, grads)]
        self._stage_backward(step, i, step.scaled(loss), kv_grads)
        if step.host is not None:
            step.host.release(i)

    def run_residency(self, x: Residency, step: "StepState") -> None:
        """Host offload: what this step and the next use on the device, the rest in host memory."""
        step.host.settle(x)

    def run_allocate_kv(self, x: AllocateKV, step: "StepState") -> None:
        sources = step.rank_plan.sources
        for s in x.sources:
            self.kv_cache.allocate(s, sources[s].length, kinds=x.kinds or sources[s].kinds, reach=sources[s].reach)

    def run_release_kv(self, x: ReleaseKV, step: "StepState") -> None:
        for s in x.sources:
            self.kv_cache.free(s, x.kinds)

    def run_send_heads(self, x: SendHeads, step: "StepState") -> None:
        step.head_sends.after_forward(x.micro_batch)

    def run_import_head(self, x: ImportHead, step: "StepState") -> None:
        step.head_sends.receive(x.micro_batch)

    def run_collect_head_grads(self, x: CollectHeadGrads, step: "StepState") -> None:
        step.head_sends.collect_grads(x.micro_batch)

    def run_return_head_grads(self, x: ReturnHeadGrads, step: "StepState") -> None:
        step.head_sends.return_grads(x.micro_batch)

    def run_transfer(self, x: Transfer, step: "StepState") -> None:
        """Sends and receives between pipeline stages (a pipeline stage's runner runs them)."""
        raise RuntimeError("a Transfer between pipeline stages needs a pipeline stage's runner")

    def run_return_replica_grads(self, x: ReturnReplicaGrads, step: "StepState") -> None:
        """Cross-rank, before the deferred backward of step ``i``: every rank sends the dK/dV
        its replicas of step ``i``'s prefixes accumulated to their owners, who add them to
        their own gradient blocks (one collective over the exchange group; the lowering emits
        it only for steps whose exchange has one)."""
        rank_plan = step.rank_plan
        ex = rank_plan.micro_batches[x.micro_batch].exchange
        cache, g = self.kv_cache, dist.get_world_size(self.exchange_group)
        send_ids = [s for owner in range(g) for s in ex.grad_send.get(owner, [])]
        # (flat per source: K/V rows and fixed-size linear states alike, every layer)
        send = torch.cat([source_grad_flat(cache, s) for s in send_ids]) if send_ids else \
            torch.zeros(0, dtype=GRAD_DTYPE, device=cache.geometry.device)
        elems = lambda s: source_grad_elems(cache.geometry, rank_plan.sources[s].length)  # noqa: E731
        send_counts = [sum(elems(s) for s in ex.grad_send.get(r, [])) for r in range(g)]
        recv_counts = [sum(elems(s) for s in ex.grad_recv.get(r, [])) for r in range(g)]
        received = return_replica_grads(send, send_counts, recv_counts, self.exchange_group)
        offset = 0
        for src in range(g):
            for s in ex.grad_recv.get(src, []):
                accumulate_source_grad_flat(cache, s, rank_plan.sources[s].length, received[offset:offset + elems(s)])
                offset += elems(s)


EXECUTE: Dict[type, str] = {
    ForwardBackward: "run_forward_backward",
    ForwardKeep: "run_forward_keep",
    ForwardDrop: "run_forward_drop",
    Forward: "run_forward",
    Backward: "run_backward",
    AllocateKV: "run_allocate_kv",
    ReleaseKV: "run_release_kv",
    Residency: "run_residency",
    SendHeads: "run_send_heads",
    ImportHead: "run_import_head",
    CollectHeadGrads: "run_collect_head_grads",
    ReturnHeadGrads: "run_return_head_grads",
    ReturnReplicaGrads: "run_return_replica_grads",
    Transfer: "run_transfer",
}
"""The :class:`StepRunner` method that executes each instruction kind."""
