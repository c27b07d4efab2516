"""PolicyActor: the update phase of an RL loop, in memory, for RL frameworks.

An RL framework (verl, slime, OpenRLHF, NeMo-RL, or a hand-written loop) owns rollouts and
rewards; it hands batches of samples to a ``PolicyActor`` and gets back log-probs, gradient
steps and weights, with prefix sharing, on any TP / DP / CP layout (under torchrun every rank
builds the same actor and passes the same batch)::

    from megatron_psrl import ActorConfig, PolicyActor

    actor = PolicyActor("Qwen/Qwen2.5-7B-local-folder", ActorConfig(micro_batch_tokens=8192))
    old = actor.compute_logprobs(batch)                 # list of per-sample float32 arrays
    metrics = actor.train_step(batch)                   # one optimizer step; metrics["logprobs"] too
    weights = actor.state_dict_hf()                     # HF names, to sync an inference engine

A batch is a list of samples, each a dict with the fields of docs/data-format.md (``tokens``,
``loss_mask``, ``advantage``, ``old_logprobs``, ``ref_logprobs``, ``weight``, ``id``) as Python
lists, numpy arrays or torch tensors, or a ``SampleBatch``. Every call validates it with the
same one-line errors as the command line.

Creating an actor never changes the caller's global RNG state. ``pretrain_agent_rl.py`` and
``tools/compute_logprobs.py`` are thin command lines over this class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_psrl.attention.backends import default_backend
from megatron_psrl.checkpoint.layout import check_ckpt_format, checkpoint_format, has_checkpoint, read_checkpoint_info
from megatron_psrl.checkpoint.loading import ModelSource, hf_memory_state_dict, load_model, source_architecture
from megatron_psrl.checkpoint.sharding import merge_state_dicts, shard_state_dict
from megatron_psrl.checkpoint.state_dict import canonical_state_dict, load_state_into
from megatron_psrl.compat import install_cpu_recompute_shims
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.data.validation import check_max_sample_length
from megatron_psrl.distributed.monitor import DEFAULT_TIMEOUT_MINUTES
from megatron_psrl.distributed.setup import ParallelLayout, exchange_group_of, gradient_group, initialize_parallel
from megatron_psrl.errors import ConfigurationError, UnsupportedFeatureError
from megatron_psrl.kvcache import (
    BlockKVCache,
    KVGeometry,
    activation_bytes_per_token,
    plan_forward_memory,
    plan_memory_group,
)
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.logits import loss_head_peak_bytes
from megatron_psrl.model.stages import pipeline_layer_counts, stage_counts, virtual_pipeline_size, virtual_stages
from megatron_psrl.options import DEFAULT_CKPT_FORMAT, TINY_MODEL_NAMES
from megatron_psrl.training.calibration import MeasuredCosts, calibrate_for_planning
from megatron_psrl.training.loss import ClaimLoss, LossConfig, PerClaimLoss, SequenceInputs, SequenceLoss
from megatron_psrl.training.memory import PeakMemory
from megatron_psrl.training.optimizer import OptimizerSettings, StepOutcome, build_optimizer
from megatron_psrl.training.planning import memory_plans, plan_with_memory
from megatron_psrl.training.step import StepOutput, StepRunner
from megatron_psrl.tree.build import build_prefix_tree
from megatron_psrl.tree.cost import CostModel
from megatron_psrl.tree.plan import StepPlan
from megatron_psrl.tree.planner import PLACEMENTS, SHARING_MODES, PlannerConfig

Batch = Union[SampleBatch, Sequence[Mapping[str, Any]]]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ActorConfig:
    """How a :class:`PolicyActor` runs (the command line's flags, as fields)."""

    tensor_model_parallel_size: int = 1
    """TP size (``--tensor-model-parallel-size``)."""

    pipeline_model_parallel_size: int = 1
    """PP size: stages of layers; trees are placed on whole pipelines (docs/architecture.md)."""

    decoder_first_pipeline_num_layers: Optional[int] = None
    """Layers of the first pipeline stage (the rest split evenly), to balance the embedding."""

    decoder_last_pipeline_num_layers: Optional[int] = None
    """Layers of the last pipeline stage (the rest split evenly), to balance the output layer."""

    loss_head_chunk_mb: float = 64.0
    """The loss head turns claimed rows into fp32 logits, log-probs and entropies in chunks of at
    most this many MB of logits (forward and backward: each chunk's logits are recomputed in
    the backward pass), so its peak is bounded by a chunk (about six times this: the logits,
    their shifted and exp copies and their gradients), not by the batch."""

    recompute_granularity: Optional[str] = None
    """Activation recomputation as in Megatron-LM: ``full`` (whole layers, see
    ``recompute_method``) or ``selective`` (core attention); None keeps every activation.
    Exact with both mechanisms: cached-prefix gradients are then injected inside the graph."""

    recompute_method: Optional[str] = None
    """With ``full``: ``uniform`` (every ``recompute_num_layers`` layers form one recomputed
    unit) or ``block`` (the first ``recompute_num_layers`` layers of each stage recompute)."""

    recompute_num_layers: Optional[int] = None
    """With ``full``: see ``recompute_method``."""

    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual pipeline stage (megatron's interleaved schedule): each rank holds
    ``layers / (PP x this)`` chunks, the pipeline bubble shrinks by that factor."""

    context_parallel_size: int = 1
    """CP size: a CP group shares the fragments of the same trees (``--context-parallel-size``)."""

    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda``."""

    dtype: str = "float32"
    """Parameter and compute dtype: ``float32``, ``bfloat16`` or ``float16`` (CUDA only)."""

    transformer_impl: str = "auto"
    """megatron layer spec: ``local``, ``transformer_engine`` or ``auto``."""

    attention_backend: str = "auto"
    """Prefix-sharing attention kernel: ``torch``, ``dense``, ``flash``, ``te`` or ``auto``."""

    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch."""

    kv_cache_budget: int = 1 << 30
    """Bytes for cached prefix K/V, their gradients and retained prefix graphs."""

    prefix_sharing: str = "tree"
    """``tree`` (mechanisms 1 + 2), ``tree-dup`` or ``none`` (the baseline)."""

    placement: str = "auto"
    """Trees over an exchange group: ``whole-tree``, ``cross-rank`` or ``auto``."""

    cost_profile: Optional[str] = None
    """File keeping the start-up cost measurement for later runs."""

    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    """Optimizer, learning-rate schedule and clipping."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The default loss (PPO / GRPO per claim); per-call overrides and custom losses exist."""

    seed: int = 1234
    """Seed of the model's random initialisation (tiny configs) and megatron's RNG tracker."""

    memory_tracking: str = "sampled"
    """CPU peak-memory measurement: ``sampled``, ``ops`` or ``off``."""

    allow_rope_extrapolation: bool = False
    """Accept samples longer than the model's ``max_position_embeddings``."""

    distributed_timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES
    """Timeout of every collective."""

    ckpt_format: str = DEFAULT_CKPT_FORMAT
    """Format :meth:`PolicyActor.save` writes (``--ckpt-format``): ``torch_dist`` (megatron-core's
    sharded format, Megatron-LM's default: loads under any TP/PP/DP layout, optimizer state
    included) or ``legacy`` (Megatron's per-rank files). Loading reads either."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigurationError(f"recompute_granularity must be full or selective, got {self.recompute_granularity!r}")
        if self.recompute_method not in (None, "uniform", "block"):
            raise ConfigurationError(f"recompute_method must be uniform or block, got {self.recompute_method!r}")
        if self.recompute_granularity == "full" and (self.recompute_method is None or not self.recompute_num_layers):
            raise ConfigurationError("recompute_granularity full needs recompute_method (uniform or block) and "
                                     "recompute_num_layers >= 1, as in Megatron-LM")
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers):
            raise ConfigurationError("recompute_method and recompute_num_layers apply to recompute_granularity full")
        if not self.loss_head_chunk_mb > 0:
            raise ConfigurationError(f"loss_head_chunk_mb must be > 0, got {self.loss_head_chunk_mb}")
        if self.dtype not in _DTYPES:
            raise ConfigurationError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.prefix_sharing not in SHARING_MODES:
            raise ConfigurationError(f"prefix_sharing must be one of {SHARING_MODES}, got {self.prefix_sharing!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigurationError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        check_ckpt_format(self.ckpt_format)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block without changing the caller's global RNG state (torch CPU and CUDA)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def model_source(model: Any) -> ModelSource:
    """A :class:`ModelSource` from what a caller has: a folder (Hugging Face or checkpoint), a
    tiny config name, a transformers model object, or ``(hf_config_dict, hf_state_dict)``."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if has_checkpoint(path):
            return ModelSource(checkpoint=path)
        if os.path.isdir(path):
            return ModelSource(hf_dir=path)
        if path in TINY_MODEL_NAMES:
            return ModelSource(tiny=path)
        raise ConfigurationError(f"{path}: no such folder (a Hugging Face save_pretrained folder or a checkpoint; "
                                 f"or a tiny config name: {', '.join(TINY_MODEL_NAMES)})")
    if isinstance(model, tuple) and len(model) == 2:
        return ModelSource(hf_config=dict(model[0]), hf_state_dict=dict(model[1]))
    if hasattr(model, "config") and hasattr(model, "state_dict"):  # a transformers PreTrainedModel
        return ModelSource(hf_config=model.config.to_dict(), hf_state_dict=model.state_dict())
    raise ConfigurationError(f"cannot build a policy from {type(model).__name__}: give a Hugging Face folder, a "
                             "checkpoint folder, a tiny config name, a transformers model or (config, state_dict)")


@dataclass
class StepResult:
    """What :meth:`PolicyActor.forward_backward` / :meth:`PolicyActor.train_step` did."""

    loss: float
    """The step's loss over the whole global batch (all ranks)."""

    metrics: Dict[str, Any]
    """Everything else: loss terms, tokens, plan and KV cache metrics, phase times (seconds)."""

    logprobs: Optional[List[np.ndarray]] = None
    """Per sample, the log-probs this step computed: every trained token, and a token trained
    in another sample that shares it; NaN where none was computed, 0 at position 0. Compare
    with the rollout's log-probs to watch the train / inference mismatch."""

    outcome: Optional[StepOutcome] = None
    """The optimizer step (train_step only)."""

    def as_dict(self) -> Dict[str, Any]:
        out = dict(self.metrics, loss=self.loss)
        if self.outcome is not None:
            out.update(grad_norm=self.outcome.grad_norm, skipped=self.outcome.skipped)
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


class PolicyActor:
    """The policy of an RL loop on megatron-core with prefix sharing (see the module docstring)."""

    def __init__(self, model: Any = "tiny-llama", config: Optional[ActorConfig] = None, *,
                 load_optimizer: bool = True, for_training: bool = True, log: Optional[Callable[[str], None]] = None):
        self.config = config = config or ActorConfig()
        self._log = log or (lambda msg: None)
        self._log_given = log is not None
        source = model_source(model)
        with preserved_rng():
            self.layout: ParallelLayout = initialize_parallel(
                config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.seed, config.device,
                timeout_minutes=config.distributed_timeout_minutes, context_parallel_size=config.context_parallel_size,
            )
            self._build(source, load_optimizer, for_training)

    # ------------------------------------------------------------------ construction
    def _build(self, source: ModelSource, load_optimizer: bool, for_training: bool) -> None:
        config, layout = self.config, self.layout
        device, dtype = layout.device, config.torch_dtype
        self.exchange_group, self.exchange_group_size = exchange_group_of(layout)
        impl = config.transformer_impl
        if impl == "auto":
            impl = "local"
            if device.type == "cuda":
                try:
                    import transformer_engine  # noqa: F401

                    impl = "transformer_engine"
                except ImportError:
                    pass
        self.transformer_impl = impl
        self.iteration = 0
        """Optimizer steps taken (a resumed checkpoint's iteration included)."""
        first, last = config.decoder_first_pipeline_num_layers, config.decoder_last_pipeline_num_layers
        uneven = first is not None or last is not None
        pp, num_layers = layout.pipeline_parallel_size, source_architecture(source).num_layers
        self.virtual_pipeline_size = virtual_pipeline_size(num_layers, pp, config.num_layers_per_virtual_pipeline_stage,
                                                           uneven)
        """Model chunks per pipeline rank (1 without virtual stages)."""
        self.pipeline_split = (pipeline_layer_counts(num_layers, pp, first, last)
                               if uneven else pp * self.virtual_pipeline_size)
        """Each (virtual) stage's layer count, or the (virtual) stage count for an even split."""
        dist_checkpoint = None
        """The iteration folder of a torch_dist checkpoint to resume from (its optimizer state is
        loaded, resharded, once the optimizer exists)."""
        if source.checkpoint is not None:
            it_dir, info = read_checkpoint_info(source.checkpoint)
            self.iteration = info.iteration
            same_layout = self._same_layout(info)
            if checkpoint_format(source.checkpoint) == "torch_dist":
                if info.has_optimizer_state and load_optimizer and for_training:
                    dist_checkpoint = (it_dir, info)
            elif info.has_optimizer_state and load_optimizer and for_training and not same_layout:
                raise ConfigurationError(
                    f"{source.checkpoint} (legacy format) was saved with TP={info.tensor_parallel_size} "
                    f"PP={info.pipeline_parallel_size}; its optimizer state cannot be loaded with "
                    f"TP={layout.tensor_parallel_size} PP={layout.pipeline_parallel_size}. Pass --no-load-optim to "
                    "resume with a fresh optimizer, or --finetune to start a new run (a torch_dist checkpoint "
                    "reshards its optimizer state)"
                )
        self.recompute = config.recompute_granularity is not None
        """Activation recomputation is on (megatron's; prefix gradients injected in the graph)."""
        overrides = {}
        if self.recompute:
            if layout.context_parallel_size > 1:
                raise UnsupportedFeatureError("activation recomputation with context parallelism is not supported "
                                              "yet (a recomputed layer would repeat its prefix K/V exchange)")
            install_cpu_recompute_shims(device)
            overrides = dict(recompute_granularity=config.recompute_granularity,
                             recompute_method=config.recompute_method, recompute_num_layers=config.recompute_num_layers)
        self.arch, self.model, optimizer_state = load_model(
            source, dtype=dtype, device=device, transformer_impl=impl,
            pipeline_layers=self.pipeline_split if uneven else None, virtual_pipeline_size=self.virtual_pipeline_size,
            config_overrides=overrides)
        self.dtype = dtype
        if device.type == "cpu" and dtype != torch.float32:
            self._log(f"warning: {config.dtype} on CPU is slower than float32 (few CPUs have fast {config.dtype} "
                      "kernels); use it to check GPU numerics, and float32 to train on CPU")
        # A log-prob-only actor (for_training=False) holds no optimizer (no fp32 master copies).
        self.optimizer = build_optimizer(self.model, config.optimizer, device) if for_training else None
        overlaps = [flag for flag, on in (("--overlap-grad-reduce", config.optimizer.overlap_grad_reduce),
                                          ("--overlap-param-gather", config.optimizer.overlap_param_gather)) if on]
        if overlaps and device.type != "cuda" and for_training:
            note = (f"{' and '.join(overlaps)} {'has' if len(overlaps) == 1 else 'have'} no effect on CPU "
                    "(megatron's DDP needs CUDA; gradients are all-reduced over gloo after the backward pass)")
            if self._log_given:
                self._log(f"warning: {note}")
            elif layout.rank == 0:
                warnings.warn(note, stacklevel=3)
        if optimizer_state and load_optimizer and self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer_state)
        if dist_checkpoint is not None:
            from megatron_psrl.checkpoint.dist_format import load_training_state

            with layout.monitor.phase("optimizer state load"):
                load_training_state(dist_checkpoint[0], self.model, self.optimizer, self._same_layout(dist_checkpoint[1]))
        tp = layout.tensor_parallel_size
        self.geometry = KVGeometry.for_model(self.arch, tp, self.pipeline_split, dtype, device,
                                             pipeline_rank=layout.pp_rank,
                                             virtual_pipeline_size=self.virtual_pipeline_size)
        self.plan_geometry = KVGeometry.for_pipeline_planning(self.arch, tp, self.pipeline_split, dtype, device,
                                                              self.virtual_pipeline_size)
        """What memory plans assume (the same on every stage; the cache uses :attr:`geometry`)."""
        self.cost_model: CostModel = cost_model_for(self.arch)
        self._flops = self.cost_model
        self.measured: Optional[MeasuredCosts] = None
        # Trees are placed whole with pipeline stages (one pipeline is one placement rank;
        # spreading a tree over pipelines, K/V exchanged per stage, is not offered yet) and with
        # recomputation (a recomputed layer would repeat its K/V exchange inside the backward).
        whole_tree_only = [why for why, on in (("pipeline parallelism", layout.pipeline_parallel_size > 1),
                                               ("activation recomputation", self.recompute)) if on]
        self.placement = "whole-tree" if whole_tree_only else config.placement
        if whole_tree_only and config.placement == "cross-rank":
            self._log(f"note: --placement cross-rank is not available with {' and '.join(whole_tree_only)} yet; "
                      "trees are placed whole on data-parallel ranks")
        if self.exchange_group_size > 1 and self.placement != "whole-tree" and config.prefix_sharing == "tree":
            # Cross-rank decisions weigh compute against transfers: measure both on this model.
            with layout.monitor.phase("cost calibration"):
                self.measured = calibrate_for_planning(self.model, self.arch, self.geometry, device,
                                                       config.micro_batch_tokens, self.exchange_group,
                                                       profile=config.cost_profile)
            self.cost_model = self.measured.cost_model()
            m = self.measured
            self._log(f"cost calibration: {m.seconds_per_token * 1e6:.1f} us/token, {m.seconds_per_key * 1e9:.2f} "
                      f"ns/key pair, {m.seconds_per_micro_batch * 1e3:.2f} ms/micro-batch, exchange "
                      f"{m.seconds_per_exchange * 1e3:.2f} ms + {1 / max(m.seconds_per_byte, 1e-15) / 1e9:.2f} GB/s")
        self.kv_cache = BlockKVCache(self.geometry, config.kv_cache_budget)
        self.act_bytes = activation_bytes_per_token(self.arch, tp, torch.tensor([], dtype=dtype).element_size())
        self.head_bytes = loss_head_peak_bytes(self.arch.padded_vocab_size(tp) // tp, config.micro_batch_tokens,
                                               int(config.loss_head_chunk_mb * 2**20))
        """The loss head's transient peak, charged by every memory plan."""
        backend = None if config.attention_backend == "auto" else config.attention_backend
        self.backend_name = backend or default_backend(device.type, dtype)
        if device.type == "cuda" and backend is None and self.backend_name == "torch":
            self._log("warning: flash-attn is not installed, so tree attention runs the torch backend's reference "
                      "math on CUDA (correct, slow): pip install flash-attn, or --attention-backend te with "
                      "Transformer Engine")
        runner_class = StepRunner
        if layout.pipeline_parallel_size > 1:
            from megatron_psrl.training.pipeline import PipelineStepRunner as runner_class
        self.runner = runner_class(self.model, self.arch.vocab_size, device, backend, self.kv_cache,
                                   exchange_group=self.exchange_group,
                                   loss_head_chunk_bytes=int(config.loss_head_chunk_mb * 2**20),
                                   inject_kv_grads=self.recompute)

    def describe_kernels(self) -> str:
        """One line: layer spec, attention kernel, optional GPU packages installed."""
        from megatron_psrl.model.kernels import describe_kernels

        return describe_kernels(self.layout.device, self.transformer_impl, self.backend_name)

    # ------------------------------------------------------------------ batches and plans
    def as_batch(self, batch: Batch, training: bool = True, needs_advantage: bool = True) -> SampleBatch:
        """Validate a batch (see the module docstring) against this model."""
        if not isinstance(batch, SampleBatch):
            batch = samples_from_dicts(list(batch), vocab_size=self.arch.vocab_size,
                                       require_advantage=training and needs_advantage, source="<batch>")
        elif training and needs_advantage and batch.advantages is None:
            raise ConfigurationError(f"{batch.source}: training needs an 'advantage' for every sample")
        if self.arch.sliding_window is not None:
            check_max_sample_length(batch, self.arch.sliding_window, "the model's sliding window")
        if not self.config.allow_rope_extrapolation:
            check_max_sample_length(batch, self.arch.max_position_embeddings, "the model's max_position_embeddings",
                                    "--allow-rope-extrapolation trains it anyway")
        return batch

    def _check_same_call(self, batch: SampleBatch, what: str, *flags: float) -> None:
        """Every rank must make the same call on the same global batch (the planner splits it);
        a framework that hands each rank its own slice would otherwise get silently wrong
        numbers, or ranks that disagree on a collective would hang. One small all-reduce."""
        if dist.get_world_size() == 1:
            return
        positions = np.arange(batch.num_tokens, dtype=np.float64) % 65521 + 1
        digest = [float(batch.num_samples), float(batch.num_tokens), float(np.dot(batch.tokens, positions)),
                  float(np.count_nonzero(batch.loss_mask)), *map(float, flags)]
        t = torch.tensor(digest + [-x for x in digest], dtype=torch.float64, device=self.layout.device)
        with self.layout.monitor.phase(f"{what} call check (iteration {self.iteration + 1})"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        high, low = t[:len(digest)], -t[len(digest):]
        if not torch.equal(high, low):
            raise ConfigurationError(
                f"{what}: the ranks passed different batches or options ({int(low[0])}-{int(high[0])} samples, "
                f"{int(low[1])}-{int(high[1])} tokens). Every rank must pass the same global batch (the planner "
                "splits it over the ranks) with the same arguments")

    def _planner_config(self, prefix_sharing: Optional[str] = None) -> PlannerConfig:
        c = self.config
        costs = (self.measured.planner_settings(self.geometry.num_layers, 2 * self.geometry.bytes_per_token)
                 if self.measured else dict(cost_model=self.cost_model))
        return PlannerConfig(micro_batch_tokens=c.micro_batch_tokens, data_parallel_size=self.layout.placement_size,
                             sharing=prefix_sharing or c.prefix_sharing, exchange_group_size=self.exchange_group_size,
                             placement=self.placement, **costs)

    def plan(self, batch: SampleBatch, times: Optional[Dict[str, float]] = None):
        """``(tree, step plan, this rank's memory plan, sharing mode used)`` of a training step
        (``times`` receives the seconds of the tree build and of the planning)."""
        t0 = time.perf_counter()
        tree = build_prefix_tree(batch)
        t1 = time.perf_counter()
        plan, memories, mode = plan_with_memory(
            tree, self._planner_config(),
            lambda ranks: plan_memory_group(ranks, self.plan_geometry, self.config.kv_cache_budget, self.act_bytes,
                                            rereads=self.recompute,
                                            # the torch backend gathers cached K/V again in backward
                                            gathers_in_backward=self.backend_name == "torch",
                                            head_bytes=self.head_bytes))
        if times is not None:
            times.update(tree=t1 - t0, plan=time.perf_counter() - t1)
        if mode != self.config.prefix_sharing:
            self._log("warning: the cached prefixes do not fit --kv-cache-budget; duplicating them this step")
        return tree, plan, memories[self.layout.placement_rank], mode

    def _loss(self, loss_fn, overrides: Dict[str, Any]) -> ClaimLoss:
        """The loss of one call: the configured PPO/GRPO loss (with ``overrides``), or a custom
        one, whose ``view.coef`` implements the configured ``loss_agg`` unless it names its own
        (or the call passes ``loss_agg=``)."""
        if loss_fn is None:
            return dataclasses.replace(self.config.loss, **overrides) if overrides else self.config.loss
        unknown = set(overrides) - {"loss_agg"}
        if unknown:
            raise ConfigurationError(f"loss overrides {sorted(unknown)} apply to the default loss only; a custom "
                                     "loss_fn takes only loss_agg=")
        if isinstance(loss_fn, SequenceLoss) or (hasattr(loss_fn, "needs_entropy")
                                                 and not isinstance(loss_fn, PerClaimLoss)):
            return loss_fn
        if not isinstance(loss_fn, PerClaimLoss):
            loss_fn = PerClaimLoss(loss_fn)
        agg = overrides.get("loss_agg") or loss_fn.loss_agg or self.config.loss.loss_agg
        return dataclasses.replace(loss_fn, loss_agg=agg) if agg != loss_fn.loss_agg else loss_fn

    # ------------------------------------------------------------------ the update
    def forward_backward(self, batch: Batch, loss_fn=None, return_logprobs: bool = True,
                         **loss_overrides) -> StepResult:
        """Forward and backward of the whole global batch; gradients accumulate in the model
        (call :meth:`optimizer_step`, or let the caller's optimizer use them).

        ``loss_fn``: None for the configured PPO / GRPO loss (``loss_overrides`` change its
        fields for this call: ``clip_eps``, ``kl_coef``, ``entropy_coef``, ``loss_agg``); a
        function of a :class:`~megatron_psrl.training.loss.ClaimView` returning per-claim
        losses (summed over the global batch); a ``PerClaimLoss``; or a ``SequenceLoss``."""
        loss = self._loss(loss_fn, loss_overrides)
        batch = self.as_batch(batch, training=True, needs_advantage=loss.needs_advantage)
        self._check_same_call(batch, "forward_backward", return_logprobs, isinstance(loss, SequenceLoss))
        with preserved_rng():
            return self._forward_backward(batch, loss, return_logprobs)

    def optimizer_step(self, skip: bool = False) -> StepOutcome:
        """Reduce the accumulated gradients over data x context parallel ranks, clip and apply
        them; a non-finite gradient norm (or ``skip``) skips the step on every rank."""
        self._require_optimizer("optimizer_step")
        with self.layout.monitor.phase(f"gradient all-reduce and optimizer step {self.iteration + 1}"):
            outcome = self.optimizer.step(skip=skip)
        if not outcome.skipped:
            self.iteration += 1
        return outcome

    def zero_grad(self) -> None:
        if self.optimizer is None:
            self.model.zero_grad(set_to_none=True)
        else:
            self.optimizer.zero_grad()

    def _require_optimizer(self, call: str) -> None:
        if self.optimizer is None:
            raise ConfigurationError(f"{call} needs an optimizer: this actor was built with for_training=False "
                                     "(log-probs only)")

    def train_step(self, batch: Batch, loss_fn=None, return_logprobs: bool = True, **loss_overrides) -> Dict[str, Any]:
        """One optimizer step over the global batch; a dict of metrics (``loss``, ``grad_norm``,
        ``skipped``, ``lr``, loss terms, tokens, plan, KV cache, phase times, and ``logprobs``)."""
        return self.train_step_result(batch, loss_fn, return_logprobs, **loss_overrides).as_dict()

    def train_step_result(self, batch: Batch, loss_fn=None, return_logprobs: bool = True,
                          **loss_overrides) -> StepResult:
        """:meth:`train_step` as a :class:`StepResult`."""
        self._require_optimizer("train_step")
        # every collective of the step runs inside a named phase (inner phases name it closer)
        with self.layout.monitor.phase(f"train step of iteration {self.iteration + 1}"):
            return self._train_step_result(batch, loss_fn, return_logprobs, loss_overrides)

    def _train_step_result(self, batch, loss_fn, return_logprobs, loss_overrides) -> StepResult:
        self.zero_grad()
        loss = self._loss(loss_fn, loss_overrides)
        batch = self.as_batch(batch, training=True, needs_advantage=loss.needs_advantage)
        self._check_same_call(batch, "train_step", return_logprobs, isinstance(loss, SequenceLoss))
        t0 = time.perf_counter()
        with preserved_rng(), PeakMemory(self.layout.device, mode=self.config.memory_tracking) as mem:
            result = self._forward_backward(batch, loss, return_logprobs)
            t1 = time.perf_counter()
            result.outcome = self.optimizer_step(skip=not np.isfinite(result.loss))
        times = result.metrics.setdefault("times", {})
        times["optimizer"] = time.perf_counter() - t1
        peak, step_time = self._reduce([float(mem.peak_bytes), time.perf_counter() - t0], op=dist.ReduceOp.MAX)
        result.metrics.update(peak_mem_bytes=int(peak), step_time_s=step_time, lr=self.optimizer.lr)
        return result

    def _forward_backward(self, batch: SampleBatch, loss: ClaimLoss, return_logprobs: bool) -> StepResult:
        monitor, it = self.layout.monitor, self.iteration + 1
        times: Dict[str, float] = {}
        tree, plan, memory, mode = self.plan(batch, times)
        sequence_loss = None
        if isinstance(loss, SequenceLoss):
            sequence_loss, loss = loss, self._sequence_surrogate(loss, plan, batch)
        t0 = time.perf_counter()
        with monitor.phase(f"forward/backward of iteration {it}"):
            out = self.runner.train(plan, self.layout.placement_rank, loss, memory,
                                    loss_scale=self.optimizer.loss_scale if self.optimizer is not None else 1.0)
        times["forward_backward"] = time.perf_counter() - t0
        keys = ["clip_frac", "pg_loss", "ratio_clamped", "kl", "entropy"]  # the same on every rank
        with monitor.phase(f"loss all-reduce of iteration {it}"):
            sums = self._reduce([out.loss, out.tokens_computed, out.tokens_recomputed, out.num_micro_batches]
                                + [out.metrics.get(k, 0.0) for k in keys], group=gradient_group())
            metrics: Dict[str, Any] = {k: v for k, v in zip(keys, sums[4:]) if k in out.metrics or
                                       self._reported(k, loss)}
            metrics.update(self._kv_metrics(bool(plan.ranks[self.layout.placement_rank].sources)))
        total = float(sums[0]) if sequence_loss is None else float(self._sequence_value)
        metrics.update(
            tokens_total=int(batch.num_tokens), tokens_computed=int(sums[1]), tokens_recomputed=int(sums[2]),
            micro_batches=int(sums[3]), tokens_unique=int(tree.num_tree_tokens), samples=batch.num_samples,
            ideal_speedup=float(self._flops.ideal_speedup(tree)),  # by definition a FLOP ratio
            prefix_sharing=mode, attention_backend=self.backend_name, times=times,
        )
        if "ratio_clamped" in metrics:
            metrics["ratio_clamped"] = int(metrics["ratio_clamped"])
        metrics.update(plan_metrics(plan, self.geometry, self.measured))
        if self.layout.pipeline_parallel_size > 1:
            metrics.update(pipeline_bubble=self.runner.last_bubble, pipeline_schedule=self.runner.last_schedule)
        logprobs = self._gather_logprobs(plan, out) if return_logprobs else None
        return StepResult(loss=total, metrics=metrics, logprobs=logprobs)

    @staticmethod
    def _reported(key: str, loss: ClaimLoss) -> bool:
        if key in ("kl", "entropy"):
            return bool(getattr(loss, "kl_coef" if key == "kl" else "entropy_coef", 0.0))
        return isinstance(loss, LossConfig)

    def _sequence_surrogate(self, loss: SequenceLoss, plan: StepPlan, batch: SampleBatch) -> PerClaimLoss:
        """The first pass of a sequence-level loss: every sample's sum of ``token_terms``
        (forward only, summed over ranks), the loss of those sums, and the per-claim surrogate
        ``dL/dS[sample] * token_terms`` whose gradient is the loss's."""
        forward_memories = memory_plans(plan, lambda ranks: [
            plan_forward_memory(r, self.plan_geometry, self.config.kv_cache_budget) for r in ranks])
        me = self.layout.placement_rank
        with self.layout.monitor.phase(f"sequence-loss forward of iteration {self.iteration + 1}"):
            local = self.runner.sequence_sums(plan, me, loss, forward_memories[me])
            sums = torch.tensor(local, dtype=torch.float64, device=self.layout.device)
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
        inputs = SequenceInputs(advantage=torch.from_numpy(advantage).to(device),
                                weight=torch.from_numpy(batch.weights.astype(np.float32)).to(device),
                                trained=torch.from_numpy(trained).to(device))
        value = loss.sequence_loss(sums, inputs)
        (grad,) = torch.autograd.grad(value, sums)
        self._sequence_value = float(value.detach())
        grad = grad.detach()
        return PerClaimLoss(lambda view: grad[view.sample] * loss.token_terms(view), needs_entropy=loss.needs_entropy,
                            needs_ref=loss.needs_ref, needs_advantage=loss.needs_advantage)

    def _gather_logprobs(self, plan: StepPlan, out: StepOutput) -> List[np.ndarray]:
        from megatron_psrl.training.logprobs import per_sample_logprobs

        return per_sample_logprobs(plan.tree, out.logprobs, gradient_group(), fill=np.nan)

    # ------------------------------------------------------------------ log-probs
    def compute_logprobs(self, batch: Batch) -> List[np.ndarray]:
        """log p(tokens[i] | tokens[:i]) of every sample (index 0: 0.0), prefix-shared, with the
        same placement over ranks as training; every rank returns all samples."""
        from megatron_psrl.training.logprobs import compute_logprobs

        batch = self.as_batch(batch, training=False)
        self._check_same_call(batch, "compute_logprobs")
        settings = (self.measured.planner_settings(self.geometry.num_layers, 2 * self.geometry.bytes_per_token)
                    if self.measured else None)
        with self.layout.monitor.phase("log-prob forward"), preserved_rng():
            return compute_logprobs(
                self.model, self.arch, batch, prefix_sharing=self.config.prefix_sharing != "none",
                micro_batch_tokens=self.config.micro_batch_tokens, kv_cache_budget=self.config.kv_cache_budget,
                attention_backend=None if self.config.attention_backend == "auto" else self.config.attention_backend,
                device=self.layout.device, allow_rope_extrapolation=True, placement=self.placement,
                cost_model=self.cost_model, exchange_group=self.exchange_group, planner_settings=settings,
                loss_head_chunk_bytes=int(self.config.loss_head_chunk_mb * 2**20),
            )

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole model in megatron names (tensor-parallel shards gathered): a snapshot on
        CPU, never a view of the live parameters (a later step does not change it)."""
        self._params_ready()
        own = {(self.layout.tp_rank, stage): {k: v.detach().to("cpu", copy=True)
                                              for k, v in canonical_state_dict(chunk).items()}
               for stage, chunk in self._stage_chunks()}
        tp, pp = self.layout.tensor_parallel_size, self.layout.pipeline_parallel_size
        if tp * pp == 1:
            return own[(0, 0)]
        gathered = [None] * (tp * pp)
        with self.layout.monitor.phase("weight gather over tensor- and pipeline-parallel ranks"):
            dist.all_gather_object(gathered, own, group=parallel_state.get_model_parallel_group())
        shards = {key: shard for part in gathered for key, shard in part.items()}
        return merge_state_dicts(shards, self.arch, tp, self.pipeline_split)

    def _stage_chunks(self):
        """``(virtual stage, chunk)`` of this rank's model chunks (chunk v of stage p holds
        virtual stage v * PP + p; one chunk, stage p, without virtual stages)."""
        chunks = model_chunks(self.model)
        return list(zip(virtual_stages(self.layout.pp_rank, self.layout.pipeline_parallel_size, len(chunks)), chunks))

    def state_dict_hf(self) -> Dict[str, torch.Tensor]:
        """The model's weights with Hugging Face names and layouts (every rank gets all of them,
        on CPU, as a snapshot), e.g. to load into an inference engine after a step."""
        return dict(get_adapter(self.arch).mcore_to_hf(self.full_state_dict()))

    def export_hf(self, out_dir: str, template_dir: Optional[str] = None, overwrite: bool = True) -> str:
        """Write a Hugging Face ``save_pretrained`` folder (safetensors + config.json), atomically."""
        from megatron_psrl.checkpoint.atomic import atomic_directory
        from megatron_psrl.checkpoint.hf_io import write_hf_checkpoint

        tensors = self.state_dict_hf()
        if self.layout.rank == 0:
            with atomic_directory(out_dir, overwrite=overwrite) as tmp:
                write_hf_checkpoint(tmp, tensors.items(), self.arch.hf_config, template_dir=template_dir)
        if dist.get_world_size() > 1:
            dist.barrier()
        return out_dir

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights into this rank's shard: every tensor of the model,
        shapes checked, no unexpected names (a misspelled key is an error, not ignored)."""
        full = hf_memory_state_dict(dict(state_dict), self.arch, strict=True)
        shards = shard_state_dict(full, self.arch, self.layout.tensor_parallel_size, self.pipeline_split)
        for stage, chunk in self._stage_chunks():
            load_state_into(chunk, shards[(self.layout.tp_rank, stage)])
        self._weights_changed()

    def _weights_changed(self) -> None:
        """Weights were loaded into the model: a bf16 model's fp32 master copies follow (else the
        next step would write the old weights back)."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ------------------------------------------------------------------ checkpoints
    def save(self, save_dir: str) -> str:
        """Save model and optimizer (none for a ``for_training=False`` actor) as iteration
        ``self.iteration``; every rank calls it. Atomic, one writer per folder."""
        from megatron_psrl.training.checkpointing import save_training_checkpoint

        fmt = self.config.ckpt_format
        if self.config.optimizer.use_distributed_optimizer and self.optimizer is not None and fmt == "legacy":
            raise UnsupportedFeatureError("the legacy checkpoint format cannot hold the distributed optimizer's "
                                          "sharded state: save with ckpt_format torch_dist (the default)")
        self._params_ready()
        with self.layout.monitor.phase(f"checkpoint save of iteration {self.iteration}"):
            return save_training_checkpoint(save_dir, self.iteration, self.model, self.optimizer, self.arch,
                                            self.layout, ckpt_format=fmt)

    def load(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        """Load weights (any TP/PP layout, either format) and, with ``load_optimizer``, the
        optimizer and learning-rate schedule: a torch_dist checkpoint's under any layout
        (resharded), a legacy one's when the layout matches. The iteration is the checkpoint's
        either way (as Megatron-LM's ``--no-load-optim``: a fresh optimizer restarts the schedule)."""
        from megatron_psrl.checkpoint import dist_format
        from megatron_psrl.checkpoint.legacy_format import load_stage_states

        layout = self.layout
        if checkpoint_format(ckpt_dir) == "torch_dist":
            it_dir, info = read_checkpoint_info(ckpt_dir)
            with layout.monitor.phase(f"checkpoint load of {it_dir}"):
                dist_format.load_model_weights(it_dir, self.model)
                self.iteration = info.iteration
                if info.has_optimizer_state and load_optimizer and self.optimizer is not None:
                    dist_format.load_training_state(it_dir, self.model, self.optimizer, self._same_layout(info))
                else:
                    self._weights_changed()
            return
        stages, chunks = zip(*self._stage_chunks())
        info, shards, optimizer_state = load_stage_states(ckpt_dir, layout.tp_rank, layout.tensor_parallel_size, stages,
                                                          self.pipeline_split, self.virtual_pipeline_size)
        for chunk, shard in zip(chunks, shards):
            load_state_into(chunk, shard)
        self.iteration = info.iteration
        if optimizer_state and load_optimizer and self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer_state)
        else:
            self._weights_changed()

    def _params_ready(self) -> None:
        """Parameters are read outside a forward pass: finish megatron's background all-gather
        of the updated ones (``overlap_param_gather`` on CUDA; nothing otherwise)."""
        if self.optimizer is not None and hasattr(self.optimizer, "sync_params"):
            self.optimizer.sync_params()

    def _same_layout(self, info) -> bool:
        """A checkpoint was saved with this actor's TP size and (virtual) pipeline stages."""
        return (info.tensor_parallel_size == self.layout.tensor_parallel_size
                and info.virtual_pipeline_size == self.virtual_pipeline_size
                and stage_counts(info.architecture, info.pipeline_split)
                == stage_counts(info.architecture, self.pipeline_split))

    def close(self) -> None:
        """End the process groups (and the collective-timeout monitor) this process uses; call
        it once at the end of the job, on every rank."""
        from megatron_psrl.distributed.setup import shutdown_parallel

        shutdown_parallel()

    # ------------------------------------------------------------------ helpers
    def _reduce(self, values: List[float], op=dist.ReduceOp.SUM, group=None) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.layout.device)
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
        read, recomputed, allocated, occupied, util_sum, ranks = self._reduce(local_sum, group=group)
        peak_util, block_size, pool_blocks = self._reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        if ranks == 0:
            return {}
        return {
            "kv_block_size": int(block_size), "kv_pool_blocks": int(pool_blocks), "kv_peak_utilisation": peak_util,
            "kv_mean_utilisation": util_sum / ranks,
            "kv_fragmentation": 1.0 - occupied / allocated if allocated else 0.0,
            "kv_hit_rate": read / (read + recomputed) if read + recomputed else 1.0,
            "kv_tokens_recomputed": int(recomputed),
        }


def cost_model_for(arch: ModelArchitecture) -> CostModel:
    """The FLOP cost model of a model (the planner's default before any measurement)."""
    return CostModel.from_dims(
        hidden_size=arch.hidden_size, num_layers=arch.num_layers, num_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        vocab_size=arch.vocab_size, name=arch.model_type,
    )


def plan_metrics(plan: StepPlan, geometry: KVGeometry, measured: Optional[MeasuredCosts]) -> Dict[str, object]:
    """What the planner decided, for the iteration line and --log-json."""
    out: Dict[str, object] = {
        "placement": "+".join(sorted(set(plan.placements))),
        "plan_imbalance": plan.imbalance(),
        "plan_rank_cost": [round(float(c), 6) for c in plan.rank_costs()],
        "exchanged_bytes": plan.exchanged_bytes(2 * geometry.bytes_per_token),
        "tokens_duplicated": plan.mechanism_counts()["duplicated_tokens"],
    }
    if measured is not None:
        out["predicted_step_s"] = float(max(plan.predicted_makespan))
        other = max(plan.alternative_makespan)
        if np.isfinite(other):
            out["predicted_other_placement_s"] = float(other)
    return out


__all__ = ["ActorConfig", "PolicyActor", "StepResult", "model_source", "preserved_rng"]
