"""Model architecture parsed from a Hugging Face config, and its megatron TransformerConfig.

Supported: the families registered in :mod:`megatron_psrl.model.families`, one bundle each:
Llama, Mistral, Qwen2/Qwen2.5 and Qwen3 (dense decoder-only, GQA, RoPE, RMSNorm, SwiGLU, tied
or untied embeddings, Qwen2's q/k/v bias, Qwen3's q/k RMSNorm), and the mixture-of-experts
families Qwen3-MoE (Qwen3 attention, every layer a top-k mixture of SwiGLU experts), Qwen2-MoE
(Qwen2 attention, routed experts plus a sigmoid-gated shared expert), Mixtral (Mistral
attention, top-k of softmax renormalised) and GLM-4.5 (dense first layers, then grouped sigmoid
routing with an expert bias and a shared expert; docs/moe.md), and the hybrid linear-attention
families. Anything else (other MoE families,
LayerNorm models, unknown RoPE scaling, sliding-window layers) is refused with a message naming
what is unsupported, before any weight is read. This module holds what every family shares
(the fields, RoPE, the checks); the family's bundle parses its own keys.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_psrl.errors import CheckpointError, PsrlError, UnsupportedModelError  # noqa: F401  (re-exported)
from megatron_psrl.options import LATENT_CACHE_CHOICES

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FULL_ATTENTION = "full_attention"
"""A layer type (Hugging Face ``layer_types``): softmax attention."""
LINEAR_ATTENTION = "linear_attention"
"""A layer type: linear attention (Gated DeltaNet)."""
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
SLIDING_ATTENTION = "sliding_attention"
"""A layer type: softmax attention within ``sliding_window`` tokens of the query's path (gpt-oss;
a family that has such layers accepts it, :meth:`ModelFamily.hf_layer_fields`)."""
ALL_LAYER_TYPES = LAYER_TYPES + (SLIDING_ATTENTION,)
_MOE_KEYS = ("num_experts", "num_local_experts", "moe_intermediate_size", "n_routed_experts")
_REQUIRED = object()


def _supported_model_types() -> Tuple[str, ...]:
    # the families import this module (its fields and errors): the registry is imported late
    from megatron_psrl.model.families.registry import supported_model_types

    return supported_model_types()


def _moe_model_types() -> Tuple[str, ...]:
    from megatron_psrl.model.families.registry import moe_model_types

    return moe_model_types()


def __getattr__(name: str) -> Any:
    """``SUPPORTED_MODEL_TYPES`` and ``MOE_MODEL_TYPES``: derived from the family registry when
    asked, so that a family registered later is listed too."""
    if name == "SUPPORTED_MODEL_TYPES":
        return _supported_model_types()
    if name == "MOE_MODEL_TYPES":
        return _moe_model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _number_reader(hf: Dict[str, Any]):
    """``number(key, kind=int, default=<required>)`` over ``hf``: a numeric config field; a
    wrong type names the field and its value, a missing required one raises ``KeyError(key)``."""

    def number(key: str, kind=int, default: Any = _REQUIRED) -> Any:
        value = hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise KeyError(key)
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise UnsupportedModelError(f"field {key!r} must be {'an integer' if kind is int else 'a number'}, "
                                        f"got {value!r}")
        return kind(value)

    return number


@dataclass
class RopeConfig:
    """Rotary position embedding parameters (Hugging Face ``rope_parameters`` semantics)."""

    theta: float = 10000.0
    """Base wavelength (``rope_theta``)."""

    rope_type: str = "default"
    """One of ``default``, ``linear``, ``llama3``, ``yarn``."""

    factor: float = 1.0
    """Context-extension factor of linear / llama3 / yarn scaling."""

    low_freq_factor: float = 1.0
    """llama3: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled."""

    high_freq_factor: float = 4.0
    """llama3: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""

    original_max_position_embeddings: Optional[int] = None
    """llama3 / yarn: context length of pre-training."""

    beta_fast: float = 32.0
    """yarn: extrapolation boundary of the linear ramp."""

    beta_slow: float = 1.0
    """yarn: interpolation boundary of the linear ramp."""

    attention_factor: Optional[float] = None
    """yarn: scale of cos/sin; derived from ``factor`` (and mscale) when None."""

    mscale: Optional[float] = None
    """yarn: optional mscale numerator (DeepSeek-style)."""

    mscale_all_dim: Optional[float] = None
    """yarn: optional mscale denominator (DeepSeek-style)."""

    truncate: bool = True
    """yarn: round the correction range to integers."""

    partial_rotary_factor: float = 1.0
    """Fraction of the head dimension that is rotated."""

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE scaling type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise UnsupportedModelError(f"RoPE scaling {self.rope_type!r} needs original_max_position_embeddings")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")

    @classmethod
    def from_hf(cls, hf: Dict[str, Any]) -> "RopeConfig":
        """Read both the transformers>=5 ``rope_parameters`` and the older ``rope_theta`` +
        ``rope_scaling`` layouts."""
        params = dict(hf.get("rope_parameters") or {})
        if not params:
            params = dict(hf.get("rope_scaling") or {})
            params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        kwargs: Dict[str, Any] = dict(theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_type=rope_type)
        for key in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
            "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate", "partial_rotary_factor",
        ):
            if params.get(key) is not None:
                kwargs[key] = params[key]
        if "partial_rotary_factor" not in kwargs and hf.get("partial_rotary_factor") is not None:
            kwargs["partial_rotary_factor"] = hf["partial_rotary_factor"]
        # As transformers >= 5: the pre-training context defaults to max_position_embeddings
        # (llama3 and yarn); a scaling type without its factor is refused (transformers does too).
        if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in kwargs:
            kwargs["original_max_position_embeddings"] = hf.get("max_position_embeddings")
        if rope_type in ("linear", "llama3", "yarn") and "factor" not in kwargs:
            raise UnsupportedModelError(f"RoPE scaling {rope_type!r} needs a 'factor'")
        return cls(**kwargs)

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """float32 ``[rot_dim / 2]`` inverse frequencies (the formulas of HF's rope utils)."""
        dim = int(head_dim * self.partial_rotary_factor)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        base_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "default":
            return base_freq
        if self.rope_type == "linear":
            return base_freq / self.factor
        if self.rope_type == "llama3":
            old_len = self.original_max_position_embeddings
            low_wavelen = old_len / self.low_freq_factor
            high_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / base_freq
            scaled = torch.where(wavelen > low_wavelen, base_freq / self.factor, base_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        # yarn
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as HF: avoid a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight

    def attention_scaling(self) -> float:
        """Factor HF multiplies cos and sin by (yarn only; 1.0 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)


@dataclass
class ModelArchitecture:
    """A dense decoder-only transformer of a supported Hugging Face family."""

    model_type: str
    """Hugging Face ``model_type`` of a registered family (:mod:`megatron_psrl.model.families`):
    ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``qwen2_moe``, ``mixtral``,
    ``glm4_moe``, the hybrid ``qwen3_next`` / ``qwen3_5*``."""

    vocab_size: int
    """Vocabulary size (unpadded)."""

    hidden_size: int
    """Model width h."""

    num_layers: int
    """Number of transformer layers."""

    num_attention_heads: int
    """Query heads."""

    num_kv_heads: int
    """Key/value heads (GQA groups); equals num_attention_heads without GQA."""

    head_dim: int
    """Per-head width (may differ from hidden_size / num_attention_heads, e.g. Qwen3)."""

    ffn_hidden_size: int
    """SwiGLU intermediate size (of the dense MLP; MoE models: see ``moe_ffn_hidden_size``)."""

    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""

    max_position_embeddings: int = 4096
    """Longest supported sequence."""

    tie_word_embeddings: bool = False
    """Output layer shares the input embedding matrix."""

    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""

    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""

    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary embedding parameters."""

    initializer_range: float = 0.02
    """Std of the random initialisation (random models only)."""

    sliding_window: Optional[int] = None
    """Sliding-window size: the ``sliding_attention`` layers (``layer_types``) attend to the last
    ``sliding_window`` tokens of a query's path, itself included (gpt-oss). A model with a window
    and no such layer (Mistral) does not apply it: its samples must not exceed it."""

    torch_dtype: str = "float32"
    """Parameter dtype of the HF checkpoint (``bfloat16``, ``float16``, ``float32``)."""

    num_experts: Optional[int] = None
    """Routed experts per MoE layer (None: a dense model)."""

    moe_ffn_hidden_size: Optional[int] = None
    """SwiGLU intermediate size of one expert (``moe_intermediate_size``; Mixtral:
    ``intermediate_size``)."""

    moe_router_topk: int = 0
    """Experts each token is routed to (``num_experts_per_tok``)."""

    moe_norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to one (``norm_topk_prob``): softmax
    over all experts, top-k, renormalise (megatron: softmax over the top-k logits,
    ``moe_router_pre_softmax=False``); without it the top-k of the full softmax are used as
    they are (``moe_router_pre_softmax=True``)."""

    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    """SwiGLU intermediate size of the shared expert every token goes through besides its routed
    ones (Qwen2-MoE ``shared_expert_intermediate_size``; None: no shared expert)."""

    moe_shared_expert_gate: bool = False
    """The shared expert's output is scaled by ``sigmoid(x . w)``, ``w`` a ``[1, h]`` weight
    (Qwen2-MoE ``mlp.shared_expert_gate``; megatron ``moe_shared_expert_gate``)."""

    moe_router_score_function: str = "softmax"
    """How the router scores experts: ``softmax`` (Qwen-MoE, Mixtral) or ``sigmoid`` (each
    expert's ``sigmoid(logit)``, the top k renormalised: DeepSeek-V3, GLM-4.5; megatron
    ``moe_router_score_function``)."""

    moe_router_num_groups: Optional[int] = None
    """Grouped routing (``n_group``): the experts split into this many equal groups, and a token
    picks its top k among the experts of its ``moe_router_group_topk`` best groups (a group's
    score: the sum of its two best experts' scores). None: no group limit."""

    moe_router_group_topk: Optional[int] = None
    """Groups a token's experts are picked from (``topk_group``); None: no group limit."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """The routing weights are multiplied by this (``routed_scaling_factor``); None: by 1."""

    moe_router_expert_bias: bool = False
    """The router adds a per-expert bias (``e_score_correction_bias``, fp32) to the scores it
    selects experts by, not to the routing weights (aux-loss-free balancing; megatron
    ``moe_router_enable_expert_bias``, its ``expert_bias`` buffer)."""

    dense_mlp_layers: List[int] = field(default_factory=list)
    """0-based indices of the layers of an MoE model whose MLP is a dense SwiGLU of
    ``ffn_hidden_size`` (``first_k_dense_replace``: the first k; megatron ``moe_layer_freq``);
    every other layer's MLP is the mixture of experts."""

    layer_types: Optional[List[str]] = None
    """Each layer's token mixer, ``full_attention``, ``sliding_attention`` or ``linear_attention``
    (Qwen3-Next / Qwen3.5 / gpt-oss ``layer_types``); None: every layer is softmax attention."""

    linear_num_key_heads: int = 0
    """Linear-attention (Gated DeltaNet) layers: query/key heads (``linear_num_key_heads``)."""

    linear_num_value_heads: int = 0
    """Linear-attention layers: value heads, a multiple of the key heads."""

    linear_key_head_dim: int = 0
    """Linear-attention layers: per-head query/key width."""

    linear_value_head_dim: int = 0
    """Linear-attention layers: per-head value width."""

    linear_conv_kernel_dim: int = 0
    """Linear-attention layers: the causal depthwise convolution's kernel size."""

    attention_output_gate: bool = False
    """Softmax-attention layers scale their output by ``sigmoid(gate)`` per head, the gate a
    second half of the query projection (Qwen3-Next / Qwen3.5; megatron ``attention_output_gate``)."""

    zero_centered_norms: bool = False
    """RMSNorm weights are stored around zero: ``x * (1 + w)`` (megatron
    ``layernorm_zero_centered_gamma``)."""

    attention_sinks: bool = False
    """Every softmax of a softmax-attention layer has one more logit per head in its denominator,
    a learnable sink (gpt-oss ``self_attn.sinks``; megatron ``softmax_type='learnable'``)."""

    linear_bias: bool = False
    """Every linear layer carries a bias: the attention's q/k/v and output projections, the
    experts and the router (gpt-oss; megatron ``add_bias_linear``)."""

    mtp_layers: int = 0
    """Multi-token-prediction layers of the checkpoint (``mtp_num_hidden_layers``, the ``mtp.*``
    tensors: a draft head for speculative decoding). Not built or trained: their tensors are
    carried through conversions unchanged (:mod:`megatron_psrl.checkpoint.passthrough`)."""

    q_lora_rank: Optional[int] = None
    """Latent attention (MLA): rank of the query's compression (``q_a_proj``, its RMSNorm, then
    ``q_b_proj``); None: the query is projected directly (``q_proj``)."""

    kv_lora_rank: int = 0
    """Latent attention (MLA, DeepSeek-V3): rank of the compressed key/value latent every head's
    key (its position-free part) and value are projected up from; 0: not latent attention."""

    qk_nope_head_dim: int = 0
    """Latent attention: per-head width of the key and query part without RoPE (from the latent)."""

    qk_rope_head_dim: int = 0
    """Latent attention: width of the rotated part of every query head and of the one RoPE key all
    heads share (projected from the hidden state beside the latent)."""

    v_head_dim: int = 0
    """Latent attention: per-head value width (the query/key width is ``head_dim``, nope + rope)."""

    latent_cache: str = "latent"
    """Latent attention: what a cached shared prefix keeps per token and layer, a run-time choice
    (``--latent-cache``; not read from the checkpoint's config). ``latent``: the normalised K/V
    latent and the rotated shared RoPE key (``kv_lora_rank + qk_rope_head_dim`` numbers, whole on
    every tensor-parallel rank), which every reader projects up again; ``per-head``: every head's
    key and value after the up-projection (``n (head_dim + v_head_dim) / tp``)."""

    hf_config: Dict[str, Any] = field(default_factory=dict)
    """The original config.json content, written back unchanged by mcore-to-hf."""

    def __post_init__(self) -> None:
        supported = _supported_model_types()
        if self.model_type not in supported:
            raise UnsupportedModelError(
                f"unsupported model type {self.model_type!r}; supported: {', '.join(supported)}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "head_dim", "ffn_hidden_size"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_layer_types()
        self._check_latent_attention()
        family = self.family
        if self.num_experts is not None and not family.is_moe or (
                self.num_experts is None and family.is_moe and not family.moe_layers_optional):
            raise UnsupportedModelError(f"model type {self.model_type!r} with num_experts={self.num_experts}")
        if self.is_moe:
            self._check_moe()
        elif self.dense_mlp_layers:
            raise UnsupportedModelError("dense_mlp_layers of a model without mixture-of-experts layers")

    def _check_moe(self) -> None:
        if not self.moe_ffn_hidden_size or self.moe_ffn_hidden_size <= 0:
            raise UnsupportedModelError(f"moe_intermediate_size must be positive, got {self.moe_ffn_hidden_size}")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                        f"got {self.moe_router_topk}")
        shared = self.moe_shared_expert_ffn_hidden_size
        if shared is not None and shared <= 0:
            raise UnsupportedModelError(f"shared_expert_intermediate_size must be positive, got {shared}")
        if self.moe_shared_expert_gate and shared is None:
            raise UnsupportedModelError("a shared-expert gate without a shared expert (shared_expert_intermediate_size)")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"router score function {self.moe_router_score_function!r}: softmax or "
                                        "sigmoid")
        if self.moe_router_expert_bias and self.moe_router_score_function != "sigmoid":
            raise UnsupportedModelError("a router expert bias (e_score_correction_bias) needs the sigmoid score "
                                        "function")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise UnsupportedModelError("grouped routing needs both n_group and topk_group")
        if groups is not None:
            if groups < 1 or self.num_experts % groups:
                raise UnsupportedModelError(f"n_group {groups} must divide n_routed_experts {self.num_experts}")
            if not 1 <= group_topk <= groups:
                raise UnsupportedModelError(f"topk_group must be in [1, n_group={groups}], got {group_topk}")
            if self.moe_router_topk > group_topk * (self.num_experts // groups):
                raise UnsupportedModelError(f"num_experts_per_tok {self.moe_router_topk} exceeds the experts of "
                                            f"topk_group {group_topk} groups of {self.num_experts // groups}")
        dense = self.dense_mlp_layers
        if len(set(dense)) != len(dense) or any(not 0 <= i < self.num_layers for i in dense):
            raise UnsupportedModelError(f"dense MLP layers {dense} must be distinct layers of the model's "
                                        f"{self.num_layers}")

    def _check_latent_attention(self) -> None:
        if not self.kv_lora_rank:
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise UnsupportedModelError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise UnsupportedModelError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise UnsupportedModelError(f"latent attention: head_dim {self.head_dim} is not qk_nope_head_dim "
                                        f"{self.qk_nope_head_dim} + qk_rope_head_dim {self.qk_rope_head_dim}")
        if self.latent_cache not in LATENT_CACHE_CHOICES:
            raise UnsupportedModelError(f"latent_cache {self.latent_cache!r}: choose from {LATENT_CACHE_CHOICES}")

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(f"layer_types names {len(self.layer_types)} layers, the model has "
                                        f"num_hidden_layers {self.num_layers}")
        unknown = sorted({t for t in self.layer_types if t not in ALL_LAYER_TYPES}, key=str)
        if unknown:
            raise UnsupportedModelError(f"layer_types {unknown} not supported; supported: {', '.join(ALL_LAYER_TYPES)}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise UnsupportedModelError(f"field 'sliding_window': sliding_attention layers need a window of at least "
                                        f"one token, got {self.sliding_window}")
        if LINEAR_ATTENTION not in self.layer_types:
            return
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedModelError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                                        f"linear_num_key_heads {self.linear_num_key_heads}")

    # ------------------------------------------------------------------ HF parsing
    @classmethod
    def from_hf_config(cls, hf: Dict[str, Any]) -> "ModelArchitecture":
        """Parse (and check) a Hugging Face config.json dict. A multimodal wrapper's language
        model is read from its family's text part (``text_config``,
        :meth:`~megatron_psrl.model.families.ModelFamily.hf_text_config`); ``hf_config`` keeps
        the whole dict."""
        model_type = hf.get("model_type", "<missing>")
        supported, moe_types = _supported_model_types(), _moe_model_types()
        from megatron_psrl.model.families.registry import get_family

        text = get_family(model_type).hf_text_config(hf) if model_type in supported else hf
        moe = [k for k in _MOE_KEYS if text.get(k)]
        reads_moe = model_type in supported and get_family(model_type).reads_moe_fields
        if model_type not in moe_types and not reads_moe and (moe or "moe" in str(model_type)):
            raise UnsupportedModelError(
                f"mixture-of-experts models other than {', '.join(moe_types)} are not supported "
                f"(model_type {model_type!r}" + (f", config keys {moe}" if moe else "") + ")"
            )
        if model_type not in supported:
            raise UnsupportedModelError(
                f"unsupported model type {model_type!r} (normalisation, attention and MLP layout are "
                f"known only for {', '.join(supported)})"
            )
        family = get_family(model_type)
        act = text.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported activation {act!r}: only SwiGLU (silu) MLPs are supported")
        attention_fields = family.hf_attention_fields(text)  # q/k/v bias, q/k norm, sliding window
        number = _number_reader(text)
        heads = number("num_attention_heads")
        hidden = number("hidden_size")
        if heads < 1:
            raise UnsupportedModelError(f"num_attention_heads must be positive, got {heads}")
        dtype = hf.get("torch_dtype") or hf.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float32"
        try:
            mlp_fields = family.hf_mlp_fields(text, number)
        except KeyError as exc:  # a field transformers would default: refused, as for dense models
            if not family.is_moe:
                raise
            raise UnsupportedModelError(f"mixture-of-experts model type {model_type!r}: missing field "
                                        f"{exc.args[0]!r}") from None
        return cls(
            **mlp_fields,
            **attention_fields,
            **family.hf_layer_fields(text, number),  # layer types, linear-attention layers
            model_type=model_type,
            vocab_size=number("vocab_size"),
            hidden_size=hidden,
            num_layers=number("num_hidden_layers"),
            num_attention_heads=heads,
            num_kv_heads=number("num_key_value_heads", default=None) or heads,
            head_dim=family.hf_head_dim(text, number),
            ffn_hidden_size=number("intermediate_size"),
            rms_norm_eps=number("rms_norm_eps", float, 1e-6),
            max_position_embeddings=number("max_position_embeddings", default=4096),
            tie_word_embeddings=bool(family.hf_tie_word_embeddings(hf)),
            rope=RopeConfig.from_hf(text),
            initializer_range=number("initializer_range", float, 0.02),
            torch_dtype=str(dtype).replace("torch.", ""),
            hf_config=dict(hf),
        )

    @classmethod
    def from_hf_dir(cls, hf_dir: str) -> "ModelArchitecture":
        path = os.path.join(hf_dir, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{hf_dir}: no config.json (expected a Hugging Face save_pretrained folder)") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(path, f"invalid JSON: {exc}") from None
        if not isinstance(hf, dict):
            raise CheckpointError(path, "expected a JSON object")
        try:
            return cls.from_hf_config(hf)
        except KeyError as exc:
            raise UnsupportedModelError(f"{path}: missing field {exc.args[0]!r}") from None
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{path}: {exc}") from None
        except (TypeError, ValueError) as exc:  # e.g. a rope_scaling value of the wrong type
            raise UnsupportedModelError(f"{path}: malformed config: {exc}") from None

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ModelArchitecture":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        if d.get("layer_types") is not None:
            d["layer_types"] = list(d["layer_types"])
        d["dense_mlp_layers"] = list(d.get("dense_mlp_layers") or [])
        return cls(**d)

    # ------------------------------------------------------------------ derived
    @property
    def num_query_groups(self) -> int:
        return self.num_kv_heads

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Vocabulary padded to a multiple of the TP size (megatron splits it evenly).

        Padded logits are masked out of the softmax, so the model stays exact.
        """
        return int(math.ceil(self.vocab_size / tensor_parallel_size) * tensor_parallel_size)

    @property
    def multi_latent_attention(self) -> bool:
        """The attention is latent attention (MLA, ``kv_lora_rank`` > 0)."""
        return self.kv_lora_rank > 0

    @property
    def rope_head_dim(self) -> int:
        """The head width RoPE's frequencies are computed for: ``head_dim`` (of which
        ``partial_rotary_factor`` is rotated); latent attention's ``qk_rope_head_dim``."""
        return self.qk_rope_head_dim if self.multi_latent_attention else self.head_dim

    def softmax_scale(self) -> float:
        """1/sqrt(head_dim), times yarn's cos/sin scaling squared (it scales both q and k).
        Latent attention: 1/sqrt(head_dim) times DeepSeek's YaRN correction squared,
        ``(0.1 mscale_all_dim ln(factor) + 1)^2`` (Hugging Face's ``DeepseekV3Attention.scaling``;
        the cos/sin scaling rotates only the RoPE part of each head, it is not folded in here)."""
        if self.multi_latent_attention:
            rope, scale = self.rope, 1.0 / math.sqrt(self.head_dim)
            if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
                scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
            return scale
        return self.rope.attention_scaling() ** 2 / math.sqrt(self.head_dim)

    @property
    def is_moe(self) -> bool:
        """The model's MLPs are mixtures of experts (all but ``dense_mlp_layers``)."""
        return self.num_experts is not None

    @property
    def moe_layers(self) -> Tuple[int, ...]:
        """0-based indices of the layers whose MLP is a mixture of experts, in layer order (the
        routes of router replay are per such layer)."""
        if not self.is_moe:
            return ()
        dense = set(self.dense_mlp_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def family(self):
        """The bundle of this model's family (:class:`megatron_psrl.model.families.ModelFamily`)."""
        from megatron_psrl.model.families.registry import get_family

        return get_family(self.model_type)

    def mlp_parameters(self) -> int:
        """Parameters of one layer's MLP: SwiGLU, or the experts, the router and the shared
        expert (with its gate) of an MoE layer (the family counts them)."""
        return self.family.mlp_parameters(self)

    def active_mlp_parameters(self) -> int:
        """Parameters one token multiplies with in a layer's MLP (MoE: its top-k experts, the
        router and the shared expert), which its FLOPs are proportional to."""
        return self.family.active_mlp_parameters(self)

    def dense_mlp_parameters(self) -> int:
        """Parameters of a dense SwiGLU MLP of ``ffn_hidden_size`` (a dense layer of an MoE model)."""
        return 3 * self.hidden_size * self.ffn_hidden_size

    def all_mlp_parameters(self) -> int:
        """Parameters of every layer's MLP (an MoE model's dense layers counted as such)."""
        dense = len(self.dense_mlp_layers)
        return (self.num_layers - dense) * self.mlp_parameters() + dense * self.dense_mlp_parameters()

    def active_ffn_hidden_size(self) -> int:
        """The SwiGLU width of a dense MLP with the FLOPs per token of this model's MLP: the
        intermediate size of a dense model; for MoE, its top-k experts' widths plus the router
        (the cost model counts the experts a token is routed to, not all of them), averaged
        over the layers when some are dense (``dense_mlp_layers``)."""
        dense = len(self.dense_mlp_layers)
        active = (self.num_layers - dense) * self.active_mlp_parameters() + dense * self.dense_mlp_parameters()
        return max(1, round(active / (self.num_layers * 3 * self.hidden_size)))

    @property
    def layer_kinds(self) -> Tuple[str, ...]:
        """Every layer's token mixer, ``full_attention`` or ``linear_attention``."""
        return tuple(self.layer_types) if self.layer_types else (FULL_ATTENTION,) * self.num_layers

    @property
    def sliding_window_layers(self) -> Tuple[int, ...]:
        """0-based indices of the layers that attend within ``sliding_window``."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == SLIDING_ATTENTION)

    @property
    def sample_length_limit(self) -> Optional[int]:
        """The longest sample the model runs as its family does: the sliding window it reads and
        no layer applies (Mistral's; refused past it), else None."""
        return self.sliding_window if self.sliding_window is not None and not self.sliding_window_layers else None

    @property
    def linear_attention_layers(self) -> Tuple[int, ...]:
        """0-based indices of the linear-attention (Gated DeltaNet) layers."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == LINEAR_ATTENTION)

    def attention_parameters(self) -> int:
        """Parameters of one softmax-attention layer's attention (projections, biases, q/k norms;
        the output gate's half of the query projection; latent attention's down- and
        up-projections and latent norms)."""
        if self.multi_latent_attention:
            return self.latent_attention_parameters()
        h, hd = self.hidden_size, self.head_dim
        q_rows = self.num_attention_heads * hd * (2 if self.attention_output_gate else 1)
        attn = h * (q_rows + 2 * self.num_kv_heads * hd) + self.num_attention_heads * hd * h
        if self.qkv_bias:
            attn += hd * (self.num_attention_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        if self.linear_bias:  # the output projection's (q/k/v: qkv_bias)
            attn += h
        if self.attention_sinks:
            attn += self.num_attention_heads
        return attn

    def latent_attention_parameters(self) -> int:
        """Parameters of one latent-attention layer: the query's down-projection, norm and
        up-projection (or its direct projection), the K/V down-projection to the latent and the
        RoPE key, the latent's norm, its up-projection to every head's key and value, and the
        output projection."""
        h, n, hd = self.hidden_size, self.num_attention_heads, self.head_dim
        r, rope, v = self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
        q = h * n * hd if self.q_lora_rank is None else self.q_lora_rank * (h + 1 + n * hd)
        return q + h * (r + rope) + r + r * n * (self.qk_nope_head_dim + v) + n * v * h

    def linear_attention_parameters(self) -> int:
        """Parameters of one Gated DeltaNet layer's mixer: the input projection to q, k, v, the
        output gate z, beta and alpha; the depthwise convolution over q, k, v; ``dt_bias`` and
        ``A_log`` per value head; the gated output norm; the output projection."""
        h, qk = self.hidden_size, self.linear_num_key_heads * self.linear_key_head_dim
        v, nv = self.linear_num_value_heads * self.linear_value_head_dim, self.linear_num_value_heads
        return (h * (2 * qk + 2 * v + 2 * nv) + (2 * qk + v) * self.linear_conv_kernel_dim + 2 * nv
                + self.linear_value_head_dim + v * h)

    def num_parameters(self) -> int:
        h = self.hidden_size
        mixers = sum(self.linear_attention_parameters() if kind == LINEAR_ATTENTION else self.attention_parameters()
                     for kind in self.layer_kinds)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return mixers + self.all_mlp_parameters() + self.num_layers * 2 * h + emb + h
