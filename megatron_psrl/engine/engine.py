"""The engine: everything one rank needs to run steps, and the step itself.

An :class:`Engine` holds this rank's model chunks, optimizer, KV cache, step runner, cost
model and placement, and the process groups (its :class:`ParallelLayout`); it is assembled by
:func:`megatron_psrl.engine.builder.build_engine`. A step, as the engine runs it:

1. :meth:`Engine.plan`: the batch's prefix tree, the step plan (trees over ranks, micro-batches,
   schedule; :mod:`megatron_psrl.schedule.plan`) and this rank's KV memory plan;
2. the step runner (:mod:`megatron_psrl.engine.step`, or :mod:`~megatron_psrl.engine.pipeline`
   with pipeline stages) runs this rank's micro-batches; gradients accumulate in the model;
3. losses and metrics are reduced over the data x context parallel ranks
   (:meth:`Engine.forward_backward`);
4. :meth:`Engine.optimizer_step` reduces the gradients, clips and applies them.

The engine validates nothing a caller passes: :class:`~megatron_psrl.rl.actor.PolicyActor`
(the in-memory API) and the command lines check batches and configs before they reach it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.attention import backends as attention_backends
from megatron_psrl.compat import install_cpu_recompute_shims
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.distributed.setup import ParallelLayout, exchange_group_of, gradient_group
from megatron_psrl.engine.budget import MemoryBudget, budget_metrics, plan_under_budget
from megatron_psrl.engine.calibration import MeasuredCosts
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.engine.logprobs import per_sample_logprobs, per_sample_values, run_logprobs
from megatron_psrl.engine.optimizer import StepOutcome
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.moe import ExpertLoad, expert_load_summary
from megatron_psrl.model.sequence_parallel import sequence_parallel_group
from megatron_psrl.model.stages import stage_counts, virtual_stages
from megatron_psrl.rl.loss import ClaimLoss, LossConfig, PerClaimLoss, SequenceInputs, SequenceLoss
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.memory import (
    MemoryPlan,
    MemorySettings,
    StepCharge,
    VarlenCharge,
    add_segment_shapes,
    step_peak_bytes,
)
from megatron_psrl.schedule.plan import StepPlan, token_aliases
from megatron_psrl.schedule.step_charge import ActivationCharge, add_row_counts
from megatron_psrl.schedule.with_memory import memory_plans, plan_with_memory, transfer_reasons
from megatron_psrl.tree.build import build_prefix_tree
from megatron_psrl.tree.prefix_tree import PrefixTree


@dataclass
class StepResult:
    """What a forward/backward (and, from ``train_step``, the optimizer step) did."""

    loss: float
    """The step's loss over the whole global batch (all ranks)."""

    metrics: Dict[str, Any]
    """Everything else: loss terms, tokens, plan and KV cache metrics, phase times (seconds)."""

    logprobs: Optional[List[np.ndarray]] = None
    """Per sample, the log-probs this step computed: every trained token, and a token trained
    in another sample that shares it; NaN where none was computed, 0 at position 0. Compare
    with the rollout's log-probs to watch the train / inference mismatch."""

    entropies: Optional[List[np.ndarray]] = None
    """Per sample, beside ``logprobs``, the entropy of the distribution that predicts each
    token, where the loss asked for it at every token (``records_every_row`` and
    ``needs_entropy``); None otherwise."""

    outcome: Optional[StepOutcome] = None
    """The optimizer step (train_step only)."""

    def as_dict(self) -> Dict[str, Any]:
        out = dict(self.metrics, loss=self.loss)
        if self.outcome is not None:
            out.update(grad_norm=self.outcome.grad_norm, skipped=self.outcome.skipped)
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


@dataclass
class Engine:
    """This rank's share of the policy and everything a step needs (see the module docstring)."""

    config: ActorConfig
    """What it was built from."""

    layout: ParallelLayout
    """Ranks, parallel sizes, device and the collective-timeout monitor."""

    arch: ModelArchitecture
    """The model's architecture (its Hugging Face config, read once)."""

    model: torch.nn.Module
    """This rank's model: one megatron GPTModel, or a list of chunks with virtual pipeline stages."""

    optimizer: Optional[Any]
    """Optimizer, schedule and gradient reduction (None for a log-prob-only engine)."""

    kv_cache: BlockKVCache
    """The dynamic-block KV cache of mechanism 2 (allocated per step, within the budget)."""

    runner: StepRunner
    """Runs this rank's micro-batches of a plan (the pipeline runner with PP > 1)."""

    geometry: KVGeometry
    """The KV cache's geometry on this rank's stages."""

    plan_geometry: KVGeometry
    """What memory plans assume (the same on every stage, so every rank plans alike)."""

    flop_model: CostModel
    """The FLOP cost model (the ideal speedup of a batch is a FLOP ratio by definition)."""

    measured: Optional[MeasuredCosts]
    """Start-up cost measurement (only when trees may be split over an exchange group), or the
    one the resumed checkpoint recorded; saved with every checkpoint."""

    placement: str
    """Trees over an exchange group: ``whole-tree``, ``cross-rank`` or ``auto``."""

    backend_name: str
    """The prefix-sharing attention kernel that runs."""

    transformer_impl: str
    """megatron's layer spec: ``local`` or ``transformer_engine``."""

    pipeline_split: Any
    """Each (virtual) stage's layer count, or the (virtual) stage count for an even split."""

    virtual_pipeline_size: int
    """Model chunks per pipeline rank (1 without virtual stages)."""

    recompute: bool
    """Activation recomputation is on (megatron's; prefix gradients injected in the graph)."""

    iteration: int
    """Optimizer steps taken (a resumed checkpoint's iteration included)."""

    act_bytes: int
    """Activation bytes per token of a kept graph (the memory plan's charge)."""

    head_bytes: int
    """The loss head's transient peak as a bound for any micro-batch (six chunks of the budget's
    rows; what memory plans charged before they charged by rows: ``graph_charge``)."""

    graph_charge: Optional[ActivationCharge] = None
    """What a micro-batch's graph, loss head and the step's gradients hold by its rows (the
    memory plans' charge; None: ``act_bytes`` per token and ``head_bytes`` at every step)."""

    memory_budget: Optional["MemoryBudget"] = None
    """``--memory-budget`` and what fills it (:mod:`megatron_psrl.engine.budget`); None: every
    step planned with the configured budgets."""

    log: Callable[[str], None] = field(default=lambda msg: None, repr=False)
    """Where notes and warnings go."""

    def __post_init__(self) -> None:
        self.exchange_group, self.exchange_group_size = exchange_group_of(self.layout)
        self._sequence_value = 0.0

    @property
    def cost_model(self) -> CostModel:
        """The planner's cost model: measured at start-up, else FLOPs. The measured one charges a
        read's derived K/V (latent attention's up-projection, not calibrated on its own) at the
        measured seconds of a FLOP of the linear term."""
        if self.measured is None:
            return self.flop_model
        measured, flops = self.measured.cost_model(), self.flop_model
        scale = measured.linear_flops_per_token / flops.linear_flops_per_token if flops.linear_flops_per_token else 0.0
        return dataclasses.replace(measured, read_flops_per_token=flops.read_flops_per_token * scale)

    # ------------------------------------------------------------------ planning
    @property
    def memory_settings(self) -> MemorySettings:
        """What this run's memory plans need (the torch, flash and te backends gather cached K/V
        again in their backward; recomputation re-reads cached prefixes)."""
        return self.memory_settings_for()

    def memory_settings_for(self, entropy: bool = False, step_budget: Optional[int] = None, offload: bool = False,
                            recompute: Optional[Tuple[Optional[str], Optional[str], Optional[int]]] = None
                            ) -> MemorySettings:
        """:attr:`memory_settings` of a step whose loss head computes the entropy, or not; with
        ``step_budget``, the step's own peak must fit it (``--memory-budget``: the KV plan has no
        limit of its own then); ``offload`` prices host offload;
        ``recompute``: megatron's recomputation setting the step would run with (default: now's)."""
        recompute = recompute or self.recompute_setting
        step = None
        if self.graph_charge is not None:
            charge = self._charge_for(recompute)
            step = StepCharge(dataclasses.replace(charge, entropy=entropy), step_budget, offload)
        # (under --memory-budget the step's own timeline is the limit; the cache's pools stay within
        # the cache's limit, the memory budget, which BlockKVCache checks)
        budget = self.config.kv_cache_budget if step_budget is None else 1 << 62
        return MemorySettings(self.plan_geometry, budget, self.act_bytes, rereads=recompute[0] is not None,
                              gathers_in_backward=self.backend_name in attention_backends.READS_CACHED_PREFIXES,
                              head_bytes=self.head_bytes if step_budget is None else 0, varlen=self.varlen_charge,
                              step=step)

    @property
    def recompute_setting(self) -> Tuple[Optional[str], Optional[str], Optional[int]]:
        """megatron's ``(recompute_granularity, recompute_method, recompute_num_layers)`` as the
        model's layers read them now (a step may change them: :mod:`megatron_psrl.engine.budget`)."""
        config = model_chunks(self.model)[0].config
        return config.recompute_granularity, config.recompute_method, config.recompute_num_layers

    def set_recompute(self, granularity: Optional[str], method: Optional[str] = None,
                      num_layers: Optional[int] = None) -> None:
        """Run the next steps with megatron's ``full`` activation recomputation of ``(method,
        num_layers)``, or none (``granularity`` None): the fields megatron's transformer block
        reads at every forward, the memory plan's re-reads and the runner's injection of prefix
        gradients inside the graph, as ``--recompute-granularity full`` builds them (``selective``
        is fixed when the layers are built: not switched here)."""
        if granularity not in (None, "full"):
            raise ConfigurationError(f"a step switches to full recomputation or none, not {granularity!r}")
        if granularity is not None:
            install_cpu_recompute_shims(self.layout.device)
        for module in self.model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "recompute_granularity"):
                config.recompute_granularity, config.recompute_method = granularity, method
                config.recompute_num_layers = num_layers
        self.recompute = granularity is not None
        self.runner.inject_kv_grads = self.recompute

    @property
    def charge(self) -> Optional[ActivationCharge]:
        """:attr:`graph_charge` under the model's recomputation setting now."""
        return self._charge_for(self.recompute_setting) if self.graph_charge is not None else None

    def _charge_for(self, recompute: Tuple[Optional[str], Optional[str], Optional[int]]) -> ActivationCharge:
        dtype_bytes = torch.tensor([], dtype=self.config.torch_dtype).element_size()
        return self.graph_charge.with_recompute(*recompute, self.arch, self.layout.tensor_parallel_size, dtype_bytes)

    def predicted_step_peak(self, plan: StepPlan, memory: Optional[MemoryPlan], entropy: bool = False) -> int:
        """The memory plan's prediction of this rank's step peak above the weights (and above
        gradients allocated before the step): :func:`~megatron_psrl.schedule.memory.step_peak_bytes`
        (``entropy``: the loss head computes it)."""
        rank = plan.ranks[self.layout.placement_rank]
        step = self.memory_settings_for(entropy).step
        if step is None:
            return step_peak_bytes(rank, memory, self.act_bytes, self.head_bytes, self.varlen_charge)
        add_row_counts(plan.index, rank)
        if self.varlen_charge is not None:
            add_segment_shapes(plan.index, rank)
        return step_peak_bytes(rank, memory, self.act_bytes, self.head_bytes, self.varlen_charge,
                               in_flight=self.layout.pipeline_parallel_size * self.virtual_pipeline_size,
                               charge=step.charge)

    @property
    def varlen_charge(self) -> Optional[VarlenCharge]:
        """The flash / te backends' gathered K/V and padded statistics (None: torch, dense)."""
        dtype_bytes = torch.tensor([], dtype=self.config.torch_dtype).element_size()
        return VarlenCharge.of(self.arch, self.layout.tensor_parallel_size, dtype_bytes, self.backend_name)

    def planner_config(self, prefix_sharing: Optional[str] = None,
                       micro_batch_tokens: Optional[int] = None) -> PlannerConfig:
        c = self.config
        costs = (self.measured.planner_settings(self.geometry.num_layers, self.geometry.row_bytes_per_token)
                 if self.measured else dict(cost_model=self.cost_model))
        cross_group_prefix = c.cross_group_prefix
        if transfer_reasons(self.layout.pipeline_parallel_size, self.recompute, self.arch.is_moe,
                            fixed_states=self.plan_geometry.fixed_bytes_per_source > 0):  # (any stage's)
            cross_group_prefix = "recompute"
        return PlannerConfig(micro_batch_tokens=micro_batch_tokens or c.micro_batch_tokens,
                             data_parallel_size=self.layout.placement_size,
                             sharing=prefix_sharing or c.prefix_sharing, exchange_group_size=self.exchange_group_size,
                             placement=self.placement, local_rank=self.layout.placement_rank,
                             split_trees_across_groups=c.split_trees_across_groups,
                             cross_group_prefix=cross_group_prefix, **costs)

    def plan(self, batch: SampleBatch, times: Optional[Dict[str, float]] = None,
             prefix_sharing: Optional[str] = None, micro_batch_tokens: Optional[int] = None,
             entropy: bool = False) -> Tuple[PrefixTree, StepPlan, Optional[MemoryPlan], str]:
        """``(tree, step plan, this rank's memory plan, sharing mode used)`` of a training step
        (``times`` receives the seconds of the tree build and of the planning; ``prefix_sharing``
        and ``micro_batch_tokens``: other settings than the run's, e.g. for the sharing check;
        ``entropy``: the step's loss head computes the entropy)."""
        t0 = time.perf_counter()
        tree = build_prefix_tree(batch)
        t1 = time.perf_counter()
        wanted = prefix_sharing or self.config.prefix_sharing
        if self.memory_budget is not None:
            plan, memories, mode, _ = plan_under_budget(self, tree, wanted, micro_batch_tokens, entropy)
        else:
            plan, memories, mode = plan_with_memory(tree, self.planner_config(wanted, micro_batch_tokens),
                                                    self.memory_settings_for(entropy))
        if times is not None:
            times.update(tree=t1 - t0, plan=time.perf_counter() - t1)
        if mode != wanted:
            budget = "--memory-budget" if self.memory_budget is not None else "--kv-cache-budget"
            self.log(f"warning: the cached prefixes do not fit {budget}; duplicating them this step")
        return tree, plan, memories[self.layout.placement_rank], mode

    # ------------------------------------------------------------------ a step
    def forward_backward(self, batch: SampleBatch, loss: ClaimLoss, return_logprobs: bool,
                         last_of_step: bool = False, prefix_sharing: Optional[str] = None,
                         micro_batch_tokens: Optional[int] = None) -> StepResult:
        """Forward and backward of the whole global batch on this rank's share of the plan;
        losses and metrics reduced over the data x context parallel ranks. ``last_of_step``:
        :meth:`optimizer_step` follows with no other backward in between, so the gradient
        reduce may start during this call's last backward pass (``--overlap-grad-reduce``).
        ``prefix_sharing``, ``micro_batch_tokens``: plan this call with other settings than the run's."""
        monitor, it = self.layout.monitor, self.iteration + 1
        times: Dict[str, float] = {}
        tree, plan, memory, mode = self.plan(batch, times, prefix_sharing, micro_batch_tokens,
                                             entropy=bool(getattr(loss, "needs_entropy", False)))
        sequence_loss = None
        if isinstance(loss, SequenceLoss):
            sequence_loss, loss = loss, self._sequence_surrogate(loss, plan, batch)
        router_losses = getattr(self.runner, "router_losses", None)
        if router_losses is not None and router_losses.needs_route_counts(plan.tree):
            t0 = time.perf_counter()
            self._count_routes(plan)
            times["route_counts"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with monitor.phase(f"forward/backward of iteration {it}"), ExpertLoad(self.model) as expert_load:
            out = self.runner.train(plan, self.layout.placement_rank, loss, memory,
                                    loss_scale=self.optimizer.loss_scale if self.optimizer is not None else 1.0,
                                    last_of_step=last_of_step)
        times["forward_backward"] = time.perf_counter() - t0
        keys = ["clip_frac", "pg_loss", "ratio_clamped", "kl", "entropy"]  # the same on every rank
        if router_losses is not None:
            keys += ["moe_z_loss", "moe_aux_loss"]
        with monitor.phase(f"loss all-reduce of iteration {it}"):
            sums = self.reduce([out.loss, out.tokens_computed, out.tokens_recomputed, out.num_micro_batches]
                               + [out.metrics.get(k, 0.0) for k in keys], group=gradient_group())
            metrics: Dict[str, Any] = {k: v for k, v in zip(keys, sums[4:]) if k in out.metrics or
                                       _reported(k, loss)}
            metrics.update(self._kv_metrics(bool(plan.ranks[self.layout.placement_rank].sources)))
            if expert_load.layer_numbers:  # (an MoE model: the same layers on every rank of the group)
                counts = expert_load.counts(self.layout.device).double()
                dist.all_reduce(counts, group=gradient_group())  # the tokens of every data x context rank
                rows_split = sequence_parallel_group(self.model.config)
                if rows_split is not None:  # sequence parallelism: each TP rank routed its share of the rows
                    dist.all_reduce(counts, group=rows_split)
                metrics["moe_expert_load"] = expert_load_summary(counts)
        total = float(sums[0]) if sequence_loss is None else float(self._sequence_value) + sum(
            float(metrics.get(k, 0.0)) for k in ("moe_z_loss", "moe_aux_loss"))  # (sums[0] has the router losses)
        metrics.update(
            tokens_total=int(batch.num_tokens), tokens_computed=int(sums[1]), tokens_recomputed=int(sums[2]),
            micro_batches=int(sums[3]), tokens_unique=int(tree.num_tree_tokens), samples=batch.num_samples,
            ideal_speedup=float(self.flop_model.ideal_speedup(tree)),  # by definition a FLOP ratio
            prefix_sharing=mode, attention_backend=self.backend_name, times=times,
        )
        if "ratio_clamped" in metrics:
            metrics["ratio_clamped"] = int(metrics["ratio_clamped"])
        metrics.update(plan_metrics(plan, self.geometry, self.measured))
        if self.memory_budget is not None and self.memory_budget.last is not None:
            metrics["memory_plan"] = budget_metrics(self.memory_budget)
        if self.layout.pipeline_parallel_size > 1:
            metrics.update(pipeline_bubble=self.runner.last_bubble, pipeline_schedule=self.runner.last_schedule)
        aliases = token_aliases(plan.head_sends)
        logprobs = (per_sample_logprobs(plan.tree, out.logprobs, gradient_group(), fill=np.nan, aliases=aliases)
                    if return_logprobs else None)
        entropies = None
        if return_logprobs and out.logprobs is not None and out.logprobs.with_entropy:
            index, _ = out.logprobs.arrays()
            entropies = per_sample_values(plan.tree, index, out.logprobs.entropy_array(), gradient_group(),
                                          fill=np.nan, aliases=aliases)
        return StepResult(loss=total, metrics=metrics, logprobs=logprobs, entropies=entropies)

    def _count_routes(self, plan: StepPlan) -> None:
        """The load-balancing loss without router replay: a forward-only pass over this rank's
        micro-batches counts every MoE layer's routes (weighted by the samples through each
        token), summed over the data x context parallel ranks, before the training step."""
        forward_memories = memory_plans(plan, self.memory_settings.forward)
        me = self.layout.placement_rank
        with self.layout.monitor.phase(f"route-count forward of iteration {self.iteration + 1}"):
            self.runner.router_losses.count_routes(plan.tree, lambda: self.runner.logprobs(plan, me, forward_memories[me]),
                                                   group=gradient_group())

    def _sequence_surrogate(self, loss: SequenceLoss, plan: StepPlan, batch: SampleBatch) -> PerClaimLoss:
        """The first pass of a sequence-level loss: every sample's sum of ``token_terms``
        (forward only, summed over ranks), the loss of those sums, and the per-claim surrogate
        ``dL/dS[sample] * token_terms`` whose gradient is the loss's."""
        forward_memories = memory_plans(plan, self.memory_settings.forward)
        me = self.layout.placement_rank
        with self.layout.monitor.phase(f"sequence-loss forward of iteration {self.iteration + 1}"):
            local = self.runner.sequence_sums(plan, me, loss, forward_memories[me])
            sums = host_to_device(local, self.layout.device, np.float64)
            if dist.get_world_size(gradient_group()) > 1:
                dist.all_reduce(sums, group=gradient_group())
        sums = sums.float().requires_grad_(True)
        tree, n, device = plan.tree, batch.num_samples, sums.device
        trained = np.bincount(tree.claim_sample, minlength=n) > 0
        advantage = np.zeros(n, dtype=np.float32)
        if batch.advantages is not None and tree.claim_flat.size:
            last = np.full(n, -1, dtype=np.int64)  # flat index of every sample's last trained token
            np.maximum.at(last, tree.claim_sample, tree.claim_flat.astype(np.int64))
            advantage[trained] = batch.advantages[last[trained]]
        inputs = SequenceInputs(advantage=host_to_device(advantage, device),
                                weight=host_to_device(batch.weights, device, np.float32),
                                trained=host_to_device(trained, device))
        value = loss.sequence_loss(sums, inputs)
        (grad,) = torch.autograd.grad(value, sums)
        self._sequence_value = float(value.detach())
        grad = grad.detach()
        return PerClaimLoss(lambda view: grad[view.sample] * loss.token_terms(view), needs_entropy=loss.needs_entropy,
                            needs_ref=loss.needs_ref, needs_advantage=loss.needs_advantage)

    def optimizer_step(self, skip: bool = False) -> StepOutcome:
        """Reduce the accumulated gradients over data x context parallel ranks, clip and apply
        them; a non-finite gradient norm (or ``skip``) skips the step on every rank."""
        with self.layout.monitor.phase(f"gradient all-reduce and optimizer step {self.iteration + 1}"):
            outcome = self.optimizer.step(skip=skip)
        if not outcome.skipped:
            self.iteration += 1
        return outcome

    def zero_grad(self) -> None:
        """Gradients zeroed for a new step; so are the token counts of the expert bias's update
        (a sharing check's passes count nothing for the step)."""
        if self.optimizer is None:
            self.model.zero_grad(set_to_none=True)
        else:
            self.optimizer.zero_grad()
        router_losses = getattr(self.runner, "router_losses", None)
        if router_losses is not None:
            router_losses.zero_expert_bias_counts()

    # ------------------------------------------------------------------ log-probs
    def compute_logprobs(self, batch: SampleBatch, with_entropy: bool = False):
        """log p(tokens[i] | tokens[:i]) of every sample (index 0: 0.0), prefix-shared, with the
        same placement over ranks as training; every rank returns all samples. With
        ``with_entropy``: ``(log-probs, entropies)``, the entropy of the distribution that
        predicts each token beside its log-prob."""
        sharing = "tree" if self.config.prefix_sharing != "none" else "none"
        group = gradient_group() if self.layout.placement_size > 1 else None
        return run_logprobs(self.runner, self.plan_geometry, batch, self.planner_config(sharing),
                            self.config.kv_cache_budget, self.layout.placement_rank, group, with_entropy=with_entropy)

    # ------------------------------------------------------------------ weights and layout
    def stage_chunks(self):
        """``(virtual stage, chunk)`` of this rank's model chunks (chunk v of stage p holds
        virtual stage v * PP + p; one chunk, stage p, without virtual stages)."""
        chunks = model_chunks(self.model)
        return list(zip(virtual_stages(self.layout.pp_rank, self.layout.pipeline_parallel_size, len(chunks)), chunks))

    def same_layout(self, info) -> bool:
        """A checkpoint was saved with this engine's TP size and (virtual) pipeline stages."""
        return same_layout(info, self.layout.tensor_parallel_size, self.virtual_pipeline_size, self.pipeline_split)

    def params_ready(self) -> None:
        """Parameters are read outside a forward pass: finish megatron's background all-gather
        of the updated ones (``overlap_param_gather`` on CUDA; nothing otherwise)."""
        if self.optimizer is not None and hasattr(self.optimizer, "sync_params"):
            self.optimizer.sync_params()

    def weights_changed(self) -> None:
        """Weights were loaded into the model: a bf16 model's fp32 master copies follow (else the
        next step would write the old weights back)."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ------------------------------------------------------------------ collectives
    def reduce(self, values: List[float], op=dist.ReduceOp.SUM, group=None) -> List[float]:
        t = host_to_device(values, self.layout.device, np.float64)
        dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    def _kv_metrics(self, used: bool) -> Dict[str, float]:
        """KV cache metrics of the step over all data x context parallel ranks (same collectives
        on every rank, zeros where a rank ran no mechanism-2 work); empty when none cached."""
        group = gradient_group()
        m = self.kv_cache.metrics
        util = m.utilisation_samples
        local_sum = [m.tokens_read, m.tokens_recomputed, m.allocated_slots, m.used_slots,
                     float(np.mean(util)) if util else 0.0, 1.0] if used else [0.0] * 6
        local_max = [m.peak_blocks_used / m.pool_blocks if m.pool_blocks else 0.0, m.block_size,
                     m.pool_blocks] if used else [0.0] * 3
        read, recomputed, allocated, occupied, util_sum, ranks = self.reduce(local_sum, group=group)
        peak_util, block_size, pool_blocks = self.reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        if ranks == 0:
            return {}
        return {
            "kv_block_size": int(block_size), "kv_pool_blocks": int(pool_blocks), "kv_peak_utilisation": peak_util,
            "kv_mean_utilisation": util_sum / ranks,
            "kv_fragmentation": 1.0 - occupied / allocated if allocated else 0.0,
            "kv_hit_rate": read / (read + recomputed) if read + recomputed else 1.0,
            "kv_tokens_recomputed": int(recomputed),
        }


def _reported(key: str, loss: ClaimLoss) -> bool:
    """A loss term is reported when the loss has it: KL / entropy when their coefficient is
    set, the PPO terms for the configured loss."""
    if key in ("kl", "entropy"):
        return bool(getattr(loss, "kl_coef" if key == "kl" else "entropy_coef", 0.0))
    if key.startswith("moe_"):  # router losses: when the step runner computed them
        return False
    return isinstance(loss, LossConfig)


def same_layout(info, tensor_parallel_size: int, vpp: int, split) -> bool:
    """A checkpoint (its info) was saved with this TP size and (virtual) pipeline stages."""
    return (info.tensor_parallel_size == tensor_parallel_size and info.virtual_pipeline_size == vpp
            and stage_counts(info.architecture, info.pipeline_split) == stage_counts(info.architecture, split))


def cost_model_for(arch: ModelArchitecture) -> CostModel:
    """The FLOP cost model of a model (the planner's default before any measurement)."""
    return CostModel.for_architecture(arch)


def plan_metrics(plan: StepPlan, geometry: KVGeometry, measured: Optional[MeasuredCosts]) -> Dict[str, object]:
    """What the planner decided, for the iteration line and --log-json."""
    out: Dict[str, object] = {
        "placement": "+".join(sorted(set(plan.placements) - {"unplanned"})),
        "plan_imbalance": plan.imbalance(),
        "plan_rank_cost": [round(float(c), 6) for c in plan.rank_costs()],
        "exchanged_bytes": plan.exchanged_bytes(geometry.row_bytes_per_token),
        "tokens_duplicated": plan.mechanism_counts()["duplicated_tokens"],
        "tokens_recomputed_across_groups": plan.split_tokens_recomputed,
        "tokens_transferred_across_groups": plan.head_tokens_sent(),
        "transferred_bytes": plan.transfer_bytes(geometry.row_bytes_per_token),
    }
    if measured is not None:
        planned = plan.planned_groups if plan.planned_groups is not None else range(len(plan.placements))
        out["predicted_step_s"] = float(max(plan.predicted_makespan[g] for g in planned))
        other = max(plan.alternative_makespan[g] for g in planned)
        if np.isfinite(other):
            out["predicted_other_placement_s"] = float(other)
    return out


__all__ = ["Engine", "StepResult", "cost_model_for", "plan_metrics", "same_layout"]
