"""Llama (1, 2, 3.x): the Llama-like dense decoder as it is."""

from __future__ import annotations

from megatron_psrl.model.adapters.base import LlamaStyleAdapter
from megatron_psrl.model.families.base import TINY_BASE, LlamaLikeFamily
from megatron_psrl.model.families.registry import register_family

LLAMA = register_family(LlamaLikeFamily(
    model_type="llama",
    adapter=LlamaStyleAdapter,
    tiny_configs={
        # The default of pretrain_agent_rl.py and the benchmarks (h256 / 4 layers).
        "tiny-llama": dict(TINY_BASE, model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
                           intermediate_size=512, num_hidden_layers=4, head_dim=64),
        # Smallest useful model, for unit tests.
        "debug-llama": dict(TINY_BASE, model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256,
                            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16),
    },
))
