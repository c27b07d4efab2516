"""What a shared prefix keeps for one layer (placeholder: the softmax-attention case only).

A model family supplies one :class:`PrefixState` per layer
(:meth:`megatron_psrl.model.families.ModelFamily.prefix_states`); the KV cache, the memory plan
and the transports size what they hold and move from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class PrefixState:
    """What a cached prefix keeps for one layer: softmax attention's post-RoPE K and V rows."""

    num_groups: int
    """Key/value heads of this tensor-parallel rank."""

    key_dim: int
    """Width of one key head."""

    value_dim: int
    """Width of one value head."""

    dtype: torch.dtype = torch.float32
    """Storage dtype of the values (the model's)."""

    @classmethod
    def softmax(cls, num_groups: int, key_dim: int, value_dim: Optional[int] = None,
                dtype: torch.dtype = torch.float32) -> "PrefixState":
        """Softmax attention: K ``[ng, key_dim]`` and V ``[ng, value_dim]`` per token
        (``value_dim`` defaults to ``key_dim``)."""
        return cls(num_groups, key_dim, key_dim if value_dim is None else value_dim, dtype)


__all__ = ["PrefixState"]
