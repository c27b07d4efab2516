"""The names a model's tensors have in checkpoints, and loading a named shard into a model.

Checkpoints name a model's tensors as megatron's local layer spec does, with the routed
experts of an MoE layer one by one (``SequentialMLP``); a model built with either layer spec
and any of megatron's expert modules (``--moe-grouped-gemm``: ``GroupedMLP`` /
``TEGroupedMLP``, :mod:`megatron_psrl.model.adapters.grouped_experts`) reads and writes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.adapters.grouped_experts import expert_layout, from_expert_layout, to_expert_layout

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


def _expert_width(model: torch.nn.Module):
    """One routed expert's FFN width (``moe_ffn_hidden_size``), None for a dense model."""
    return getattr(getattr(model, "config", None), "moe_ffn_hidden_size", None)


def _own_state(model: torch.nn.Module) -> Dict[str, Tensor]:
    """The model's own tensors under local-spec names, without TE's ``_extra_state`` entries."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def canonical_state_dict(model: torch.nn.Module) -> Dict[str, Tensor]:
    """The model's state dict with local-spec names, experts one by one, and without TE's
    ``_extra_state`` entries (views of the parameters; with grouped-GEMM experts the experts'
    tensors are copies)."""
    return from_expert_layout(_own_state(model), _expert_width(model))


def load_state_into(model: PsrlGPTModel, shard: Dict[str, Tensor]) -> None:
    """Load a rank shard (any dtype, local-spec names) strictly into a model of either layer
    spec and expert module: every parameter must be present and match."""
    own = _own_state(model)
    layout = expert_layout(own)  # the shard's experts go into the model's expert module
    shard = to_expert_layout(from_expert_layout(shard, _expert_width(model)), layout)
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
