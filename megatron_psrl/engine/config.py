"""The engine's configuration: :class:`ActorConfig`, the command line's flags as fields.

One config drives every entry point: ``pretrain_agent_rl.py`` turns its flags into it
(``megatron_psrl.training.trainer.actor_config_from_args``), ``PolicyActor`` takes it, and
:func:`megatron_psrl.engine.builder.build_engine` assembles the engine from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_psrl.checkpoint.layout import check_ckpt_format
from megatron_psrl.distributed.monitor import DEFAULT_TIMEOUT_MINUTES
from megatron_psrl.dtypes import DTYPES
from megatron_psrl.engine.optimizer import OptimizerSettings
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import (
    CROSS_GROUP_PREFIX,
    DEFAULT_CKPT_FORMAT,
    LATENT_CACHE_CHOICES,
    MOE_LOAD_BALANCING_TYPES,
    MOE_TOKEN_DISPATCHERS,
    PLACEMENTS,
    SHARING_MODES,
)
from megatron_psrl.rl.loss import LossConfig

"""The dtypes a config names, and their torch dtypes."""


@dataclass
class ActorConfig:
    """How an engine, and the PolicyActor over it, runs (the command line's flags, as fields)."""

    tensor_model_parallel_size: int = 1
    """TP size (``--tensor-model-parallel-size``)."""

    sequence_parallel: bool = False
    """With TP > 1, megatron's sequence parallelism (``--sequence-parallel``): outside attention each
    tensor-parallel rank holds a share of a micro-batch's rows (a pack is padded to a multiple of
    TP; docs/architecture.md). Less activation memory; needed by mixture-of-experts models under
    TP. The last layer then computes every row (``last_layer_row_skip`` has no effect). No effect
    with TP = 1."""

    pipeline_model_parallel_size: int = 1
    """PP size: stages of layers; trees are placed on whole pipelines, or with ``placement``
    ``cross-rank`` spread over them, stage exchanging with stage (docs/architecture.md)."""

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

    last_layer_row_skip: bool = True
    """The model's last layer computes queries, attention output, output projection and MLP
    only for the rows whose log-prob is computed (``--no-last-layer-row-skip`` turns it off):
    every other row's output is read by nothing (its K/V, still computed, are). Exact; off by
    itself where the layout cannot use it (docs/architecture.md)."""

    deterministic: bool = False
    """GPU kernels that run the same way every time (``--deterministic``): flash-attn's
    deterministic backward, Transformer Engine's deterministic attention algorithms, megatron's
    ``deterministic_mode``. What stays nondeterministic on a GPU: docs/installation.md,
    "Deterministic runs". On CPU every kernel already is (resumes are bit for bit)."""

    check_sharing_every: int = 0
    """Every this many steps, check prefix sharing against the per-sample computation on a few
    of the step's samples before the update (``--check-sharing-every``;
    :mod:`megatron_psrl.rl.sharing_check`); 0: never."""

    check_sharing_samples: int = 2
    """Samples of the step's batch the check computes again without sharing."""

    check_sharing_warn_only: bool = False
    """A failed check logs a warning instead of stopping the run."""

    overlap_kv_exchange: bool = True
    """Cross-rank placement: every layer's prefix K/V all-to-all runs asynchronously while the
    attention computes over the keys the rank has (its fragment, cached prefixes); the received
    rows' attention is merged in by log-sum-exp, and in the backward their gradients travel back
    while the rest of the attention's backward runs (``--no-overlap-kv-exchange``: the
    synchronous exchange). Exact either way; the overlap needs the ``torch`` attention backend
    (the others wait for the rows before their kernel)."""

    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual pipeline stage (the interleaved 1F1B order): each rank holds
    ``layers / (PP x this)`` chunks, the pipeline bubble shrinks by that factor."""

    context_parallel_size: int = 1
    """CP size: a CP group shares the fragments of the same trees (``--context-parallel-size``)."""

    expert_model_parallel_size: int = 1
    """MoE models: EP size, the experts split over that many ranks of a stage (tensor-parallel,
    then data-parallel ranks; with TP > 1 it needs ``sequence_parallel``)
    (``--expert-model-parallel-size``; docs/moe.md)."""

    moe_token_dispatcher_type: str = "allgather"
    """MoE models: megatron's token dispatcher, ``allgather`` or ``alltoall``
    (``--moe-token-dispatcher-type``)."""

    moe_aux_loss_coeff: float = 0.0
    """MoE models: the load-balancing loss's coefficient (``--moe-aux-loss-coeff``), over the whole
    global batch with a shared token counted once per sample (docs/moe.md "Router losses"):
    ``aux_loss`` only; without router replay a forward-only pre-pass counts the routes."""

    moe_z_loss_coeff: float = 0.0
    """MoE models: the router z-loss's coefficient (``--moe-z-loss-coeff``), averaged over the
    whole global batch's tokens with a shared token counted once per sample."""

    moe_router_load_balancing_type: str = "aux_loss"
    """MoE models: megatron's load-balancing type (``--moe-router-load-balancing-type``):
    ``aux_loss``, ``seq_aux_loss``, ``global_aux_loss`` (losses: no effect while
    ``moe_aux_loss_coeff`` is 0) or ``none``; ``sinkhorn`` is refused (it balances the routes
    of the tokens of a batch together, so sharing would change every route)."""

    expert_tensor_parallel_size: int = 1
    """MoE models: TP size inside the experts (``--expert-tensor-parallel-size``); only 1 yet."""

    moe_grouped_gemm: bool = False
    """MoE models: megatron's grouped-GEMM experts (``--moe-grouped-gemm``; CUDA only)."""

    moe_router_enable_expert_bias: bool = False
    """MoE models whose router carries an expert bias (grouped sigmoid routing: GLM-4.5): update
    it every step with megatron's aux-loss-free balancing rule (``--moe-router-enable-expert-bias``;
    ``bias += moe_router_bias_update_rate * sign(mean - tokens per expert)``), the tokens counted
    once per sample as the per-sample run counts them (docs/moe.md). Off: the bias is loaded and
    used for selection, and stays as loaded. Refused for a model without such a bias (softmax
    routers: Qwen-MoE, Mixtral)."""

    moe_router_bias_update_rate: float = 1e-3
    """MoE models: the expert bias's step with ``moe_router_enable_expert_bias``
    (``--moe-router-bias-update-rate``; Megatron-LM's default)."""

    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda``."""

    dtype: str = "float32"
    """Parameter and compute dtype: ``float32``, ``bfloat16`` or ``float16`` (megatron's dynamic loss
    scaling; runs on CPU too, slowly: use it there to check numerics)."""

    transformer_impl: str = "auto"
    """megatron layer spec: ``local``, ``transformer_engine`` or ``auto``."""

    attention_backend: str = "auto"
    """Prefix-sharing attention kernel: ``torch``, ``dense``, ``flash``, ``te`` or ``auto``."""

    latent_cache: str = "auto"
    """What a latent-attention model's (DeepSeek-V3, Kimi K2) cached shared prefix keeps per
    token and layer (``--latent-cache``): ``latent``, the normalised K/V latent and the rotated
    RoPE key, projected up again by every reader (DeepSeek-V3: 576 numbers, against 40,960 for
    ``per-head``, every head's key and value); ``auto``: ``latent``, except ``per-head`` under
    sequence parallelism (a rank holds only its rows' latent there). Other families ignore it."""

    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch."""

    kv_cache_budget: int = 1 << 30
    """Bytes for cached prefix K/V, their gradients and retained prefix graphs (not used with a
    ``memory_budget``, which covers them)."""

    memory_budget: Optional[int] = None
    """Bytes the step may hold on the device, everything counted (``--memory-budget``): weights,
    gradients, optimizer state, kept graphs, cached K/V and their gradients, the loss head,
    attention temporaries. The planner fills it for speed, per step: micro-batch budget (at
    most ``micro_batch_tokens``), keep or recompute per prefix, activation recomputation per
    layer, host offload (``memory_offload``); a budget no plan fits is refused naming the
    smallest that would (docs/architecture.md, "One memory budget"). None: on CUDA the
    device's free memory at start-up less 10% of its total, none on CPU; 0: none."""

    memory_offload: bool = False
    """With a memory budget, host offload of kept graphs and cached K/V is one of the planner's
    levers (``--memory-offload``): kept graphs' saved tensors and cached K/V blocks that neither
    the running nor the next schedule step uses live in host memory (pinned, copied on a side
    stream on CUDA; :mod:`megatron_psrl.engine.host_offload`), priced as the bytes moved over
    the host link, less the compute they overlap. Not with pipeline stages or a cross-rank
    exchange. The CUDA path has not run on a GPU yet."""

    prefix_sharing: str = "tree"
    """``tree`` (mechanisms 1 + 2), ``tree-dup`` or ``none`` (the baseline)."""

    placement: str = "auto"
    """Trees over an exchange group: ``whole-tree``, ``cross-rank`` or ``auto``."""

    split_trees_across_groups: bool = True
    """A tree larger than one exchange group's share of the step is split between groups (or,
    where a group places trees whole, between ranks), each part recomputing the prefix it
    shares, when the planner predicts a shorter step (``--no-split-trees-across-groups``
    keeps every tree in one group; docs/architecture.md)."""

    cross_group_prefix: str = "auto"
    """How the parts of a tree split between groups get the prefix they share
    (``--cross-group-prefix``): ``recompute`` (each part computes it), ``transfer`` (one rank
    computes it and sends its K/V; the readers' dK/dV come back) or ``auto`` (per part, the
    cheaper by the start-up measurement of the links; recompute where none was measured).
    Always recomputed with pipeline stages, activation recomputation and MoE models."""

    cost_profile: Optional[str] = None
    """File keeping the start-up cost measurement for later runs."""

    recalibrate: bool = False
    """Measure the planner's costs at start-up even when resuming a checkpoint that recorded
    the ones its run planned with (``--recalibrate``; ``--cost-profile``'s are measured anew
    too, and the file rewritten). By default a resumed run plans with the recorded costs, so
    it places and cuts trees as the saving run would have, and continues to the same losses
    bit for bit; measured again, the plans (and the rounding) may differ."""

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
                     "expert_model_parallel_size", "micro_batch_tokens"):
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
        if self.check_sharing_every < 0 or self.check_sharing_samples < 1:
            raise ConfigurationError(f"check_sharing_every must be >= 0 and check_sharing_samples >= 1, got "
                                     f"{self.check_sharing_every} and {self.check_sharing_samples}")
        if self.memory_budget is not None and self.memory_budget < 0:
            raise ConfigurationError(f"memory_budget must be >= 0 bytes (0: none), got {self.memory_budget}")
        if not self.loss_head_chunk_mb > 0:
            raise ConfigurationError(f"loss_head_chunk_mb must be > 0, got {self.loss_head_chunk_mb}")
        if self.dtype not in DTYPES:
            raise ConfigurationError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.prefix_sharing not in SHARING_MODES:
            raise ConfigurationError(f"prefix_sharing must be one of {SHARING_MODES}, got {self.prefix_sharing!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigurationError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.cross_group_prefix not in CROSS_GROUP_PREFIX:
            raise ConfigurationError(f"cross_group_prefix must be one of {CROSS_GROUP_PREFIX}, "
                                     f"got {self.cross_group_prefix!r}")
        check_ckpt_format(self.ckpt_format)
        if self.latent_cache not in ("auto",) + LATENT_CACHE_CHOICES:
            raise ConfigurationError(f"latent_cache must be one of {('auto',) + LATENT_CACHE_CHOICES}, "
                                     f"got {self.latent_cache!r}")
        if self.latent_cache == "latent" and self.sequence_parallel and self.tensor_model_parallel_size > 1:
            raise ConfigurationError("--latent-cache latent is not supported with --sequence-parallel (a rank holds "
                                     "only its rows' latent): use --latent-cache per-head (or auto)")
        if self.ckpt_format == "legacy" and self.expert_model_parallel_size > 1:
            raise ConfigurationError(f"--ckpt-format legacy cannot hold the experts of --expert-model-parallel-size "
                                     f"{self.expert_model_parallel_size} (it writes one data-parallel replica's "
                                     "tensors, and each expert-parallel rank holds other experts): use torch_dist")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.moe_token_dispatcher_type not in MOE_TOKEN_DISPATCHERS:
            raise ConfigurationError(f"moe_token_dispatcher_type must be one of {MOE_TOKEN_DISPATCHERS}, "
                                     f"got {self.moe_token_dispatcher_type!r}")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigurationError(f"moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.moe_z_loss_coeff < 0:
            raise ConfigurationError(f"moe_z_loss_coeff must be >= 0, got {self.moe_z_loss_coeff}")
        from megatron_psrl.model.moe_losses import check_router_loss_settings

        check_router_loss_settings(self.moe_aux_loss_coeff, self.moe_z_loss_coeff, self.moe_router_load_balancing_type,
                                   self.pipeline_model_parallel_size, self.context_parallel_size,
                                   self.num_layers_per_virtual_pipeline_stage is not None)
        if self.moe_router_load_balancing_type not in MOE_LOAD_BALANCING_TYPES:
            why = (": it balances the routes of a batch's tokens together, so sharing (one token routed for many "
                   "samples) would change every route" if self.moe_router_load_balancing_type == "sinkhorn" else "")
            raise ConfigurationError(f"--moe-router-load-balancing-type must be one of {MOE_LOAD_BALANCING_TYPES}, "
                                     f"got {self.moe_router_load_balancing_type!r}{why}")
        if self.moe_router_bias_update_rate < 0:
            raise ConfigurationError(f"moe_router_bias_update_rate must be >= 0, got {self.moe_router_bias_update_rate}")
        if self.expert_tensor_parallel_size != 1:
            raise ConfigurationError(f"--expert-tensor-parallel-size {self.expert_tensor_parallel_size} is not "
                                     "supported yet (experts run whole on every rank that holds them: 1)")
        if self.moe_grouped_gemm and self.device == "cpu":
            raise ConfigurationError("--moe-grouped-gemm needs CUDA (its kernels are GPU-only); on CPU the experts "
                                     "run one by one (megatron's SequentialMLP)")
        if self.expert_model_parallel_size > 1:
            unsupported = [what for what, on in (
                ("--context-parallel-size > 1 and pipeline stages",
                 self.context_parallel_size > 1 and self.pipeline_model_parallel_size > 1),
                ("virtual pipeline stages", self.num_layers_per_virtual_pipeline_stage is not None),
                ("--placement cross-rank and pipeline stages",
                 self.placement == "cross-rank" and self.pipeline_model_parallel_size > 1)) if on]
            if unsupported:
                raise ConfigurationError(f"--expert-model-parallel-size > 1 with {', '.join(unsupported)} is not "
                                         "supported yet (expert parallelism runs with data, tensor, context and "
                                         "pipeline parallelism)")
            if self.moe_token_dispatcher_type != "alltoall":
                raise ConfigurationError("--expert-model-parallel-size > 1 needs --moe-token-dispatcher-type alltoall: "
                                         "the allgather dispatcher needs the same token count on every expert-parallel "
                                         "rank, and tree-packed micro-batches differ")

    def parallel_overrides(self) -> dict:
        """megatron TransformerConfig fields of the parallel layout beyond the group sizes (and
        ``deterministic_mode``, which the attention reads)."""
        out = dict(sequence_parallel=True) if self.sequence_parallel and self.tensor_model_parallel_size > 1 else {}
        return dict(out, deterministic_mode=True) if self.deterministic else out

    @property
    def resolved_latent_cache(self) -> str:
        """:attr:`latent_cache` with ``auto`` decided (``ModelArchitecture.latent_cache``)."""
        if self.latent_cache != "auto":
            return self.latent_cache
        return "per-head" if self.sequence_parallel and self.tensor_model_parallel_size > 1 else "latent"

    def moe_overrides(self) -> dict:
        """megatron TransformerConfig fields of the MoE flags (used for MoE models only; the
        expert-bias update only for a model whose router has the bias)."""
        # (megatron's own router losses stay off: megatron_psrl.model.moe_losses computes them weighted)
        out = dict(moe_token_dispatcher_type=self.moe_token_dispatcher_type, moe_aux_loss_coeff=0.0,
                   moe_router_load_balancing_type=self.moe_router_load_balancing_type,
                   moe_grouped_gemm=self.moe_grouped_gemm)
        if self.moe_router_enable_expert_bias:
            out["moe_router_bias_update_rate"] = self.moe_router_bias_update_rate
        return out

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


__all__ = ["ActorConfig", "DTYPES"]
