"""PrefixSharingAttention: megatron-core's core-attention slot, with tree attention inside.

It has the constructor and forward contract of megatron's ``TEDotProductAttention`` (so it sits
in the ``core_attention`` slot of any GPT layer spec, local or Transformer Engine) and accepts:

- ``packed_seq_params=TreeAttentionMetadata``: a tree-packed micro-batch, ``[t, 1, np, hn]``;
  every token attends to its ancestors and the earlier tokens of its own segment (with
  ``query_rows``, the model's last layer: only those rows' outputs, ``[n, 1, np*hv]``);
- ``packed_seq_params=PackedSeqParams(qkv_format="thd")``: megatron's packed sequences,
  ``[t, np, hn]``, causal within every ``cu_seqlens`` segment;
- ``packed_seq_params=None``: plain causal attention over ``[s, b, np, hn]``.

A layer with a sliding window (megatron's ``window_size`` / ``window_attn_skip_freq``) runs the
plan's windowed form (``AttentionPlan.windowed``), reading only the cached prefix rows some
query's window reaches; with ``softmax_type`` ``learnable`` (``off-by-one``: fixed at zero) the
module holds megatron's ``softmax_offset``, one sink logit per head that the backend joins to
every softmax's denominator once (:mod:`megatron_psrl.attention.window`).

Values may be narrower than queries and keys (latent attention, DeepSeek-V3: ``hn`` 192 =
128 without RoPE + 64 with it, ``hv`` 128; megatron's ``k_channels`` / ``v_channels``): the
output is ``np * hv`` wide, and every backend takes the two widths (the CPU kernels and
flash-attn 2, which take one, get values padded with zeros for the call: exact).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_psrl.attention.backends import (
    BACKENDS,
    TETreeAttention,
    blockwise_tree_attention,
    default_backend,
    dense_tree_attention,
    flash_tree_attention,
)
from megatron_psrl.attention.backends.varlen import require_cuda, te_deterministic
from megatron_psrl.attention.metadata import CachedPrefixKV, TreeAttentionMetadata
from megatron_psrl.attention.plan import AttentionPlan, causal_plan
from megatron_psrl.attention.window import layer_window, rows_in_window, runnable_backend
from megatron_psrl.errors import ConfigurationError, UnsupportedFeatureError

Tensor = torch.Tensor

# Mask types megatron passes for decoder self-attention (THD turns causal into padding_causal).
_CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


def te_builds_with_model() -> bool:
    """Whether a model built for the ``te`` backend builds Transformer Engine's attention in its
    constructor: where CUDA is (TE runs nowhere else; on CPU the backend's first forward fails
    with an error naming CUDA instead)."""
    return torch.cuda.is_available()


def saved_bytes_per_token(num_heads: int, num_kv_heads: int, head_dim: int, tensor_parallel_size: int,
                          dtype_bytes: int) -> int:
    """Bytes per token this core attention saves for backward in one layer, beyond the fused QKV
    output (the value is a view of it): the query and key after RoPE, the output, and the fp32
    log-sum-exp. The same for every modelled backend (``torch`` saves its inputs; ``flash`` and
    ``te`` save the pack's K/V and gather again in backward)."""
    hd, tp = head_dim, tensor_parallel_size
    q, kv = num_heads * hd // tp, num_kv_heads * hd // tp
    return (2 * q + kv) * dtype_bytes + 4 * (q // hd)  # (the log-sum-exp is fp32 in any dtype)


class PrefixSharingAttention(MegatronModule):
    """Exact prefix-sharing core attention (TE-compatible constructor and forward).

    ``backend``: the attention backend the model is built for (None: chosen per micro-batch
    from ``TreeAttentionMetadata.backend`` or the device). Built for ``te``, it holds Transformer
    Engine's attention from the start (:func:`te_builds_with_model`); a model built otherwise
    and run with ``te`` builds it at its first forward, and its state dict grows then."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: Optional[str] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"PrefixSharingAttention supports self attention only, got {attention_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            # Dropout would make a shared prefix differ between the samples that share it.
            raise ConfigurationError("prefix sharing is exact only without attention dropout (set it to 0)")
        if config.context_parallel_size > 1:
            raise UnsupportedFeatureError(
                "megatron's context parallelism is not used by PrefixSharingAttention: megatron_psrl exchanges prefix "
                "K/V itself (--context-parallel-size); build the model with context_parallel_size=1"
            )
        if backend is not None and backend not in BACKENDS:
            raise ConfigurationError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.head_dim = k_channels if k_channels is not None else config.kv_channels
        """Query/key head width (megatron's ``k_channels``: latent attention's nope + rope part)."""
        self.value_dim = v_channels if v_channels is not None else self.head_dim
        """Value head width (``v_channels``; latent attention's is narrower than the keys')."""
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
        self.default_backend = backend
        self.deterministic = bool(getattr(config, "deterministic_mode", False))
        """The GPU kernels' deterministic variants (megatron's ``deterministic_mode``, ``--deterministic``)."""
        self._te: Optional[TETreeAttention] = None
        self.copies_value = not config.qk_layernorm
        """Save a copy of V, not V itself, in a graph (see :meth:`_own_value`). With q/k norms the
        key norm's input, a view of the same projection output, keeps that buffer alive anyway."""
        self.window = layer_window(config, layer_number)
        """Keys a query sees, itself included (a sliding window; None: every ancestor)."""
        self.softmax_offset = self._sink_parameter(config)
        """``[np / tp]``: this rank's heads' sink logits (megatron's name and layout), or None."""
        if backend == "te" and te_builds_with_model():
            # Built now, not at the first forward: its ``_extra_state`` is then in the (sharded)
            # state dict from the start, so a checkpoint saved before any step loads after one.
            tp = config.tensor_model_parallel_size
            self._te = self._build_te(config.num_attention_heads // tp, config.num_query_groups // tp, self.head_dim,
                                      layer_number, self.value_dim)

    def _sink_parameter(self, config: TransformerConfig) -> Optional[Tensor]:
        """megatron's ``softmax_offset`` for ``softmax_type`` ``learnable`` (a parameter, split
        over the tensor-parallel ranks by heads) or ``off-by-one`` (zeros); None for ``vanilla``."""
        kind = getattr(config, "softmax_type", "vanilla")
        if kind == "vanilla":
            return None
        if kind not in ("learnable", "off-by-one"):
            raise ConfigurationError(f"softmax_type {kind!r}: choose vanilla, off-by-one or learnable")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        heads = config.num_attention_heads // config.tensor_model_parallel_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        if kind == "off-by-one":
            return torch.zeros(heads, dtype=config.params_dtype, device=device)
        # Every head's sink drawn, this rank's heads kept: the same model under any TP layout
        # (as megatron's CPU initialisation of the split weights), and the same draws after it.
        every = torch.zeros(config.num_attention_heads, dtype=config.params_dtype, device=device)
        if config.perform_initialization:
            config.init_method(every)
        first = parallel_state.get_tensor_model_parallel_rank() * heads
        offset = torch.nn.Parameter(every[first:first + heads].clone())
        set_tensor_model_parallel_attributes(offset, is_parallel=True, dim=0, stride=1)
        return offset

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron's, with the learnable sink split over the tensor-parallel ranks by heads."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            from megatron.core import parallel_state
            from megatron.core.transformer.utils import (
                ensure_metadata_has_dp_cp_group,
                make_sharded_tensors_for_checkpoint,
            )

            state.update(make_sharded_tensors_for_checkpoint(
                {"softmax_offset": self.softmax_offset}, prefix, {"softmax_offset": 0}, sharded_offsets,
                tp_group=parallel_state.get_tensor_model_parallel_group(),
                dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]))
        return state

    def _build_te(self, num_heads: int, num_groups: int, head_dim: int, layer_number: int,
                  value_dim: Optional[int] = None) -> TETreeAttention:
        if self.deterministic:
            te_deterministic()
        if value_dim is None or value_dim == head_dim:
            return TETreeAttention(num_heads, num_groups, head_dim, self.softmax_scale, layer_number)
        return TETreeAttention(num_heads, num_groups, head_dim, self.softmax_scale, layer_number, value_dim=value_dim)

    def _own_value(self, v: Tensor) -> Tensor:
        """``v`` in a storage of its own when a graph would save it. V is a view of the fused QKV
        projection's output ``[t, (np + 2 ng) hn]``; saved as a view it keeps that whole buffer
        alive until the backward, its Q and K parts included, which the attention never reads
        again (it saves Q and K after RoPE, separate tensors). A copy of V costs ``ng hn`` per
        token and frees ``(np + 2 ng) hn`` (tiny Llama: 1.5 KB per token and layer in fp32)."""
        if not (self.copies_value and v.requires_grad and torch.is_grad_enabled()):
            return v
        if v.untyped_storage().nbytes() <= v.numel() * v.element_size():
            return v  # owns its storage already
        return v.clone(memory_format=torch.contiguous_format)

    # ------------------------------------------------------------------ dispatch
    def _run(self, backend: str, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, external) -> Tensor:
        if self.window is not None:  # its window's keys only (older cached rows are not read)
            plan = plan.windowed(self.window)
        external = rows_in_window(external, plan.external_starts)
        sink = self.softmax_offset
        backend = runnable_backend(backend, self.window, sink is not None)
        if backend == "torch":  # reads CachedPrefixKV sources itself (no copy kept for backward)
            return blockwise_tree_attention(q, k, v, plan, external, self.softmax_scale, sink=sink)
        if backend == "dense":
            external = [e if isinstance(e, tuple) else e.materialize() for e in external]
            return dense_tree_attention(q, k, v, plan, external, self.softmax_scale, sink=sink)
        # flash and te read CachedPrefixKV sources themselves too (varlen_tree_attention: no copy
        # kept for backward); K/V in flight from other ranks are waited for and copied first
        external = [e if isinstance(e, (tuple, CachedPrefixKV)) else e.materialize() for e in external]
        if backend == "flash":
            return flash_tree_attention(q, k, v, plan, external, self.softmax_scale, deterministic=self.deterministic)
        if backend == "te":
            require_cuda("te", q)  # before importing Transformer Engine: the CPU error names CUDA
            if self._te is None:  # a model built for another backend: its state grows now
                self._te = self._build_te(q.shape[1], k.shape[1], q.shape[2], self.layer_number, v.shape[2])
            return self._te(q, k, v, plan, external, self.softmax_scale)
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by PrefixSharingAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in _CAUSAL_MASK_TYPES:
            raise NotImplementedError(
                f"PrefixSharingAttention implements causal decoder attention only, got {mask_type}"
            )
        backend_default = self.default_backend or default_backend(query.device.type, query.dtype)

        if isinstance(packed_seq_params, TreeAttentionMetadata):
            # query [t, 1, np, hn], key [t, 1, ng, hn], value [t, 1, ng, hv] (sbhd with one packed row)
            if attention_mask is not None:
                raise NotImplementedError(
                    "PrefixSharingAttention takes the tree mask from TreeAttentionMetadata.plan; pass attention_mask=None"
                )
            if query.shape[1] != 1:
                raise ValueError("a tree-packed micro-batch has batch size 1 ([t, 1, np, hn])")
            q, k, v = query[:, 0], key[:, 0], value[:, 0]
            meta = packed_seq_params
            # Sequence parallelism pads a pack to a multiple of TP rows: the padding rows take
            # no part (their output is zero; megatron_psrl.model.sequence_parallel).
            rows = meta.plan.num_keys if meta.plan.num_keys is not None else meta.plan.num_tokens
            padding = q.shape[0] - rows if meta.query_rows is None else 0
            if padding > 0:
                q, k, v = q[:rows], k[:rows], v[:rows]
            v = self._own_value(v)
            external = ()
            if meta.kv_hook is not None:
                replaced = meta.kv_hook.on_kv(self.layer_number, k, v)
                if replaced is not None:  # cross-rank: the exchange's outputs (same values)
                    k, v = replaced
                external = meta.kv_hook.external_kv(self.layer_number)
            if meta.query_rows is not None:
                # Only these rows' outputs are needed (the last layer): their queries over
                # every row's keys, by their query-subset plan. [t, np, hn] -> [n, np, hn]
                q = q.index_select(0, meta.query_rows)
            out = self._run(meta.backend or backend_default, q, k, v, meta.plan, external)
            after = getattr(meta.kv_hook, "after_attention", None)
            if after is not None:  # an overlapped exchange: rows no attention waited for
                after(self.layer_number)
            out = out.reshape(q.shape[0], 1, -1)  # [t, 1, np*hv] ([n, 1, np*hv] with query_rows)
            return F.pad(out, (0, 0, 0, 0, 0, padding)) if padding > 0 else out

        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # query [t, np, hn]; causal within every cu_seqlens segment.
            cu = packed_seq_params.cu_seqlens_q
            padded = packed_seq_params.cu_seqlens_q_padded
            if padded is not None and not torch.equal(padded, cu):
                raise NotImplementedError("padded THD sequences are not supported")
            plan = causal_plan(np.diff(cu.cpu().numpy()))
            out = self._run(backend_default, query, key, value, plan, ())
            return out.reshape(query.shape[0], -1)  # [t, np*hn]

        if attention_mask is not None:
            raise NotImplementedError(
                "PrefixSharingAttention implements causal masks itself; pass attention_mask=None"
            )
        # Plain sbhd causal: query [s, b, np, hn]
        s, b = query.shape[:2]
        plan = causal_plan([s])
        outs = [self._run(backend_default, query[:, i], key[:, i], value[:, i], plan, ()) for i in range(b)]
        return torch.stack(outs, dim=1).reshape(s, b, -1)  # [s, b, np*hn]
