"""Multi-head latent attention (MLA, DeepSeek-V3) for tree-packed micro-batches.

megatron-core's ``MLASelfAttention`` computes, per token, a compressed K/V latent
(``linear_kv_down_proj``: ``kv_lora_rank`` numbers, RMS-normalised by ``kv_layernorm``) and one
RoPE key shared by all heads (``qk_pos_emb_head_dim`` numbers), projects the latent up to every
head's position-free key and its value (``linear_kv_up_proj``), and the query down and up
(``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``; or directly, ``linear_q_proj``).
Its core attention sees keys of ``qk_head_dim + qk_pos_emb_head_dim`` and values of
``v_head_dim`` per head; the project's :class:`~megatron_psrl.attention.PrefixSharingAttention`
sits in that slot as in every other layer.

:class:`TreeMLASelfAttention` is megatron's module (its parameters, forward, output projection)
with its own :meth:`~TreeMLASelfAttention.get_query_key_value_tensors`, for two reasons:

- RoPE by position ids: megatron's MLA computes its own angles for positions ``0..s-1``, where a
  tree token's position is its depth in its sample. The layer rotates by the angles the model
  computed from the pack's position ids (``rotary_pos_emb``, as every other layer gets them:
  :class:`~megatron_psrl.model.gpt.RotaryFrequencies`, of the rotated width), with megatron's
  own rotation (``apply_rotary_pos_emb``: DeepSeek's de-interleaved pairs, YaRN's cos/sin scale);
- exact gradients under tensor parallelism: every rank expands the shared RoPE key over its own
  heads only, so the key's gradient is a partial sum on each rank, which megatron-core 0.16
  never adds up when the down-projection is column-parallel (the local spec; NVIDIA/Megatron-LM
  issue 1699): here the key passes ``copy_to_tensor_model_parallel_region`` (identity forward,
  all-reduce of its gradient in backward) before the rotation.

It is also where a shared prefix's cache is read and written when it keeps the latent
(``ModelArchitecture.latent_cache`` ``latent``, the default; the spec:
``PrefixState.latent``): the normalised K/V latent (after ``kv_layernorm``) and the rotated RoPE
key of every token go to the micro-batch's hook (``LatentPrefixHook.on_latent``, the engine's
``PrefixKV``), which stores, captures and exchanges them as K/V rows are, and every reader
projects the cached rows up with the layer's own ``linear_kv_up_proj``
(:meth:`TreeMLASelfAttention.up_project`) before attending as to per-head K/V. The latent is
whole on every tensor-parallel rank while each rank projects it to its own heads, so a reader's
latent and RoPE-key gradients are summed over the ranks (the column-parallel up-projection's
input gradient is; the RoPE key passes ``copy_to_tensor_model_parallel_region``), and the
producer takes them where its own are complete too: the latent at the up-projection's input
(summed there), the RoPE key after the rotation and before its sum over the ranks, which
therefore comes after the rotation here (both linear: the same gradient).

The projections, norms and their tensor-parallel gathers and scatters are megatron's, in
megatron's order.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple, runtime_checkable

import torch
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size

from megatron_psrl.compat import latent_attention_construction
from megatron_psrl.errors import ConfigurationError, UnsupportedFeatureError

Tensor = torch.Tensor


@runtime_checkable
class LatentPrefixHook(Protocol):
    """How mechanism 2 plugs into a latent-attention layer (``packed_seq_params.kv_hook``; the
    engine's :class:`~megatron_psrl.engine.prefix_kv.PrefixKV`)."""

    def on_latent(self, layer_number: int, latent: Tensor, rope_key: Tensor,
                  up_project: Callable[[Tensor, Tensor], Tuple[Tensor, Tensor]]
                  ) -> Optional[Tuple[Tensor, Tensor]]:
        """Called with the pack's normalised K/V latent ``[t, r]`` and rotated RoPE key
        ``[t, rope]``: where the layer's cached prefixes keep them, stores (and captures, or
        exchanges) those of the prefixes the pack produces, and makes the keys and values of
        the prefixes it reads with ``up_project`` (the core attention's ``external_kv``). May
        return the two tensors the layer must use instead (the same values, through the
        cross-rank exchange), or None."""


class TreeMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` that rotates by the RoPE angles the layer is given
    (``rotary_pos_emb`` ``[s, 1, 1, rot]``, from every token's position id) and sums the shared
    RoPE key's gradient over the tensor-parallel ranks (see the module docstring).

    ``rope_mscale``: the factor YaRN scales cos and sin by (Hugging Face's
    ``attention_scaling``, ``ModelArchitecture.rope.attention_scaling()``); the softmax scale is
    megatron's (from ``rotary_scaling_factor`` and ``mscale_all_dim``, DeepSeek's rule)."""

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=AttnMaskType.padding,
                 cp_comm_type: Optional[str] = None, pg_collection=None, rope_mscale: float = 1.0):
        with latent_attention_construction(config):  # (its rotary module, dropped below: CPU-safe)
            super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if config.apply_rope_fusion:
            raise ConfigurationError("latent attention rotates by the angles of explicit positions: build it with "
                                     "apply_rope_fusion=False")
        if config.cache_mla_latents or self.recompute_up_proj:
            raise UnsupportedFeatureError("latent attention with cache_mla_latents or the 'mla_up_proj' recompute "
                                          "module is not supported for tree-packed training")
        self.rotary_pos_emb = None  # megatron's positions 0..s-1: not used (the layer is given its angles)
        self.rope_mscale = float(rope_mscale)
        self._angles: Optional[Tensor] = None

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        """megatron's forward, rotating by ``rotary_pos_emb`` (``[s, 1, 1, rot]``)."""
        if rotary_pos_emb is None:
            raise ValueError("TreeMLASelfAttention needs the RoPE angles of the micro-batch's positions "
                             "(rotary_pos_emb [s, 1, 1, qk_pos_emb_head_dim])")
        self._angles = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            self._angles = None  # (autograd saved what the backward uses)

    def _down_projections(self, hidden_states: Tensor):
        """megatron's down-projections and their tensor-parallel gathers: ``(q_compressed or the
        hidden states, kv_compressed, k_pos_emb, share)``, ``[s, b, ...]`` (sequence parallelism:
        ``s / TP`` rows of the first two, every row of the RoPE key). ``share``: the RoPE key
        must pass ``copy_to_tensor_model_parallel_region`` (its gradient summed over the ranks'
        heads), which :meth:`get_query_key_value_tensors` applies after the rotation (both are
        linear: the same gradient), so that the rotated key a cached prefix keeps is taken before
        it (a reader's gradient, summed over the ranks already, is added after the sum)."""
        config = self.config
        if config.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if q_compressed.size(-1) != config.q_lora_rank:  # column-parallel: [s, b, q_lora_rank / TP]
                q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
                if config.sequence_parallel:
                    q_compressed = scatter_to_sequence_parallel_region(q_compressed)
        else:
            q_compressed = hidden_states
        widths = [config.kv_lora_rank, config.qk_pos_emb_head_dim]
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        if kv_combined.size(-1) != sum(widths):  # column-parallel: [s, b, (kv_lora_rank + rope) / TP]
            kv_compressed, k_pos_emb = torch.split(gather_from_tensor_model_parallel_region(kv_combined), widths, -1)
            if config.sequence_parallel:
                kv_compressed = scatter_to_sequence_parallel_region(kv_compressed)
            # every rank's heads read the whole key: their gradients are summed (the gather's
            # backward only splits)
            return q_compressed, kv_compressed, k_pos_emb, True
        kv_compressed, k_pos_emb = torch.split(kv_combined, widths, -1)  # a duplicated down-projection (TE's spec)
        if get_pg_size(self.tp_group) > 1 and config.sequence_parallel:  # (its backward reduce-scatters: sums
            k_pos_emb = gather_from_sequence_parallel_region(k_pos_emb, group=self.tp_group)  # the ranks' heads)
            return q_compressed, kv_compressed, k_pos_emb, False
        return q_compressed, kv_compressed, k_pos_emb, get_pg_size(self.tp_group) > 1

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *, inference_params=None):
        """``(query [s, b, n, qk + rope], key [s, b, n, qk + rope], value [s, b, n, v],
        q_compressed, kv_compressed)`` of ``hidden_states`` ``[s, b, h]`` (this rank's ``n`` heads)."""
        if inference_context is not None or inference_params is not None:
            raise UnsupportedFeatureError("TreeMLASelfAttention is a training layer: no inference context")
        config, n = self.config, self.num_attention_heads_per_partition
        q_compressed, kv_compressed, k_pos_emb, share = self._down_projections(hidden_states)
        if config.q_lora_rank is not None:
            q_compressed = self.q_layernorm(q_compressed)
            q, _ = self.linear_q_up_proj(q_compressed)
        else:
            q, _ = self.linear_q_proj(q_compressed)
        kv_compressed = self.kv_layernorm(kv_compressed)
        q = q.view(*q.shape[:-1], n, self.q_head_dim)  # [s, b, n, qk + rope]
        q_no_pe, q_pos_emb = torch.split(q, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        angles = self._angles[:q.shape[0]]  # [s, 1, 1, rope] (sequence parallelism pads the pack)
        rotate = dict(config=config, mscale=self.rope_mscale, cp_group=self.pg_collection.cp)
        q_pos_emb = apply_rotary_pos_emb(q_pos_emb, angles, **rotate)
        k_pos_emb = apply_rotary_pos_emb(k_pos_emb.unsqueeze(-2), angles, **rotate)  # [s, b, 1, rope]
        on_latent = getattr(getattr(packed_seq_params, "kv_hook", None), "on_latent", None)
        if on_latent is not None:  # a cached prefix keeps the latent: [s, r] and [s, rope] (b = 1)
            replaced = on_latent(self.layer_number, kv_compressed[:, 0], k_pos_emb[:, 0, 0], self.up_project)
            if replaced is not None:  # cross-rank: the exchange's outputs (the same values)
                kv_compressed, k_pos_emb = replaced[0].unsqueeze(1), replaced[1][:, None, None]
        if share:
            k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.tp_group)
        kv, _ = self.linear_kv_up_proj(kv_compressed)
        kv = kv.view(*kv.shape[:-1], n, config.qk_head_dim + config.v_head_dim)  # [s, b, n, qk + v]
        k_no_pe, value = torch.split(kv, [config.qk_head_dim, config.v_head_dim], dim=-1)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(-1, -1, n, -1)], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous(), q_compressed, kv_compressed

    def up_project(self, latent: Tensor, rope_key: Tensor):
        """A cached prefix's keys ``[m, n, qk + rope]`` and values ``[m, n, v]`` (this rank's
        heads) from its rows' latent ``[m, r]`` and rotated RoPE key ``[m, rope]``: the layer's
        own up-projection, so its weight gradient takes every reader's rows. Under tensor
        parallelism both inputs are whole on every rank and their gradients summed over the
        ranks' heads (the column-parallel up-projection sums its input's; the RoPE key passes
        ``copy_to_tensor_model_parallel_region``): every rank holds the same complete gradient,
        as the producer's latent and (not yet summed) RoPE key take it."""
        config, n = self.config, self.num_attention_heads_per_partition
        if config.sequence_parallel and get_pg_size(self.tp_group) > 1:
            raise UnsupportedFeatureError("a latent prefix cache under sequence parallelism (use --latent-cache "
                                          "per-head)")
        if get_pg_size(self.tp_group) > 1:
            rope_key = copy_to_tensor_model_parallel_region(rope_key, group=self.tp_group)
        kv, _ = self.linear_kv_up_proj(latent.unsqueeze(1))  # [m, 1, n (qk + v)]
        kv = kv.view(latent.shape[0], n, config.qk_head_dim + config.v_head_dim)
        k_no_pe, value = torch.split(kv, [config.qk_head_dim, config.v_head_dim], dim=-1)
        key = torch.cat([k_no_pe, rope_key.unsqueeze(1).expand(-1, n, -1)], dim=-1)
        return key, value.contiguous()
