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

import re
from typing import Dict, Iterator, Tuple

import torch

from megatron_psrl.model.adapters.base import GetTensor, Tensor
from megatron_psrl.model.adapters.qwen import Qwen3Adapter

_FUSED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3-MoE: Qwen3's layout with a mixture-of-experts MLP in every layer."""

    model_types = ("qwen3_moe",)

    def hf_mlp_shapes(self) -> Dict[str, Tuple[int, ...]]:
        a = self.arch
        h, f = a.hidden_size, a.moe_ffn_hidden_size
        shapes = {"mlp.gate.weight": (a.num_experts, h)}
        for i in range(a.num_experts):
            p = f"mlp.experts.{i}."
            shapes.update({p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h), p + "down_proj.weight": (h, f)})
        return shapes

    def _mlp_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield mc + "mlp.router.weight", get(hf + "mlp.gate.weight")
        for i in range(self.arch.num_experts):
            src, dst = f"{hf}mlp.experts.{i}.", f"{mc}mlp.experts.local_experts.{i}."
            yield dst + "linear_fc1.weight", torch.cat([get(src + "gate_proj.weight"), get(src + "up_proj.weight")], 0)
            yield dst + "linear_fc2.weight", get(src + "down_proj.weight")

    def _mlp_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield hf + "mlp.gate.weight", mcore[mc + "mlp.router.weight"]
        for i in range(self.arch.num_experts):
            src, dst = f"{mc}mlp.experts.local_experts.{i}.", f"{hf}mlp.experts.{i}."
            gate, up = torch.chunk(mcore[src + "linear_fc1.weight"], 2, dim=0)
            yield dst + "gate_proj.weight", gate.clone()
            yield dst + "up_proj.weight", up.clone()
            yield dst + "down_proj.weight", mcore[src + "linear_fc2.weight"]


def unfuse_experts(state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """A state dict with transformers' in-memory fused experts (``mlp.experts.gate_up_proj``
    ``[E, 2I, h]``, ``mlp.experts.down_proj`` ``[E, h, I]``) named per expert as checkpoints
    are (``mlp.experts.{i}.{gate,up,down}_proj.weight``); other tensors unchanged. Views, no copy."""
    out: Dict[str, Tensor] = {}
    for name, tensor in state.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = tensor
            continue
        prefix = m.group(1)
        for i in range(tensor.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{prefix}{i}.down_proj.weight"] = tensor[i]
            else:
                gate, up = torch.chunk(tensor[i], 2, dim=0)
                out[f"{prefix}{i}.gate_proj.weight"] = gate
                out[f"{prefix}{i}.up_proj.weight"] = up
    return out
