"""Qwen3-MoE: Qwen3 attention, every layer a top-k mixture of SwiGLU experts, no shared expert."""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.adapters.qwen3_moe import Qwen3MoeAdapter
from megatron_psrl.model.families.base import TINY_BASE, NumberReader
from megatron_psrl.model.families.moe import MoEFamily, num_experts, refuse_dense_layers
from megatron_psrl.model.families.qwen3 import Qwen3Family
from megatron_psrl.model.families.registry import register_family


class Qwen3MoeFamily(MoEFamily, Qwen3Family):
    """Qwen3 attention with an MoE MLP in every layer."""

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        refuse_dense_layers(hf, number, "Qwen3-MoE")
        if hf.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError("shared experts (shared_expert_intermediate_size) are not supported "
                                        "for Qwen3-MoE")
        return dict(
            num_experts=num_experts(hf, "num_experts"),  # transformers >= 5 saves it as num_local_experts
            moe_ffn_hidden_size=number("moe_intermediate_size"),
            moe_router_topk=number("num_experts_per_tok"),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )


QWEN3_MOE = register_family(Qwen3MoeFamily(
    model_type="qwen3_moe",
    adapter=Qwen3MoeAdapter,
    tiny_configs={
        # 2 layers of 8 experts, top-2, renormalised routing weights (norm_topk_prob, as the
        # published Qwen3-MoE models).
        "debug-qwen3-moe": dict(TINY_BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                router_aux_loss_coef=0.0),
    },
    shape_configs={
        # Qwen3-30B-A3B's architecture (its published config.json; 131,072 positions for the
        # 128k-token workloads), randomly initialised: the memory arithmetic's MoE shape
        # (benchmarks/memory_gpu_arithmetic.py).
        "qwen3-30b-a3b-class": dict(TINY_BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                                    vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                    head_dim=128, rope_theta=1000000.0, max_position_embeddings=131072,
                                    tie_word_embeddings=False, router_aux_loss_coef=0.001,
                                    torch_dtype="bfloat16"),
    },
))
