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
from megatron_psrl.engine.optimizer import OptimizerSettings
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import DEFAULT_CKPT_FORMAT, PLACEMENTS, SHARING_MODES
from megatron_psrl.rl.loss import LossConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a config names, and their torch dtypes."""


@dataclass
class ActorConfig:
    """How an engine, and the PolicyActor over it, runs (the command line's flags, as fields)."""

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
        if self.dtype not in DTYPES:
            raise ConfigurationError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.prefix_sharing not in SHARING_MODES:
            raise ConfigurationError(f"prefix_sharing must be one of {SHARING_MODES}, got {self.prefix_sharing!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigurationError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        check_ckpt_format(self.ckpt_format)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


__all__ = ["ActorConfig", "DTYPES"]
