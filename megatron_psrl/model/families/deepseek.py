"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) and Kimi K2 (``kimi_k2``, the same architecture):
multi-head latent attention (MLA), dense SwiGLU first layers, then DeepSeek-V3's mixture of
experts.

Latent attention (:class:`LatentAttentionFamily`; megatron's ``MLASelfAttention`` as the
project's :class:`~megatron_psrl.model.latent_attention.TreeMLASelfAttention`): per token a K/V
latent of ``kv_lora_rank`` numbers (RMS-normalised, ``kv_a_layernorm``) is projected up to every
head's key without RoPE (``qk_nope_head_dim``) and its value (``v_head_dim``); one RoPE key of
``qk_rope_head_dim`` numbers, projected beside the latent, is shared by all heads; the query is
projected through a ``q_lora_rank`` latent with its own RMSNorm (or directly when
``q_lora_rank`` is null). A head's query and key are ``nope + rope`` wide (``head_dim``), its
value ``v_head_dim``. RoPE rotates DeepSeek's interleaved pairs (``rope_interleave``, the only
layout megatron's MLA has); YaRN scales cos and sin by its attention factor and the softmax scale
by DeepSeek's correction ``(0.1 mscale_all_dim ln(factor) + 1)^2``
(:meth:`~megatron_psrl.model.architecture.ModelArchitecture.softmax_scale`).

The MLP (:class:`DeepseekV3Family`): the first ``first_k_dense_replace`` layers' dense SwiGLU
(``intermediate_size``, Llama's), then MoE layers of grouped sigmoid routing
(:mod:`.grouped_routing`, GLM-4.5's: expert groups, the expert bias ``e_score_correction_bias``
for selection only, ``routed_scaling_factor``, ungated shared experts), with transformers'
``DeepseekV3Config`` defaults of the optional fields. A config without MoE layers
(``first_k_dense_replace >= num_hidden_layers``) is a dense model of the family
(:attr:`~.base.ModelFamily.moe_layers_optional`). :class:`LatentAttentionFamily` holds the
attention's share of every method (parsing, megatron config, layer spec, prefix state, saved
bytes, parameters, FLOPs) and reaches the MLP through the hooks an MoE MLP overrides
(``hf_mlp_fields``, ``moe_config_fields``, ``layer_spec_choices`` through ``super()``,
``mlp_saved_bytes_per_token``, ``mlp_parameters``, ``active_mlp_parameters``): the routed MLP is
composed with it as ``class DeepseekV3Family(GroupedRoutingMixin, LatentAttentionFamily,
MoEFamily)``, its saved bytes corrected for the dense layers
(:meth:`~.moe.MoEFamily.dense_layers_saved_bytes_difference`) and its FLOPs averaged over them.

Multi-token-prediction layers (``num_nextn_predict_layers``, a draft head; DeepSeek-V3 has one,
stored as layer ``num_hidden_layers``) are not built or trained: their tensors are carried
through conversions unchanged (one logged line when a checkpoint has them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Dict, Mapping, Tuple

import torch

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.adapters.deepseek import DeepseekV3Adapter
from megatron_psrl.model.families.base import FP32_BYTES, TINY_BASE, LayerSpecChoices, LlamaLikeFamily, NumberReader
from megatron_psrl.model.families.grouped_routing import GroupedRoutingMixin
from megatron_psrl.model.families.moe import MoEFamily
from megatron_psrl.model.families.registry import register_family

if TYPE_CHECKING:
    from megatron_psrl.kvcache.prefix_state import PrefixState
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.schedule.cost import ModelDims

logger = logging.getLogger(__name__)
_MTP_LOGGED: set = set()

HF_DEFAULT_FIRST_K_DENSE = 3
HF_DEFAULT_ROUTED_EXPERTS = 256
"""transformers' ``DeepseekV3Config`` defaults of ``first_k_dense_replace`` / ``n_routed_experts``
(read when a config omits them, as transformers does)."""


class LatentAttentionFamily(LlamaLikeFamily):
    """Multi-head latent attention (MLA) and a dense SwiGLU MLP (see the module docstring)."""

    # ------------------------------------------------------------------ Hugging Face config
    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if hf.get("attention_bias"):
            raise UnsupportedModelError(f"field 'attention_bias': biases on {self.model_type} attention projections "
                                        "are not supported")
        if hf.get("rope_interleave") is False:
            raise UnsupportedModelError("field 'rope_interleave': false is not supported (megatron's latent attention "
                                        "rotates DeepSeek's interleaved pairs only)")
        heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise UnsupportedModelError(f"field 'num_key_value_heads' {kv_heads} != num_attention_heads {heads}: "
                                        "latent attention has a key and a value for every query head")
        rotary = (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get("partial_rotary_factor",
                                                                                 hf.get("partial_rotary_factor"))
        if rotary not in (None, 1, 1.0):
            raise UnsupportedModelError(f"field 'partial_rotary_factor' {rotary}: latent attention rotates the whole "
                                        "qk_rope_head_dim")
        return dict(qkv_bias=False, qk_norm=False, sliding_window=None)

    def hf_head_dim(self, hf: Dict[str, Any], number: NumberReader) -> int:
        """A head's query/key width, ``qk_nope_head_dim + qk_rope_head_dim`` (transformers sets
        its ``head_dim`` to the RoPE part: that is ``qk_rope_head_dim`` here)."""
        return number("qk_nope_head_dim") + number("qk_rope_head_dim")

    def hf_layer_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        """Every layer softmax attention; the latent attention's widths and ranks; the
        multi-token-prediction layers (``num_nextn_predict_layers``)."""
        fields = super().hf_layer_fields(hf, number)
        fields.update(q_lora_rank=number("q_lora_rank", default=None), kv_lora_rank=number("kv_lora_rank"),
                      qk_nope_head_dim=number("qk_nope_head_dim"), qk_rope_head_dim=number("qk_rope_head_dim"),
                      v_head_dim=number("v_head_dim"), mtp_layers=number("num_nextn_predict_layers", default=0))
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if fields[name] <= 0:
                raise UnsupportedModelError(f"field {name!r} must be positive, got {fields[name]}")
        if fields["mtp_layers"] and self.model_type not in _MTP_LOGGED:  # (once per process: configs are parsed often)
            _MTP_LOGGED.add(self.model_type)
            logger.info("%s: the checkpoint's %d multi-token-prediction layer(s) (num_nextn_predict_layers) are "
                        "carried through conversions unchanged, not built or trained", self.model_type,
                        fields["mtp_layers"])
        return fields

    # ------------------------------------------------------------------ megatron model
    def transformer_config_class(self, arch: "ModelArchitecture") -> type:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def transformer_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        """Llama's fields plus megatron's MLA fields: the ranks and widths, and the YaRN fields
        megatron derives the softmax scale from (``rotary_scaling_factor``, ``mscale_all_dim``;
        the angles themselves come from the model's position ids,
        :class:`~megatron_psrl.model.latent_attention.TreeMLASelfAttention`).

        ``qk_layernorm`` stays False although the layer has the latents' RMSNorms (the spec is
        asked for them, :meth:`layer_spec_choices`): megatron's ``finalize_model_grads`` sums the
        gradient of every ``q_layernorm`` over the tensor-parallel ranks when it is set (a
        per-head q/k norm's gradient is partial on each rank), while the query latent is whole
        on every rank and its norm's gradient complete there (summed, it would count TP times;
        under sequence parallelism both latent norms run on a rank's rows and are summed as
        every sequence-parallel norm is)."""
        rope = arch.rope
        yarn_correction = rope.rope_type != "default" and bool(rope.mscale_all_dim)
        return dict(
            super().transformer_config_fields(arch),
            multi_latent_attention=True,
            qk_layernorm=False,
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=arch.kv_lora_rank,
            qk_head_dim=arch.qk_nope_head_dim,
            qk_pos_emb_head_dim=arch.qk_rope_head_dim,
            v_head_dim=arch.v_head_dim,
            rope_type="yarn",
            rotary_base=rope.theta,
            rotary_scaling_factor=float(rope.factor),
            mscale=float(rope.mscale or 1.0),
            mscale_all_dim=float(rope.mscale_all_dim) if yarn_correction else 0.0,
            original_max_position_embeddings=rope.original_max_position_embeddings or arch.max_position_embeddings,
            beta_fast=float(rope.beta_fast),
            beta_slow=float(rope.beta_slow),
            apply_rope_fusion=False,
        )

    def layer_spec_choices(self, arch: "ModelArchitecture") -> LayerSpecChoices:
        """The MLP's choices (an MoE MLP's experts) with latent attention and its latents' norms."""
        return dataclasses.replace(super().layer_spec_choices(arch), qk_layernorm=True, multi_latent_attention=True)

    # ------------------------------------------------------------------ KV cache
    def prefix_states(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                      dtype: torch.dtype) -> Tuple["PrefixState", ...]:
        """``arch.latent_cache`` ``latent``: the normalised K/V latent and the rotated shared RoPE
        key, before the up-projection (whole on every tensor-parallel rank; a reader projects them
        up to this rank's heads, :class:`~megatron_psrl.model.latent_attention.TreeMLASelfAttention`);
        ``per-head``: per-head K (``nope + rope``) and V (``v_head_dim``) after RoPE and the
        up-projection, this rank's heads, at the core-attention tap."""
        from megatron_psrl.kvcache.prefix_state import PrefixState

        heads = arch.num_attention_heads // tensor_parallel_size
        if arch.latent_cache == "latent":
            state = PrefixState.latent(arch.kv_lora_rank, arch.qk_rope_head_dim, dtype=dtype, num_heads=heads,
                                       key_dim=arch.head_dim, value_dim=arch.v_head_dim)
        else:
            state = PrefixState.softmax(heads, arch.head_dim, arch.v_head_dim, dtype=dtype)
        return (state,) * arch.num_layers

    # ------------------------------------------------------------------ memory plan
    def attention_saved_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                        dtype_bytes: int) -> int:
        """What the core attention saves: the query and key (``n hd / tp`` each), the value
        (``n v / tp``; a copy of its own, not a view of the up-projection), the output
        (``n v / tp``) and the fp32 log-sum-exp (``n / tp``)."""
        n, tp, b = arch.num_attention_heads, tensor_parallel_size, dtype_bytes
        return (2 * n * arch.head_dim + 2 * n * arch.v_head_dim) // tp * b + FP32_BYTES * n // tp

    def latent_saved_bytes_per_token(self, arch: "ModelArchitecture", dtype_bytes: int) -> int:
        """What latent attention saves besides its core attention, per token (the latents are
        whole on every tensor-parallel rank: gathered after the column-parallel down-projections):

        - the query latent's RMSNorm (``q_lora_rank`` r_q): its input and normalised input in fp32,
          its output in the model dtype (the up-projection's input), its fp32 statistic;
        - the K/V latent's RMSNorm (r): the same, where its fp32 input is a view of the
          down-projection's whole output, latent and RoPE key (``r + rope``), when the model is
          fp32 (a lower precision casts a copy of the latent only);
        - RoPE's cos and sin for the query and the key: ``4 rope`` in the model dtype."""
        b, r, rope = dtype_bytes, arch.kv_lora_rank, arch.qk_rope_head_dim
        query = 0 if arch.q_lora_rank is None else 2 * arch.q_lora_rank * FP32_BYTES + arch.q_lora_rank * b + FP32_BYTES
        latent_input = (r + rope if b == FP32_BYTES else r) * FP32_BYTES
        latent = latent_input + r * FP32_BYTES + r * b + FP32_BYTES
        return query + latent + 4 * rope * b

    def saved_activation_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                         dtype_bytes: int) -> int:
        """Counted from megatron's local MLA layer with the project's core attention (a test
        compares it with what ``saved_tensors_hooks`` sees, fp32 and bf16). Per layer: the two
        layer RMSNorms (``2h`` fp32 + ``h``, and a statistic, each), the latents
        (:meth:`latent_saved_bytes_per_token`), the core attention
        (:meth:`attention_saved_bytes_per_token`) and the MLP (:meth:`mlp_saved_bytes_per_token`:
        fused SwiGLU ``3f / tp``). Plus the final norm (``2h`` fp32 and its statistic) and the input
        ids (int64)."""
        h, tp, b = arch.hidden_size, tensor_parallel_size, dtype_bytes
        norms = 2 * (2 * h * FP32_BYTES + h * b + FP32_BYTES)
        per_layer = (norms + self.latent_saved_bytes_per_token(arch, b) + self.attention_saved_bytes_per_token(arch, tp, b)
                     + self.mlp_saved_bytes_per_token(arch, tp, b))
        return arch.num_layers * per_layer + 2 * h * FP32_BYTES + FP32_BYTES + 8

    # ------------------------------------------------------------------ FLOPs
    def cost_dims(self, arch: "ModelArchitecture") -> "ModelDims":
        """A dense multi-head transformer with this model's attention FLOPs per key: ``QK^T`` over
        ``nope + rope`` and ``PV`` over ``v`` per head, as heads of the mean width
        ``(nope + rope + v) / 2``; and its projections' and MLP's FLOPs per token through the MLP
        width (the latent projections, less the stand-in's own q/k/v/o projections, plus the
        active MLP). The stand-in's projections are wider than latent attention's (DeepSeek-V3:
        4 h n 160 = 587M weights against 187M), so a dense MLP narrower than the difference
        cannot absorb it: the width is then 1 and the linear term over by the rest. An MoE model's
        active MLP is averaged over its layers, dense first layers included."""
        from megatron_psrl.schedule.cost import ModelDims

        h, n = arch.hidden_size, arch.num_attention_heads
        width = max(1, round((arch.head_dim + arch.v_head_dim) / 2))
        dense = len(arch.dense_mlp_layers)  # (an MoE model's dense first layers: the MLP averaged over the layers)
        mlp = ((arch.num_layers - dense) * self.active_mlp_parameters(arch)
               + dense * arch.dense_mlp_parameters()) / arch.num_layers
        per_token = arch.latent_attention_parameters() + mlp
        ffn = round((per_token - 4 * h * n * width) / (3 * h))
        return ModelDims(hidden_size=h, num_layers=arch.num_layers, num_heads=n, num_kv_heads=n, head_dim=width,
                         ffn_hidden_size=max(1, ffn), vocab_size=arch.vocab_size, gated=True)


    def read_flops_per_token(self, arch: "ModelArchitecture") -> float:
        """With a latent cache (``arch.latent_cache``), every reader projects each cached token's
        latent up to every head's key and value: ``r x n (nope + v)`` multiply-adds per layer,
        forward + backward (3x; all tensor-parallel ranks together, as the linear term)."""
        from megatron_psrl.schedule.cost import FORWARD_BACKWARD_FACTOR

        if arch.latent_cache != "latent":
            return 0.0
        weights = arch.kv_lora_rank * arch.num_attention_heads * (arch.qk_nope_head_dim + arch.v_head_dim)
        return FORWARD_BACKWARD_FACTOR * 2.0 * weights * arch.num_layers


class DeepseekV3Family(GroupedRoutingMixin, LatentAttentionFamily, MoEFamily):
    """DeepSeek-V3 / Kimi K2: latent attention, dense first layers, then grouped sigmoid routing
    (see the module docstring). A config whose every layer is dense (``first_k_dense_replace >=
    num_hidden_layers``, or no routed experts) is a dense model of the family."""

    reads_moe_fields = True  # DeepSeek configs carry MoE fields whatever layers are dense
    moe_layers_optional = True

    # transformers' DeepseekV3Config defaults (topk_method "noaux_tc": the only one it has)
    hf_mlp_defaults = dict(n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
                           n_shared_experts=1, first_k_dense_replace=HF_DEFAULT_FIRST_K_DENSE,
                           n_routed_experts=HF_DEFAULT_ROUTED_EXPERTS, topk_method="noaux_tc")

    def hf_has_moe_layers(self, hf: Mapping[str, Any]) -> bool:
        """Routed experts (``n_routed_experts``, transformers' default 256) in layers
        ``first_k_dense_replace`` (default 3) and up, when there are such layers."""
        experts = hf.get("n_routed_experts", HF_DEFAULT_ROUTED_EXPERTS)
        first_moe = hf.get("first_k_dense_replace")
        first_moe = HF_DEFAULT_FIRST_K_DENSE if first_moe is None else first_moe
        return bool(experts) and first_moe < hf["num_hidden_layers"]

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        """Grouped routing's fields (:func:`~.grouped_routing.grouped_routing_fields`, with
        transformers' defaults), none for a config without MoE layers."""
        if not self.hf_has_moe_layers(hf):
            return {}
        experts = dict(hf, n_routed_experts=hf.get("n_routed_experts", HF_DEFAULT_ROUTED_EXPERTS))
        return super().hf_mlp_fields(experts, number)

    # ------------------------------------------------------------------ an all-dense config
    def moe_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        return super().moe_config_fields(arch) if arch.is_moe else {}

    def mlp_saved_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                  dtype_bytes: int) -> int:
        """An MoE layer's (:meth:`MoEFamily.moe_saved_bytes_per_token`), SwiGLU's in a dense model."""
        if arch.is_moe:
            return super().mlp_saved_bytes_per_token(arch, tensor_parallel_size, dtype_bytes)
        return LlamaLikeFamily.mlp_saved_bytes_per_token(self, arch, tensor_parallel_size, dtype_bytes)

    def saved_activation_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                         dtype_bytes: int) -> int:
        """Latent attention's count (every layer's MLP :meth:`mlp_saved_bytes_per_token`), less
        the difference of an MoE layer's MLP and a dense SwiGLU in each dense layer."""
        every_layer = super().saved_activation_bytes_per_token(arch, tensor_parallel_size, dtype_bytes)
        return every_layer - self.dense_layers_saved_bytes_difference(arch, tensor_parallel_size, dtype_bytes)

    def mlp_parameters(self, arch: "ModelArchitecture") -> int:
        return super().mlp_parameters(arch) if arch.is_moe else LlamaLikeFamily.mlp_parameters(self, arch)

    def active_mlp_parameters(self, arch: "ModelArchitecture") -> int:
        return super().active_mlp_parameters(arch) if arch.is_moe else LlamaLikeFamily.active_mlp_parameters(self, arch)


DEEPSEEK_TINY: Dict[str, Any] = dict(
    {k: v for k, v in TINY_BASE.items() if k != "head_dim"},  # (transformers sets head_dim = qk_rope_head_dim)
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=256, hidden_size=64,
    intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    max_position_embeddings=4096,
    kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True,
    rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=1024),
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=2, num_nextn_predict_layers=0,
)
"""2 dense layers (``first_k_dense_replace`` = the layer count: the MoE fields are read, no layer
uses them) of 4 heads: query latent 32, K/V latent 24, keys 16 + 8 (RoPE) wide, values 12;
YaRN with DeepSeek's mscale / mscale_all_dim (cos/sin scaled by 0.93, the softmax by 1.29)."""

DEEPSEEK_TINY_MOE: Dict[str, Any] = dict(DEEPSEEK_TINY, num_hidden_layers=3, first_k_dense_replace=1)
""":data:`DEEPSEEK_TINY`'s attention in 3 layers, the first dense, then two MoE layers: 8 routed
experts of width 32 in 2 groups, top-2 from the best group (``k // topk_group`` = 2, the group
score Hugging Face and megatron share), the expert bias used for selection, the weights
renormalised and scaled by 2.5, one shared expert."""

DEEPSEEK_V3_CLASS: Dict[str, Any] = dict(
    {k: v for k, v in TINY_BASE.items() if k != "head_dim"},
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
    first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
    max_position_embeddings=163840, rope_theta=10000.0, rope_interleave=True, torch_dtype="bfloat16",
    rope_scaling=dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=4096),
)
"""DeepSeek-V3 (671B; its config.json): 61 layers, the first 3 dense, 256 routed experts top-8
and a shared one in the others (8 groups, the best 4 kept), one multi-token-prediction layer
(not built): 671.0B parameters."""

DEEPSEEK_V3 = register_family(DeepseekV3Family(
    model_type="deepseek_v3",
    adapter=DeepseekV3Adapter,
    tiny_configs={"debug-deepseek-v3": DEEPSEEK_TINY, "debug-deepseek-v3-moe": DEEPSEEK_TINY_MOE},
    shape_configs={"deepseek-v3-class": DEEPSEEK_V3_CLASS},
), aliases=("kimi_k2",))
"""Kimi K2 ships ``model_type`` ``kimi_k2`` with DeepSeek-V3's architecture
(``DeepseekV3ForCausalLM``): the same bundle."""
