"""Qwen3-Next (``Qwen3NextForCausalLM``): the hybrid decoder of :mod:`.hybrid` with a top-k
mixture of SwiGLU experts and a sigmoid-gated shared expert in every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from megatron_psrl.model.adapters.hybrid import Qwen3NextAdapter
from megatron_psrl.model.families.base import TINY_BASE, LayerSpecChoices, NumberReader
from megatron_psrl.model.families.hybrid import HybridFamily
from megatron_psrl.model.families.moe import MoEFamily, num_experts, refuse_dense_layers
from megatron_psrl.model.families.registry import register_family

if TYPE_CHECKING:
    from megatron_psrl.model.architecture import ModelArchitecture


ALWAYS_RENORMALISED = ("qwen3_5_moe_text", "qwen3_5_moe")
"""Model types whose router renormalises the top-k weights whatever the config says
(transformers' Qwen3.5-MoE router has no ``norm_topk_prob``; Qwen3-Next's reads it)."""


class HybridMoeFamily(MoEFamily, HybridFamily):
    """Gated softmax attention and Gated DeltaNet layers, routed experts and a gated shared
    expert in every layer (Qwen3-Next, Qwen3.5-MoE)."""

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        refuse_dense_layers(hf, number, self.model_type)
        renormalised = self.model_type in ALWAYS_RENORMALISED or bool(hf.get("norm_topk_prob", True))
        return dict(
            num_experts=num_experts(hf, "num_experts"),
            moe_ffn_hidden_size=number("moe_intermediate_size"),
            moe_router_topk=number("num_experts_per_tok"),
            moe_norm_topk_prob=renormalised,
            moe_shared_expert_ffn_hidden_size=number("shared_expert_intermediate_size"),
            moe_shared_expert_gate=True,
        )

    def layer_spec_choices(self, arch: "ModelArchitecture") -> LayerSpecChoices:
        return HybridFamily.layer_spec_choices(self, arch)  # its experts, and the linear layers and norms


HYBRID_TINY: Dict[str, Any] = dict(
    TINY_BASE, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
"""4 layers: 3 linear, then 1 softmax (transformers' default pattern); 2 key heads of 8 under 4
value heads of 8 in the linear layers."""

HYBRID_MOE_TINY: Dict[str, Any] = dict(
    HYBRID_TINY, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, router_aux_loss_coef=0.0,
)

QWEN3_NEXT = register_family(HybridMoeFamily(
    model_type="qwen3_next",
    adapter=Qwen3NextAdapter,
    tiny_configs={
        "debug-qwen3-next": dict(HYBRID_MOE_TINY, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                                 decoder_sparse_step=1, mlp_only_layers=[]),
    },
    shape_configs={
        # Qwen3-Next-80B-A3B (its config.json, without its multi-token-prediction layer)
        "qwen3-next-80b-a3b": dict(
            TINY_BASE, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936,
            hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, rope_theta=10000000.0,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, full_attention_interval=4, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=262144, torch_dtype="bfloat16",
            router_aux_loss_coef=0.0),
    },
))
