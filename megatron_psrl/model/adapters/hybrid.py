"""Qwen3-Next and Qwen3.5 adapters: layers of softmax attention with an output gate and layers
of Gated DeltaNet linear attention (``layer_types``), zero-centred RMSNorms (stored as they are:
both sides compute ``x * (1 + w)``), a dense SwiGLU MLP (Qwen3.5) or routed experts with a
sigmoid-gated shared expert (Qwen3-Next, Qwen3.5-MoE).

Softmax-attention layers (``self_attn.``): Hugging Face's ``q_proj`` emits, per query head, the
head's query then its gate (``[np * 2 * hd, h]``); megatron's ``linear_qkv`` with
``attention_output_gate`` holds, per key/value group, the group's query heads, their gates, the
key head and the value head (``[ng * (2 np/ng + 2) * hd, h]``).

Linear-attention layers (``linear_attn.``), megatron's ``GatedDeltaNet`` names below
``self_attention.``: ``in_proj.weight`` ``[q; k; v; z; beta; alpha]`` (``2 nk dk + 2 nv dv +
2 nv`` rows), ``conv1d.weight`` ``[q; k; v]`` channels ``[2 nk dk + nv dv, 1, kernel]``,
``dt_bias`` / ``A_log`` ``[nv]``, ``out_norm.weight`` ``[dv]`` (the gated norm's plain weight),
``out_proj.weight`` ``[h, nv dv]``. Qwen3.5 names the projections ``in_proj_qkv`` (``[q; k;
v]``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next fuses them per key head:
``in_proj_qkvz`` rows ``[nk, (dk, dk, r dv, r dv)]`` and ``in_proj_ba`` rows ``[nk, (r, r)]``
(``r = nv / nk``), which is regrouped into megatron's order here. Tensor parallelism splits
each of the six parts of ``in_proj`` (and the three of ``conv1d``) by heads
(:mod:`megatron_psrl.checkpoint.sharding`).

A multimodal wrapper (Qwen3.5 ``ForConditionalGeneration``) keeps its language model under
``model.language_model.`` and its vision tower under ``model.visual.``; the vision tower is not
part of the megatron model: its tensors are carried through a conversion unchanged
(:attr:`HybridAdapter.hf_passthrough_prefixes`).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch

from megatron_psrl.model.adapters.base import GetTensor, LlamaStyleAdapter, Tensor
from megatron_psrl.model.adapters.experts import RoutedExpertsMixin
from megatron_psrl.model.adapters.qwen2_moe import Qwen2MoeAdapter
from megatron_psrl.model.architecture import LINEAR_ATTENTION

_GDN = "self_attention."


class HybridAdapter(LlamaStyleAdapter):
    """Qwen3.5 (dense, text-only ``model.`` names): gated softmax attention with q/k norms and
    Gated DeltaNet layers as ``layer_types`` says. Subclasses: the MoE MLP, the fused Qwen3-Next
    projections, the wrapper's names."""

    hf_model_prefix: str = "model."
    """The language model's name prefix (``model.language_model.`` in a multimodal wrapper)."""

    reads_rank_slices = False  # gated q_proj rows and the linear layers' parts: cut from the whole

    # ------------------------------------------------------------------ names and shapes
    def _linear_dims(self) -> Tuple[int, int, int, int]:
        """``(nk dk, nv dv, nv, dv)``."""
        a = self.arch
        return (a.linear_num_key_heads * a.linear_key_head_dim, a.linear_num_value_heads * a.linear_value_head_dim,
                a.linear_num_value_heads, a.linear_value_head_dim)

    def hf_attention_shapes(self) -> Dict[str, Tuple[int, ...]]:
        a = self.arch
        h, hd = a.hidden_size, a.head_dim
        q, kv = a.num_attention_heads * hd, a.num_kv_heads * hd
        return {"self_attn.q_proj.weight": (2 * q, h), "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}

    def hf_linear_projection_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shapes of a linear-attention layer's input projections (Qwen3.5's four)."""
        h, (qk, v, nv, _) = self.arch.hidden_size, self._linear_dims()
        return {"linear_attn.in_proj_qkv.weight": (2 * qk + v, h), "linear_attn.in_proj_z.weight": (v, h),
                "linear_attn.in_proj_b.weight": (nv, h), "linear_attn.in_proj_a.weight": (nv, h)}

    def hf_linear_shapes(self) -> Dict[str, Tuple[int, ...]]:
        h, (qk, v, nv, dv) = self.arch.hidden_size, self._linear_dims()
        return {**self.hf_linear_projection_shapes(),
                "linear_attn.conv1d.weight": (2 * qk + v, 1, self.arch.linear_conv_kernel_dim),
                "linear_attn.dt_bias": (nv,), "linear_attn.A_log": (nv,), "linear_attn.norm.weight": (dv,),
                "linear_attn.out_proj.weight": (h, v)}

    def hf_layer_shapes_of(self, layer: int) -> Dict[str, Tuple[int, ...]]:
        """Shapes of layer ``layer``'s HF tensors, by name suffix after ``...layers.{layer}.``."""
        h = self.arch.hidden_size
        mixer = (self.hf_linear_shapes() if self.arch.layer_kinds[layer] == LINEAR_ATTENTION
                 else self.hf_attention_shapes())
        return {"input_layernorm.weight": (h,), **mixer, "post_attention_layernorm.weight": (h,),
                **self.hf_mlp_shapes()}

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        a, p = self.arch, self.hf_model_prefix
        shapes = {f"{p}embed_tokens.weight": (a.vocab_size, a.hidden_size), f"{p}norm.weight": (a.hidden_size,)}
        if not a.tie_word_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, a.hidden_size)
        for i in range(a.num_layers):
            shapes.update({f"{p}layers.{i}.{s}": shape for s, shape in self.hf_layer_shapes_of(i).items()})
        return shapes

    # ------------------------------------------------------------------ gated softmax attention
    def _gated_qkv(self, q_gate: Tensor, k: Tensor, v: Tensor) -> Tensor:
        a = self.arch
        ng, rep, hd = a.num_kv_heads, a.num_attention_heads // a.num_kv_heads, a.head_dim
        heads = q_gate.reshape(a.num_attention_heads, 2, hd, -1)  # per head: query, gate
        q, gate = (heads[:, j].reshape(ng, rep * hd, -1) for j in (0, 1))
        parts = (q, gate, k.reshape(ng, hd, -1), v.reshape(ng, hd, -1))
        return torch.cat(parts, dim=1).reshape(ng * (2 * rep + 2) * hd, -1)

    def _split_gated_qkv(self, qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        a = self.arch
        ng, rep, hd = a.num_kv_heads, a.num_attention_heads // a.num_kv_heads, a.head_dim
        q, gate, k, v = torch.split(qkv.reshape(ng, (2 * rep + 2) * hd, -1), [rep * hd, rep * hd, hd, hd], dim=1)
        q_gate = torch.stack([q.reshape(ng * rep, hd, -1), gate.reshape(ng * rep, hd, -1)], dim=1)
        return q_gate.reshape(ng * rep * 2 * hd, -1), k.reshape(ng * hd, -1).clone(), v.reshape(ng * hd, -1).clone()

    def _attention_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        p = hf + "self_attn."
        yield mc + "self_attention.linear_qkv.weight", self._gated_qkv(
            get(p + "q_proj.weight"), get(p + "k_proj.weight"), get(p + "v_proj.weight"))
        yield mc + "self_attention.q_layernorm.weight", get(p + "q_norm.weight")
        yield mc + "self_attention.k_layernorm.weight", get(p + "k_norm.weight")
        yield mc + "self_attention.linear_proj.weight", get(p + "o_proj.weight")

    def _attention_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        p, m = hf + "self_attn.", mc + "self_attention."
        q_gate, k, v = self._split_gated_qkv(mcore[m + "linear_qkv.weight"])
        yield p + "q_proj.weight", q_gate
        yield p + "k_proj.weight", k
        yield p + "v_proj.weight", v
        yield p + "o_proj.weight", mcore[m + "linear_proj.weight"]
        yield p + "q_norm.weight", mcore[m + "q_layernorm.weight"]
        yield p + "k_norm.weight", mcore[m + "k_layernorm.weight"]

    # ------------------------------------------------------------------ Gated DeltaNet
    def _in_proj_parts(self, get: GetTensor, hf: str) -> List[Tensor]:
        """``[q, k, v, z, beta, alpha]`` rows of a linear layer's input projection."""
        qk, v, _, _ = self._linear_dims()
        p = hf + "linear_attn."
        qkv = get(p + "in_proj_qkv.weight")
        return [*torch.split(qkv, [qk, qk, v], 0), get(p + "in_proj_z.weight"), get(p + "in_proj_b.weight"),
                get(p + "in_proj_a.weight")]

    def _in_proj_to_hf(self, parts: List[Tensor], hf: str) -> Iterator[Tuple[str, Tensor]]:
        p = hf + "linear_attn."
        yield p + "in_proj_qkv.weight", torch.cat(parts[:3], 0)
        yield p + "in_proj_z.weight", parts[3].clone()
        yield p + "in_proj_b.weight", parts[4].clone()
        yield p + "in_proj_a.weight", parts[5].clone()

    def _linear_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        p, m = hf + "linear_attn.", mc + _GDN
        yield m + "in_proj.weight", torch.cat(self._in_proj_parts(get, hf), 0)
        yield m + "conv1d.weight", get(p + "conv1d.weight")
        yield m + "dt_bias", get(p + "dt_bias")
        yield m + "A_log", get(p + "A_log")
        yield m + "out_norm.weight", get(p + "norm.weight")
        yield m + "out_proj.weight", get(p + "out_proj.weight")

    def _linear_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        p, m = hf + "linear_attn.", mc + _GDN
        qk, v, nv, _ = self._linear_dims()
        yield from self._in_proj_to_hf(list(torch.split(mcore[m + "in_proj.weight"], [qk, qk, v, v, nv, nv], 0)), hf)
        yield p + "conv1d.weight", mcore[m + "conv1d.weight"]
        yield p + "dt_bias", mcore[m + "dt_bias"]
        yield p + "A_log", mcore[m + "A_log"]
        yield p + "norm.weight", mcore[m + "out_norm.weight"]
        yield p + "out_proj.weight", mcore[m + "out_proj.weight"]

    # ------------------------------------------------------------------ conversion
    def hf_to_mcore(self, get: GetTensor) -> Iterator[Tuple[str, Tensor]]:
        p = self.hf_model_prefix
        yield "embedding.word_embeddings.weight", get(p + "embed_tokens.weight")
        for i, kind in enumerate(self.arch.layer_kinds):
            hf, mc = f"{p}layers.{i}.", f"decoder.layers.{i}."
            yield mc + "input_layernorm.weight", get(hf + "input_layernorm.weight")
            mixer = self._linear_to_mcore if kind == LINEAR_ATTENTION else self._attention_to_mcore
            yield from mixer(get, hf, mc)
            yield mc + "pre_mlp_layernorm.weight", get(hf + "post_attention_layernorm.weight")
            yield from self._mlp_to_mcore(get, hf, mc)
        yield "decoder.final_layernorm.weight", get(p + "norm.weight")
        if not self.arch.tie_word_embeddings:
            yield "output_layer.weight", get("lm_head.weight")

    def mcore_to_hf(self, mcore: Dict[str, Tensor]) -> Iterator[Tuple[str, Tensor]]:
        p = self.hf_model_prefix
        yield p + "embed_tokens.weight", mcore["embedding.word_embeddings.weight"]
        for i, kind in enumerate(self.arch.layer_kinds):
            hf, mc = f"{p}layers.{i}.", f"decoder.layers.{i}."
            yield hf + "input_layernorm.weight", mcore[mc + "input_layernorm.weight"]
            mixer = self._linear_to_hf if kind == LINEAR_ATTENTION else self._attention_to_hf
            yield from mixer(mcore, hf, mc)
            yield hf + "post_attention_layernorm.weight", mcore[mc + "pre_mlp_layernorm.weight"]
            yield from self._mlp_to_hf(mcore, hf, mc)
        yield p + "norm.weight", mcore["decoder.final_layernorm.weight"]
        if not self.arch.tie_word_embeddings:
            yield "lm_head.weight", mcore["output_layer.weight"]


class Qwen3_5Adapter(HybridAdapter):
    """Qwen3.5 text model (``Qwen3_5ForCausalLM``): dense SwiGLU MLPs."""


class Qwen3_5WrapperAdapter(Qwen3_5Adapter):
    """Qwen3.5 multimodal wrapper (``Qwen3_5ForConditionalGeneration``): the language model under
    ``model.language_model.``, the vision tower carried through."""

    hf_model_prefix = "model.language_model."
    hf_passthrough_prefixes = ("model.visual.",)


class Qwen3_5MoeAdapter(RoutedExpertsMixin, HybridAdapter):
    """Qwen3.5-MoE text model: routed experts and a sigmoid-gated shared expert in every layer
    (Qwen2-MoE's names)."""

    hf_shared_expert_shapes = Qwen2MoeAdapter.hf_shared_expert_shapes
    _shared_expert_to_mcore = Qwen2MoeAdapter._shared_expert_to_mcore
    _shared_expert_to_hf = Qwen2MoeAdapter._shared_expert_to_hf


class Qwen3_5MoeWrapperAdapter(Qwen3_5MoeAdapter):
    """Qwen3.5-MoE multimodal wrapper: names as :class:`Qwen3_5WrapperAdapter`."""

    hf_model_prefix = "model.language_model."
    hf_passthrough_prefixes = ("model.visual.",)


class Qwen3NextAdapter(Qwen3_5MoeAdapter):
    """Qwen3-Next: Qwen3.5-MoE's layout with the linear layers' input projections fused per key
    head (``in_proj_qkvz``, ``in_proj_ba``)."""

    def _grouping(self) -> Tuple[int, int, int, int]:
        """``(nk, dk, r dv, r)``: key heads, their width, a key head's value width and value heads."""
        a = self.arch
        r = a.linear_num_value_heads // a.linear_num_key_heads
        return a.linear_num_key_heads, a.linear_key_head_dim, r * a.linear_value_head_dim, r

    def hf_linear_projection_shapes(self) -> Dict[str, Tuple[int, ...]]:
        h, (qk, v, nv, _) = self.arch.hidden_size, self._linear_dims()
        return {"linear_attn.in_proj_qkvz.weight": (2 * qk + 2 * v, h), "linear_attn.in_proj_ba.weight": (2 * nv, h)}

    def _in_proj_parts(self, get: GetTensor, hf: str) -> List[Tensor]:
        nk, dk, rv, r = self._grouping()
        p = hf + "linear_attn."
        qkvz = get(p + "in_proj_qkvz.weight").reshape(nk, 2 * dk + 2 * rv, -1)
        ba = get(p + "in_proj_ba.weight").reshape(nk, 2 * r, -1)
        parts = list(torch.split(qkvz, [dk, dk, rv, rv], 1)) + list(torch.split(ba, [r, r], 1))
        return [t.reshape(-1, t.shape[-1]) for t in parts]  # per key head -> all heads in a row

    def _in_proj_to_hf(self, parts: List[Tensor], hf: str) -> Iterator[Tuple[str, Tensor]]:
        nk = self._grouping()[0]
        grouped = [t.reshape(nk, -1, t.shape[-1]) for t in parts]
        p = hf + "linear_attn."
        yield p + "in_proj_qkvz.weight", torch.cat(grouped[:4], 1).reshape(-1, parts[0].shape[-1])
        yield p + "in_proj_ba.weight", torch.cat(grouped[4:], 1).reshape(-1, parts[0].shape[-1])
