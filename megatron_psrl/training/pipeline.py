"""Pipeline parallelism: one rank's share of a step plan run as one stage of a pipeline.

Every stage of a pipeline group holds the same rank plan (the planner places trees on
data x context parallel ranks; the stages of one pipeline are one placement rank), packs the
same micro-batches and builds the same ``TreeAttentionMetadata``, so only hidden states and
their gradients travel between stages (megatron's ``P2PCommunicator``: the shapes first, since
tree-packed micro-batches differ in length, ``variable_seq_lengths``). The loss, log-probs
and entropies are computed on the last stage from the claims.

Two executors, chosen per step from the plan:

- **Mechanism 1 only** (every schedule step is ``forward_backward``: micro-batches are
  independent): megatron-core's own schedule, ``get_forward_backward_func`` (1F1B), with a
  ``forward_step_func`` that packs micro-batch ``i`` and a loss function over its claims.
- **Mechanism 2** (cached prefixes: a producer's backward waits until its readers are done,
  which 1F1B's first-in-first-out backward order cannot honour): every stage runs the plan's
  schedule in the plan's order. A forward receives its input from the stage before and sends
  its output on; a backward receives the output's gradient from the stage after, runs
  ``autograd.backward([output, K rows, V rows, ...], [grad, dK, dV, ...])`` (this stage's own
  block KV cache and dK/dV, for its own layers) and sends the input's gradient back. Each
  stage handles the messages of schedule step ``k`` only at its own step ``k``, so every
  message it waits for is sent by a neighbour that needs nothing from it first: no deadlock.
  Consecutive forwards overlap across stages; a backward waits for the stages after it.

Either way, the bubble is measured: the time each stage spends waiting in p2p receives over
the step's time (``pipeline_bubble``).
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
from megatron_psrl.kvcache.memory_plan import MemoryPlan
from megatron_psrl.training.loss import ClaimLoss, claim_coefficients
from megatron_psrl.training.step import ComputedLogprobs, StepOutput, StepRunner
from megatron_psrl.tree.planner import StepPlan

Tensor = torch.Tensor


class _TimedP2P(P2PCommunicator):
    """megatron's P2PCommunicator, adding up the time spent in its transfers (waits included)."""

    wait_s = 0.0

    def _communicate(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super()._communicate(*args, **kwargs)
        finally:
            self.wait_s += time.perf_counter() - t0


class PipelineStepRunner(StepRunner):
    """A :class:`StepRunner` for one pipeline stage (see the module docstring)."""

    def __init__(self, model, vocab_size: int, device: torch.device, attention_backend: Optional[str] = None,
                 kv_cache=None, exchange_group=None):
        super().__init__(model, vocab_size, device, attention_backend, kv_cache, exchange_group)
        install_cpu_pipeline_shims(device)
        config = model.config
        config.variable_seq_lengths = True  # tree-packed micro-batches differ in length
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.last_rank = dist.get_global_rank(self.pp_group, self.pp_size - 1)
        self.p2p = _TimedP2P(pp_group=self.pp_group, config=config)
        self._io: Dict[int, Tuple[Optional[Tensor], Tensor]] = {}  # micro-batch -> (stage input, stage output)
        self.last_bubble: float = 0.0
        """Measured bubble fraction of the last step (mean over stages of p2p wait / step time)."""
        self.last_schedule: str = ""
        """Executor of the last step: ``1f1b`` (megatron's) or ``plan-order``."""

    # ------------------------------------------------------------------ ordered executor
    def _stage_forward(self, i: int, ids: Tensor, pos: Tensor, meta: TreeAttentionMetadata, grad: bool) -> Optional[Tensor]:
        x = None
        if not self.first:
            # [t, 1, h]; its shape comes with it (variable_seq_lengths)
            x = self.p2p.recv_forward((len(ids), 1, self.model.config.hidden_size), is_first_stage=False)
            if grad:
                x.requires_grad_(True)
            self.model.set_input_tensor(x)
        out = self.model(ids, pos, meta)  # [t, 1, h]
        if not self.last:
            self.p2p.send_forward(out.detach(), is_last_stage=False)
        if grad:
            self._io[i] = (x, out)
        return out[:, 0] if self.last else None

    def _stage_backward(self, i: int, tensors: List[Tensor], grads: List[Tensor]) -> None:
        x, out = self._io.pop(i)
        if not self.last:
            g = self.p2p.recv_backward(tuple(out.shape), is_last_stage=False)
            tensors, grads = [out] + tensors, [g] + grads
        if tensors:
            torch.autograd.backward(tensors, grads)
        if not self.first:
            dx = x.grad if x.grad is not None else torch.zeros_like(x)
            self.p2p.send_backward(dx, is_first_stage=False)

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
        """Run one step's executor and set :attr:`last_bubble` from its p2p waits."""
        self.p2p.wait_s = 0.0
        t0 = time.perf_counter()
        out = run()
        wall = time.perf_counter() - t0
        t = torch.tensor([self.p2p.wait_s / max(wall, 1e-9)], dtype=torch.float64)
        dist.all_reduce(t, group=self.pp_group)
        self.last_bubble = float(t) / self.pp_size
        return out

    # ------------------------------------------------------------------ a training step
    def train(self, plan: StepPlan, rank: int, loss_cfg: ClaimLoss, memory: Optional[MemoryPlan] = None,
              loss_scale: float = 1.0) -> StepOutput:
        rank_plan = plan.ranks[rank]
        independent = not rank_plan.sources and all(op == "forward_backward" for op, _ in rank_plan.schedule)
        self.last_schedule = "1f1b" if independent else "plan-order"
        if independent and rank_plan.micro_batches:
            return self._measure(lambda: self._train_megatron_schedule(plan, rank, loss_cfg, loss_scale))
        return self._measure(lambda: super(PipelineStepRunner, self).train(plan, rank, loss_cfg, memory, loss_scale))

    def _forward_only(self, plan, rank, memory, claims_loss=None, coefficients=None) -> StepOutput:
        self.last_schedule = "plan-order"
        return self._measure(lambda: super(PipelineStepRunner, self)._forward_only(
            plan, rank, memory, claims_loss=claims_loss, coefficients=coefficients))

    def _train_megatron_schedule(self, plan: StepPlan, rank: int, loss_cfg: ClaimLoss,
                                 loss_scale: float) -> StepOutput:
        """Mechanism-1 micro-batches through megatron-core's 1F1B schedule."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.process_groups_config import ProcessGroupCollection

        rank_plan = plan.ranks[rank]
        coefficients = claim_coefficients(plan.tree, getattr(loss_cfg, "loss_agg", None) or "token-mean")
        out = StepOutput(num_micro_batches=len(rank_plan.micro_batches), logprobs=ComputedLogprobs())
        if self.kv_cache is not None:
            self.kv_cache.release_pool()
        metric_sums: Dict[str, float] = {}
        order = [i for _, i in rank_plan.schedule]
        packs = {}

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            pack = packs[i] = rank_plan.pack(plan.index, i)
            out.tokens_computed += pack.num_tokens
            out.key_pairs += pack.key_pairs()
            meta = TreeAttentionMetadata(plan=pack.plan, backend=self.attention_backend, kv_hook=None)
            ids = torch.from_numpy(pack.input_ids).to(self.device)
            pos = torch.from_numpy(pack.position_ids).to(self.device)
            hidden = model(ids, pos, meta)  # [t, 1, h]; megatron set the stage input

            def loss_func(output: Tensor):
                rows = self._claimed_rows(plan, pack)
                loss, metrics = output.sum() * 0.0, {}
                if len(rows):
                    claim_loss, metrics, _ = self._loss_head(plan, pack, output[:, 0], rows, loss_cfg, coefficients,
                                                             out.logprobs)
                    loss = loss + claim_loss
                out.loss += float(loss.detach())
                for k, v in metrics.items():
                    metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
                # (loss, num_tokens, reduced): calculate_per_token_loss, so megatron does not rescale
                return loss, torch.tensor(1, dtype=torch.int), {}

            return hidden, loss_func

        config = self.model.config
        config.grad_scale_func = (lambda t: t * loss_scale) if loss_scale != 1.0 else None
        groups = ProcessGroupCollection()
        groups.tp = parallel_state.get_tensor_model_parallel_group()
        groups.cp = parallel_state.get_context_parallel_group()
        groups.pp = self.pp_group
        groups.embd = parallel_state.get_embedding_group(check_initialized=False)
        groups.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
        groups.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(order), model=[self.model],
            num_microbatches=len(order), seq_length=max(mb.num_tokens for mb in rank_plan.micro_batches),
            micro_batch_size=1, forward_only=False, p2p_communicator=self.p2p, pg_collection=groups,
        )
        config.grad_scale_func = None
        out.metrics = metric_sums
        return self._finish(out)
