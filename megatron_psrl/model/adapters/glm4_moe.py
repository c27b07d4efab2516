"""GLM-4.5 / GLM-4.5-Air adapter (``Glm4MoeForCausalLM``): GQA attention with q/k/v biases
(``attention_bias``) and, with ``use_qk_norm``, per-head q/k RMSNorms (Qwen3's names and
layout); the MLPs of :mod:`.grouped_routing` (dense first layers, routed experts with the
router's expert bias, an ungated shared expert)."""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

from megatron_psrl.model.adapters.base import GetTensor, Tensor
from megatron_psrl.model.adapters.grouped_routing import GroupedRoutingAdapterMixin
from megatron_psrl.model.adapters.qwen import Qwen2Adapter, Qwen3Adapter

_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


class Glm4MoeAdapter(GroupedRoutingAdapterMixin, Qwen2Adapter):
    """q/k/v biases when ``attention_bias``, q/k norms when ``use_qk_norm``."""

    def hf_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        shapes = super().hf_layer_shapes()
        if not self.arch.qkv_bias:
            shapes = {k: v for k, v in shapes.items() if k not in _BIASES}
        if self.arch.qk_norm:
            shapes.update({name: (self.arch.head_dim,) for name in _QK_NORMS})
        return shapes

    def _attention_extras_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self.arch.qkv_bias:
            yield from Qwen2Adapter._attention_extras_to_mcore(self, get, hf, mc)
        if self.arch.qk_norm:
            yield from Qwen3Adapter._attention_extras_to_mcore(self, get, hf, mc)

    def _attention_extras_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self.arch.qkv_bias:
            yield from Qwen2Adapter._attention_extras_to_hf(self, mcore, hf, mc)
        if self.arch.qk_norm:
            yield from Qwen3Adapter._attention_extras_to_hf(self, mcore, hf, mc)


__all__ = ["Glm4MoeAdapter"]
