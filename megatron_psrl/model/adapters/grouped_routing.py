"""The MLPs of a DeepSeek-V3-style model (GLM-4.5, DeepSeek-V3, Kimi K2): dense SwiGLU MLPs in
the first ``first_k_dense_replace`` layers, then routed experts with an expert-bias router and
ungated shared experts (:mod:`megatron_psrl.model.families.grouped_routing`).

Hugging Face names (Hub and ``save_pretrained``), below ``model.layers.{l}.``:

| Hugging Face | megatron-core |
|---|---|
| dense layer: ``mlp.gate_proj`` / ``up_proj`` / ``down_proj`` | ``mlp.linear_fc1`` (``[gate; up]``) / ``mlp.linear_fc2`` |
| ``mlp.gate.weight`` ``[E, h]`` | ``mlp.router.weight`` |
| ``mlp.gate.e_score_correction_bias`` ``[E]`` (fp32 in transformers; a folder's other dtype: kept by an export) | ``mlp.router.expert_bias`` (fp32 buffer) |
| ``mlp.experts.{i}.gate_proj`` / ``up_proj`` / ``down_proj`` | ``mlp.experts.local_experts.{i}.linear_fc1`` / ``linear_fc2`` |
| ``mlp.shared_experts.gate_proj`` / ``up_proj`` / ``down_proj`` (width ``n_shared * f``) | ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` |

transformers >= 5 keeps the routed experts fused in memory (``mlp.experts.gate_up_proj`` /
``down_proj``, :func:`~megatron_psrl.model.adapters.experts.unfuse_experts`).

Multi-token-prediction layers (``num_nextn_predict_layers``) are stored as further decoder
layers, ``model.layers.{num_hidden_layers + j}.``; transformers does not build them, nor does
megatron_psrl: a conversion carries their tensors through unchanged
(:attr:`GroupedRoutingAdapterMixin.hf_passthrough_prefixes`,
:mod:`megatron_psrl.checkpoint.passthrough`).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch

from megatron_psrl.model.adapters.base import GetTensor, LlamaStyleAdapter, Tensor
from megatron_psrl.model.adapters.experts import RoutedExpertsMixin

SHARED = "mlp.shared_experts."
"""The shared experts' names below a layer (Hugging Face and megatron alike)."""


class GroupedRoutingAdapterMixin(RoutedExpertsMixin):
    """Dense first layers, the router's expert bias and the ungated shared experts; listed
    before the family's attention adapter in the bases."""

    @property
    def hf_passthrough_prefixes(self) -> Tuple[str, ...]:  # type: ignore[override]
        """The multi-token-prediction layers (``model.layers.{L + j}.``), carried through."""
        a = self.arch
        return tuple(f"model.layers.{a.num_layers + j}." for j in range(a.mtp_layers))

    def _dense(self, layer: int) -> bool:
        return layer in self.arch.dense_mlp_layers

    # ------------------------------------------------------------------ names and shapes
    def hf_layer_shapes_of(self, layer: int) -> Dict[str, Tuple[int, ...]]:
        shapes = self.hf_layer_shapes()  # (the MoE MLP's)
        if not self._dense(layer):
            return shapes
        shapes = {k: v for k, v in shapes.items() if not k.startswith(self.hf_moe_block)}
        return {**shapes, **LlamaStyleAdapter.hf_mlp_shapes(self)}

    def hf_mlp_shapes(self) -> Dict[str, Tuple[int, ...]]:
        shapes = super().hf_mlp_shapes()
        if self.arch.moe_router_expert_bias:
            shapes["mlp.gate.e_score_correction_bias"] = (self.arch.num_experts,)
        return shapes

    def hf_fp32_names(self) -> List[str]:
        """Every MoE layer's ``e_score_correction_bias``: megatron's ``expert_bias`` is an fp32
        buffer in a model of any dtype (``TopKRouter._maintain_float32_expert_bias``)."""
        if not (self.arch.is_moe and self.arch.moe_router_expert_bias):
            return []
        return [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(self.arch.num_layers)
                if not self._dense(i)]

    def hf_shared_expert_shapes(self) -> Dict[str, Tuple[int, ...]]:
        h, s = self.arch.hidden_size, self.arch.moe_shared_expert_ffn_hidden_size
        if not s:
            return {}
        return {SHARED + "gate_proj.weight": (s, h), SHARED + "up_proj.weight": (s, h),
                SHARED + "down_proj.weight": (h, s)}

    # ------------------------------------------------------------------ conversion
    def _layer_mlp_to_mcore(self, layer: int, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self._dense(layer):
            return LlamaStyleAdapter._mlp_to_mcore(self, get, hf, mc)
        return self._mlp_to_mcore(get, hf, mc)

    def _layer_mlp_to_hf(self, layer: int, mcore: Dict[str, Tensor], hf: str,
                         mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self._dense(layer):
            return LlamaStyleAdapter._mlp_to_hf(self, mcore, hf, mc)
        return self._mlp_to_hf(mcore, hf, mc)

    def _mlp_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield from super()._mlp_to_mcore(get, hf, mc)
        if self.arch.moe_router_expert_bias:
            yield mc + "mlp.router.expert_bias", get(hf + "mlp.gate.e_score_correction_bias")

    def _mlp_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield from super()._mlp_to_hf(mcore, hf, mc)
        if self.arch.moe_router_expert_bias:
            yield hf + "mlp.gate.e_score_correction_bias", mcore[mc + "mlp.router.expert_bias"]

    def _shared_expert_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self.arch.moe_shared_expert_ffn_hidden_size:
            src, dst = hf + SHARED, mc + SHARED
            # [gate; up]: [2S, h]
            yield dst + "linear_fc1.weight", torch.cat([get(src + "gate_proj.weight"), get(src + "up_proj.weight")], 0)
            yield dst + "linear_fc2.weight", get(src + "down_proj.weight")

    def _shared_expert_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        if self.arch.moe_shared_expert_ffn_hidden_size:
            src, dst = mc + SHARED, hf + SHARED
            gate, up = torch.chunk(mcore[src + "linear_fc1.weight"], 2, dim=0)  # 2 x [S, h]
            yield dst + "gate_proj.weight", gate.clone()
            yield dst + "up_proj.weight", up.clone()
            yield dst + "down_proj.weight", mcore[src + "linear_fc2.weight"]


__all__ = ["GroupedRoutingAdapterMixin"]
