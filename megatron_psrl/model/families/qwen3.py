"""Qwen3: Llama's layout with an RMSNorm over each query and key head (before RoPE)."""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.adapters.qwen import Qwen3Adapter
from megatron_psrl.model.families.base import TINY_BASE, LlamaLikeFamily, refuse_sliding_window
from megatron_psrl.model.families.registry import register_family


class Qwen3Family(LlamaLikeFamily):
    """Qwen3 attention: per-head q/k RMSNorm; ``attention_bias`` and ``use_sliding_window`` refused."""

    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if hf.get("attention_bias"):
            raise UnsupportedModelError("attention_bias on Qwen3 models is not supported")
        refuse_sliding_window(hf)
        return dict(qkv_bias=False, qk_norm=True, sliding_window=None)


QWEN3 = register_family(Qwen3Family(
    model_type="qwen3",
    adapter=Qwen3Adapter,
    tiny_configs={
        "tiny-qwen3": dict(TINY_BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=48),
    },
))
