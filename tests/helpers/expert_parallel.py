"""The expert-parallel gradient check shared by the MoE torchrun scripts: every parameter this
rank holds against the per-sample reference (dense ones summed over the data-parallel ranks,
this rank's experts renumbered to their global index, a pipeline stage's layers to theirs)."""

import re
from typing import Callable, Dict

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_psrl.model.adapters import get_adapter, unfuse_experts
from megatron_psrl.model.moe import expert_index

LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")


def rank_reference(actor, ref_grads: Dict[str, torch.Tensor], ep_rank: int,
                   ep_size: int) -> Callable[[str], torch.Tensor]:
    """Parameter name of this rank's model -> the reference tensor (``ref_grads``: HF names,
    fused or per-expert experts)."""
    full = dict(get_adapter(actor.arch).hf_to_mcore(lambda n: unfuse_experts(ref_grads)[n]))
    per_rank = actor.arch.num_experts // ep_size
    # a pipeline stage numbers its layers from 0: its first layer is global layer `offset`
    offset = min(m.layer_number for m in actor.model.modules() if isinstance(m, TransformerLayer)) - 1

    def reference(name):
        parts = expert_index(name)  # this rank's local expert j is global expert ep_rank * E / EP + j
        if parts is not None:
            name = f"{parts[0]}{parts[1] + ep_rank * per_rank}{parts[2]}"
        layer = LAYER.match(name)
        return full[f"{layer.group(1)}{int(layer.group(2)) + offset}{layer.group(3)}" if layer else name]

    return reference


def assert_rank_grads_match(actor, ref_grads: Dict[str, torch.Tensor], ep_rank: int, ep_size: int,
                            rel: float = 1e-5) -> float:
    """After ``actor.forward_backward`` and the gradient reduction: every ``main_grad`` of this
    rank within ``rel`` of the reference's; the worst relative error."""
    reference = rank_reference(actor, ref_grads, ep_rank, ep_size)
    worst = 0.0
    for name, p in actor.model.named_parameters():
        expected = reference(name)
        scale = float(expected.abs().max())
        err = float((p.main_grad - expected).abs().max())
        worst = max(worst, err / (scale + 1e-30))
        assert err <= rel * scale + 1e-9, (name, err, scale)
    return worst
