"""Qwen2/Qwen2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) adapters."""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

from megatron_psrl.model.adapters.base import GetTensor, LlamaStyleAdapter, Tensor


class Qwen2Adapter(LlamaStyleAdapter):
    """Qwen2 / Qwen2.5: Llama layout plus biases on the q, k and v projections."""

    def hf_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        q, kv = self.arch.num_attention_heads * self.arch.head_dim, self.arch.num_kv_heads * self.arch.head_dim
        return {**super().hf_layer_shapes(), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,)}

    def _attention_extras_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        p = hf + "self_attn."
        yield mc + "self_attention.linear_qkv.bias", self._interleave_qkv(
            get(p + "q_proj.bias"), get(p + "k_proj.bias"), get(p + "v_proj.bias")
        )

    def _attention_extras_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        q, k, v = self._split_qkv(mcore[mc + "self_attention.linear_qkv.bias"])
        yield hf + "self_attn.q_proj.bias", q
        yield hf + "self_attn.k_proj.bias", k
        yield hf + "self_attn.v_proj.bias", v


class Qwen3Adapter(LlamaStyleAdapter):
    """Qwen3: Llama layout plus RMSNorm over each query and key head (before RoPE)."""

    def hf_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        hd = self.arch.head_dim
        return {**super().hf_layer_shapes(), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}

    def _attention_extras_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield mc + "self_attention.q_layernorm.weight", get(hf + "self_attn.q_norm.weight")
        yield mc + "self_attention.k_layernorm.weight", get(hf + "self_attn.k_norm.weight")

    def _attention_extras_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield hf + "self_attn.q_norm.weight", mcore[mc + "self_attention.q_layernorm.weight"]
        yield hf + "self_attn.k_norm.weight", mcore[mc + "self_attention.k_layernorm.weight"]
