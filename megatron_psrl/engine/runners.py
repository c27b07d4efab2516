"""Which step runner a rank uses: the one place that decides (the builder, and the log-prob
pass over a bare model, both ask here)."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_psrl.engine.step import StepRunner
from megatron_psrl.kvcache import BlockKVCache
from megatron_psrl.model.logits import DEFAULT_CHUNK_BYTES


def make_runner(model, vocab_size: int, device: torch.device, attention_backend: Optional[str],
                kv_cache: BlockKVCache, exchange_group=None, loss_head_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                inject_kv_grads: bool = False, **options) -> StepRunner:
    """The step runner of this rank, built complete: megatron's pipeline schedules with pipeline
    stages (:class:`~megatron_psrl.engine.pipeline.PipelineStepRunner`), else the plain runner
    (``options``: :class:`~megatron_psrl.engine.step.StepRunner`'s keyword-only settings)."""
    pipeline = parallel_state.model_parallel_is_initialized() and \
        parallel_state.get_pipeline_model_parallel_world_size() > 1
    runner_class = StepRunner
    if pipeline:
        from megatron_psrl.engine.pipeline import PipelineStepRunner as runner_class
    return runner_class(model, vocab_size, device, attention_backend, kv_cache, exchange_group=exchange_group,
                        loss_head_chunk_bytes=loss_head_chunk_bytes, inject_kv_grads=inject_kv_grads, **options)


__all__ = ["make_runner"]
