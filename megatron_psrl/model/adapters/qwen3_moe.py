"""Qwen3-MoE adapter: Qwen3 attention, every MLP a router and ``E`` SwiGLU experts.

Hugging Face names (as on the Hub, and as ``save_pretrained`` writes them): the router
``mlp.gate.weight`` ``[E, h]`` and every expert on its own,
``mlp.experts.{i}.{gate,up,down}_proj.weight``. megatron's MoELayer: ``mlp.router.weight`` and
``mlp.experts.local_experts.{i}.linear_fc1.weight`` (``[gate; up]``) / ``linear_fc2.weight``,
``i`` the global expert index in a full state dict (expert parallelism renumbers them per rank,
``megatron_psrl.model.moe.local_experts``).

transformers >= 5 keeps the experts fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, h]``,
``mlp.experts.down_proj`` ``[E, h, I]``); :func:`unfuse_experts` names such a state dict (a
model's ``state_dict()`` or its gradients) as the checkpoint does.
"""

from __future__ import annotations

from megatron_psrl.model.adapters.experts import RoutedExpertsMixin, unfuse_experts
from megatron_psrl.model.adapters.qwen import Qwen3Adapter


class Qwen3MoeAdapter(RoutedExpertsMixin, Qwen3Adapter):
    """Qwen3-MoE: Qwen3's layout with a mixture-of-experts MLP in every layer."""


__all__ = ["Qwen3MoeAdapter", "unfuse_experts"]
