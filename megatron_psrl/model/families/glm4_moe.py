"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``): GQA attention with q/k/v biases
(``attention_bias``), partial RoPE (``partial_rotary_factor``, 0.5), optional per-head q/k
RMSNorms (``use_qk_norm``), and DeepSeek-V3's mixture of experts
(:mod:`.grouped_routing`): dense first layers, a grouped sigmoid router with an expert bias,
one ungated shared expert. Its multi-token-prediction layer (``num_nextn_predict_layers``,
stored as layer ``num_hidden_layers``) is carried through conversions, not trained."""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.adapters.glm4_moe import Glm4MoeAdapter
from megatron_psrl.model.families.base import TINY_BASE
from megatron_psrl.model.families.grouped_routing import GroupedRoutingMixin
from megatron_psrl.model.families.moe import MoEFamily
from megatron_psrl.model.families.registry import register_family

HF_DEFAULTS: Dict[str, Any] = dict(partial_rotary_factor=0.5, rms_norm_eps=1e-5)
"""transformers' ``Glm4MoeConfig`` defaults that differ from the generic reader's (partial
RoPE; the norms' epsilon), applied where config.json leaves the field out."""


class Glm4MoeFamily(GroupedRoutingMixin, MoEFamily):
    """GLM-4.5's attention with the grouped-routing MoE."""

    # transformers' Glm4MoeConfig defaults
    hf_mlp_defaults = dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                           n_shared_experts=1, first_k_dense_replace=1)

    def hf_text_config(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        """config.json with transformers' defaults (:data:`HF_DEFAULTS`) where it has none."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        out = dict(hf)
        for key, value in HF_DEFAULTS.items():
            if out.get(key) is None and not (key == "partial_rotary_factor" and rope.get(key) is not None):
                out[key] = value
        return out

    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias on GLM-4.5 models is not supported")
        return dict(qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=bool(hf.get("use_qk_norm", False)),
                    sliding_window=None)


GLM4_MOE = register_family(Glm4MoeFamily(
    model_type="glm4_moe",
    adapter=Glm4MoeAdapter,
    tiny_configs={
        # 3 layers: a dense one, then two of 8 experts in 2 groups (top-2 from the best group, the
        # expert bias used for selection, weights scaled by 2.5) plus a shared expert; q/k/v
        # biases, half the head dimension rotated (GLM-4.5's pattern at toy size)
        "debug-glm4-moe": dict(TINY_BASE, model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
                               vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                               n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                               routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=False,
                               partial_rotary_factor=0.5, rms_norm_eps=1e-5, num_nextn_predict_layers=0),
    },
    shape_configs={
        # GLM-4.5-Air (its published config.json; 106B total, 12B active): 46 layers, the first
        # dense; 128 experts top-8 plus a shared one; its MTP layer (layer 46) is not built
        "glm-4.5-air-class": dict(
            TINY_BASE, model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552,
            hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
            num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
            num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False,
            partial_rotary_factor=0.5, rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
            num_nextn_predict_layers=1, torch_dtype="bfloat16"),
    },
))
