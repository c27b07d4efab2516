"""DeepSeek-V3 (and Kimi K2) adapter: latent attention's projections and norms
(:class:`LatentAttentionAdapter`), and the MLPs of grouped routing (dense first layers, routed
experts with the router's ``e_score_correction_bias``, an ungated shared expert:
:class:`~megatron_psrl.model.adapters.grouped_routing.GroupedRoutingAdapterMixin`; a config
without MoE layers has Llama's dense MLP in every layer).

Hugging Face names under ``model.layers.{i}.self_attn.`` and megatron's (``MLASelfAttention``,
the local spec) under ``decoder.layers.{i}.self_attention.``, every tensor as it is (the row
layouts agree: per head ``[nope; rope]`` query rows and ``[nope; v]`` key/value rows, the latent
before the RoPE key in ``kv_a_proj_with_mqa``; both sides de-interleave the RoPE pairs the same
way when they rotate, ``rope_interleave``):

=============================  ===========================  ==============================
Hugging Face                   megatron                     shape
=============================  ===========================  ==============================
``q_a_proj``                   ``linear_q_down_proj``       ``[q_lora_rank, h]``
``q_a_layernorm``              ``q_layernorm``              ``[q_lora_rank]``
``q_b_proj``                   ``linear_q_up_proj``         ``[n (nope + rope), q_lora_rank]``
``q_proj`` (no q_lora_rank)    ``linear_q_proj``            ``[n (nope + rope), h]``
``kv_a_proj_with_mqa``         ``linear_kv_down_proj``      ``[kv_lora_rank + rope, h]``
``kv_a_layernorm``             ``kv_layernorm``             ``[kv_lora_rank]``
``kv_b_proj``                  ``linear_kv_up_proj``        ``[n (nope + v), kv_lora_rank]``
``o_proj``                     ``linear_proj``              ``[h, n v]``
=============================  ===========================  ==============================

(Transformer Engine's spec would fuse the two latent norms into the up-projections,
``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``; latent
attention is built with the local spec only, see ``megatron_psrl.model.gpt.build_layer_spec``.)

Multi-token-prediction layers (``num_nextn_predict_layers``: DeepSeek-V3 stores its one as
``model.layers.{num_hidden_layers}.*``) are not part of the megatron model: a conversion carries
their tensors through unchanged (:attr:`LatentAttentionAdapter.hf_passthrough_prefixes`).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

from megatron_psrl.model.adapters.base import GetTensor, LlamaStyleAdapter, Tensor
from megatron_psrl.model.adapters.grouped_routing import GroupedRoutingAdapterMixin

_SA, _MA = "self_attn.", "self_attention."


class LatentAttentionAdapter(LlamaStyleAdapter):
    """Latent attention (the names above); each layer's MLP through :meth:`_layer_mlp_to_mcore`
    / :meth:`_layer_mlp_to_hf` (Llama's dense SwiGLU here)."""

    reads_rank_slices = False  # the down-projections' rows are split by megatron's column layout: cut from the whole

    @property
    def hf_passthrough_prefixes(self) -> Tuple[str, ...]:  # type: ignore[override]
        """The multi-token-prediction layers' tensors (``model.layers.{L}.`` .. for every one of
        ``num_nextn_predict_layers``), carried through unchanged."""
        first = self.arch.num_layers
        return tuple(f"model.layers.{first + i}." for i in range(self.arch.mtp_layers))

    def _pairs(self) -> List[Tuple[str, str]]:
        """``(Hugging Face, megatron)`` name suffixes of one layer's attention tensors."""
        q = ([("q_proj.weight", "linear_q_proj.weight")] if self.arch.q_lora_rank is None else
             [("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_a_layernorm.weight", "q_layernorm.weight"),
              ("q_b_proj.weight", "linear_q_up_proj.weight")])
        return q + [("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
                    ("kv_a_layernorm.weight", "kv_layernorm.weight"),
                    ("kv_b_proj.weight", "linear_kv_up_proj.weight"), ("o_proj.weight", "linear_proj.weight")]

    def hf_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        a = self.arch
        h, n, hd, r = a.hidden_size, a.num_attention_heads, a.head_dim, a.kv_lora_rank
        q = ({"q_proj.weight": (n * hd, h)} if a.q_lora_rank is None else
             {"q_a_proj.weight": (a.q_lora_rank, h), "q_a_layernorm.weight": (a.q_lora_rank,),
              "q_b_proj.weight": (n * hd, a.q_lora_rank)})
        attention = {**q, "kv_a_proj_with_mqa.weight": (r + a.qk_rope_head_dim, h), "kv_a_layernorm.weight": (r,),
                     "kv_b_proj.weight": (n * (a.qk_nope_head_dim + a.v_head_dim), r),
                     "o_proj.weight": (h, n * a.v_head_dim)}
        return {"input_layernorm.weight": (h,), **{_SA + k: s for k, s in attention.items()},
                "post_attention_layernorm.weight": (h,), **self.hf_mlp_shapes()}

    def _attention_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        for hf_name, mc_name in self._pairs():
            yield mc + _MA + mc_name, get(hf + _SA + hf_name)

    def _attention_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        for hf_name, mc_name in self._pairs():
            yield hf + _SA + hf_name, mcore[mc + _MA + mc_name]


class DeepseekV3Adapter(GroupedRoutingAdapterMixin, LatentAttentionAdapter):
    """Latent attention with grouped routing's MLPs; every layer dense in a config without MoE
    layers (``ModelArchitecture.num_experts`` None)."""

    def _dense(self, layer: int) -> bool:
        return not self.arch.is_moe or super()._dense(layer)

    def hf_mlp_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return super().hf_mlp_shapes() if self.arch.is_moe else LlamaStyleAdapter.hf_mlp_shapes(self)

    def mcore_to_hf(self, mcore: Dict[str, Tensor]) -> Iterator[Tuple[str, Tensor]]:
        if self.arch.is_moe:  # (routed experts in any of megatron's layouts)
            return super().mcore_to_hf(mcore)
        return LatentAttentionAdapter.mcore_to_hf(self, mcore)


__all__ = ["DeepseekV3Adapter", "LatentAttentionAdapter"]
