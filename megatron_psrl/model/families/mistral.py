"""Mistral: Llama's layout; a ``sliding_window`` is read (sequences must not exceed it)."""

from __future__ import annotations

from megatron_psrl.model.adapters.base import LlamaStyleAdapter
from megatron_psrl.model.families.base import TINY_BASE, LlamaLikeFamily
from megatron_psrl.model.families.registry import register_family

MISTRAL = register_family(LlamaLikeFamily(
    model_type="mistral",
    adapter=LlamaStyleAdapter,
    tiny_configs={
        "tiny-mistral": dict(TINY_BASE, model_type="mistral", architectures=["MistralForCausalLM"],
                             sliding_window=None),
    },
))
