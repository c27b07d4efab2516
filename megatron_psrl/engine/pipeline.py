"""Pipeline parallelism: one rank's share of a step plan run as one stage of a pipeline.

Every stage of a pipeline group holds the same rank plan (the planner places trees on
data x context parallel ranks; the stages of one pipeline are one placement rank), packs the
same micro-batches and builds the same ``TreeAttentionMetadata``, so only hidden states and
their gradients travel between stages, and every receiver knows their shapes
(:class:`~megatron_psrl.engine.stage_links.StageLinks`: batched sends and receives, no shape
messages, no host synchronisation). The loss, log-probs and entropies are computed on the last
stage from the claims.

One executor runs every stage: the :class:`~megatron_psrl.engine.step.StepRunner`'s, the
same instructions and participants (router replay and losses, the KV pool, the gradient
reduce's start) as without pipeline parallelism; a stage only adds the transfers around each
model run. A forward receives its input from the stage before and sends its output on; a
backward receives the output's gradient from the stage after, runs
``autograd.backward([output, K rows, V rows, ...], [grad, dK, dV, ...])`` (this stage's own
block KV cache and dK/dV, for its own layers) and sends the input's gradient back. The order:

- **1F1B** for a step of independent micro-batches (mechanism 1 only, every schedule step
  ``forward_backward``): :func:`~megatron_psrl.schedule.instructions.one_f_one_b` splits each
  into a kept forward and its backward in megatron's 1F1B order (warm-up forwards, then one
  forward and one backward in turn), so stages overlap and a stage holds at most
  ``PP - stage`` graphs. A backward that recomputes routes its MoE tokens as its forward did
  (the participants hold the routes), so activation recomputation with router replay runs here too.
- **The plan's order** for mechanism 2 (cached prefixes: a producer's backward waits until
  its readers are done, which 1F1B's first-in-first-out backward order cannot honour), trees
  split across pipelines (each stage's per-layer K/V exchanges meet the same micro-batch on the
  same stage of the other pipelines) and expert parallelism (a stage's MoE all-to-alls meet
  the same passes of the stage's other pipelines, whose micro-batch counts differ, through the
  expert lockstep, :class:`~megatron_psrl.model.moe.ExpertLockstep`: docs/moe.md). Every stage
  runs the same instructions in the same order, so every message it waits for is sent by a
  neighbour that needs nothing from it first: no deadlock.

One exception remains: with virtual stages (several model chunks per rank), steps of
independent micro-batches run megatron-core's interleaved 1F1B schedule
(``get_forward_backward_func``, its ``P2PCommunicator`` with ``variable_seq_lengths``) with a
``forward_step_func`` that packs micro-batch ``i`` and the same loss head and participants;
other virtual-stage steps run in the plan's order, one micro-batch at a time through the chunks.

The bubble is measured: the time each stage spends waiting on its transfers over the step's
device time (``pipeline_bubble``; :class:`StageLinks` times waits on the host on CPU and with
CUDA events on GPU; megatron's communicator synchronises the device, so the device is drained
before its timer starts, :class:`_TimedP2P`).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_psrl.attention.metadata import TreeAttentionMetadata
from megatron_psrl.compat import install_cpu_pipeline_shims
from megatron_psrl.engine.participants import KVCacheLifecycle, RouterState, StepParticipant
from megatron_psrl.engine.stage_links import StageLinks
from megatron_psrl.engine.step import ComputedLogprobs, StepOutput, StepRunner, StepState
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.sequence_parallel import padded_rows
from megatron_psrl.rl.loss import ClaimLoss, claim_coefficients
from megatron_psrl.schedule.instructions import LOCAL_INSTRUCTIONS, Instruction, flatten, lower_training, one_f_one_b
from megatron_psrl.schedule.memory import MemoryPlan
from megatron_psrl.schedule.plan import RankPlan, StepPlan

Tensor = torch.Tensor


_clock = time.perf_counter  # the bubble's clock (a test replaces it with a fake one)


def _settle(device: Optional[torch.device]) -> None:
    """Wait for the work queued on ``device`` (CUDA runs it asynchronously; CPU: nothing).

    At a step's start and end, so that its measured time is its device time. And before every
    transfer of megatron's communicator (its interleaved schedule only), where it costs no wait
    the step would not have anyway: megatron-core 0.16's ``P2PCommunicator._communicate``
    drains the device itself on every call. Tree-packed micro-batches differ in length
    (``variable_seq_lengths``), so it first exchanges shapes, then calls
    ``torch.cuda.synchronize()`` unconditionally and reads the shapes with ``.tolist()``
    (``_communicate_shapes``), and after the batched isend/irecv it synchronises again
    (``batch_p2p_sync``, on by default). Draining here, outside the timer, moves that wait in
    front of the clock: the bubble measured is the neighbour and the wire, not this stage's
    own queued compute. (The project's own links, :class:`StageLinks`, never synchronise.)"""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedP2P(P2PCommunicator):
    """megatron's P2PCommunicator, adding up the time spent in its transfers (waits included).

    megatron's ``_communicate`` calls ``torch.cuda.synchronize()`` (around batched isend/irecv
    and the shape exchange of variable-length micro-batches): timed as is, a transfer would
    include every kernel this stage had queued before it, its own compute, and the bubble would
    be far too large. The device is drained first, outside the timer, so what is timed is the
    wait for the neighbour and the transfer itself."""

    wait_s = 0.0
    device: Optional[torch.device] = None

    def _communicate(self, *args, **kwargs):
        _settle(self.device)  # this stage's own queued compute: not a wait
        t0 = _clock()
        try:
            return super()._communicate(*args, **kwargs)
        finally:
            self.wait_s += _clock() - t0


class PipelineStepRunner(StepRunner):
    """A :class:`StepRunner` for one pipeline stage (see the module docstring). With virtual
    stages the rank holds several model chunks: a micro-batch's forward runs them in order,
    chunk ``v`` receiving from the previous rank's chunk ``v`` (stage 0: the last rank's chunk
    ``v - 1``), and its backward in reverse."""

    def __init__(self, model, vocab_size: int, device: torch.device, attention_backend: Optional[str] = None,
                 kv_cache=None, exchange_group=None, **kwargs):
        super().__init__(model, vocab_size, device, attention_backend, kv_cache, exchange_group, **kwargs)
        install_cpu_pipeline_shims(device)
        self.chunks = model_chunks(model)
        for chunk in self.chunks:
            chunk.config.variable_seq_lengths = True  # tree-packed micro-batches differ in length
        self.config = self.chunks[0].config
        self.chunk_layers = [{layer.layer_number for layer in chunk.decoder.layers} for chunk in self.chunks]
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.last_rank = dist.get_global_rank(self.pp_group, self.pp_size - 1)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.links = StageLinks(self.pp_group, device, self.config.pipeline_dtype or self.config.params_dtype)
        """Activations and their gradients to and from the neighbours (the project's executor)."""
        self.p2p = _TimedP2P(pp_group=self.pp_group, config=self.config)
        """megatron's communicator, for its interleaved schedule only (virtual stages)."""
        self.p2p.device = device
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.groups = ProcessGroupCollection()
        """The process groups megatron's schedules take with a custom p2p communicator."""
        self.groups.tp = parallel_state.get_tensor_model_parallel_group()
        self.groups.cp = parallel_state.get_context_parallel_group()
        self.groups.pp = self.pp_group
        self.groups.embd = parallel_state.get_embedding_group(check_initialized=False)
        self.groups.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
        self.groups.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # micro-batch -> per chunk (its input, its output)
        self._io: Dict[int, List[Tuple[Optional[Tensor], Tensor]]] = {}
        self.last_bubble: float = 0.0
        """Measured bubble fraction of the last step (mean over stages of p2p wait / step time)."""
        self.last_schedule: str = ""
        """Order of the last step: ``1f1b`` (this executor, mechanism-1 steps), ``plan-order``
        (this executor, the plan's order) or ``interleaved-1f1b`` (megatron's schedule)."""

    def _receives(self, v: int) -> bool:
        return not (self.first and v == 0)

    def _sends(self, v: int) -> bool:
        return not (self.last and v == len(self.chunks) - 1)

    # ------------------------------------------------------------------ the stage's model runs
    def _activation_rows(self, tokens: int) -> int:
        """Rows of the hidden states between stages for a pack of ``tokens``: this rank's
        sequence-parallel share of the padded pack, or all of them."""
        if not self.config.sequence_parallel:
            return tokens
        tp = self.config.tensor_model_parallel_size
        return padded_rows(tokens, tp) // tp

    def _stage_forward(self, i: int, ids: Tensor, pos: Tensor, meta: TreeAttentionMetadata, grad: bool) -> Optional[Tensor]:
        io = []
        out = None
        for v, chunk in enumerate(self.chunks):
            x = None
            if self._receives(v):  # [t, 1, h] (a sequence-parallel share), with the outbox's sends
                x = self.links.recv_forward((self._activation_rows(len(ids)), 1, self.config.hidden_size))
                if grad:
                    x.requires_grad_(True)
                chunk.set_input_tensor(x)
            else:
                self.links.flush()  # a run that receives nothing: what waits goes first
            out = chunk(ids, pos, meta)  # [t, 1, h]
            if self._sends(v):
                self.links.send_forward(out)
            io.append((x, out))
        if grad:
            self._io[i] = io
        return out.squeeze(1) if self.last else None

    def runs_no_backward(self, x, step) -> bool:
        """Every stage but the last runs a backward for every micro-batch (the gradient the
        next stage sends back, zeros if it had no loss)."""
        return False

    def _stage_backward(self, step, i: int, loss: Optional[Tensor], kv_grads) -> None:
        io = self._io.pop(i)
        # the chunks' backwards start from their outputs sent on (or the loss) and their K/V rows
        self._arm_backward(step, [out for v, (_, out) in enumerate(io) if self._sends(v)]
                           + ([loss] if loss is not None else []) + [rows for _, rows, _ in kv_grads])
        for v in reversed(range(len(self.chunks))):
            x, out = io[v]
            tensors: List[Tensor] = []
            grads: List[Tensor] = []
            if self._sends(v):  # the output's gradient comes from the next chunk's rank
                tensors.append(out)
                grads.append(self.links.recv_backward(out.shape))
            else:
                self.links.flush()
                if loss is not None:
                    tensors.append(loss)
                    grads.append(torch.ones_like(loss))
            for layer, rows, grad in kv_grads:  # dK/dV of the producer's rows in this chunk's layers
                if layer in self.chunk_layers[v]:
                    tensors.append(rows)
                    grads.append(grad)
            if tensors:
                torch.autograd.backward(tensors, grads)
            if self._receives(v):
                self.links.send_backward(x.grad if x.grad is not None else torch.zeros_like(x))

    def _participants(self, step, instructions: List[Instruction], training: bool) -> List[StepParticipant]:
        """The step's participants, the stage's links first (their ``end`` posts the last sends
        before any other participant's closing communication)."""
        return [_LinksFlush(self.links, self.expert_group is not None)] + super()._participants(
            step, instructions, training)

    def _training_stream(self, rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Instruction]:
        """The plan's order, or 1F1B (:func:`one_f_one_b`) for a step of independent micro-batches."""
        if not self._runs_1f1b(rank_plan):
            return super()._training_stream(rank_plan, memory)
        return flatten(one_f_one_b(lower_training(rank_plan, {}, {}), self.stage, self.pp_size))

    def _independent(self, rank_plan: RankPlan) -> bool:
        """Micro-batches that may run in a 1F1B order: independent (mechanism 1, every step
        ``forward_backward``, no tree split across pipelines) and no expert parallelism (a
        stage's MoE all-to-alls meet the same pass on the stage's other pipelines, whose
        micro-batch counts differ: the expert lockstep follows the plan's order)."""
        return (self.expert_group is None and not rank_plan.sources and not rank_plan.cross_rank
                and all(op == "forward_backward" for op, _ in rank_plan.schedule))

    def _runs_1f1b(self, rank_plan: RankPlan) -> bool:
        """A step this executor runs in 1F1B order: independent micro-batches and one model chunk
        (virtual stages: megatron's interleaved schedule or the plan's order)."""
        return len(self.chunks) == 1 and self._independent(rank_plan)

    # ------------------------------------------------------------------ results on every stage
    def _from_loss_stage(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.pp_group)
        return box[0]

    def _finish(self, out: StepOutput) -> StepOutput:
        index, values = out.logprobs.arrays() if out.logprobs is not None else (None, None)
        shared = self._from_loss_stage((out.loss, out.metrics, index, values) if self.last else None)
        out.loss, out.metrics, index, values = shared
        if index is not None:
            out.logprobs = ComputedLogprobs()
            if len(index):
                out.logprobs.add(index, torch.from_numpy(values))
        return out

    def _measure(self, run):
        """Run one step's executor and set :attr:`last_bubble` from its transfers' waits."""
        self.p2p.wait_s = 0.0
        self.links.reset()
        _settle(self.device)  # the step's time is its device time, from drained to drained
        t0 = _clock()
        out = run()
        _settle(self.device)
        wall = _clock() - t0
        waited = self.p2p.wait_s + self.links.blocked.seconds
        t = torch.tensor([waited / max(wall, 1e-9)], dtype=torch.float64)
        dist.all_reduce(t, group=self.pp_group)
        self.last_bubble = float(t) / self.pp_size
        return out

    # ------------------------------------------------------------------ a training step
    def train(self, plan: StepPlan, rank: int, loss_cfg: ClaimLoss, memory: Optional[MemoryPlan] = None,
              loss_scale: float = 1.0, last_of_step: bool = False) -> StepOutput:
        rank_plan = plan.ranks[rank]
        if self._runs_megatron_interleaved(plan, rank_plan):
            self.last_schedule = "interleaved-1f1b"
            return self._measure(lambda: self._train_megatron_schedule(plan, rank, loss_cfg, loss_scale))
        # this executor: the plan's instructions, in 1F1B order when the micro-batches are independent
        self.last_schedule = "1f1b" if self._runs_1f1b(rank_plan) else "plan-order"
        return self._measure(lambda: super(PipelineStepRunner, self).train(plan, rank, loss_cfg, memory, loss_scale,
                                                                           last_of_step))

    def _runs_megatron_interleaved(self, plan: StepPlan, rank_plan: RankPlan) -> bool:
        """Virtual stages with independent micro-batches: megatron's interleaved 1F1B schedule.

        It needs at least PP micro-batches, and PP > 2 (with two stages both neighbours are one
        rank, and its batched sends and receives in both directions, shapes first with
        ``variable_seq_lengths``, are not matched in order over gloo): other steps run in the
        plan's order here (still interleaved over the chunks, one micro-batch at a time). With
        activation recomputation a backward routes (and weighs) its MoE tokens again, with what
        the last forward set, after later forwards in megatron's order: those steps too."""
        if len(self.chunks) == 1 or not self._independent(rank_plan):
            return False
        per_pack_routers = plan.tree.batch.routed_experts is not None or self.router_losses is not None
        num = len(rank_plan.micro_batches)
        return self.pp_size > 2 and num >= self.pp_size and not (self.inject_kv_grads and per_pack_routers)

    def _forward_only(self, plan, rank, memory, claims_loss=None, coefficients=None,
                      with_entropy: bool = False) -> StepOutput:
        if with_entropy:  # _finish hands the loss stage's log-probs to every stage, not entropies
            raise ConfigurationError("per-token entropies of a log-prob pass are not available with pipeline "
                                     "parallelism yet (--pipeline-model-parallel-size 1)")
        self.last_schedule = "plan-order"
        return self._measure(lambda: super(PipelineStepRunner, self)._forward_only(
            plan, rank, memory, claims_loss=claims_loss, coefficients=coefficients))

    def _group_size(self, num_microbatches: int) -> int:
        """Contiguous micro-batches per virtual stage in megatron's interleaved schedule: the
        smallest group size it accepts (PP if that divides the count; fewer groups otherwise)."""
        for g in range(self.pp_size, num_microbatches + 1):
            rest = num_microbatches % g
            if rest == 0 or rest >= self.pp_size:
                return g
        return num_microbatches

    def _train_megatron_schedule(self, plan: StepPlan, rank: int, loss_cfg: ClaimLoss,
                                 loss_scale: float) -> StepOutput:
        """Mechanism-1 micro-batches through megatron-core's 1F1B (or interleaved 1F1B) schedule."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rank_plan = plan.ranks[rank]
        coefficients = claim_coefficients(plan.tree, getattr(loss_cfg, "loss_agg", None) or "token-mean")
        step = StepState(plan, rank, None, loss_cfg, coefficients, loss_scale,
                         StepOutput(num_micro_batches=len(rank_plan.micro_batches), logprobs=ComputedLogprobs()))
        # the plan-order executor's participants that concern these steps: the KV pool (none is
        # held: mechanism 1 only), router replay and router losses (begun and summed alike)
        step.participants = [KVCacheLifecycle(self.kv_cache, training=True), RouterState(self, training=True)]
        order = [i for _, i in rank_plan.schedule]
        packs = {}

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            if i not in packs:  # every chunk of this rank runs micro-batch i: pack it once
                pack = packs[i] = rank_plan.pack(plan.index, i)
                step.out.tokens_computed += pack.num_tokens
                step.out.key_pairs += pack.key_pairs()
            pack = packs[i]
            meta = TreeAttentionMetadata(plan=pack.plan, backend=self.attention_backend, kv_hook=None)
            ids = host_to_device(pack.input_ids, self.device)
            pos = host_to_device(pack.position_ids, self.device)
            # MoE: this pack's routes and router-loss weights (every row: no output_rows here);
            # the backward consults neither (no recomputation on this path, see train)
            self._replay_routes(plan, i, pack, None)
            if self.router_losses is not None:
                self.router_losses.set_pack(i, pack)
            hidden = model(ids, pos, meta)  # [t, 1, h]; megatron set the chunk's input

            def loss_func(output: Tensor):
                rows = self._claimed_rows(plan, pack)
                loss, metrics = output.sum() * 0.0, {}
                unclaimed = self._unclaimed_rows(step, pack, rows)
                if len(unclaimed):
                    self._record_rows(plan, pack, output[:, 0], unclaimed, step.out.logprobs)
                if len(rows):
                    claim_loss, metrics, _ = self._loss_head(plan, pack, output[:, 0], rows, loss_cfg, coefficients,
                                                             step.out.logprobs)
                    loss = loss + claim_loss
                step.account(loss, metrics)
                # (loss, num_tokens, reduced): calculate_per_token_loss, so megatron does not rescale
                return loss, torch.tensor(1, dtype=torch.int), {}

            return hidden, loss_func

        config = self.config
        config.grad_scale_func = (lambda t: t * loss_scale) if loss_scale != 1.0 else None
        for participant in step.participants:
            participant.begin(step)
        vpp = len(self.chunks)
        if vpp > 1:
            config.microbatch_group_size_per_vp_stage = self._group_size(len(order))
        try:
            get_forward_backward_func(self.pp_size, vpp if vpp > 1 else None)(
                forward_step_func=forward_step, data_iterator=[iter(order) for _ in self.chunks],
                model=list(self.chunks), num_microbatches=len(order),
                seq_length=max(mb.num_tokens for mb in rank_plan.micro_batches), micro_batch_size=1,
                forward_only=False, p2p_communicator=self.p2p, pg_collection=self.groups,
            )
        finally:
            config.grad_scale_func = None
            for participant in step.participants:
                participant.end(step)
        return self.close(step)


class _LinksFlush(StepParticipant):
    """A stage's sends wait for its next receive (:class:`~megatron_psrl.engine.stage_links.StageLinks`):
    before an instruction that communicates otherwise (heads, replica gradients) and at the end
    of the step, whatever still waits goes. With expert parallelism, before every instruction:
    the expert lockstep runs empty passes (all-to-alls with the stage's other pipelines) before
    a model run's own receive, and a send held back meanwhile could be what those pipelines'
    neighbours wait for."""

    def __init__(self, links: StageLinks, before_every_instruction: bool):
        self.links = links
        self.before_every_instruction = before_every_instruction

    def before(self, instruction: Instruction, step) -> None:
        if self.before_every_instruction or (instruction.pass_kind is None
                                             and not isinstance(instruction, LOCAL_INSTRUCTIONS)):
            self.links.flush()

    def end(self, step) -> None:
        self.links.flush()
