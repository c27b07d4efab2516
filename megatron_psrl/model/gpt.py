"""The megatron-core GPT model with prefix-sharing attention and per-token RoPE positions.

``PsrlGPTModel`` is megatron-core's ``GPTModel`` (embedding, ``TransformerBlock`` of
megatron ``TransformerLayer``s, final norm, output layer; tensor parallelism from megatron's
parallel layers) with three differences, all needed by tree packing:

- the ``core_attention`` slot of every layer holds :class:`PrefixSharingAttention`;
- RoPE frequencies are computed from explicit position ids (a tree token's position is its
  depth in its sample, not its offset in the pack) and handed to the decoder;
- ``forward`` returns final hidden states ``[t, h]``; logits are computed only for the rows
  that need them (``output_logits``), because most tokens of a pack carry no loss;
- the last layer (:class:`PsrlTransformerLayer`) goes past its K/V projection only for the
  rows whose final hidden state is read (``TreeAttentionMetadata.output_rows``): every row's
  K/V are keys of the rows kept, nothing reads the other rows' outputs;
- under sequence parallelism a pack is padded to a multiple of TP rows before the embedding is
  scattered and gathered back to its ``t`` rows at the end
  (:mod:`megatron_psrl.model.sequence_parallel`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_psrl.attention import PrefixSharingAttention, TreeAttentionMetadata
from megatron_psrl.compat import (
    eager_activation,
    keeps_cuda_embedding_sync,
    quiet_expected_import_warnings,
    swiglu_fusion_fields,
    transformer_config_overrides,
)
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.sequence_parallel import (
    SequenceParallelTorchNorm,
    padded_rows,
    padding_mask,
    tensor_parallel_rank_and_size,
    with_sequence_parallel_norms,
)
from megatron_psrl.model.stages import pipeline_layer_counts

quiet_expected_import_warnings()

Tensor = torch.Tensor

TRANSFORMER_IMPLS = ("local", "transformer_engine")


def build_transformer_config(
    arch: ModelArchitecture,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    pipeline_layers: Optional[Sequence[int]] = None,
    virtual_pipeline_size: int = 1,
    **overrides,
) -> TransformerConfig:
    """megatron TransformerConfig equivalent to the HF architecture."""
    if arch.num_kv_heads % tensor_parallel_size:
        raise ConfigurationError(
            f"tensor parallel size {tensor_parallel_size} must divide the {arch.num_kv_heads} key/value heads"
        )
    if virtual_pipeline_size > 1:  # interleaved stages: an even split into PP x V chunks
        if pipeline_layers is not None:
            raise ConfigurationError("virtual pipeline stages need an even split of the layers (no "
                                     "--decoder-first/last-pipeline-num-layers)")
        per_chunk = pipeline_layer_counts(arch.num_layers, pipeline_parallel_size * virtual_pipeline_size)[0]
        overrides.setdefault("virtual_pipeline_model_parallel_size", virtual_pipeline_size)
        pipeline_layers = (per_chunk * virtual_pipeline_size,) * pipeline_parallel_size
    if pipeline_layers is None:
        pipeline_layers = pipeline_layer_counts(arch.num_layers, pipeline_parallel_size)
    if len(pipeline_layers) != pipeline_parallel_size or sum(pipeline_layers) != arch.num_layers:
        raise ConfigurationError(f"pipeline stages of {list(pipeline_layers)} layers do not split the model's "
                                 f"{arch.num_layers} layers over {pipeline_parallel_size} stages")
    if len(set(pipeline_layers)) > 1:  # Megatron-LM's uneven split: first / last stage differ
        overrides.setdefault("num_layers_in_first_pipeline_stage", pipeline_layers[0])
        overrides.setdefault("num_layers_in_last_pipeline_stage", pipeline_layers[-1])
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        layernorm_epsilon=arch.rms_norm_eps,
        **arch.family.transformer_config_fields(arch),  # norm, MLP, biases, q/k norms
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        softmax_scale=arch.softmax_scale(),
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        # The RL loss is normalised over the global batch already: megatron's DDP must sum
        # data-parallel gradients, not average them.
        calculate_per_token_loss=True,
    )
    kwargs.update(transformer_config_overrides(device))
    if kwargs["activation_func"] is F.silu and kwargs.get("gated_linear_unit"):  # SwiGLU: fused on every device
        kwargs.update(swiglu_fusion_fields())
    kwargs["activation_func"] = eager_activation(kwargs["activation_func"], device)
    kwargs.update(moe_config_fields(arch))
    kwargs.update(overrides)
    with warnings.catch_warnings():
        # selective recompute of core attention: megatron warns that TE's fused attention would
        # not need it; ours is not TE's, and the choice is the user's
        warnings.filterwarnings("ignore", message="If you are using transformer_engine as the transformer")
        return arch.family.transformer_config_class(arch)(**kwargs)  # (latent attention: MLATransformerConfig)


def moe_config_fields(arch: ModelArchitecture) -> dict:
    """TransformerConfig fields of an MoE architecture (none for a dense one): its family's
    (:meth:`megatron_psrl.model.families.ModelFamily.moe_config_fields`; every supported MoE
    family uses megatron's softmax top-k router, dropless, load-balancing loss off unless
    ``moe_aux_loss_coeff`` overrides it)."""
    return arch.family.moe_config_fields(arch)


def local_spec_only(arch: ModelArchitecture) -> bool:
    """The model is built with megatron's local layer spec only (latent attention; the hybrid
    families' zero-centred norms and Gated DeltaNet layers)."""
    choices = arch.family.layer_spec_choices(arch)
    return choices.multi_latent_attention or choices.zero_centered_norms


def build_layer_spec(arch: ModelArchitecture, transformer_impl: str = "local", moe_grouped_gemm: bool = False,
                     attention_backend: Optional[str] = None, dense_mlp: bool = False) -> ModuleSpec:
    """megatron's GPT layer spec with PrefixSharingAttention in the core-attention slot, built for
    ``attention_backend`` (None: chosen at run time; ``te`` builds Transformer Engine's attention
    with the model) (MoE architectures: megatron's MoELayer as the MLP, unless ``dense_mlp``: the
    spec of their dense layers; ``moe_grouped_gemm``: its grouped-GEMM experts, GPU only). What
    the spec is built with (experts, q/k norms, the norm) is the family's choice
    (:meth:`megatron_psrl.model.families.ModelFamily.layer_spec_choices`)."""
    choices = arch.family.layer_spec_choices(arch)
    experts = None if dense_mlp else choices.num_experts
    grouped = bool(moe_grouped_gemm and experts)
    if choices.multi_latent_attention and transformer_impl != "local":
        raise ConfigurationError(f"model type {arch.model_type!r} (latent attention) is built with transformer_impl "
                                 "'local' only: Transformer Engine's latent-attention spec duplicates the "
                                 "down-projections the local spec splits, which the checkpoints' tensor-parallel "
                                 "layout does not cover yet")
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=grouped,
                                                          qk_layernorm=choices.qk_layernorm)
    elif transformer_impl == "local":
        # (torch norms that also run under sequence parallelism; as megatron's without it)
        spec = with_sequence_parallel_norms(get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=grouped, normalization=choices.normalization,
            qk_layernorm=choices.qk_layernorm, multi_latent_attention=choices.multi_latent_attention))
    else:
        raise ConfigurationError(f"unknown transformer_impl {transformer_impl!r}; choose from {TRANSFORMER_IMPLS}")
    if choices.multi_latent_attention:  # megatron's MLA rotating by the pack's position ids
        from megatron_psrl.model.latent_attention import TreeMLASelfAttention

        attention = spec.submodules.self_attention
        spec.submodules.self_attention = dataclasses.replace(
            attention, module=TreeMLASelfAttention, params=dict(attention.params, rope_mscale=arch.rope.attention_scaling()))
    spec.submodules.self_attention.submodules.core_attention = (
        PrefixSharingAttention if attention_backend is None
        else ModuleSpec(module=PrefixSharingAttention, params={"backend": attention_backend}))
    experts = getattr(getattr(spec.submodules.mlp, "submodules", None), "experts", None)
    if arch.linear_bias and getattr(getattr(experts, "submodules", None), "linear_fc2", None) is RowParallelLinear:
        experts.submodules.linear_fc2 = BiasedExpertOutput
    return spec


class BiasedExpertOutput(RowParallelLinear):
    """megatron's ``RowParallelLinear`` as an expert's fc2 when the experts have biases (gpt-oss).
    megatron's ``MLP`` adds the routing-weighted bias to this layer's output in place
    (``output += bias * probs``); without tensor or expert parallelism that output is the input
    a reduce over one rank hands back as is, an autograd view that may not be modified in
    place. Here such an output is returned as a tensor of its own (a copy of the expert's rows)."""

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return (output.clone() if output._is_view() else output), bias


def _with_norm(spec, norm):
    """``spec`` (a megatron ModuleSpec tree) with ``norm`` wherever it names a torch norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec in (WrappedTorchNorm, SequenceParallelTorchNorm):
        return norm
    if isinstance(spec, ModuleSpec):
        module = norm if spec.module in (WrappedTorchNorm, SequenceParallelTorchNorm) else spec.module
        return dataclasses.replace(spec, module=module, submodules=_with_norm(spec.submodules, norm))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _with_norm(getattr(spec, f.name), norm)
                                            for f in dataclasses.fields(spec)})
    return spec


def linear_attention_spec(config: TransformerConfig) -> ModuleSpec:
    """The token mixer of a linear-attention layer: the project's tree-packed Gated DeltaNet
    (:mod:`megatron_psrl.model.linear_attention`), its input projection and output projection
    megatron's tensor-parallel linears, its gated output norm a plain RMSNorm (``w * x``)."""
    try:
        from megatron_psrl.model import linear_attention
    except ImportError as exc:
        raise ConfigurationError(f"linear-attention layers need megatron_psrl.model.linear_attention "
                                 f"(TreeGatedDeltaNet), which this build lacks ({exc})") from None
    return linear_attention.tree_gated_delta_net_spec(config, "local")


def build_hybrid_layer_specs(arch: ModelArchitecture, config: TransformerConfig, vp_stage: Optional[int] = None,
                             transformer_impl: str = "local", moe_grouped_gemm: bool = False,
                             attention_backend: Optional[str] = None) -> list:
    """The layer specs of this rank's (virtual) stage of a model with zero-centred norms and
    linear-attention layers (Qwen3-Next, Qwen3.5): softmax layers as :func:`build_layer_spec`
    (the output gate is the config's ``attention_output_gate``), linear layers the same layer
    with :func:`linear_attention_spec` as the mixer, every decoder norm zero-centred
    (:class:`~megatron_psrl.model.norms.ZeroCenteredRMSNorm`). The local implementation only."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_psrl.model.norms import ZeroCenteredRMSNorm

    if transformer_impl != "local":
        raise ConfigurationError(f"model type {arch.model_type!r} is built with transformer_impl 'local' only "
                                 "(its zero-centred norms and Gated DeltaNet layers have no Transformer Engine spec "
                                 "here yet)")
    softmax = _with_norm(build_layer_spec(arch, "local", moe_grouped_gemm, attention_backend), ZeroCenteredRMSNorm)
    linear = None
    if arch.linear_attention_layers:
        linear = dataclasses.replace(softmax, submodules=dataclasses.replace(
            softmax.submodules, self_attention=linear_attention_spec(config)))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage)
    kinds = arch.layer_kinds[offset:offset + count]
    return [linear if kind == "linear_attention" else softmax for kind in kinds]


class RotaryFrequencies(torch.nn.Module):
    """RoPE angles for explicit positions: ``[t] -> [t, 1, 1, rot_dim]`` (megatron's layout).

    ``freqs = position * inv_freq`` is one multiplication per element, bit-identical to
    megatron's ``torch.outer`` and Hugging Face's matmul with an inner dimension of one.
    """

    def __init__(self, arch: ModelArchitecture):
        super().__init__()
        self.register_buffer("inv_freq", arch.rope.inv_freq(arch.rope_head_dim), persistent=False)

    def forward(self, position_ids: Tensor) -> Tensor:
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[:, None] * inv_freq[None, :]  # [t, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # non-interleaved halves, as HF's rotate_half
        return emb[:, None, None, :]


class PsrlTransformerLayer(TransformerLayer):
    """megatron's ``TransformerLayer``; as the model's last layer, given
    ``TreeAttentionMetadata.output_rows``, it computes only those rows past the K/V projection.

    Every row's input norm and QKV projection run (the kept rows attend to every row's K/V;
    the K/V hook of mechanism 2 stores and exchanges them); the queries, core attention,
    output projection, residuals, pre-MLP norm and MLP (an MoE layer's routing included) run
    on the kept rows only. Same operations on the same rows, so the kept rows' outputs and
    every gradient are those of the full layer (up to the rounding of a differently sized
    GEMM). Any other layer, or a layout this does not cover (sequence parallelism: rows are
    split over TP ranks; fp8 / fp4: their GEMMs want row counts in multiples; inference
    contexts; megatron's norm recomputation and activation offloading; a cross-attention; a
    linear-attention mixer, ``computes_every_row``),
    runs megatron's full layer: the model then returns every row."""

    def forward(self, *args, **kwargs):
        meta = kwargs.get("packed_seq_params")
        if not self._computes_output_rows_only(meta, kwargs):
            return super().forward(*args, **kwargs)
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return self._forward_output_rows(hidden_states, meta.for_output_rows(hidden_states.device),
                                         attention_mask=kwargs.get("attention_mask"),
                                         rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                                         attention_bias=kwargs.get("attention_bias"))

    def _computes_output_rows_only(self, meta, kwargs) -> bool:
        config = self.config
        return (isinstance(meta, TreeAttentionMetadata) and meta.output_rows is not None
                and meta.query_rows is None
                # megatron's attention with the project's core attention (not a linear layer's
                # mixer), no output gate (megatron gates every row's output with every row's gate)
                and isinstance(getattr(self.self_attention, "core_attention", None), PrefixSharingAttention)
                and not getattr(config, "attention_output_gate", False)
                and self.layer_number == config.num_layers  # global numbering: the model's last layer
                and not config.sequence_parallel
                and not getattr(config, "fp8", None) and not getattr(config, "fp4", None)  # GEMM row multiples
                and kwargs.get("inference_context") is None and kwargs.get("context") is None
                and not getattr(self, "recompute_input_layernorm", False)
                and not getattr(self, "offload_attn_norm", False)
                and not getattr(self, "offload_mlp_norm", False)
                and not getattr(config, "inference_fuse_tp_communication", False)
                and isinstance(self.cross_attention, IdentityOp)
                # a linear-attention mixer's every row feeds its descendants' states
                and not getattr(self.self_attention, "computes_every_row", False))

    def _forward_output_rows(self, hidden_states: Tensor, meta: TreeAttentionMetadata, attention_mask=None,
                             rotary_pos_emb=None, attention_bias=None):
        """megatron's ``_forward_attention`` + ``_forward_mlp`` for the rows ``meta.query_rows``:
        ``[t, 1, h] -> ([n, 1, h], None)``."""
        residual = hidden_states.index_select(0, meta.query_rows)  # [n, 1, h]
        # Every row: its K/V are keys of the kept rows (core attention takes the queries it needs).
        input_layernorm_output = self.input_layernorm(hidden_states)  # [t, 1, h]
        attention_output_with_bias = self.self_attention(
            input_layernorm_output, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias, packed_seq_params=meta,
        )  # ([n, 1, h], bias): core attention returned the kept rows, linear_proj ran on them
        with self.bias_dropout_add_exec_handler():
            hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attention_output_with_bias, residual, self.hidden_dropout)
        # Pre-MLP norm, MLP (MoE: only the kept rows are routed) and its residual: megatron's own.
        return self._forward_mlp(hidden_states), None


def mixed_mlp_block_spec(arch: ModelArchitecture, config: TransformerConfig, vp_stage: Optional[int] = None,
                         transformer_impl: str = "local", moe_grouped_gemm: bool = False,
                         attention_backend: Optional[str] = None) -> TransformerBlockSubmodules:
    """The block of this rank's (virtual) stage of an MoE model whose ``dense_mlp_layers`` have a
    dense MLP (GLM-4.5 / DeepSeek-V3 ``first_k_dense_replace``): each layer the spec of
    :func:`build_layer_spec`, dense or MoE as megatron's ``get_gpt_decoder_block_spec`` picks them
    from ``moe_layer_freq``, and the final norm as the uniform block's."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = set(arch.family.layer_spec_choices(arch).dense_mlp_layers)
    specs = [_with_row_skip(build_layer_spec(arch, transformer_impl, moe_grouped_gemm, attention_backend,
                                             dense_mlp=kind)) for kind in (False, True)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage)
    layers = [specs[i in dense] for i in range(offset, offset + count)]
    if transformer_impl == "local":
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelTorchNorm)
    from megatron.core.extensions.transformer_engine import TENorm  # (the TE spec's block norm)

    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)


def _with_row_skip(spec):
    """``spec`` with :class:`PsrlTransformerLayer` for megatron's ``TransformerLayer`` (its
    submodules as they are); any other spec as it is (its last layer then runs in full)."""
    if isinstance(spec, ModuleSpec) and spec.module is TransformerLayer:
        return dataclasses.replace(spec, module=PsrlTransformerLayer)
    return spec


class PsrlGPTModel(GPTModel):
    """megatron-core GPTModel for tree-packed micro-batches (see module docstring)."""

    def __init__(
        self,
        arch: ModelArchitecture,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        transformer_impl: str = "local",
        vp_stage: Optional[int] = None,
        attention_backend: Optional[str] = None,
    ):
        grouped = getattr(config, "moe_grouped_gemm", False)
        if arch.family.layer_spec_choices(arch).zero_centered_norms:  # Qwen3-Next / Qwen3.5
            from megatron_psrl.model.norms import ZeroCenteredRMSNorm

            specs = build_hybrid_layer_specs(arch, config, vp_stage, transformer_impl, grouped, attention_backend)
            layer_spec = TransformerBlockSubmodules(layer_specs=[_with_row_skip(s) for s in specs],
                                                    layer_norm=ZeroCenteredRMSNorm)
        elif arch.family.layer_spec_choices(arch).dense_mlp_layers:  # MoE layers after dense ones
            layer_spec = mixed_mlp_block_spec(arch, config, vp_stage, transformer_impl, grouped, attention_backend)
        else:
            layer_spec = _with_row_skip(build_layer_spec(arch, transformer_impl, moe_grouped_gemm=grouped,
                                                         attention_backend=attention_backend))
        if transformer_impl == "local" and not isinstance(layer_spec, TransformerBlockSubmodules):
            # The final norm named, not megatron's block default: that is apex's FusedLayerNorm
            # when apex is installed without Transformer Engine, which refuses RMSNorm; and under
            # sequence parallelism the norm must run on its rows' share.
            layer_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage),
                                                    layer_norm=SequenceParallelTorchNorm)
        super().__init__(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=arch.padded_vocab_size(config.tensor_model_parallel_size),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="none",
            # sequence parallelism: forward pads the pack to a multiple of TP, then scatters
            scatter_embedding_sequence_parallel=False,
            vp_stage=vp_stage,
        )
        self.arch = arch
        self.rotary_frequencies = RotaryFrequencies(arch)
        if config.sequence_parallel and post_process:
            # forward gathers the final rows (the loss head picks rows of the whole pack): the
            # output layer then runs as without sequence parallelism, its input gradient summed
            # over the TP ranks (each computed its vocabulary slice's share)
            self.output_layer.sequence_parallel = False
            self.output_layer.allreduce_dgrad = config.tensor_model_parallel_size > 1

    def forward(  # type: ignore[override]
        self,
        input_ids: Optional[Tensor],
        position_ids: Tensor,
        attention_metadata: TreeAttentionMetadata,
        decoder_input: Optional[Tensor] = None,
    ) -> Tensor:
        """Hidden states of a packed micro-batch.

        Args:
            input_ids: ``[t]`` token ids (first pipeline stage).
            position_ids: ``[t]`` true position of every token in its sample.
            attention_metadata: the micro-batch's tree plan (megatron packed_seq_params); with
                ``output_rows``, the last layer computes only those rows (see the returns).
            decoder_input: ``[t, 1, h]`` instead of embedding input_ids (later stages).

        Returns:
            ``[t, 1, h]`` hidden states; final-normalised on the last pipeline stage, where
            they are ``[len(output_rows), 1, h]``, the rows ``output_rows`` in order, when the
            metadata names them and the last layer could skip the others
            (:class:`PsrlTransformerLayer`; the row count tells).
        """
        # Sequence parallelism: the pack's t rows padded to t', a multiple of TP, each rank's share
        # [t' / TP, 1, h] through the decoder, the last stage's rows gathered and cut back to
        # [t, 1, h] (megatron_psrl.model.sequence_parallel). Without it: TP counts as 1, no padding.
        split = self.config.sequence_parallel
        rows = position_ids.shape[0]
        rank, tp = tensor_parallel_rank_and_size() if split else (0, 1)
        pad = padded_rows(rows, tp) - rows
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids[None, :], position_ids=None)  # [t, 1, h]
            if split:
                padded = F.pad(decoder_input, (0, 0, 0, 0, 0, pad)) if pad else decoder_input
                decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(padded)  # [t' / TP, 1, h]
        positions = F.pad(position_ids, (0, pad)) if pad else position_ids
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=None,
                              rotary_pos_emb=self.rotary_frequencies(positions),  # [t', 1, 1, rot_dim]
                              packed_seq_params=attention_metadata,
                              padding_mask=padding_mask(rows, rank, tp, position_ids.device))
        if not (split and self.post_process):
            return hidden  # (with sequence parallelism, [t' / TP, 1, h] to the next stage)
        # every rank's rows (the backward keeps this rank's share of the summed gradient)
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return hidden[:rows]  # [t, 1, h]

    def _is_in_embd_group(self) -> bool:
        # megatron moves the tied output copy to CUDA before syncing it (compat item 5)
        return keeps_cuda_embedding_sync(self.config) and super()._is_in_embd_group()

    def output_logits(self, hidden: Tensor) -> Tensor:
        """``[n, h] -> [n, V / tp]``: this tensor-parallel rank's slice of the logits."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden[:, None, :], weight=weight)  # [n, 1, V/tp]
        return logits[:, 0, :]


class PsrlModelChunks(torch.nn.Module):
    """This rank's model chunks under virtual pipeline parallelism (megatron's interleaved
    schedule): chunk ``v`` of stage ``p`` holds virtual stage ``v * PP + p``. It behaves as one
    module for the optimizer, gradient reduction and state dicts (names ``chunks.{v}.``);
    the runners and checkpoints take the chunks one by one (:func:`model_chunks`)."""

    def __init__(self, chunks: Sequence[PsrlGPTModel]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    @property
    def config(self) -> TransformerConfig:
        return self.chunks[0].config

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.chunks[0].share_embeddings_and_output_weights


def model_chunks(model: torch.nn.Module) -> Sequence[PsrlGPTModel]:
    """The chunks of a rank's model in virtual-stage order (one chunk without virtual stages)."""
    return list(model.chunks) if isinstance(model, PsrlModelChunks) else [model]
