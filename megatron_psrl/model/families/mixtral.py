"""Mixtral: Mistral attention, every layer ``num_local_experts`` SwiGLU experts of width
``intermediate_size``, top k of the softmax renormalised (always)."""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.adapters.mixtral import MixtralAdapter
from megatron_psrl.model.families.base import TINY_BASE, NumberReader
from megatron_psrl.model.families.moe import MoEFamily, num_experts
from megatron_psrl.model.families.registry import register_family


class MixtralFamily(MoEFamily):
    """Mistral's attention (the Llama-like parsing) with an MoE MLP in every layer."""

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        jitter = number("router_jitter_noise", float, 0.0)
        if jitter:
            raise UnsupportedModelError(f"router_jitter_noise {jitter} is not supported (random training-time "
                                        "scaling of the MoE input)")
        return dict(
            num_experts=num_experts(hf, "num_local_experts"),
            moe_ffn_hidden_size=number("intermediate_size"),
            moe_router_topk=number("num_experts_per_tok"),
            moe_norm_topk_prob=True,
        )


MIXTRAL = register_family(MixtralFamily(
    model_type="mixtral",
    adapter=MixtralAdapter,
    tiny_configs={
        # Mistral attention, 8 experts of width intermediate_size, top-2 of the softmax
        # renormalised, no sliding window (as Mixtral-8x7B).
        "debug-mixtral": dict(TINY_BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=256,
                              hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                              sliding_window=None, router_jitter_noise=0.0, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, router_aux_loss_coef=0.0),
    },
))
