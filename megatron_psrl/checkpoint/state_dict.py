"""The names a model's tensors have in checkpoints, and loading a named shard into a model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch

from megatron_psrl.errors import ConfigurationError

if TYPE_CHECKING:
    from megatron_psrl.model.gpt import PsrlGPTModel

Tensor = torch.Tensor

# Transformer Engine's layer spec fuses the pre-attention / pre-MLP norms into the following
# linear layer, so their parameters have other names than in the local spec. Checkpoints always
# use the local names (Megatron-LM's convention for converted checkpoints).
_TE_NORM_NAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)


def canonical_name(name: str) -> str:
    """The checkpoint (local-spec) name of a model parameter of either layer spec."""
    for te, local in _TE_NORM_NAMES:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def canonical_state_dict(model: torch.nn.Module) -> Dict[str, Tensor]:
    """The model's state dict with local-spec names and without TE's ``_extra_state`` entries."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_state_into(model: PsrlGPTModel, shard: Dict[str, Tensor]) -> None:
    """Load a rank shard (any dtype, local-spec names) strictly into a model of either layer
    spec: every parameter must be present and match."""
    own = {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(shard))
    unexpected = sorted(k for k in set(shard) - set(own) if not k.endswith("_extra_state"))
    if missing or unexpected:
        raise ConfigurationError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, target in own.items():
            src = shard[name]
            if tuple(src.shape) != tuple(target.shape):
                raise ConfigurationError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(target.shape)}")
            target.copy_(src.to(dtype=target.dtype, device=target.device))
