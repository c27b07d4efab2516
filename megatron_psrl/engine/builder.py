"""How the engine is assembled: :func:`build_engine`, in named steps.

Every entry point (``PolicyActor``, the ``pretrain_agent_rl.py`` loop, ``tools/
compute_logprobs.py``, the benchmarks, framework adapters) builds its engine here, so one
place decides the parallel layout, the layer spec, the pipeline split, what a checkpoint
resumes, the KV cache, the placement of trees over ranks and the step runner. Each step is a
function of the config and what the steps before it made; read them top to bottom:

1. :func:`process_groups`: torch.distributed and megatron's parallel state, RNG seeds;
2. :func:`layer_spec`: megatron's local layers or Transformer Engine's;
3. :func:`pipeline_split`: the (virtual) pipeline stages' layers;
4. :func:`resume_point`: the iteration and optimizer state a checkpoint resumes;
5. :func:`recompute_overrides`: activation recomputation;
6. :func:`model_and_optimizer`: this rank's model chunks and optimizer, their state loaded;
7. :func:`kv_geometry`: the KV cache's and the memory plan's geometry;
8. :func:`placement_and_costs`: trees over an exchange group, and the planner's cost model
   (measured at start-up when trees may be split over ranks, or the one a resumed checkpoint
   planned with);
9. :func:`cache_and_runner`: the block KV cache, the attention backend and the step runner.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch

from megatron_psrl.attention.backends import check_attention_backend, default_backend
from megatron_psrl.checkpoint.dist_format import load_training_state
from megatron_psrl.checkpoint.layout import COST_JSON, checkpoint_format, read_checkpoint_info, read_cost_record
from megatron_psrl.checkpoint.loading import ModelSource, load_model, source_architecture
from megatron_psrl.compat import install_cpu_recompute_shims, seed_model_parallel_rng, training_fusions
from megatron_psrl.distributed.setup import (
    ParallelLayout,
    exchange_group_of,
    gradient_group,
    initialize_parallel,
)
from megatron_psrl.engine.budget import free_device_memory, memory_budget_for, resolve_budget
from megatron_psrl.engine.calibration import MeasuredCosts, calibrate_for_planning
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.engine.engine import Engine, cost_model_for, same_layout
from megatron_psrl.engine.optimizer import build_optimizer
from megatron_psrl.engine.prefix_kv import check_prefix_taps
from megatron_psrl.engine.runners import make_runner
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.errors import ConfigurationError, UnsupportedFeatureError
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.model.gpt import local_spec_only
from megatron_psrl.model.logits import chunk_rows, loss_head_peak_bytes
from megatron_psrl.model.stages import pipeline_layer_counts, stage_counts, virtual_pipeline_size
from megatron_psrl.schedule.memory import activation_bytes_per_token
from megatron_psrl.schedule.step_charge import ActivationCharge
from megatron_psrl.schedule.with_memory import whole_tree_reasons

Log = Callable[[str], None]


def build_engine(source: ModelSource, config: ActorConfig, *, layout: Optional[ParallelLayout] = None,
                 load_optimizer: bool = True, for_training: bool = True, log: Optional[Log] = None) -> Engine:
    """This rank's engine for ``source`` (every rank calls it with the same arguments).

    ``layout``: process groups the caller opened already with ``config``'s sizes (the command
    line opens them before its start-up checks); their RNG is seeded again here, as opening
    them would. ``for_training=False``: no optimizer (a log-prob-only engine). ``log``: where
    notes and warnings go (None: dropped)."""
    say = log or (lambda msg: None)
    layout = process_groups(config, layout)
    # (the CUDA default budget: the device's free memory before this run's model is on it)
    budget = resolve_budget(config, layout.device, free_device_memory(layout.device))
    impl = layer_spec(config, layout.device, source_architecture(source))
    vpp, split = pipeline_split(config, layout, source)
    resume = resume_point(source, layout, vpp, split, load_optimizer and for_training)
    overrides = recompute_overrides(config, layout)
    arch, model, optimizer = model_and_optimizer(source, config, layout, impl, vpp, split, overrides, resume,
                                                 load_optimizer, for_training, say)
    geometry, plan_geometry = kv_geometry(arch, config, layout, vpp, split, model)
    placement, flop_model, measured = placement_and_costs(config, layout, arch, model, plan_geometry,
                                                          recompute=bool(overrides), log=say, resume=resume,
                                                          budget=budget is not None)
    # (with an optimizer, the data-parallel reduce may start during a step's last backward)
    backend_name, kv_cache, runner = cache_and_runner(
        config, layout, arch, model, geometry, recompute=bool(overrides), log=say,
        arm_grad_reduce=optimizer.arm_grad_reduce if optimizer is not None else None, kv_limit=budget)
    tp = layout.tensor_parallel_size
    engine = Engine(
        config=config, layout=layout, arch=arch, model=model, optimizer=optimizer, kv_cache=kv_cache, runner=runner,
        geometry=geometry, plan_geometry=plan_geometry, flop_model=flop_model, measured=measured,
        placement=placement, backend_name=backend_name, transformer_impl=impl, pipeline_split=split,
        virtual_pipeline_size=vpp, recompute=bool(overrides), iteration=resume.iteration,
        act_bytes=activation_bytes_per_token(arch, tp, torch.tensor([], dtype=config.torch_dtype).element_size()),
        head_bytes=loss_head_peak_bytes(arch.padded_vocab_size(tp) // tp, config.micro_batch_tokens,
                                        int(config.loss_head_chunk_mb * 2**20)),
        graph_charge=activation_charge(arch, config, layout, vpp, split, runner, grads_in_step=optimizer is None,
                                       model=model),
        log=say,
    )
    engine.memory_budget = memory_budget_for(engine, budget)
    return engine


def _parameter_bytes(model, num_layers: int) -> Tuple[int, int, int]:
    """``(all, one layer's, the input embedding's)`` parameter bytes of this rank's chunks."""
    total = layers = embedding = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        layers += size if ".layers." in f".{name}" else 0
        embedding += size if "embedding" in name else 0
    return total, layers // max(1, num_layers), embedding


def activation_charge(arch, config: ActorConfig, layout: ParallelLayout, vpp: int, split, runner: StepRunner,
                      grads_in_step: bool, model) -> ActivationCharge:
    """What a micro-batch's graph and loss head hold by its rows (the memory plan's charge):
    for the largest pipeline stage (every stage plans alike), with the run's recomputation and
    row skip; the parameters' gradients count in the step when no buffer holds them before it
    (a log-prob-only engine's ``.grad``; megatron's DDP allocates its buffers at start-up)."""
    tp = layout.tensor_parallel_size
    layers = arch.num_layers if layout.pipeline_parallel_size == 1 else max(stage_counts(arch, split)) * vpp
    grads = _parameter_bytes(model, layers) if grads_in_step else (0, 0, 0)
    local_vocab = arch.padded_vocab_size(tp) // tp
    # (the largest stage is charged: only the last one's last layer skips rows)
    row_skip = (runner.last_layer_row_skip and not (config.sequence_parallel and tp > 1)
                and layout.pipeline_parallel_size == 1)
    return ActivationCharge.of(arch, tp, torch.tensor([], dtype=config.torch_dtype).element_size(), local_vocab,
                               chunk_rows(local_vocab, int(config.loss_head_chunk_mb * 2**20)), row_skip=row_skip,
                               grad_bytes=grads, num_layers=layers,
                               recompute=(config.recompute_granularity, config.recompute_method,
                                          config.recompute_num_layers),
                               weight_grad_temporaries=grads_in_step
                               or not training_fusions(layout.device)["gradient_accumulation_fusion"])


# ---------------------------------------------------------------------- the steps
def process_groups(config: ActorConfig, layout: Optional[ParallelLayout]) -> ParallelLayout:
    """torch.distributed, megatron's TP / PP / CP / DP groups and the RNG seeds."""
    if layout is None:
        return initialize_parallel(
            config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.seed, config.device,
            timeout_minutes=config.distributed_timeout_minutes, context_parallel_size=config.context_parallel_size,
            expert_model_parallel_size=config.expert_model_parallel_size)
    from megatron.core import parallel_state

    sizes = (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.context_parallel_size,
             parallel_state.get_expert_model_parallel_world_size())
    wanted = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size,
              config.expert_model_parallel_size)
    if sizes != wanted:
        raise ConfigurationError(f"the process groups opened have TP/PP/CP/EP {sizes}, the config asks for {wanted}")
    seed_model_parallel_rng(config.seed, layout.device)
    return layout


def layer_spec(config: ActorConfig, device: torch.device, arch=None) -> str:
    """``auto``: Transformer Engine's layers on CUDA where it is installed, else megatron's local
    ones (also for a model built with the local spec only, :func:`~megatron_psrl.model.gpt.local_spec_only`)."""
    if config.transformer_impl != "auto":
        return config.transformer_impl
    if arch is not None and local_spec_only(arch):
        return "local"
    if device.type == "cuda":
        try:
            import transformer_engine  # noqa: F401

            return "transformer_engine"
        except ImportError:
            pass
    return "local"


def pipeline_split(config: ActorConfig, layout: ParallelLayout,
                   source: ModelSource) -> Tuple[int, Union[int, Sequence[int]]]:
    """``(virtual stages per rank, split)``: the split is each (virtual) stage's layer count
    with an uneven first / last stage, else the (virtual) stage count of an even split."""
    first, last = config.decoder_first_pipeline_num_layers, config.decoder_last_pipeline_num_layers
    uneven = first is not None or last is not None
    pp, num_layers = layout.pipeline_parallel_size, source_architecture(source).num_layers
    vpp = virtual_pipeline_size(num_layers, pp, config.num_layers_per_virtual_pipeline_stage, uneven)
    return vpp, (pipeline_layer_counts(num_layers, pp, first, last) if uneven else pp * vpp)


@dataclass
class ResumePoint:
    """What a checkpoint resumes (nothing for a Hugging Face or tiny source)."""

    iteration: int = 0
    """Optimizer steps the checkpoint had taken."""

    dist_checkpoint: Optional[str] = None
    """Iteration folder of a torch_dist checkpoint whose optimizer state is loaded (resharded)
    once the optimizer exists."""

    same_layout: bool = True
    """The checkpoint was saved with this run's TP size and (virtual) pipeline stages."""

    iteration_dir: Optional[str] = None
    """The checkpoint's iteration folder (None: not resuming a checkpoint)."""

    planning_costs: Optional[MeasuredCosts] = None
    """The start-up cost calibration the checkpoint's run planned with (its
    ``psrl_cost_calibration.json``; None when it recorded none): planned with again unless
    ``recalibrate``, so the resumed run makes the plans the saving run would have made."""


def resume_point(source: ModelSource, layout: ParallelLayout, vpp: int, split, with_optimizer: bool) -> ResumePoint:
    """The resume point of ``source``; a legacy checkpoint's optimizer state under another
    layout is refused (a torch_dist one reshards)."""
    if source.checkpoint is None:
        return ResumePoint()
    it_dir, info = read_checkpoint_info(source.checkpoint)
    same = same_layout(info, layout.tensor_parallel_size, vpp, split)
    record = read_cost_record(it_dir)
    costs = None if record is None else MeasuredCosts.from_record(record, os.path.join(it_dir, COST_JSON))
    point = ResumePoint(iteration=info.iteration, same_layout=same, iteration_dir=it_dir, planning_costs=costs)
    if checkpoint_format(source.checkpoint) == "torch_dist":
        if info.has_optimizer_state and with_optimizer:
            point.dist_checkpoint = it_dir
    elif info.has_optimizer_state and with_optimizer and not same:
        raise ConfigurationError(
            f"{source.checkpoint} (legacy format) was saved with TP={info.tensor_parallel_size} "
            f"PP={info.pipeline_parallel_size}; its optimizer state cannot be loaded with "
            f"TP={layout.tensor_parallel_size} PP={layout.pipeline_parallel_size}. Pass --no-load-optim to "
            "resume with a fresh optimizer, or --finetune to start a new run (a torch_dist checkpoint "
            "reshards its optimizer state)"
        )
    elif with_optimizer:  # a legacy optimizer state holds the sub-optimizers of the EP size it was saved with
        from megatron_psrl.checkpoint.legacy_format import check_optimizer_expert_parallel
        from megatron_psrl.model.builder import expert_parallel_layout

        check_optimizer_expert_parallel(it_dir, info, max(1, expert_parallel_layout()[1]))
    return point


def recompute_overrides(config: ActorConfig, layout: ParallelLayout) -> Dict[str, object]:
    """megatron's TransformerConfig fields for activation recomputation (empty when off)."""
    if config.recompute_granularity is None:
        return {}
    if layout.context_parallel_size > 1:
        raise UnsupportedFeatureError("activation recomputation with context parallelism is not supported "
                                      "yet (a recomputed layer would repeat its prefix K/V exchange)")
    install_cpu_recompute_shims(layout.device)
    return dict(recompute_granularity=config.recompute_granularity, recompute_method=config.recompute_method,
                recompute_num_layers=config.recompute_num_layers)


def model_and_optimizer(source: ModelSource, config: ActorConfig, layout: ParallelLayout, impl: str, vpp: int,
                        split, overrides: Dict[str, object], resume: ResumePoint, load_optimizer: bool,
                        for_training: bool, log: Log):
    """``(architecture, model, optimizer)``: the rank's chunks with the source's weights, and
    (for training) the optimizer with the checkpoint's state when it has one."""
    device, dtype = layout.device, config.torch_dtype
    uneven = not isinstance(split, int)
    overrides = dict(overrides, **config.parallel_overrides(), **moe_overrides(config, source_architecture(source)))
    if for_training:  # (megatron's DDP gives every weight the main_grad its fused kernels add into)
        overrides.update(training_fusions(device))
    arch, model, optimizer_state = load_model(
        source, dtype=dtype, device=device, transformer_impl=impl, pipeline_layers=split if uneven else None,
        virtual_pipeline_size=vpp, config_overrides=overrides,
        attention_backend=None if config.attention_backend == "auto" else config.attention_backend)
    if arch.multi_latent_attention:  # (a run-time choice: what its cached prefixes keep)
        arch = dataclasses.replace(arch, latent_cache=config.resolved_latent_cache)
    if device.type == "cpu" and dtype != torch.float32:
        log(f"warning: {config.dtype} on CPU is slower than float32 (few CPUs have fast {config.dtype} "
            "kernels); use it to check GPU numerics, and float32 to train on CPU")
    if not for_training:  # a log-prob-only engine holds no optimizer (no fp32 master copies)
        return arch, model, None
    optimizer = build_optimizer(model, config.optimizer, device)
    if optimizer_state and load_optimizer:
        optimizer.load_state_dict(optimizer_state)
    if resume.dist_checkpoint is not None:
        with layout.monitor.phase("optimizer state load"):
            load_training_state(resume.dist_checkpoint, model, optimizer, resume.same_layout)
    return arch, model, optimizer


def moe_overrides(config: ActorConfig, arch) -> Dict[str, object]:
    """megatron's TransformerConfig fields of the MoE flags (an MoE model), or a refusal of MoE
    flags for a dense model."""
    if arch.is_moe:
        if config.moe_router_enable_expert_bias and not arch.moe_router_expert_bias:
            raise ConfigurationError(f"--moe-router-enable-expert-bias: a {arch.model_type} router has no expert bias "
                                     "(megatron's aux-loss-free balancing biases a sigmoid router's selection: "
                                     "grouped routing, e.g. glm4_moe; this family routes by softmax)")
        return config.moe_overrides()
    if config.moe_router_enable_expert_bias:
        raise ConfigurationError(f"--moe-router-enable-expert-bias applies to mixture-of-experts models; this is a "
                                 f"dense {arch.model_type} model")
    if config.expert_model_parallel_size > 1 or config.moe_grouped_gemm:
        raise ConfigurationError(f"--expert-model-parallel-size / --moe-grouped-gemm apply to mixture-of-experts "
                                 f"models; this is a dense {arch.model_type} model")
    return {}


def kv_geometry(arch, config: ActorConfig, layout: ParallelLayout, vpp: int, split,
                model=None) -> Tuple[KVGeometry, KVGeometry]:
    """``(the cache's geometry on this rank's stages, what memory plans assume on every stage)``."""
    tp, dtype, device = layout.tensor_parallel_size, config.torch_dtype, layout.device
    geometry = KVGeometry.for_model(arch, tp, split, dtype, device, pipeline_rank=layout.pp_rank,
                                    virtual_pipeline_size=vpp)
    check_prefix_taps(arch, geometry, model)
    return geometry, KVGeometry.for_pipeline_planning(arch, tp, split, dtype, device, vpp)


def placement_and_costs(config: ActorConfig, layout: ParallelLayout, arch, model, geometry: KVGeometry,
                        recompute: bool, log: Log, resume: Optional[ResumePoint] = None, budget: bool = False):
    """``(placement, FLOP cost model, measured costs or None)``; ``geometry``: what every stage's
    plans assume (``KVGeometry.for_pipeline_planning``), so that every stage places alike.

    Trees are placed whole with recomputation, and with pipeline stages unless ``--placement
    cross-rank`` asks for them to be split over pipelines
    (:func:`~megatron_psrl.schedule.with_memory.whole_tree_reasons`). Where trees may be split over
    an exchange group, the planner weighs compute against transfers measured on this model at
    start-up (not with pipeline stages: a stage cannot run the whole model; nor with linear-attention
    layers, whose states the calibration does not measure: placement is cross-rank by request
    there, fragments cut by the FLOP cost model). With a memory budget (``budget``) the costs are
    measured too (without an exchange group where trees are not split): the budget planner prices
    its levers with them (a micro-batch's fixed cost, the forward a recomputation repeats), which
    FLOPs alone misjudge for small micro-batches. A resumed checkpoint's
    recorded calibration (``resume.planning_costs``) is used instead of measuring, unless
    ``config.recalibrate``."""
    whole_tree_only = whole_tree_reasons(layout.pipeline_parallel_size, recompute, config.placement,
                                         fixed_states=geometry.fixed_bytes_per_source > 0)
    if (config.expert_model_parallel_size > 1 and layout.context_parallel_size == 1
            and config.placement == "auto"):
        # With experts over the data-parallel ranks, trees are split over them by request only
        # (--placement cross-rank): ``auto`` keeps them whole, the layout every EP test and
        # checkpoint was made with (its calibrated choice would change a resumed run's rounding)
        whole_tree_only = list(whole_tree_only) + ["expert parallelism without --placement cross-rank"]
    placement = "whole-tree" if whole_tree_only else config.placement
    if whole_tree_only and config.placement == "cross-rank":
        log(f"note: --placement cross-rank is not available with {' and '.join(whole_tree_only)} yet; "
            "trees are placed whole on data-parallel ranks")
    flop_model = cost_model_for(arch)
    group, group_size = exchange_group_of(layout)
    cross_rank = group_size > 1 and placement != "whole-tree" and config.prefix_sharing == "tree"
    if geometry.fixed_bytes_per_source:  # (cross-rank by request: the calibration measures K/V transfers only)
        cross_rank = False
    if not (cross_rank or budget):  # (a memory budget prices its levers in measured seconds: engine/budget.py)
        return placement, flop_model, None
    if layout.pipeline_parallel_size > 1:  # (the calibration runs the whole model: not on one stage)
        return placement, flop_model, None
    group = group if cross_rank else None
    resume = resume or ResumePoint()
    with layout.monitor.phase("cost calibration"):
        m, origin = calibrate_for_planning(model, arch, geometry, layout.device, config.micro_batch_tokens, group,
                                           profile=config.cost_profile, overlap_kv_exchange=config.overlap_kv_exchange,
                                           recorded=resume.planning_costs, recalibrate=config.recalibrate,
                                           backend=attention_backend_name(config, layout.device))
    if resume.iteration_dir is not None and origin != "checkpoint" and not config.recalibrate:
        why = ("records no cost calibration (its run measured none, or saved before checkpoints kept it)"
               if resume.planning_costs is None
               else f"recorded a cost calibration of another model or layout ({resume.planning_costs.key})")
        log(f"note: {resume.iteration_dir} {why}: this run uses its own, so it may place and cut trees "
            "otherwise than the run that saved it, and round differently")
    source = {"measured": "measured at start-up", "profile": f"from --cost-profile {config.cost_profile}",
              "checkpoint": f"reused from the checkpoint {resume.iteration_dir}; --recalibrate measures anew"}[origin]
    log(f"cost calibration ({source}): {m.seconds_per_token * 1e6:.1f} us/token, {m.seconds_per_key * 1e9:.2f} "
        f"ns/key pair, {m.seconds_per_micro_batch * 1e3:.2f} ms/micro-batch, exchange "
        f"{m.seconds_per_exchange * 1e3:.2f} ms + {1 / max(m.seconds_per_byte, 1e-15) / 1e9:.2f} GB/s, "
        + (f"{m.exchange_exposed_fraction:.0%} of it exposed when overlapped" if m.overlap_kv_exchange else
           "all of it charged (not overlapped: --no-overlap-kv-exchange, or an attention backend that waits "
           "for the rows)"))
    return placement, flop_model, m


def attention_backend_name(config: ActorConfig, device: torch.device) -> str:
    """The attention backend the run uses: the configured one, or the device's default."""
    if config.attention_backend != "auto":
        return config.attention_backend
    return default_backend(device.type, config.torch_dtype)


def cache_and_runner(config: ActorConfig, layout: ParallelLayout, arch, model, geometry: KVGeometry,
                     recompute: bool, log: Log, arm_grad_reduce=None,
                     kv_limit: Optional[int] = None) -> Tuple[str, BlockKVCache, StepRunner]:
    """``(attention backend, KV cache, step runner)``: the pipeline runner with PP > 1, built
    complete (``arm_grad_reduce``: the optimizer's, when a step's last backward may start the
    data-parallel reduce; ``kv_limit``: the cache's limit, ``--memory-budget`` when one is set,
    else ``--kv-cache-budget``)."""
    device = layout.device
    backend = None if config.attention_backend == "auto" else config.attention_backend
    backend_name = attention_backend_name(config, device)
    check_attention_backend(backend_name, device.type, config.torch_dtype)  # its kernel exists here, or fail now
    if device.type == "cuda" and backend is None and backend_name == "torch":
        log("note: flash-attn is not installed, so tree attention runs the torch backend with PyTorch's fused "
            "memory-efficient attention (checked against the reference math at first use); pip install "
            "flash-attn, or --attention-backend te with Transformer Engine, for the varlen kernels")
    kv_cache = BlockKVCache(geometry, kv_limit or config.kv_cache_budget)
    group, _ = exchange_group_of(layout)
    router_losses = None
    bias_counts = arch.is_moe and config.moe_router_enable_expert_bias  # (weighted per sample, as the losses)
    if arch.is_moe and (config.moe_aux_loss_coeff > 0 or config.moe_z_loss_coeff > 0 or bias_counts):
        from megatron_psrl.model.moe_losses import RouterLosses

        router_losses = RouterLosses(model, config.moe_aux_loss_coeff, config.moe_z_loss_coeff,
                                     expert_bias_counts=bias_counts)
    runner = make_runner(
        model, arch.vocab_size, device, backend, kv_cache, exchange_group=group,
        loss_head_chunk_bytes=int(config.loss_head_chunk_mb * 2**20), inject_kv_grads=recompute,
        # The router losses (and expert-bias counts) count every row of every layer: the last layer computes them all.
        last_layer_row_skip=config.last_layer_row_skip and router_losses is None,
        overlap_kv_exchange=config.overlap_kv_exchange, router_losses=router_losses,
        # (the heads of trees split between exchange groups travel over it)
        head_send_group=gradient_group() if layout.placement_size > 1 else None,
        arm_grad_reduce=arm_grad_reduce)
    return backend_name, kv_cache, runner


__all__ = ["ResumePoint", "build_engine"]
