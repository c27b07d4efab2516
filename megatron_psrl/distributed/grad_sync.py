"""Gradient reduction and norms over megatron's process groups, with plain torch.distributed.

Used on CPU (gloo) in place of megatron's DistributedDataParallel and optimizer, which need
CUDA (``megatron_psrl.compat``, item 3). The RL loss is already normalised over the whole
global batch, so data-parallel gradients are *summed*, not averaged.
"""

from __future__ import annotations

import math
from typing import Iterable, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 64 * 1024 * 1024


def allreduce_gradients(params: Iterable[torch.nn.Parameter], group=None, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``p.grad`` over ``group`` (default: megatron's data x context parallel group), bucketed."""
    group = group if group is not None else parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return
    params = list(params)
    for p in params:
        # Every rank must contribute the same tensors, even one whose trees never reached a
        # parameter (or that got no work at all).
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    bucket: List[torch.Tensor] = []
    size = 0
    for g in grads + [None]:
        if g is not None and (not bucket or (g.dtype == bucket[0].dtype and size + g.numel() * g.element_size() <= bucket_bytes)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                dst.copy_(src)
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


def tensor_parallel_partial_params(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Parameters whose gradient each tensor-parallel rank holds only in part.

    Replicated parameters applied to rank-local activations: the per-head q/k RMSNorm weights
    (Qwen3) see only this rank's heads. megatron's ``finalize_model_grads`` sums exactly these
    (its ``qk_layernorm`` rule); sequence-parallel norms would join them.
    """
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "qk_layernorm", False):
        return []
    return [p for n, p in model.named_parameters() if p.requires_grad and ("q_layernorm" in n or "k_layernorm" in n)]


def _identity(p):
    return p


def allreduce_tensor_parallel_partial_gradients(model: torch.nn.Module, holder=_identity) -> None:
    """Sum the partial gradients of :func:`tensor_parallel_partial_params` over the TP group
    (``holder(p)``: the tensor whose ``.grad`` holds p's gradient, e.g. its fp32 main copy)."""
    if not parallel_state.model_parallel_is_initialized():
        return
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    allreduce_gradients([holder(p) for p in tensor_parallel_partial_params(model)], group=group)


def allreduce_embedding_gradients(model: torch.nn.Module, holder=_identity) -> None:
    """With PP > 1 and tied embeddings, the first stage's word embeddings and the last stage's
    copy of them (the output layer) are one parameter: sum their gradients over megatron's
    embedding group so both copies take the same step (megatron's
    ``_allreduce_word_embedding_grads``)."""
    if not parallel_state.model_parallel_is_initialized():
        return
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    from megatron_psrl.model.gpt import model_chunks

    for chunk in model_chunks(model):  # the chunk of the first / last virtual stage
        if chunk.pre_process or chunk.post_process:
            weight = holder(chunk.shared_embedding_or_output_weight())
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def gradient_norm(params: Iterable[torch.nn.Parameter], holder=_identity) -> float:
    """L2 norm of all gradients of the model, counting tensor-parallel duplicates and the last
    pipeline stage's copy of tied embeddings once, summed over the model-parallel (TP x PP) group
    (``holder(p).grad`` is p's gradient)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        grad = holder(p).grad
        if grad is not None and param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
            total += grad.detach().double().pow(2).sum().cpu()
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return math.sqrt(float(total))


def clip_gradients_(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale gradients in place so their norm is at most ``max_norm``."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
