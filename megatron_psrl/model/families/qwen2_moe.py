"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention, routed experts plus a shared expert
gated by ``sigmoid(mlp.shared_expert_gate(x))`` in every layer."""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.model.adapters.qwen2_moe import Qwen2MoeAdapter
from megatron_psrl.model.families.base import TINY_BASE, NumberReader, refuse_sliding_window
from megatron_psrl.model.families.moe import MoEFamily, num_experts, refuse_dense_layers
from megatron_psrl.model.families.qwen2 import Qwen2Family
from megatron_psrl.model.families.registry import register_family


class Qwen2MoeFamily(MoEFamily, Qwen2Family):
    """Qwen2 attention (its q/k/v bias can be switched off) with routed and shared experts."""

    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        refuse_sliding_window(hf)
        return dict(qkv_bias=bool(hf.get("qkv_bias", True)), qk_norm=False, sliding_window=None)

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        """Routed experts and a shared expert of width ``shared_expert_intermediate_size``;
        ``norm_topk_prob`` defaults to false (transformers' default, and the published models')."""
        refuse_dense_layers(hf, number, "Qwen2-MoE")
        return dict(
            num_experts=num_experts(hf, "num_experts"),
            moe_ffn_hidden_size=number("moe_intermediate_size"),
            moe_router_topk=number("num_experts_per_tok"),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_shared_expert_ffn_hidden_size=number("shared_expert_intermediate_size"),
            moe_shared_expert_gate=True,
        )


QWEN2_MOE = register_family(Qwen2MoeFamily(
    model_type="qwen2_moe",
    adapter=Qwen2MoeAdapter,
    tiny_configs={
        # q/k/v bias, 8 routed experts top-2 without renormalisation (norm_topk_prob false, as
        # the published models), a shared expert of width 48 gated by sigmoid(mlp.shared_expert_gate(x)).
        "debug-qwen2-moe": dict(TINY_BASE, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
                                use_sliding_window=False, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, router_aux_loss_coef=0.0),
    },
))
