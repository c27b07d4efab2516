"""gpt-oss: alternating sliding-window and full softmax layers with a learnable sink per head,
biases on every linear layer, and a mixture of clamped-SwiGLU experts in every layer.

- attention: GQA, YaRN RoPE, q/k/v and output biases (``attention_bias``), one sink logit per
  head in every softmax's denominator (``self_attn.sinks``); ``layer_types`` alternates
  ``sliding_attention`` (the last ``sliding_window`` tokens of the query's path) and
  ``full_attention``;
- MLP: ``num_local_experts`` experts of width ``intermediate_size``, each
  ``down((up + 1) * gate * sigmoid(1.702 gate))`` with gate clamped to at most 7 and up to
  [-7, 7] (``swiglu_limit``), biases on both projections; the router a linear layer with a
  bias, softmax over its top-k logits.

megatron builds all of it: ``softmax_type='learnable'`` (the core attention's
``softmax_offset``), ``window_size`` / ``window_attn_skip_freq`` (per-layer windows, read by
:class:`~megatron_psrl.attention.PrefixSharingAttention`), ``add_bias_linear``, ``quick_gelu``
with ``glu_linear_offset`` 1 and ``activation_func_clamp_value`` 7, a softmax top-k router
without pre-softmax. Refused: MXFP4-quantised checkpoints (``quantization_config``), no
attention bias, another ``swiglu_limit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Tuple

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.adapters.gpt_oss import GptOssAdapter
from megatron_psrl.model.families.base import TINY_BASE, NumberReader
from megatron_psrl.model.families.moe import MoEFamily, num_experts
from megatron_psrl.model.families.registry import register_family

if TYPE_CHECKING:
    import torch

    from megatron_psrl.kvcache.prefix_state import PrefixState
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.schedule.cost import ModelDims

SWIGLU_LIMIT = 7.0
"""transformers' gpt-oss clamps the gate to at most this and the up projection to [-this, this]."""
GLU_ALPHA = 1.702
"""The gate's sigmoid slope: ``gate * sigmoid(1.702 gate)``, megatron's ``quick_gelu``."""
LAYER_KINDS = ("sliding_attention", "full_attention")


class GptOssFamily(MoEFamily):
    """gpt-oss: windowed and full softmax layers with sinks, biases everywhere, clamped-SwiGLU experts."""

    # ------------------------------------------------------------------ Hugging Face config
    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?") if isinstance(hf["quantization_config"], dict) \
                else "?"
            raise UnsupportedModelError(f"field 'quantization_config': quantised gpt_oss checkpoints ({method}) are "
                                        "not supported; use a bf16 checkpoint")
        if hf.get("attention_bias", True) is not True:
            raise UnsupportedModelError("field 'attention_bias': gpt_oss without attention biases is not supported")
        window = hf.get("sliding_window")
        if isinstance(window, bool) or (window is not None and (not isinstance(window, int) or window < 1)):
            raise UnsupportedModelError(f"field 'sliding_window' must be a positive integer, got {window!r}")
        return dict(qkv_bias=True, qk_norm=False, sliding_window=window, attention_sinks=True, linear_bias=True)

    def hf_layer_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        """``layer_types``: as written, or transformers' default (sliding, full, sliding, ...)."""
        layers = number("num_hidden_layers")
        kinds = hf.get("layer_types")
        if kinds is None:
            kinds = [LAYER_KINDS[i % 2] for i in range(layers)]
        unknown = sorted({str(k) for k in kinds} - set(LAYER_KINDS))
        if unknown:
            raise UnsupportedModelError(f"field 'layer_types': {unknown} not supported for gpt_oss; supported: "
                                        f"{', '.join(LAYER_KINDS)}")
        return dict(layer_types=list(kinds))

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        limit = number("swiglu_limit", float, SWIGLU_LIMIT)
        if limit != SWIGLU_LIMIT:
            raise UnsupportedModelError(f"field 'swiglu_limit': {limit} is not supported (transformers' gpt_oss "
                                        f"clamps at {SWIGLU_LIMIT})")
        return dict(
            num_experts=num_experts(hf, "num_local_experts"),
            moe_ffn_hidden_size=number("intermediate_size"),
            moe_router_topk=number("num_experts_per_tok"),
            moe_norm_topk_prob=True,  # softmax over the top-k logits
        )

    # ------------------------------------------------------------------ megatron model
    def transformer_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        """Biases on every linear layer, the clamped GLU ``quick_gelu(min(gate, 7)) *
        (clamp(up, -7, 7) + 1)``, a learnable sink per head, and megatron's per-layer windows:
        ``window_size`` ``(W - 1, 0)`` (a query sees itself and ``W - 1`` keys before it) on the
        layers ``window_attn_skip_freq`` marks 1 (``layer_types`` ``sliding_attention``)."""
        from megatron.core.activations import quick_gelu

        windowed = [1 if kind == "sliding_attention" else 0 for kind in arch.layer_kinds]
        return dict(
            super().transformer_config_fields(arch),
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=SWIGLU_LIMIT,
            add_bias_linear=True,
            add_qkv_bias=True,
            softmax_type="learnable",
            window_size=(arch.sliding_window - 1, 0) if any(windowed) else None,
            window_attn_skip_freq=windowed if any(windowed) else None,
        )

    # ------------------------------------------------------------------ KV cache
    def prefix_states(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                      dtype: "torch.dtype") -> Tuple["PrefixState", ...]:
        """Softmax K/V in every layer; a sliding layer's carries its window, so a cached prefix
        keeps there only the rows some reader's window reaches (a pool of their own)."""
        from megatron_psrl.kvcache.prefix_state import PrefixState

        sliding = set(arch.sliding_window_layers)
        return tuple(PrefixState.softmax(arch.num_kv_heads // tensor_parallel_size, arch.head_dim, dtype=dtype,
                                         window=arch.sliding_window if i in sliding else None)
                     for i in range(arch.num_layers))

    # ------------------------------------------------------------------ memory plan
    fused_glu = False  # (the clamped quick-GELU GLU runs unfused on CPU: compat.eager_activation)

    def moe_saved_bytes_per_token(self, arch: "ModelArchitecture", dtype_bytes: int) -> int:
        """:meth:`MoEFamily.moe_saved_bytes_per_token` for the clamped GLU: two more ``f``-wide
        tensors per routed copy, in the model dtype (SwiGLU's ``silu`` keeps a view of the fc1
        output; here the clamped gate, which ``quick_gelu``'s product keeps with its sigmoid, and
        ``up + 1``, which the GLU's product keeps, are tensors of their own). The biases save
        nothing (fc1's is added before the GLU, fc2's times the routing weight the experts keep
        already). Counted against what ``saved_tensors_hooks`` sees, fp32 and bf16, with the
        eager ``quick_gelu`` that runs on CPU (tests/kvcache/test_moe_activation_estimate.py);
        megatron's compiled one (CUDA) keeps one tensor fewer: an ``f`` per copy over there."""
        k, f = arch.moe_router_topk, arch.moe_ffn_hidden_size
        return super().moe_saved_bytes_per_token(arch, dtype_bytes) + 2 * k * f * dtype_bytes

    # ------------------------------------------------------------------ cost model
    def cost_dims(self, arch: "ModelArchitecture") -> "ModelDims":
        """The MoE's dims, attention charged per key pair on the full layers only: a sliding
        layer sees at most ``sliding_window`` keys per token, charged per token."""
        import dataclasses

        windowed = len(arch.sliding_window_layers)
        return dataclasses.replace(super().cost_dims(arch), attention_layers=arch.num_layers - windowed,
                                   window_keys=arch.sliding_window if windowed else 0)

    # ------------------------------------------------------------------ parameters
    def mlp_parameters(self, arch: "ModelArchitecture") -> int:
        """Every expert (both projections and their biases) and the router with its bias."""
        h, f, e = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
        return e * (3 * h * f + 2 * f + h) + e * (h + 1)

    def active_mlp_parameters(self, arch: "ModelArchitecture") -> int:
        """The token's top-k experts and the whole router."""
        h, f, e = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
        return arch.moe_router_topk * (3 * h * f + 2 * f + h) + e * (h + 1)


_DEBUG = dict(
    TINY_BASE, model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=256, hidden_size=64,
    intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=8, num_experts_per_tok=2, sliding_window=8, layer_types=list(LAYER_KINDS),
    attention_bias=True, swiglu_limit=SWIGLU_LIMIT, rms_norm_eps=1e-5, router_aux_loss_coef=0.0,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=4096),
    max_position_embeddings=131072,
)
_DEBUG.pop("rope_theta")

GPT_OSS = register_family(GptOssFamily(
    model_type="gpt_oss",
    adapter=GptOssAdapter,
    tiny_configs={
        # 2 layers (sliding, full), a window of 8 tokens (trees' branches are longer), 8 experts
        # top-2, YaRN RoPE as released.
        "debug-gpt-oss": _DEBUG,
    },
    shape_configs={
        # gpt-oss-120b's architecture (random weights): 36 layers alternating a 128-token window
        # and full attention, 64 heads over 8 key/value groups of 64, 128 experts top-4.
        "gpt-oss-120b-class": dict(
            _DEBUG, vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
            sliding_window=128, layer_types=[LAYER_KINDS[i % 2] for i in range(36)], torch_dtype="bfloat16",
            initializer_range=0.02),
    },
))
