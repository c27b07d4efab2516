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
reduce's start) as without pipeline parallelism; a stage only adds the transfers. A forward
receives its input from the stage before and sends its output on; a backward receives the
output's gradient from the stage after, runs ``autograd.backward([output, K rows, V rows,
...], [grad, dK, dV, ...])`` (this stage's own block KV cache and dK/dV, for its own layers)
and sends the input's gradient back. The order:

- **1F1B** for a step of independent micro-batches (mechanism 1 only, every schedule step
  ``forward_backward``): :func:`~megatron_psrl.schedule.instructions.one_f_one_b` splits each
  into a kept forward and its backward in megatron's 1F1B order (warm-up forwards, then one
  forward and one backward in turn), so stages overlap and a stage holds at most
  ``PP - stage`` graphs. A backward that recomputes routes its MoE tokens as its forward did
  (the participants hold the routes), so activation recomputation with router replay runs here too.
- **The interleaved order** of the same steps with virtual stages (several model chunks per
  rank): :func:`~megatron_psrl.schedule.interleaved.interleaved_1f1b` lowers the step into
  one kept forward and one backward per micro-batch and chunk (``ForwardKeep`` /
  ``Backward`` with a ``chunk``) in megatron's interleaved 1F1B order, and
  :class:`~megatron_psrl.schedule.instructions.Transfer` instructions between them: the sends
  and receives that go together, one batch each (:meth:`StageLinks.transfer`). A chunk's
  forward reads the input a transfer received for it and leaves its output for the next
  transfer; its backward likewise with gradients.
- **The plan's order** for mechanism 2 (cached prefixes: a producer's backward waits until
  its readers are done, which 1F1B's first-in-first-out backward order cannot honour), trees
  split across pipelines (each stage's per-layer K/V exchanges meet the same micro-batch on the
  same stage of the other pipelines) and expert parallelism (a stage's MoE all-to-alls meet
  the same passes of the stage's other pipelines, whose micro-batch counts differ, through the
  expert lockstep, :class:`~megatron_psrl.model.moe.ExpertLockstep`: docs/moe.md), one
  micro-batch at a time through the chunks. Every stage runs the same instructions in the same
  order, so every message it waits for is sent by a neighbour that needs nothing from it
  first: no deadlock.

In 1F1B and the plan's order a model run receives and sends itself (a send goes with the
stage's next receive, :class:`StageLinks`); in the interleaved order only the transfers do.

megatron-core's own pipeline schedules are not used (its ``P2PCommunicator`` with
``variable_seq_lengths`` exchanges shapes and synchronises the device around every transfer,
and it runs steps through its own loop, not these instructions).

The bubble is measured: the time each stage spends waiting on its transfers over the step's
device time (``pipeline_bubble``; :class:`StageLinks` times waits on the host on CPU and with
CUDA events on GPU).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_psrl.attention.metadata import TreeAttentionMetadata
from megatron_psrl.engine.participants import StepParticipant
from megatron_psrl.engine.stage_links import StageLinks
from megatron_psrl.engine.step import ComputedLogprobs, StepOutput, StepRunner
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.sequence_parallel import padded_rows
from megatron_psrl.rl.loss import ClaimLoss
from megatron_psrl.schedule.instructions import (
    LOCAL_INSTRUCTIONS,
    Backward,
    ForwardKeep,
    Instruction,
    Transfer,
    flatten,
    lower_training,
    one_f_one_b,
)
from megatron_psrl.schedule.interleaved import interleaved_1f1b
from megatron_psrl.schedule.memory import MemoryPlan
from megatron_psrl.schedule.packing import PackedMicroBatch
from megatron_psrl.schedule.plan import RankPlan, StepPlan

Tensor = torch.Tensor


_clock = time.perf_counter  # the bubble's clock (a test replaces it with a fake one)


def _settle(device: Optional[torch.device]) -> None:
    """Wait for the work queued on ``device`` (CUDA runs it asynchronously; CPU: nothing): at a
    step's start and end, so that its measured time is its device time."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class _ChunkRuns:
    """A virtual-stage step's tensors between its instructions (one model chunk per run)."""

    def __init__(self) -> None:
        self.packs: Dict[int, PackedMicroBatch] = {}
        """Micro-batch -> its pack, from its first chunk's forward to its last's."""
        self.io: Dict[Tuple[int, int], Tuple[Optional[Tensor], Tensor]] = {}
        """(micro-batch, chunk) -> a kept forward's input (None: the embedding's) and output,
        until its backward."""
        self.received: Dict[Tuple[int, int, bool], Tensor] = {}
        """(micro-batch, chunk, gradient) -> a chunk's input (or its output's gradient), from
        the transfer that received it until the run that reads it."""
        self.made: Dict[Tuple[int, int, bool], Tensor] = {}
        """(micro-batch, chunk, gradient) -> a chunk's output (or its input's gradient), from
        the run that made it until the transfer that sends it."""


class PipelineStepRunner(StepRunner):
    """A :class:`StepRunner` for one pipeline stage (see the module docstring). With virtual
    stages the rank holds several model chunks: a micro-batch's forward runs them in order,
    chunk ``v`` receiving from the previous rank's chunk ``v`` (stage 0: the last rank's chunk
    ``v - 1``), and its backward in reverse."""

    def __init__(self, model, vocab_size: int, device: torch.device, attention_backend: Optional[str] = None,
                 kv_cache=None, exchange_group=None, **kwargs):
        super().__init__(model, vocab_size, device, attention_backend, kv_cache, exchange_group, **kwargs)
        self.chunks = model_chunks(model)
        self.config = self.chunks[0].config
        self.chunk_layers = [{layer.layer_number for layer in chunk.decoder.layers} for chunk in self.chunks]
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.last_rank = dist.get_global_rank(self.pp_group, self.pp_size - 1)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.links = StageLinks(self.pp_group, device, self.config.pipeline_dtype or self.config.params_dtype)
        """Activations and their gradients to and from the neighbours."""
        # micro-batch -> per chunk (its input, its output)
        self._io: Dict[int, List[Tuple[Optional[Tensor], Tensor]]] = {}
        self._chunk_runs = _ChunkRuns()
        """The step's tensors between one-chunk runs and transfers (virtual stages, interleaved)."""
        self.last_bubble: float = 0.0
        """Measured bubble fraction of the last step (mean over stages of p2p wait / step time)."""
        self.last_schedule: str = ""
        """Order of the last step: ``1f1b`` or ``interleaved`` (independent micro-batches, one
        chunk or several per rank), or ``plan-order``."""

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

    def _stage_forward(self, i: int, ids: Tensor, pos: Tensor, meta: TreeAttentionMetadata, grad: bool,
                       chunk: Optional[int] = None) -> Optional[Tensor]:
        if chunk is not None:
            return self._chunk_forward(i, chunk, ids, pos, meta, grad)
        io = []
        out = None
        for v, module in enumerate(self.chunks):
            x = None
            if self._receives(v):  # [t, 1, h] (a sequence-parallel share), with the outbox's sends
                x = self.links.recv_forward((self._activation_rows(len(ids)), 1, self.config.hidden_size))
                if grad:
                    x.requires_grad_(True)
                module.set_input_tensor(x)
            else:
                self.links.flush()  # a run that receives nothing: what waits goes first
            out = module(ids, pos, meta)  # [t, 1, h]
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

    # ------------------------------------------------------------------ one chunk per run (virtual stages)
    def run_forward_keep(self, x: ForwardKeep, step) -> None:
        """A kept forward of every chunk, or (``x.chunk``) of one: the micro-batch packed at its
        first chunk's forward, its loss (last stage) kept at its last chunk's for its backward."""
        if x.chunk is None:
            return super().run_forward_keep(x, step)
        runs, i = self._chunk_runs, x.micro_batch
        last = x.chunk == len(self.chunks) - 1
        if i not in runs.packs:  # (packed, its tokens counted, once per micro-batch)
            runs.packs[i] = self._pack(step, i)
        pack = runs.packs.pop(i) if last else runs.packs[i]
        loss, metrics, _, _ = self._forward(step, i, pack, self._rows(step, pack, x.forward_pass), x.forward_pass,
                                            chunk=x.chunk)
        step.account(loss, metrics)
        if last:
            step.pending[i] = (loss, [], None)

    def run_backward(self, x: Backward, step) -> None:
        """A backward of every chunk, or (``x.chunk``) of one, the first of which (the last
        chunk's) starts from the loss the forward kept."""
        if x.chunk is None:
            return super().run_backward(x, step)
        loss = step.pending.pop(x.micro_batch)[0] if x.chunk == len(self.chunks) - 1 else None
        for participant in step.participants:  # (routes and router-loss weights of a recomputation)
            participant.before_graph_backward(x, step)
        self._chunk_backward(step, x.micro_batch, x.chunk, step.scaled(loss))

    def run_transfer(self, x: Transfer, step) -> None:
        """The transfer's sends (what earlier runs made) and receives (buffers of the shapes the
        plan gives, for later runs) as one batch, waited for (:meth:`StageLinks.transfer`)."""
        runs, links, stages = self._chunk_runs, self.links, self.pp_size
        peer = {False: links.next_rank, True: links.prev_rank}  # activations go on, gradients back
        sends = [(runs.made.pop((m.micro_batch, m.sender_chunk(stages), m.gradient)), peer[m.gradient])
                 for m in x.sends]
        rows = [self._activation_rows(step.rank_plan.micro_batches[m.micro_batch].num_tokens) for m in x.receives]
        received = links.transfer(sends, [((t, 1, self.config.hidden_size), peer[not m.gradient])
                                          for t, m in zip(rows, x.receives)])
        for m, tensor in zip(x.receives, received):  # [t, 1, h] (a sequence-parallel share)
            runs.received[(m.micro_batch, m.receiver_chunk(stages), m.gradient)] = tensor

    def _chunk_forward(self, i: int, v: int, ids: Tensor, pos: Tensor, meta: TreeAttentionMetadata,
                       grad: bool) -> Optional[Tensor]:
        """Chunk ``v`` of micro-batch ``i`` on the input a transfer received for it; its output
        kept for its backward and, unless it is the model's last part, for the next transfer."""
        runs = self._chunk_runs
        x = None
        if self._receives(v):
            x = runs.received.pop((i, v, False)).requires_grad_(grad)
            self.chunks[v].set_input_tensor(x)
        out = self.chunks[v](ids, pos, meta)  # [t, 1, h]
        runs.io[(i, v)] = (x, out)
        if self._sends(v):
            runs.made[(i, v, False)] = out.detach()
            return None
        return out.squeeze(1)

    def _chunk_backward(self, step, i: int, v: int, loss: Optional[Tensor]) -> None:
        """Chunk ``v``'s backward of micro-batch ``i`` from its output's gradient a transfer
        received (the model's last part: from the loss), its input's gradient kept for the next
        transfer (zeros when nothing reached it)."""
        runs = self._chunk_runs
        x, out = runs.io.pop((i, v))
        roots: List[Tensor] = []
        grads: List[Tensor] = []
        if self._sends(v):
            roots, grads = [out], [runs.received.pop((i, v, True))]
        elif loss is not None:
            roots, grads = [loss], [torch.ones_like(loss)]
        self._arm_backward(step, roots)
        if roots:
            torch.autograd.backward(roots, grads)
        if self._receives(v):
            runs.made[(i, v, True)] = x.grad if x.grad is not None else torch.zeros_like(x)

    # ------------------------------------------------------------------ the step's order
    def _participants(self, step, instructions: List[Instruction], training: bool) -> List[StepParticipant]:
        """The step's participants, the stage's links first (their ``end`` posts the last sends
        before any other participant's closing communication)."""
        return [_LinksFlush(self.links, self.expert_group is not None)] + super()._participants(
            step, instructions, training)

    def _schedule(self, rank_plan: RankPlan) -> str:
        """The order of a training step (:attr:`last_schedule`): ``1f1b`` or ``interleaved``
        for independent micro-batches (one model chunk per rank or several), else ``plan-order``."""
        if not self._independent(rank_plan):
            return "plan-order"
        return "1f1b" if len(self.chunks) == 1 else "interleaved"

    def _training_stream(self, rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Instruction]:
        """The plan's order, or for a step of independent micro-batches 1F1B (:func:`one_f_one_b`)
        or with virtual stages the interleaved order and its transfers (:func:`interleaved_1f1b`)."""
        schedule = self._schedule(rank_plan)
        if schedule == "plan-order":
            return super()._training_stream(rank_plan, memory)
        steps = lower_training(rank_plan, {}, {})
        if schedule == "1f1b":
            return flatten(one_f_one_b(steps, self.stage, self.pp_size))
        return interleaved_1f1b(steps, self.stage, self.pp_size, len(self.chunks))

    def _independent(self, rank_plan: RankPlan) -> bool:
        """Micro-batches that may run in a 1F1B order: independent (mechanism 1, every step
        ``forward_backward``, no tree split across pipelines) and no expert parallelism (a
        stage's MoE all-to-alls meet the same pass on the stage's other pipelines, whose
        micro-batch counts differ: the expert lockstep follows the plan's order)."""
        return (self.expert_group is None and not rank_plan.sources and not rank_plan.cross_rank
                and all(op == "forward_backward" for op, _ in rank_plan.schedule))

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
        self.links.reset()
        _settle(self.device)  # the step's time is its device time, from drained to drained
        t0 = _clock()
        out = run()
        _settle(self.device)
        wall = _clock() - t0
        t = torch.tensor([self.links.blocked.seconds / max(wall, 1e-9)], dtype=torch.float64)
        dist.all_reduce(t, group=self.pp_group)
        self.last_bubble = float(t) / self.pp_size
        return out

    # ------------------------------------------------------------------ a training step
    def train(self, plan: StepPlan, rank: int, loss_cfg: ClaimLoss, memory: Optional[MemoryPlan] = None,
              loss_scale: float = 1.0, last_of_step: bool = False) -> StepOutput:
        self.last_schedule = self._schedule(plan.ranks[rank])
        self._chunk_runs = _ChunkRuns()  # (nothing left over from a step that failed)
        return self._measure(lambda: super(PipelineStepRunner, self).train(plan, rank, loss_cfg, memory, loss_scale,
                                                                           last_of_step))

    def _forward_only(self, plan, rank, memory, claims_loss=None, coefficients=None,
                      with_entropy: bool = False) -> StepOutput:
        if with_entropy:  # _finish hands the loss stage's log-probs to every stage, not entropies
            raise ConfigurationError("per-token entropies of a log-prob pass are not available with pipeline "
                                     "parallelism yet (--pipeline-model-parallel-size 1)")
        self.last_schedule = "plan-order"
        return self._measure(lambda: super(PipelineStepRunner, self)._forward_only(
            plan, rank, memory, claims_loss=claims_loss, coefficients=coefficients))


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
