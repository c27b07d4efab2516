"""Per-token log-probs and entropies from vocab-parallel logits.

Under tensor parallelism every rank holds a contiguous slice of the vocabulary. The softmax
normaliser, the target logit and the entropy are sums over the whole vocabulary, so each is
a local partial sum followed by an all-reduce over the TP group. megatron's
``reduce_from_tensor_model_parallel_region`` all-reduces in the forward pass and is the
identity in the backward pass, which is the correct gradient because every TP rank computes
the same (replicated) loss from the reduced values. Padded vocabulary entries (the vocabulary
is padded to a multiple of the TP size) are masked out, so the result equals the unpadded
model's.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

Tensor = torch.Tensor

_MASKED_LOGIT = -1e30


def _tp_group_and_rank():
    if not parallel_state.model_parallel_is_initialized():
        return None, 0, 1
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def vocab_parallel_logprobs(
    logits: Tensor, targets: Tensor, vocab_size: int, with_entropy: bool = False
) -> Tuple[Tensor, Optional[Tensor]]:
    """log p(target) and (optionally) the entropy of every row.

    Args:
        logits: ``[n, V_local]`` this TP rank's logits slice (any float dtype; math in fp32).
        targets: ``[n]`` global token ids.
        vocab_size: the real (unpadded) vocabulary size.
        with_entropy: also return ``-sum_v p_v log p_v`` per row.

    Returns:
        ``(logprobs [n] fp32, entropy [n] fp32 or None)``.
    """
    group, rank, world = _tp_group_and_rank()
    logits = logits.float()
    n, v_local = logits.shape
    v_start = rank * v_local
    num_real = max(0, min(v_local, vocab_size - v_start))
    if world == 1 and num_real == v_local:
        # The whole vocabulary here: PyTorch's fused log-softmax (one pass forward and one
        # backward, one [n, V] tensor saved) computes the same function.
        return _local_logprobs(logits, targets, with_entropy)
    if num_real < v_local:
        logits = logits.clone()
        # Finite (not -inf): exp() still gives exactly 0, and 0 * value stays 0 in gradients.
        logits[:, num_real:] = _MASKED_LOGIT

    row_max = logits.detach().max(dim=-1).values  # [n]; a constant shift, no gradient needed
    if world > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max[:, None]
    exp = torch.exp(shifted)
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1)) if world > 1 else exp.sum(dim=-1)
    log_z = torch.log(sum_exp)  # [n]

    local_target = targets - v_start
    in_range = (local_target >= 0) & (local_target < v_local)
    picked = shifted.gather(1, local_target.clamp(0, v_local - 1)[:, None])[:, 0]
    picked = torch.where(in_range, picked, torch.zeros_like(picked))
    if world > 1:
        picked = reduce_from_tensor_model_parallel_region(picked)
    logprobs = picked - log_z

    entropy = None
    if with_entropy:
        # H = log Z - sum_v exp(z_v) z_v / Z. Written with the two all-reduced sums only, so
        # that every rank's gradient reaches its own logits through reduced values alone
        # (p_v = exp(z_v) / Z computed locally would hide other ranks' terms from d/dZ).
        weighted = (exp * shifted).sum(dim=-1)
        if world > 1:
            weighted = reduce_from_tensor_model_parallel_region(weighted)
        entropy = log_z - weighted / sum_exp
    return logprobs, entropy


def _local_logprobs(logits: Tensor, targets: Tensor, with_entropy: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`vocab_parallel_logprobs` when this rank holds the whole, unpadded vocabulary."""
    logp = torch.log_softmax(logits, dim=-1)  # [n, V]
    picked = logp.gather(1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(dim=-1) if with_entropy else None
    return picked, entropy


DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""fp32 logits of one chunk of claimed rows (``--loss-head-chunk-mb`` 64; the head peaks at about six times it)."""


def chunk_rows(local_vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 logits ``[rows, local_vocab]`` fit ``chunk_bytes``."""
    return max(1, int(chunk_bytes) // (4 * max(1, local_vocab)))


LOSS_HEAD_PEAK_FACTOR = 6
"""The loss head's transient peak in units of one chunk's fp32 logits: logits, log-softmax
(or the shifted logits and their exponentials), and their gradients in the backward pass."""


def loss_head_peak_bytes(local_vocab: int, max_rows: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Upper estimate of the loss head's transient bytes for a micro-batch of at most ``max_rows``
    claimed rows (what the KV budget's memory plan charges every running micro-batch)."""
    rows = min(max(1, max_rows), chunk_rows(local_vocab, chunk_bytes))
    return LOSS_HEAD_PEAK_FACTOR * rows * local_vocab * 4


def chunked_logprobs(output_logits, hidden: Tensor, targets: Tensor, vocab_size: int, with_entropy: bool = False,
                     rows_per_chunk: Optional[int] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`vocab_parallel_logprobs` of ``output_logits(hidden)``, ``rows_per_chunk`` rows at a
    time, so the loss head's peak is one chunk's ``[rows, V/tp]`` tensors, not the batch's.

    With gradients, each chunk runs under activation checkpointing: only its hidden rows are
    kept, and its logits are recomputed in the backward pass (one extra output-layer matmul
    per chunk; every tensor-parallel rank runs the same chunks, so the all-reduces match).
    The same rows in the same order give the same numbers as one call: each row's log-prob and
    entropy depend on that row only.

    Args:
        output_logits: ``[n, h] -> [n, V/tp]`` (the model's output layer).
        hidden: ``[n, h]`` final hidden states of the rows.
        targets: ``[n]`` global token ids.
        rows_per_chunk: None or ``>= n``: one chunk (no checkpointing).
    """
    n = hidden.shape[0]

    def head(h: Tensor, t: Tensor) -> Tuple[Tensor, Tensor]:
        logp, ent = vocab_parallel_logprobs(output_logits(h), t, vocab_size, with_entropy=with_entropy)
        return logp, (ent if ent is not None else logp.new_zeros(0))

    if rows_per_chunk is None or rows_per_chunk >= n:
        logp, ent = head(hidden, targets)
        return logp, (ent if with_entropy else None)
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled()
    parts = []
    for start in range(0, n, rows_per_chunk):
        h, t = hidden[start:start + rows_per_chunk], targets[start:start + rows_per_chunk]
        parts.append(checkpoint(head, h, t, use_reentrant=False) if grad else head(h, t))
    logp = torch.cat([p[0] for p in parts])
    return logp, (torch.cat([p[1] for p in parts]) if with_entropy else None)
