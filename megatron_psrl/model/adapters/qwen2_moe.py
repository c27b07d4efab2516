"""Qwen2-MoE adapter: Qwen2 attention (q/k/v bias unless ``qkv_bias`` is false), every MLP a
router, ``E`` SwiGLU experts and a shared expert gated by a sigmoid.

Hugging Face names (Hub and ``save_pretrained``), below ``model.layers.{l}.mlp.``: the router
``gate.weight`` ``[E, h]``, experts ``experts.{i}.{gate,up,down}_proj.weight``, the shared
expert ``shared_expert.{gate,up,down}_proj.weight`` (width ``S`` =
``shared_expert_intermediate_size``) and its gate ``shared_expert_gate.weight`` ``[1, h]``:
``y = experts(x) + sigmoid(x . gate) * shared_expert(x)``. megatron's MoELayer with a
``SharedExpertMLP`` (``moe_shared_expert_gate``): ``mlp.shared_experts.linear_fc1.weight``
(``[gate; up]``, ``[2S, h]``), ``linear_fc2.weight`` ``[h, S]`` and ``gate_weight`` ``[1, h]``.
"""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch

from megatron_psrl.model.adapters.base import GetTensor, Tensor
from megatron_psrl.model.adapters.experts import RoutedExpertsMixin
from megatron_psrl.model.adapters.qwen import Qwen2Adapter

_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


class Qwen2MoeAdapter(RoutedExpertsMixin, Qwen2Adapter):
    """Qwen2-MoE: Qwen2's layout with routed experts and a gated shared expert in every layer."""

    # ------------------------------------------------------------------ q/k/v bias (optional)
    def hf_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        shapes = super().hf_layer_shapes()
        if not self.arch.qkv_bias:
            shapes = {k: v for k, v in shapes.items() if k not in _BIASES}
        return shapes

    def _attention_extras_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self.arch.qkv_bias:
            yield from super()._attention_extras_to_mcore(get, hf, mc)

    def _attention_extras_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self.arch.qkv_bias:
            yield from super()._attention_extras_to_hf(mcore, hf, mc)

    # ------------------------------------------------------------------ shared expert
    def hf_shared_expert_shapes(self) -> Dict[str, Tuple[int, ...]]:
        h, s = self.arch.hidden_size, self.arch.moe_shared_expert_ffn_hidden_size
        return {"mlp.shared_expert.gate_proj.weight": (s, h), "mlp.shared_expert.up_proj.weight": (s, h),
                "mlp.shared_expert.down_proj.weight": (h, s), "mlp.shared_expert_gate.weight": (1, h)}

    def _shared_expert_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        src, dst = hf + "mlp.shared_expert.", mc + "mlp.shared_experts."
        # [gate; up]: [2S, h]
        yield dst + "linear_fc1.weight", torch.cat([get(src + "gate_proj.weight"), get(src + "up_proj.weight")], 0)
        yield dst + "linear_fc2.weight", get(src + "down_proj.weight")
        yield dst + "gate_weight", get(hf + "mlp.shared_expert_gate.weight")  # [1, h]

    def _shared_expert_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        src, dst = mc + "mlp.shared_experts.", hf + "mlp.shared_expert."
        gate, up = torch.chunk(mcore[src + "linear_fc1.weight"], 2, dim=0)  # 2 x [S, h]
        yield dst + "gate_proj.weight", gate.clone()
        yield dst + "up_proj.weight", up.clone()
        yield dst + "down_proj.weight", mcore[src + "linear_fc2.weight"]
        yield hf + "mlp.shared_expert_gate.weight", mcore[src + "gate_weight"]
