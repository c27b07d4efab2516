"""Qwen3.5: the hybrid decoder of :mod:`.hybrid`, dense (``qwen3_5_text``,
``Qwen3_5ForCausalLM``) or with Qwen3-Next's experts (``qwen3_5_moe_text``,
``Qwen3_5MoeForCausalLM``), and their multimodal wrappers (``qwen3_5`` /
``qwen3_5_moe``, ``...ForConditionalGeneration``): the language model's config under
``text_config`` and its weights under ``model.language_model.``; the vision tower
(``vision_config``, ``model.visual.``) is not trained and is carried through conversions
unchanged. Multimodal samples are not supported: text positions only (Qwen3.5's three RoPE
position ids are then equal, plain RoPE)."""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.model.adapters.hybrid import (
    Qwen3_5Adapter,
    Qwen3_5MoeAdapter,
    Qwen3_5MoeWrapperAdapter,
    Qwen3_5WrapperAdapter,
)
from megatron_psrl.model.families.hybrid import HybridFamily, hf_text_part
from megatron_psrl.model.families.qwen3_next import HYBRID_MOE_TINY, HYBRID_TINY, HybridMoeFamily
from megatron_psrl.model.families.registry import register_family


class WrapperMixin:
    """A multimodal wrapper: the language model is read from ``text_config``; the top-level
    ``tie_word_embeddings`` decides the output layer (as transformers' wrapper)."""

    def hf_text_config(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        return hf_text_part(hf)

    def hf_tie_word_embeddings(self, hf: Dict[str, Any]) -> bool:
        if "tie_word_embeddings" in hf:
            return bool(hf["tie_word_embeddings"])
        return bool(hf_text_part(hf).get("tie_word_embeddings", False))


class Qwen3_5WrapperFamily(WrapperMixin, HybridFamily):
    """Qwen3.5 (dense) multimodal wrapper."""


class Qwen3_5MoeWrapperFamily(WrapperMixin, HybridMoeFamily):
    """Qwen3.5-MoE multimodal wrapper."""


_VISION_TINY = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                    num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
_TEXT = dict(HYBRID_TINY, model_type="qwen3_5_text")
_MOE_TEXT = dict(HYBRID_MOE_TINY, model_type="qwen3_5_moe_text")

QWEN3_5_TEXT = register_family(HybridFamily(
    model_type="qwen3_5_text",
    adapter=Qwen3_5Adapter,
    tiny_configs={"debug-qwen3.5-text": dict(_TEXT, architectures=["Qwen3_5ForCausalLM"])},
))

QWEN3_5 = register_family(Qwen3_5WrapperFamily(
    model_type="qwen3_5",
    adapter=Qwen3_5WrapperAdapter,
    tiny_configs={
        "debug-qwen3.5": dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"],
                              text_config=_TEXT, vision_config=dict(_VISION_TINY, model_type="qwen3_5_vision"),
                              tie_word_embeddings=False, torch_dtype="float32"),
    },
))

QWEN3_5_MOE_TEXT = register_family(HybridMoeFamily(
    model_type="qwen3_5_moe_text",
    adapter=Qwen3_5MoeAdapter,
    tiny_configs={"debug-qwen3.5-moe-text": dict(_MOE_TEXT, architectures=["Qwen3_5MoeForCausalLM"])},
))

QWEN3_5_MOE = register_family(Qwen3_5MoeWrapperFamily(
    model_type="qwen3_5_moe",
    adapter=Qwen3_5MoeWrapperAdapter,
    tiny_configs={
        "debug-qwen3.5-moe": dict(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"],
                                  text_config=_MOE_TEXT,
                                  vision_config=dict(_VISION_TINY, model_type="qwen3_5_moe_vision"),
                                  tie_word_embeddings=False, torch_dtype="float32"),
    },
))
