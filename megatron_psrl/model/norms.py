"""RMSNorms that megatron's torch norm (``WrappedTorchNorm``) does not provide: the zero-centred
one of Qwen3-Next / Qwen3.5 (``x * (1 + w)``, weights stored around zero; megatron
``layernorm_zero_centered_gamma``, which ``WrappedTorchNorm`` refuses) and a plain one that
ignores that flag (the linear layers' gated output norm, ``w * x``, in a model whose other
norms are zero-centred).

Both compute as Hugging Face's Qwen3-Next / Qwen3.5 norms do: in fp32, the result cast back to
the input's dtype (the zero-centred one multiplies by ``1 + w`` in fp32 before the cast; the
plain one casts the normalised input back first, then multiplies by ``w``, as
``Qwen3_5RMSNormGated``). Under sequence parallelism the weight is marked ``sequence_parallel``
(megatron sums its gradient over the tensor-parallel ranks), as
:class:`~megatron_psrl.model.sequence_parallel.SequenceParallelTorchNorm` does.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


class RMSNorm(torch.nn.Module):
    """``RMSNorm(config, hidden_size, eps)`` in megatron's norm slot; ``zero_centered`` None
    follows ``config.layernorm_zero_centered_gamma``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, zero_centered: Optional[bool] = None, **kwargs):
        super().__init__()
        self.zero_centered = config.layernorm_zero_centered_gamma if zero_centered is None else zero_centered
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            setattr(self.weight, "sequence_parallel", True)

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.type_as(x)


class ZeroCenteredRMSNorm(RMSNorm):
    """:class:`RMSNorm` computing ``x * (1 + w)`` whatever the config says."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        kwargs.pop("zero_centered", None)
        super().__init__(config, hidden_size, eps, zero_centered=True)


class PlainRMSNorm(RMSNorm):
    """:class:`RMSNorm` computing ``w * x`` whatever the config says."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        kwargs.pop("zero_centered", None)
        super().__init__(config, hidden_size, eps, zero_centered=False)
