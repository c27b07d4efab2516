"""The engine's side of ``--memory-budget`` (:mod:`megatron_psrl.schedule.budget` holds the choice).

- :func:`resolve_budget`: the budget a run plans with (given; on CUDA by default the device's
  free memory at start-up less :data:`~megatron_psrl.schedule.budget.DEFAULT_HEADROOM_FRACTION`
  of its total; none on CPU unless given);
- :func:`static_memory`: the weights, the gradients' buffers and the optimizer state of this
  rank (the largest rank's, so that every rank plans alike);
- :func:`plan_under_budget`: a step's plan of least predicted time under the budget, each lever
  evaluated on the step's batch by planning it (:func:`evaluate_lever`).

Every rank must take the same decision (pipeline stages share a plan; the assignment of trees
to groups depends on the micro-batch budget), so under a budget the step is planned for every
rank (no local planning) and fits when every rank's predicted peak fits. ``engine`` arguments
are :class:`~megatron_psrl.engine.engine.Engine` objects (which call this module).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.kvcache import CacheBudgetError
from megatron_psrl.schedule.budget import (
    Lever,
    MemoryBudgetError,
    Outcome,
    Pricing,
    StaticMemory,
    choose,
    default_memory_budget,
    describe,
    exposed_transfer_seconds,
    micro_batch_ladder,
    optimizer_state_bytes,
    size_text,
)
from megatron_psrl.schedule.cost import FORWARD_BACKWARD_FACTOR
from megatron_psrl.schedule.memory import StepBudgetError, add_segment_shapes, step_peak_bytes
from megatron_psrl.schedule.plan import MemoryPlan, PlanningError, StepPlan
from megatron_psrl.schedule.planner import token_cost_function
from megatron_psrl.schedule.step_charge import add_row_counts
from megatron_psrl.schedule.with_memory import plan_with_memory
from megatron_psrl.tree.prefix_tree import PrefixTree


@dataclass
class MemoryBudget:
    """A run's memory budget and what the planner needs to fill it."""

    budget_bytes: int
    """``--memory-budget`` (or the CUDA default)."""
    static: StaticMemory
    """The weights, gradients' buffers and optimizer state (the largest rank's)."""
    pricing: Pricing
    """What turns a plan into predicted seconds."""
    max_recompute_layers: int = 0
    """Layers the planner may recompute (0: recomputation is not one of its levers here)."""
    offload: bool = False
    """Host offload is one of its levers (``--memory-offload``)."""
    last: Optional[Outcome] = None
    """The last step's choice."""


def free_device_memory(device: torch.device) -> Optional[Tuple[int, int]]:
    """``(free, total)`` bytes of a CUDA device (None elsewhere)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def resolve_budget(config: ActorConfig, device: torch.device, free: Optional[Tuple[int, int]]) -> Optional[int]:
    """The budget a run plans with: ``config.memory_budget`` bytes; None on CPU (and 0 anywhere):
    none; None on CUDA: ``free`` (the device's ``(free, total)`` at start-up) less the headroom."""
    if config.memory_budget is not None:
        return int(config.memory_budget) or None
    if free is None:
        return None
    return default_memory_budget(*free)


def static_memory(model: torch.nn.Module, optimizer, config: ActorConfig, shards: int) -> StaticMemory:
    """This rank's weights, the gradients' buffers allocated before a step (megatron's DDP
    ``main_grad``) and the optimizer state megatron keeps (:func:`optimizer_state_bytes`)."""
    seen = set()
    weights = grads = params = 0
    for p in model.parameters():
        if p.untyped_storage().data_ptr() not in seen:
            seen.add(p.untyped_storage().data_ptr())
            weights += p.untyped_storage().nbytes()
        params += p.numel()
        g = getattr(p, "main_grad", None) if optimizer is not None else None
        if g is not None and g.untyped_storage().data_ptr() not in seen:
            seen.add(g.untyped_storage().data_ptr())
            grads += g.untyped_storage().nbytes()
    state = 0
    if optimizer is not None:
        o = config.optimizer
        state = optimizer_state_bytes(params, torch.tensor([], dtype=config.torch_dtype).element_size(), o.optimizer,
                                      o.sgd_momentum, shards if o.use_distributed_optimizer else 1)
    return StaticMemory(weights=weights, gradients=grads, optimizer_state=state)


def memory_budget_for(engine, budget_bytes: Optional[int]) -> Optional[MemoryBudget]:
    """The engine's :class:`MemoryBudget` (None without a budget); refused when the static memory
    alone fills it. The static memory is the largest rank's, so that every rank plans alike."""
    if budget_bytes is None or engine.graph_charge is None:
        return None
    local = static_memory(engine.model, engine.optimizer, engine.config, engine.layout.data_parallel_size)
    parts = [local.weights, local.gradients, local.optimizer_state]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        parts = [int(x) for x in engine.reduce(parts, op=torch.distributed.ReduceOp.MAX)]
    static = StaticMemory(*parts)
    if static.total >= budget_bytes:
        raise MemoryBudgetError(f"--memory-budget {size_text(budget_bytes)} cannot hold the weights, gradients and "
                                f"optimizer state ({size_text(static.total)}) and a step: the smallest budget that "
                                f"could fit is more than {size_text(static.total)}")
    layout, c = engine.layout, engine.config
    switchable = (c.recompute_granularity is None and layout.pipeline_parallel_size == 1
                  and layout.context_parallel_size == 1 and engine.exchange_group_size == 1
                  and c.expert_model_parallel_size == 1)
    # (host offload runs in the single-stage executor's own schedule: not with PP or a cross-rank exchange)
    offloadable = layout.pipeline_parallel_size == 1 and engine.exchange_group_size == 1
    return MemoryBudget(budget_bytes, static, Pricing.for_device(layout.device.type),
                        max_recompute_layers=engine.graph_charge.num_layers if switchable else 0,
                        offload=c.memory_offload and offloadable)


class _Recorder:
    """Memory settings that remember the least step peak of every group that cannot fit."""

    def __init__(self, settings):
        self.settings, self.needed = settings, []
        self.varlen, self.step = settings.varlen, settings.step

    def __call__(self, plans):
        try:
            return self.settings(plans)
        except StepBudgetError as exc:
            self.needed.append(exc.needed)
            raise


def evaluate_lever(engine, tree: PrefixTree, sharing: str, lever: Lever, room: int,
                   entropy: bool) -> Outcome:
    """Plan ``tree`` with ``lever`` and the step's budget ``room``: whether every rank fits, its
    peak, and its predicted seconds (:func:`predicted_seconds`). Two cuts of the micro-batches
    are weighed: the default, and one that also ends a micro-batch after every shared prefix
    (``PlannerConfig.cut_after_shared_prefixes``: a kept producer graph of the prefix alone);
    the faster that fits, else the leaner. The second is not planned where the default fits
    with every graph kept and its micro-batches cut by the budget alone: more micro-batches of
    the same work cannot be priced faster."""
    config = dataclasses.replace(engine.planner_config(sharing, lever.micro_batch_tokens), local_rank=None)
    c = engine.config  # (the configured setting: an earlier step's choice may still be on the model)
    recompute = (c.recompute_granularity, c.recompute_method, c.recompute_num_layers)
    if lever.recompute_layers:  # (a recomputed layer cannot receive a head's K/V: recomputed, as with the flag)
        recompute = ("full", "block", lever.recompute_layers)
        config = dataclasses.replace(config, cross_group_prefix="recompute")
    default = _evaluate_cut(engine, tree, config, lever, room, entropy, recompute)
    outcomes = [default]
    if not config.cut_after_shared_prefixes and not _fits_uncut(default):
        cut = _evaluate_cut(engine, tree, dataclasses.replace(config, cut_after_shared_prefixes=True), lever, room,
                            entropy, recompute)
        same = cut.fits and default.fits and _micro_batch_sizes(cut) == _micro_batch_sizes(default)
        outcomes += [] if same else [cut]  # (no shared prefix ends inside a micro-batch: the same plan)
    fitting = [o for o in outcomes if o.fits]
    if fitting:
        return min(fitting, key=lambda o: o.seconds)
    return min(outcomes, key=lambda o: o.peak_bytes)


def _micro_batch_sizes(outcome: Outcome) -> List[List[int]]:
    return [[len(mb.computed_tokens) for mb in rank.micro_batches] for rank in outcome.details["plan"].ranks]


def _evaluate_cut(engine, tree: PrefixTree, config, lever: Lever, room: int, entropy: bool, recompute) -> Outcome:
    """:func:`evaluate_lever` for one planner configuration."""
    settings = _Recorder(engine.memory_settings_for(entropy, room, lever.offload, recompute))
    try:
        plan, memories, mode = plan_with_memory(tree, config, settings)
    except (CacheBudgetError, PlanningError) as exc:
        # (the least peak of the plans tried: the default cut, at branch switches, duplicated)
        least = min(settings.needed, default=getattr(exc, "needed", 1 << 62))
        return Outcome(lever, False, least)
    peaks = _rank_peaks(engine, plan, memories, settings.settings.step.charge)
    peak = max(peaks, default=0)
    if peak > room:
        return Outcome(lever, False, min([peak] + settings.needed) if settings.needed else peak)
    seconds = predicted_seconds(engine, plan, memories, lever)
    dropped = sum(not k for m in memories if m is not None for k in m.keep_graph.values())
    return Outcome(lever, True, peak, seconds,
                   dict(plan=plan, memories=memories, sharing=mode, dropped_graphs=dropped))


def _rank_peaks(engine, plan: StepPlan, memories: List[Optional[MemoryPlan]], charge) -> List[int]:
    """Every rank's predicted step peak."""
    in_flight = in_flight_graphs(engine.layout.pipeline_parallel_size, engine.virtual_pipeline_size)
    peaks = []
    for rank, memory in zip(plan.ranks, memories):
        if memory is None:
            add_row_counts(plan.index, rank)
            if engine.varlen_charge is not None:
                add_segment_shapes(plan.index, rank)
        peaks.append(step_peak_bytes(rank, memory, engine.act_bytes, 0, engine.varlen_charge, in_flight, charge))
    return peaks


def in_flight_graphs(pipeline_parallel_size: int, virtual_pipeline_size: int = 1) -> int:
    """Graphs (of a whole rank's layers) the first pipeline stage holds at once under megatron's
    1F1B schedule in a step without cached prefixes: as many as the pipeline's stages; with
    virtual stages, its warm-up's ``2 (PP - 1) + (VPP - 1) PP + 1`` chunks of ``1 / VPP`` of them."""
    pp, vpp = pipeline_parallel_size, virtual_pipeline_size
    if pp == 1:
        return 1
    if vpp == 1:
        return pp
    return -(-(2 * (pp - 1) + (vpp - 1) * pp + 1) // vpp)


def predicted_seconds(engine, plan: StepPlan, memories: List[Optional[MemoryPlan]], lever: Lever) -> float:
    """The step's predicted seconds: per rank, the cost model's work (its micro-batches, the
    forward again of every dropped graph and of the recomputed layers), a fixed cost per
    micro-batch, and the host copies the compute does not hide; the slowest rank. The work is
    in seconds measured at start-up on this model and device (``engine.measured``: per token,
    key pair and logit row, and per micro-batch), else in FLOPs at the pricing's rate."""
    pricing, layers = engine.memory_budget.pricing, max(1, engine.graph_charge.num_layers)
    measured = engine.measured
    if measured is not None:  # (seconds already: the rate is 1, the fixed cost the measured one)
        pricing = dataclasses.replace(pricing, device_flops_per_s=1.0,
                                      seconds_per_micro_batch=measured.seconds_per_micro_batch)
    token_cost = token_cost_function(plan.index, measured.cost_model() if measured is not None else engine.flop_model)
    share = lever.recompute_layers / layers
    worst = 0.0
    for rank, memory in zip(plan.ranks, memories):
        cost = {i: float(np.sum(token_cost(mb.computed_tokens))) for i, mb in enumerate(rank.micro_batches)}
        keep = memory.keep_graph if memory is not None else {}
        forward = lambda i: cost[i] / FORWARD_BACKWARD_FACTOR  # noqa: E731
        per_step = []
        for op, i in rank.schedule:
            c = {"forward_backward": cost[i], "forward": forward(i)}.get(op, cost[i] - forward(i))
            c += forward(i) if op == "backward" and not keep.get(i, True) else 0.0
            per_step.append((c + share * forward(i) * (op != "forward")) / pricing.device_flops_per_s)
        moved = memory.offloaded_bytes if memory is not None and memory.offloaded_bytes else [0] * len(per_step)
        fixed = pricing.seconds_per_micro_batch * sum(mb.computes for mb in rank.micro_batches)
        worst = max(worst, fixed + sum(per_step) + exposed_transfer_seconds(moved, per_step, pricing.host_bytes_per_s))
    return worst


def plan_under_budget(engine, tree: PrefixTree, sharing: str, micro_batch_tokens: Optional[int],
                      entropy: bool) -> Tuple[StepPlan, List[Optional[MemoryPlan]], str, Outcome]:
    """The step's plan of least predicted time under the engine's budget (see the module
    docstring); the chosen recomputation is set on the model; one log line says what was chosen."""
    budget = engine.memory_budget
    ladder = micro_batch_ladder(micro_batch_tokens or engine.config.micro_batch_tokens)
    clean = lambda o: o.details["dropped_graphs"] == 0 and o.details["sharing"] == sharing  # noqa: E731
    outcome = choose(lambda lever, room: evaluate_lever(engine, tree, sharing, lever, room, entropy),
                     budget.budget_bytes, budget.static, ladder, budget.max_recompute_layers, budget.offload,
                     unbeatable=lambda o: unbeatable(o, sharing), clean=clean)
    if budget.max_recompute_layers:
        k = outcome.lever.recompute_layers
        engine.set_recompute(*(("full", "block", k) if k else (None, None, None)))
    budget.last = outcome
    engine.log(describe(outcome, budget.budget_bytes, budget.static, engine.graph_charge.num_layers))
    d = outcome.details
    return d["plan"], d["memories"], d["sharing"], outcome


def _default_cut(outcome: Outcome) -> bool:
    """The plan cuts its micro-batches by the budget alone (not also at branch switches or after
    shared prefixes, which make more of them): no smaller micro-batches can be faster."""
    config = outcome.details["plan"].config
    return not (config.cut_at_branch_switches or config.cut_after_shared_prefixes)


def _fits_uncut(outcome: Outcome) -> bool:
    """It fits with every producer's graph kept and the budget's own cut (:func:`_default_cut`)."""
    return outcome.fits and outcome.details["dropped_graphs"] == 0 and _default_cut(outcome)


def unbeatable(outcome: Outcome, sharing: str) -> bool:
    """``schedule.budget.choose``'s ``unbeatable`` for this module's evaluation: the largest
    micro-batches fit with every graph kept, the budget's own cut and the ``sharing`` asked for
    (no prefix duplicated), so no other lever can be priced faster."""
    return _fits_uncut(outcome) and outcome.details["sharing"] == sharing


def budget_metrics(budget: MemoryBudget) -> dict:
    """The last step's choice, for the iteration line and --log-json."""
    o = budget.last
    return {"budget_bytes": budget.budget_bytes, "static_bytes": budget.static.total,
            "predicted_peak_bytes": budget.static.total + o.peak_bytes, "predicted_step_s": o.seconds,
            "micro_batch_tokens": o.lever.micro_batch_tokens, "recompute_layers": o.lever.recompute_layers,
            "host_offload": o.lever.offload, "dropped_graphs": o.details.get("dropped_graphs", 0)}


__all__ = ["MemoryBudget", "budget_metrics", "evaluate_lever", "free_device_memory", "in_flight_graphs", "memory_budget_for",
           "plan_under_budget", "predicted_seconds", "resolve_budget", "static_memory", "unbeatable"]
