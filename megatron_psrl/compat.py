"""Everything megatron_psrl does differently because megatron-core assumes CUDA.

This is the only place that knows; each workaround is inactive when CUDA is used. What they
are, why, and what dropping each one would take:

1. ``transformer_config_overrides``: on CPU, megatron's fused kernels (bias-GELU/SwiGLU,
   bias-dropout-add, masked softmax, RoPE fusion, persistent layer norm, gradient
   accumulation fusion) do not exist; they are switched off and weights are initialised on
   the CPU (``use_cpu_initialization``). Dropping it needs CPU builds of those fusions.
2. ``seed_model_parallel_rng``: ``tensor_parallel.model_parallel_cuda_manual_seed`` saves and
   restores CUDA RNG states. On CPU we install megatron's inference RNG tracker (its
   ``fork()`` is a no-op) and seed torch's CPU generator; dropout is disallowed anyway
   (prefix sharing is exact only without it). Dropping it needs a device-agnostic tracker
   upstream.
3. ``cpu_gradient_sync`` / ``use_megatron_ddp``: megatron's DistributedDataParallel and its
   optimizers allocate buffers with ``torch.cuda.current_stream()`` / ``device='cuda'``. On
   CPU, gradients are all-reduced by ``megatron_psrl.distributed.grad_sync`` (gloo) and
   stepped with ``torch.optim``. Dropping it needs a device-agnostic param-and-grad buffer.
4. Pipeline schedules (``pipeline_parallel/schedules.py``) allocate ``device='cuda'``
   tensors; training with PP > 1 is not offered on CPU (checkpoints are still sharded and
   merged for any PP). Dropping it needs device-agnostic schedules.

Design choices that are *not* workarounds (they hold on GPU too): RoPE frequencies come from
explicit per-token position ids (megatron's RotaryEmbedding knows only 0..S-1) and the core
attention is our PrefixSharingAttention (megatron's local DotProductAttention also uses a
CUDA global memory buffer, but we replace it for tree attention anyway).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from megatron_psrl import quiet_expected_import_warnings  # noqa: F401  (kept here for callers)


def on_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def transformer_config_overrides(device: torch.device) -> Dict[str, Any]:
    """TransformerConfig fields to force on ``device`` (empty on CUDA)."""
    if on_cuda(device):
        return {}
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def seed_model_parallel_rng(seed: int, device: torch.device) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (CUDA or the CPU stand-in)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if on_cuda(device):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # The inference tracker never touches CUDA RNG state; torch.cuda.manual_seed is lazy
        # (a no-op without CUDA).
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def use_megatron_ddp(device: torch.device) -> bool:
    """Megatron's DDP and optimizers need CUDA; on CPU our gloo gradient sync is used."""
    return on_cuda(device)
