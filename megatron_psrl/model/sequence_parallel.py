"""Sequence parallelism (megatron's ``--sequence-parallel``) for tree-packed micro-batches.

Under sequence parallelism the rows of a pack are split over the tensor-parallel ranks between
the tensor-parallel regions: the embedding's output, the norms, the residual stream and the MLP
(an MoE layer's routing included) see ``t / TP`` rows per rank; the QKV projection gathers them
back (column-parallel, ``[t, 1, np/TP * hn]``), so the core attention sees every row of the pack
with this rank's heads, as without it, and the output projection reduce-scatters its result.
megatron's MoE layers need it under TP (their token dispatchers take sequence-parallel input).

A pack has any number of rows; megatron splits evenly, so the model appends ``(-t) % TP`` zero
rows (:func:`padded_rows`) before scattering the embedding and drops them again:

- the core attention computes the pack's ``t`` rows only and returns zeros for the padding
  (``PrefixSharingAttention``), so no real row attends to a padding row;
- the MLP of a padding row computes on its own row only (dropless routing is per token), so the
  real rows are untouched; a padding row's output is read by nothing;
- the MoE routers get megatron's ``padding_mask`` (True: padding), which the expert-load
  counts read, and the per-row inputs of router replay and the router losses are sharded like
  the rows (:func:`shard_rows`), the padding rows with weight 0 / experts ``0..k-1``;
- the final hidden states are gathered and cut to ``t`` rows before the loss head.

Every parameter a rank applies to its own rows only (the norms, the MoE router, a shared
expert's gate) gets a ``sequence_parallel`` attribute, so megatron's ``finalize_model_grads``
sums its gradient over the tensor-parallel group. megatron's ``WrappedTorchNorm`` (the local
spec's norm) refuses sequence parallelism only because torch's norm lacks that attribute:
:class:`SequenceParallelTorchNorm` adds it.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def padded_rows(rows: int, tp: int) -> int:
    """``rows`` rounded up to a multiple of ``tp`` (megatron splits the sequence evenly)."""
    return -(-rows // tp) * tp


def tensor_parallel_rank_and_size() -> Tuple[int, int]:
    """``(rank, size)`` of this rank's tensor-parallel group (``(0, 1)`` before megatron's groups exist)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def sequence_parallel_group(config):
    """The tensor-parallel group when ``config`` runs sequence parallelism with TP > 1 (each rank
    then routes and counts its own share of the rows), else None."""
    from megatron.core import parallel_state

    if not getattr(config, "sequence_parallel", False) or tensor_parallel_rank_and_size()[1] == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def local_row_range(rows: int, rank: int, tp: int) -> Tuple[int, int]:
    """``[start, end)``: the rows of the padded pack that tensor-parallel rank ``rank`` holds."""
    share = padded_rows(rows, tp) // tp
    return rank * share, (rank + 1) * share


def shard_rows(values: Tensor, rank: int, tp: int, fill: Optional[Tensor] = None) -> Tensor:
    """This rank's share of a per-row tensor of a whole pack (``[t, ...] -> [t' / TP, ...]``),
    the padding rows ``fill`` (broadcast to a row; zeros when None)."""
    rows = values.shape[0]
    start, end = local_row_range(rows, rank, tp)
    mine = values[start:min(end, rows)]
    missing = end - max(start, rows)
    if missing <= 0:
        return mine
    pad = values.new_zeros((missing, *values.shape[1:]))
    if fill is not None:
        pad[:] = fill.to(pad.dtype)
    return torch.cat([mine, pad], dim=0)


def padding_mask(rows: int, rank: int, tp: int, device: torch.device) -> Optional[Tensor]:
    """megatron's ``padding_mask`` of this rank's rows, ``[1, t' / TP]`` bool, True on padding; None
    when the pack needs none."""
    if rows % tp == 0:
        return None
    start, end = local_row_range(rows, rank, tp)
    return (torch.arange(start, end, device=device) >= rows)[None, :]


@contextlib.contextmanager
def _sequence_parallel_off(config):
    saved = config.sequence_parallel
    config.sequence_parallel = False
    try:
        yield
    finally:
        config.sequence_parallel = saved


class SequenceParallelTorchNorm:
    """megatron's ``WrappedTorchNorm`` (torch's RMSNorm / LayerNorm) that also runs under
    sequence parallelism: a norm is per row, so on a rank's share of the rows it computes what
    it computes on all of them; its weight (and bias) is marked ``sequence_parallel`` so that
    megatron sums its gradient over the tensor-parallel ranks, as it does for Transformer
    Engine's and apex's norms. Without sequence parallelism: ``WrappedTorchNorm`` as it is."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        with _sequence_parallel_off(config):  # megatron's other checks still apply
            norm = WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", True)
        return norm


def with_sequence_parallel_norms(spec):
    """``spec`` (a megatron ModuleSpec tree) with :class:`SequenceParallelTorchNorm` wherever it
    names ``WrappedTorchNorm``."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(spec, ModuleSpec):
        module = SequenceParallelTorchNorm if spec.module is WrappedTorchNorm else spec.module
        return dataclasses.replace(spec, module=module, submodules=with_sequence_parallel_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: with_sequence_parallel_norms(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec)})
    return spec


__all__ = ["SequenceParallelTorchNorm", "local_row_range", "padded_rows", "padding_mask", "sequence_parallel_group",
           "shard_rows", "tensor_parallel_rank_and_size", "with_sequence_parallel_norms"]
