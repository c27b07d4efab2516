"""Qwen2 / Qwen2.5: Llama's layout with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.model.adapters.qwen import Qwen2Adapter
from megatron_psrl.model.families.base import TINY_BASE, LlamaLikeFamily, refuse_sliding_window
from megatron_psrl.model.families.registry import register_family


class Qwen2Family(LlamaLikeFamily):
    """Qwen2 attention: q/k/v biases always; ``use_sliding_window`` refused."""

    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        refuse_sliding_window(hf)
        return dict(qkv_bias=True, qk_norm=False, sliding_window=None)


QWEN2 = register_family(Qwen2Family(
    model_type="qwen2",
    adapter=Qwen2Adapter,
    tiny_configs={
        "tiny-qwen2": dict(TINY_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    },
    shape_configs={
        # Qwen2.5-1.5B's architecture (its published config.json), randomly initialised: the GPU
        # benchmarks' realistic size (benchmarks/gpu_acceptance.py).
        "qwen2.5-1.5b-shape": dict(TINY_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                   vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                   num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                   head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True,
                                   torch_dtype="bfloat16"),
    },
))
