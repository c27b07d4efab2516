"""A model family as one bundle: :class:`ModelFamily` and the Llama-like dense decoder.

Everything that differs between two supported Hugging Face families is a method or field of
their bundle, so the rest of the system asks the bundle instead of testing ``model_type``:

- which config.json keys are read, and which variants are refused (:meth:`hf_attention_fields`,
  :meth:`hf_mlp_fields`);
- megatron's ``TransformerConfig`` fields and layer-spec choices (:meth:`transformer_config_fields`,
  :meth:`moe_config_fields`, :meth:`layer_spec_choices`);
- the state-dict adapter class (:attr:`adapter`);
- what a cached prefix keeps per layer (:meth:`prefix_states`);
- the memory plan's saved-activation bytes and the cost model's FLOP dimensions
  (:meth:`saved_activation_bytes_per_token`, :meth:`cost_dims`, parameter counts);
- its debug-size configs (:attr:`tiny_configs`, :attr:`shape_configs`).

:class:`LlamaLikeFamily` is the dense decoder all current families share (GQA, RoPE, RMSNorm,
SwiGLU); Qwen's attention variants override its parsing, and
:class:`~megatron_psrl.model.families.moe.MoEFamily` replaces its MLP.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple, Type

import torch
import torch.nn.functional as F

from megatron_psrl.errors import UnsupportedModelError

if TYPE_CHECKING:
    from megatron_psrl.kvcache.prefix_state import PrefixState
    from megatron_psrl.model.adapters.base import LlamaStyleAdapter
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.schedule.cost import ModelDims

FP32_BYTES = 4
"""The norms' internals and statistics and the attention's log-sum-exp stay fp32 in any dtype."""

NumberReader = Callable[..., Any]
"""``number(key, kind=int, default=<required>)``: a numeric config.json field, checked (see
:meth:`~megatron_psrl.model.architecture.ModelArchitecture.from_hf_config`); a missing required
field raises ``KeyError(key)``."""

TINY_BASE: Dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
"""The config.json fields every debug-size config starts from (each family overrides some)."""


@dataclass(frozen=True)
class LayerSpecChoices:
    """What megatron's GPT layer-spec builders (``get_gpt_layer_local_spec`` and the Transformer
    Engine one) are asked for; the implementation and the core attention are chosen elsewhere."""

    num_experts: Optional[int] = None
    """Routed experts of the MLP (megatron's ``MoELayer``); None: a dense MLP."""

    qk_layernorm: bool = False
    """Per-head norms on queries and keys before RoPE."""

    normalization: str = "RMSNorm"
    """The layer norms of the local spec (Transformer Engine's reads ``config.normalization``)."""

    linear_attention_layers: Tuple[int, ...] = ()
    """0-based indices of the layers whose token mixer is linear attention (Gated DeltaNet)."""

    zero_centered_norms: bool = False
    """The decoder's RMSNorms compute ``x * (1 + w)`` (megatron ``layernorm_zero_centered_gamma``)."""

    multi_latent_attention: bool = False
    """The token mixer is latent attention (megatron's ``MLASelfAttention``, built as the project's
    :class:`~megatron_psrl.model.latent_attention.TreeMLASelfAttention`); with ``qk_layernorm``
    its latents' RMSNorms."""
    dense_mlp_layers: Tuple[int, ...] = ()
    """0-based indices of the layers of an MoE model built with a dense MLP (megatron's
    ``moe_layer_freq`` 0); the others get ``num_experts``' MoE layer."""


@dataclass(frozen=True)
class ModelFamily(abc.ABC):
    """One Hugging Face model family: how it is parsed, built, converted, cached and costed.

    Registered by ``model_type`` (:func:`~megatron_psrl.model.families.register_family`); a
    family is one module that builds its bundle and registers it."""

    model_type: str
    """Hugging Face ``model_type`` (the registry key), e.g. ``llama``."""

    adapter: Type["LlamaStyleAdapter"]
    """The Hugging Face <-> megatron state-dict adapter class (:mod:`megatron_psrl.model.adapters`)."""

    tiny_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)
    """Debug-size config.json dicts by ``--model`` name, randomly initialised (CI, quick runs)."""

    shape_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)
    """Full-size architectures by name, randomly initialised (GPU benchmarks; too large for CPU tests)."""

    is_moe: ClassVar[bool] = False
    """The MLPs are mixtures of experts (``ModelArchitecture.num_experts`` is set), all but
    those of ``ModelArchitecture.dense_mlp_layers``."""

    moe_layers_optional: ClassVar[bool] = False
    """An MoE family some of whose configs have no MoE layer (DeepSeek-V3 with
    ``first_k_dense_replace >= num_hidden_layers``): those parse as dense models
    (``ModelArchitecture.num_experts`` None) of the family."""

    has_linear_attention: ClassVar[bool] = False
    """Some layers' token mixer is linear attention (``ModelArchitecture.layer_types``)."""

    reads_moe_fields: ClassVar[bool] = False
    """The family reads a config's mixture-of-experts fields itself, MoE or not (DeepSeek-V3's
    configs carry them whatever layers are dense); otherwise a family that is not MoE is refused
    any of them before parsing."""

    # ------------------------------------------------------------------ Hugging Face config
    def hf_has_moe_layers(self, hf: Mapping[str, Any]) -> bool:
        """Whether the config.json dict ``hf`` has mixture-of-experts layers (every config of an
        MoE family, unless :attr:`moe_layers_optional`)."""
        return self.is_moe

    @abc.abstractmethod
    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        """``qkv_bias``, ``qk_norm`` and ``sliding_window`` of a config.json; raises
        :class:`UnsupportedModelError` for an attention variant not implemented."""

    def hf_text_config(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        """The part of a config.json that describes the language model (a multimodal wrapper's
        ``text_config``; the whole dict otherwise)."""
        return hf

    def hf_head_dim(self, hf: Dict[str, Any], number: NumberReader) -> int:
        """The query/key head width ``ModelArchitecture.head_dim``: ``head_dim``, else hidden
        size / heads."""
        return number("head_dim", default=None) or number("hidden_size") // number("num_attention_heads")

    def hf_tie_word_embeddings(self, hf: Dict[str, Any]) -> bool:
        """Whether the output layer shares the input embedding (``tie_word_embeddings``)."""
        return bool(self.hf_text_config(hf).get("tie_word_embeddings", False))

    def hf_layer_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        """Per-layer structure of :class:`ModelArchitecture` (``layer_types`` and the linear
        layers' fields; none for a model of softmax-attention layers only); a config naming
        linear-attention layers is refused by a family without them."""
        if any(t != "full_attention" for t in hf.get("layer_types") or []):
            raise UnsupportedModelError(f"field 'layer_types': {self.model_type} layers are softmax attention only")
        return {}

    @abc.abstractmethod
    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        """The MLP fields of :class:`ModelArchitecture` beyond ``ffn_hidden_size`` (MoE: experts,
        routing, shared expert); a missing required field raises ``KeyError(key)``."""

    # ------------------------------------------------------------------ megatron model
    def transformer_config_class(self, arch: "ModelArchitecture") -> type:
        """megatron's config class the model is built with (``TransformerConfig``; latent
        attention: ``MLATransformerConfig``)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig

    @abc.abstractmethod
    def transformer_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        """``TransformerConfig`` fields of the layer's structure (norm, MLP, biases, q/k norms)."""

    @abc.abstractmethod
    def moe_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        """``TransformerConfig`` fields of the MoE layer (none for a dense family)."""

    @abc.abstractmethod
    def layer_spec_choices(self, arch: "ModelArchitecture") -> LayerSpecChoices:
        """What megatron's layer spec is built with."""

    # ------------------------------------------------------------------ KV cache
    @abc.abstractmethod
    def prefix_states(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                      dtype: torch.dtype) -> Tuple["PrefixState", ...]:
        """What a cached prefix keeps for each layer of the model (megatron layer order), on one
        tensor-parallel rank, in ``dtype``."""

    # ------------------------------------------------------------------ memory plan and cost model
    @abc.abstractmethod
    def attention_saved_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                        dtype_bytes: int) -> int:
        """Bytes per token one layer's core attention saves for backward."""

    @abc.abstractmethod
    def saved_activation_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                         dtype_bytes: int) -> int:
        """Bytes per token of every tensor autograd saves for backward, all layers, exactly."""

    @abc.abstractmethod
    def mlp_parameters(self, arch: "ModelArchitecture") -> int:
        """Parameters of one layer's MLP."""

    @abc.abstractmethod
    def active_mlp_parameters(self, arch: "ModelArchitecture") -> int:
        """Parameters one token multiplies with in a layer's MLP (its FLOPs are proportional)."""

    @abc.abstractmethod
    def cost_dims(self, arch: "ModelArchitecture") -> "ModelDims":
        """The dense transformer whose FLOPs per token the cost model charges for this model."""

    def read_flops_per_token(self, arch: "ModelArchitecture") -> float:
        """Forward + backward FLOPs, all layers, a reader spends per cached prefix token it reads
        beyond attending to it (``CostModel.read_flops_per_token``): 0, readers attend to the
        cached K/V themselves."""
        return 0.0


class LlamaLikeFamily(ModelFamily):
    """A Llama-like dense decoder: GQA with RoPE, RMSNorm, a SwiGLU MLP, no biases (Llama,
    Mistral); sliding-window configs are read (sequences must not exceed the window)."""

    # ------------------------------------------------------------------ Hugging Face config
    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UnsupportedModelError("attention_bias / mlp_bias on Llama-style models is not supported")
        sliding = int(hf["sliding_window"]) if hf.get("sliding_window") is not None else None
        return dict(qkv_bias=False, qk_norm=False, sliding_window=sliding)

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ megatron model
    def transformer_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        return dict(
            normalization="RMSNorm",
            gated_linear_unit=True,  # SwiGLU: linear_fc1 holds [gate; up]
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=arch.qkv_bias,
            qk_layernorm=arch.qk_norm,
        )

    def moe_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        return {}

    def layer_spec_choices(self, arch: "ModelArchitecture") -> LayerSpecChoices:
        return LayerSpecChoices(num_experts=None, qk_layernorm=arch.qk_norm)

    # ------------------------------------------------------------------ KV cache
    def prefix_states(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                      dtype: torch.dtype) -> Tuple["PrefixState", ...]:
        """Every layer is softmax attention: post-RoPE K and V of this rank's key/value heads."""
        # imported here: the KV cache package may itself ask the families for its geometry
        from megatron_psrl.kvcache.prefix_state import PrefixState

        state = PrefixState.softmax(arch.num_kv_heads // tensor_parallel_size, arch.head_dim, dtype=dtype)
        return (state,) * arch.num_layers

    # ------------------------------------------------------------------ memory plan
    def attention_saved_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                        dtype_bytes: int) -> int:
        """Beyond the fused QKV output (the value is a view of it): the query and key after
        RoPE, the output, and the fp32 log-sum-exp. The same for every modelled backend (see
        :func:`megatron_psrl.schedule.memory.attention_saved_bytes_per_token`)."""
        from megatron_psrl.attention.core_attention import saved_bytes_per_token

        return saved_bytes_per_token(arch.num_attention_heads, arch.num_kv_heads, arch.head_dim,
                                     tensor_parallel_size, dtype_bytes)

    fused_glu: bool = True
    """The MLP's gated activation is megatron's fused SwiGLU on every device
    (``megatron_psrl.compat.swiglu_fusion_fields``): it saves the fc1 output only. False where
    the activation is not SwiGLU and runs unfused on CPU (gpt-oss's clamped GLU)."""

    def glu_saved_widths(self) -> int:
        """``f``-wide tensors per token that one GLU MLP keeps for backward: fused, the fc1
        output (2) and the fc2 input (1); unfused, also the two halves' activation products (2)."""
        return 3 if self.fused_glu else 5

    def mlp_saved_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                  dtype_bytes: int) -> int:
        """SwiGLU: the fc1 output (2f / tp) and the fc2 input (f / tp); unfused also its two
        halves' activation products (:meth:`glu_saved_widths`)."""
        return self.glu_saved_widths() * arch.ffn_hidden_size // tensor_parallel_size * dtype_bytes

    def saved_activation_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                         dtype_bytes: int) -> int:
        """Counted from megatron's local layer with the project's core attention (a test compares
        it with the storages ``torch.autograd.graph.saved_tensors_hooks`` sees, fp32 and bf16).
        Per layer:

        - each of the two RMSNorms: its input and the normalised input in fp32 (torch's RMSNorm
          computes in fp32), its output in the model dtype (the next linear's input): 2h fp32 + h;
        - V: a copy of it, ng hd / tp (the core attention copies V out of the fused QKV output, so
          a kept graph does not hold that whole buffer); with Qwen3's q/k norms the key norm's
          input is a view of it, which keeps the fused QKV output, (np + 2 ng) hd / tp, instead;
        - the query after RoPE and the attention output: 2 np hd / tp; the key after RoPE: ng hd / tp;
        - RoPE's cos and sin for queries and keys: 4 r, ``r`` the rotated width (``hd``; partial
          RoPE: ``partial_rotary_factor * hd``);
        - Qwen3's per-head q/k norms: the query's input and normalised input in fp32 (2 np hd / tp);
          the key's normalised input, and its input where the cast to fp32 copies it (a view of
          the fused QKV output in fp32): (1 or 2) ng hd / tp;
        - the MLP: :meth:`mlp_saved_bytes_per_token` (fused SwiGLU 3f / tp; an MoE layer's experts);
        - fp32 statistics: the norms' reciprocal RMS (2, plus np + ng per-head ones with q/k
          norms) and the attention's log-sum-exp (np / tp).

        Plus the final norm (2h fp32 and its statistic) and the input ids (int64). The attention's
        share is :meth:`attention_saved_bytes_per_token`."""
        h, hd, tp, b = arch.hidden_size, arch.head_dim, tensor_parallel_size, dtype_bytes
        q, kv = arch.num_attention_heads * hd // tp, arch.num_kv_heads * hd // tp
        fp32 = FP32_BYTES
        norms = 2 * (2 * h * fp32 + h * b)
        value = (q + 2 * kv if arch.qk_norm else kv) * b
        rotated = 2 * ((int(hd * arch.rope.partial_rotary_factor) + 1) // 2)  # (RopeConfig.inv_freq's width x 2)
        attention = value + 4 * rotated * b + self.attention_saved_bytes_per_token(arch, tp, b)
        qk_norms = 2 * q * fp32 + (1 if b == fp32 else 2) * kv * fp32 if arch.qk_norm else 0
        mlp = self.mlp_saved_bytes_per_token(arch, tp, b)
        stats = fp32 * (2 + ((q + kv) // hd if arch.qk_norm else 0))
        per_layer = norms + attention + qk_norms + mlp + stats
        return arch.num_layers * per_layer + 2 * h * fp32 + fp32 + 8

    # ------------------------------------------------------------------ parameters and FLOPs
    def mlp_parameters(self, arch: "ModelArchitecture") -> int:
        return 3 * arch.hidden_size * arch.ffn_hidden_size

    def active_mlp_parameters(self, arch: "ModelArchitecture") -> int:
        return 3 * arch.hidden_size * arch.ffn_hidden_size

    def cost_dims(self, arch: "ModelArchitecture") -> "ModelDims":
        """GQA attention and a SwiGLU MLP of the active width (for MoE, the experts a token is
        routed to and the router, :meth:`ModelArchitecture.active_ffn_hidden_size`)."""
        # imported here: loading a model need not load the planner's data and tree modules
        from megatron_psrl.schedule.cost import ModelDims

        return ModelDims(hidden_size=arch.hidden_size, num_layers=arch.num_layers,
                         num_heads=arch.num_attention_heads, num_kv_heads=arch.num_kv_heads,
                         head_dim=arch.head_dim, ffn_hidden_size=arch.active_ffn_hidden_size(),
                         vocab_size=arch.vocab_size, gated=True)


def refuse_sliding_window(hf: Dict[str, Any]) -> None:
    """Qwen configs carry a ``sliding_window`` size that applies only with ``use_sliding_window``,
    which is refused."""
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention (use_sliding_window) is not supported")
