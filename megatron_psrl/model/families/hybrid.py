"""Qwen3-Next and Qwen3.5: hybrid decoders of softmax-attention and linear-attention layers.

``layer_types`` names each layer's token mixer (default: three ``linear_attention`` layers,
then one ``full_attention``, ``full_attention_interval`` 4):

- softmax attention as Qwen3's (q/k RMSNorm before RoPE) with an output gate (the query
  projection emits each head's query and gate; ``o_proj(attn * sigmoid(gate))``, megatron
  ``attention_output_gate``) and partial RoPE (``partial_rotary_factor``, 0.25: the first quarter
  of each head is rotated). Qwen3.5's multimodal RoPE (``mrope_section``) rotates with three
  position ids; for text they are equal and it is plain RoPE, which is what is built;
- linear attention: Gated DeltaNet (megatron's ``GatedDeltaNet`` parameters, the project's
  tree-packed module :class:`megatron_psrl.model.linear_attention.TreeGatedDeltaNet`):
  ``linear_num_key_heads`` / ``linear_num_value_heads`` heads of ``linear_key_head_dim`` /
  ``linear_value_head_dim``, a causal depthwise convolution of ``linear_conv_kernel_dim``;
- every RMSNorm of the decoder (layer norms, q/k norms, final norm) is zero-centred,
  ``x * (1 + w)`` (megatron ``layernorm_zero_centered_gamma``); the linear layers' gated output
  norm is a plain one, ``w * x``.

Multi-token-prediction layers (``mtp_num_hidden_layers``, 1 in every released checkpoint: a
draft head for speculative decoding, which transformers' models also skip) are not built or
trained; their ``mtp.*`` tensors are carried through conversions unchanged.

Refused: attention biases, sliding windows, unknown layer types, dense MLP layers in an MoE model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.architecture import FULL_ATTENTION, LAYER_TYPES, LINEAR_ATTENTION
from megatron_psrl.model.families.base import FP32_BYTES, LayerSpecChoices, NumberReader, refuse_sliding_window
from megatron_psrl.model.families.qwen3 import Qwen3Family

if TYPE_CHECKING:
    from megatron_psrl.kvcache.prefix_state import PrefixState
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.schedule.cost import ModelDims

DEFAULT_FULL_ATTENTION_INTERVAL = 4


def layer_types(hf: Dict[str, Any], num_layers: int) -> List[str]:
    """``layer_types`` of a config, or transformers' default from ``full_attention_interval``
    (every ``interval``-th layer softmax attention, the others linear); an unknown type is
    refused naming the field."""
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise UnsupportedModelError(f"field 'full_attention_interval' must be a positive integer, got {interval!r}")
        return [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    if not isinstance(types, list):
        raise UnsupportedModelError(f"field 'layer_types' must be a list, got {types!r}")
    unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if unknown:
        raise UnsupportedModelError(f"field 'layer_types': layer types {unknown} are not supported; "
                                    f"supported: {', '.join(LAYER_TYPES)}")
    return list(types)


class HybridFamily(Qwen3Family):
    """Gated softmax attention and Gated DeltaNet layers, zero-centred norms (Qwen3.5 dense)."""

    has_linear_attention = True

    # ------------------------------------------------------------------ Hugging Face config
    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if hf.get("attention_bias"):
            raise UnsupportedModelError(f"attention_bias on {self.model_type} models is not supported")
        refuse_sliding_window(hf)
        return dict(qkv_bias=False, qk_norm=True, sliding_window=None)

    def hf_layer_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        types = layer_types(hf, number("num_hidden_layers"))
        linear = LINEAR_ATTENTION in types
        fields = dict(layer_types=types, attention_output_gate=True, zero_centered_norms=True,
                      mtp_layers=number("mtp_num_hidden_layers", default=0))
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            fields[name] = number(name) if linear else number(name, default=0)
        return fields

    # ------------------------------------------------------------------ megatron model
    def transformer_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        """Qwen3's fields plus zero-centred norms, the attention's output gate and the linear
        layers (megatron's ``experimental_attention_variant="gated_delta_net"`` with a per-layer
        ``linear_attention_freq``: 1 linear, 0 softmax). Partial RoPE needs no field: the model
        hands megatron angles of the rotated width only
        (:class:`megatron_psrl.model.gpt.RotaryFrequencies`)."""
        fields = dict(super().transformer_config_fields(arch), layernorm_zero_centered_gamma=True,
                      attention_output_gate=True)
        if arch.linear_attention_layers:
            fields.update(
                experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[1 if kind == LINEAR_ATTENTION else 0 for kind in arch.layer_kinds],
                linear_num_key_heads=arch.linear_num_key_heads,
                linear_num_value_heads=arch.linear_num_value_heads,
                linear_key_head_dim=arch.linear_key_head_dim,
                linear_value_head_dim=arch.linear_value_head_dim,
                linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
            )
        return fields

    def layer_spec_choices(self, arch: "ModelArchitecture") -> LayerSpecChoices:
        return LayerSpecChoices(num_experts=arch.num_experts, qk_layernorm=True,
                                linear_attention_layers=arch.linear_attention_layers, zero_centered_norms=True)

    # ------------------------------------------------------------------ KV cache
    def prefix_states(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                      dtype: torch.dtype) -> Tuple["PrefixState", ...]:
        """Softmax layers: post-RoPE K and V of this rank's key/value heads. Linear layers: the
        delta rule's state ``[nv, dk, dv]`` of this rank's value heads and the convolution's last
        ``kernel - 1`` inputs of this rank's channels (the prefix state of a recurrent mixer, one
        fixed slot per cached prefix). It is kept in fp32 whatever ``dtype``: the kernels carry
        the state in fp32 from one segment to the next, and a rounded copy would make a cached
        prefix's readers differ from the same tree in one pack (the conv inputs are exact in
        fp32; the state is small next to a prefix's K/V)."""
        from megatron_psrl.kvcache.prefix_state import PrefixState

        tp = tensor_parallel_size
        softmax = PrefixState.softmax(arch.num_kv_heads // tp, arch.head_dim, dtype=dtype)
        conv_channels = (2 * arch.linear_num_key_heads * arch.linear_key_head_dim
                         + arch.linear_num_value_heads * arch.linear_value_head_dim) // tp
        recurrent = (PrefixState.recurrent(arch.linear_num_value_heads // tp, arch.linear_key_head_dim,
                                           arch.linear_value_head_dim, conv_channels, arch.linear_conv_kernel_dim,
                                           dtype=torch.float32) if arch.linear_attention_layers else None)
        return tuple(recurrent if kind == LINEAR_ATTENTION else softmax for kind in arch.layer_kinds)

    # ------------------------------------------------------------------ memory plan
    def linear_saved_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                     dtype_bytes: int) -> int:
        """Bytes per token a Gated DeltaNet mixer saves for backward, this rank's heads (an
        estimate of the tensors the delta rule's autograd keeps, not a count of one
        implementation): the input projection's output (``2 qk + 2 v + 2 nv``), the convolution's
        output and its activation (``2 (2 qk + v)``), the L2-normalised q and k (``2 qk``,
        repeated per value head when ``nv > nk``: ``2 nv dk``), the fp32 decay and beta
        (``2 nv`` fp32), the recurrence's output (``v``), the gated norm's input, normalised input
        and gate (``3 v``, fp32) and the output projection's input (``v``)."""
        tp, b = tensor_parallel_size, dtype_bytes
        qk = arch.linear_num_key_heads * arch.linear_key_head_dim // tp
        nv = arch.linear_num_value_heads // tp
        v = nv * arch.linear_value_head_dim
        qk_rep = max(qk, nv * arch.linear_key_head_dim)
        model_dtype = (2 * qk + 2 * v + 2 * nv) + 2 * (2 * qk + v) + 2 * qk_rep + v + v
        return model_dtype * b + (2 * nv + 3 * v) * FP32_BYTES

    def saved_activation_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                         dtype_bytes: int) -> int:
        """Qwen3's count for the softmax layers plus their output gate (the gate and the gated
        output: ``2 np hd / tp``, the fp32 sigmoid ``np hd / tp``); the linear layers' mixer
        (:meth:`linear_saved_bytes_per_token`) in place of attention, with the same norms and MLP."""
        tp, b = tensor_parallel_size, dtype_bytes
        dense = super().saved_activation_bytes_per_token(arch, tp, b)  # every layer as softmax attention
        per_softmax = (dense - (2 * arch.hidden_size * FP32_BYTES + FP32_BYTES + 8)) // arch.num_layers
        q = arch.num_attention_heads * arch.head_dim // tp
        gate = 2 * q * b + q * FP32_BYTES
        h, n_linear = arch.hidden_size, len(arch.linear_attention_layers)
        norms_mlp = 2 * (2 * h * FP32_BYTES + h * b) + 2 * FP32_BYTES + self.mlp_saved_bytes_per_token(arch, tp, b)
        per_linear = norms_mlp + self.linear_saved_bytes_per_token(arch, tp, b)
        softmax_layers = arch.num_layers - n_linear
        return dense - arch.num_layers * per_softmax + softmax_layers * (per_softmax + gate) + n_linear * per_linear

    # ------------------------------------------------------------------ FLOPs
    def cost_dims(self, arch: "ModelArchitecture") -> "ModelDims":
        """A dense GQA transformer with this model's FLOPs per token. The quadratic attention
        term is the softmax layers' only: the heads are scaled by their share of the layers
        (rounded, a divisor of the key/value groups kept). The linear term is matched exactly
        through the MLP width: per layer on average, the softmax layers' projections (the
        output gate's half of ``q_proj`` included), the linear layers' Gated DeltaNet
        parameters plus the recurrence's ``2 dk dv`` multiply-adds per value head and token (no
        term grows with the context), and the MLP's active parameters, less the dense model's
        own attention projections."""
        from megatron_psrl.schedule.cost import ModelDims

        h, n, hd = arch.hidden_size, arch.num_layers, arch.head_dim
        n_linear = len(arch.linear_attention_layers)
        recurrence = 2 * arch.linear_num_value_heads * arch.linear_key_head_dim * arch.linear_value_head_dim
        per_token = ((n - n_linear) * arch.attention_parameters()
                     + n_linear * (arch.linear_attention_parameters() + recurrence)
                     + n * arch.active_mlp_parameters())
        heads = max(1, round(arch.num_attention_heads * (n - n_linear) / n))
        kv = max(1, min(heads, round(arch.num_kv_heads * (n - n_linear) / n)))
        while heads % kv:
            kv -= 1
        projections = h * hd * (2 * heads + 2 * kv)
        ffn = round((per_token / n - projections) / (3 * h))
        return ModelDims(hidden_size=h, num_layers=n, num_heads=heads, num_kv_heads=kv, head_dim=hd,
                         ffn_hidden_size=max(1, ffn), vocab_size=arch.vocab_size, gated=True)


def hf_text_part(hf: Dict[str, Any]) -> Dict[str, Any]:
    """A multimodal wrapper's language-model config (``text_config``), refused if missing."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"model type {hf.get('model_type')!r} needs a 'text_config' object")
    return text
