"""Hugging Face <-> megatron-core state-dict adapter for Llama-style decoder families.

Works on *full* (unsharded, unpadded) tensors; tensor/pipeline sharding is a separate,
family-independent step (``megatron_psrl.checkpoint.sharding``). The conversions are pure
reshapes and concatenations, so a round trip reproduces every tensor bit for bit.

Layouts megatron-core uses:
- ``linear_qkv``: rows grouped by key/value head: for every group g, the ``np/ng`` query
  heads of g, then g's key head, then g's value head (``[ng * (np/ng + 2) * hn, h]``);
- ``linear_fc1``: ``[gate; up]`` stacked (SwiGLU: ``silu(gate) * up``).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_psrl.model.architecture import ModelArchitecture

Tensor = torch.Tensor
GetTensor = Callable[[str], Tensor]


class LlamaStyleAdapter:
    """Llama / Mistral; subclasses add Qwen2's q/k/v bias and Qwen3's q/k norms."""

    hf_passthrough_prefixes: Tuple[str, ...] = ()
    """Hugging Face tensors outside the megatron model that a conversion carries through
    unchanged (a multimodal wrapper's vision tower; :mod:`megatron_psrl.checkpoint.passthrough`)."""

    reads_rank_slices: bool = True
    """:func:`megatron_psrl.checkpoint.loading.hf_rank_state_dict` can read one rank's slices of
    each tensor (its names and row layouts); otherwise a rank's shard is cut from the whole
    state dict."""

    hf_fused_expert_tensors: Tuple[str, ...] = ()
    """Layer tensors (name suffixes after ``model.layers.{i}.``) that hold every routed expert
    along their first dimension (gpt-oss's fused experts): a per-rank load reads only its
    expert-parallel rank's rows of them (:attr:`expert_rows`)."""

    expert_rows: Optional[Tuple[int, int]] = None
    """The routed experts ``[first, stop)`` whose rows ``get`` returns of each of
    :attr:`hf_fused_expert_tensors` (set by a per-rank load, which converts those experts
    only); None: every expert, the tensors whole."""

    def __init__(self, arch: ModelArchitecture):
        self.arch = arch

    # ------------------------------------------------------------------ names and shapes
    def hf_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shapes of one layer's HF tensors, by name suffix after ``model.layers.{i}.``."""
        a = self.arch
        h = a.hidden_size
        q, kv = a.num_attention_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "post_attention_layernorm.weight": (h,),
            **self.hf_mlp_shapes(),
        }

    def hf_mlp_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shapes of one layer's MLP tensors, by name suffix after ``model.layers.{i}.``."""
        h, f = self.arch.hidden_size, self.arch.ffn_hidden_size
        return {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor the HF checkpoint must contain, with the shape config.json implies."""
        a = self.arch
        shapes = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size), "model.norm.weight": (a.hidden_size,)}
        if not a.tie_word_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, a.hidden_size)
        for i in range(a.num_layers):
            shapes.update({f"model.layers.{i}.{suffix}": shape for suffix, shape in self.hf_layer_shapes_of(i).items()})
        return shapes

    def hf_layer_shapes_of(self, layer: int) -> Dict[str, Tuple[int, ...]]:
        """:meth:`hf_layer_shapes` of layer ``layer`` (0-based; families whose layers differ
        override it)."""
        return self.hf_layer_shapes()

    def hf_keys(self) -> List[str]:
        """Every tensor name the HF checkpoint must contain."""
        return list(self.hf_shapes())

    def hf_fp32_names(self) -> List[str]:
        """HF tensors megatron keeps in fp32 whatever the model's dtype (buffers: a router's expert
        bias); a conversion records the dtype the folder stored them in when it is another
        (``CheckpointInfo.hf_dtypes``), so that an export writes them back in it. None here."""
        return []

    # ------------------------------------------------------------------ qkv layout
    def _interleave_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        a = self.arch
        ng, rep, hd = a.num_kv_heads, a.num_attention_heads // a.num_kv_heads, a.head_dim
        tail = q.shape[1:]  # (h,) for weights, () for biases
        parts = (q.reshape(ng, rep * hd, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail))
        return torch.cat(parts, dim=1).reshape(ng * (rep + 2) * hd, *tail)

    def _split_qkv(self, qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        a = self.arch
        ng, rep, hd = a.num_kv_heads, a.num_attention_heads // a.num_kv_heads, a.head_dim
        tail = qkv.shape[1:]
        g = qkv.reshape(ng, (rep + 2) * hd, *tail)
        q, k, v = torch.split(g, [rep * hd, hd, hd], dim=1)
        return (
            q.reshape(ng * rep * hd, *tail).clone(),
            k.reshape(ng * hd, *tail).clone(),
            v.reshape(ng * hd, *tail).clone(),
        )

    # ------------------------------------------------------------------ hooks for families
    def _attention_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        """One layer's attention tensors (GQA: q/k/v fused per group, the family's extras, the
        output projection); a family with another token mixer overrides it."""
        yield mc + "self_attention.linear_qkv.weight", self._interleave_qkv(
            get(hf + "self_attn.q_proj.weight"), get(hf + "self_attn.k_proj.weight"), get(hf + "self_attn.v_proj.weight")
        )
        yield from self._attention_extras_to_mcore(get, hf, mc)
        yield mc + "self_attention.linear_proj.weight", get(hf + "self_attn.o_proj.weight")

    def _attention_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        """Inverse of :meth:`_attention_to_mcore`."""
        q, k, v = self._split_qkv(mcore[mc + "self_attention.linear_qkv.weight"])
        yield hf + "self_attn.q_proj.weight", q
        yield hf + "self_attn.k_proj.weight", k
        yield hf + "self_attn.v_proj.weight", v
        yield from self._attention_extras_to_hf(mcore, hf, mc)
        yield hf + "self_attn.o_proj.weight", mcore[mc + "self_attention.linear_proj.weight"]

    def _attention_extras_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        return iter(())

    def _attention_extras_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        return iter(())

    def _mlp_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield mc + "mlp.linear_fc1.weight", torch.cat([get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")], 0)
        yield mc + "mlp.linear_fc2.weight", get(hf + "mlp.down_proj.weight")

    def _mlp_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        gate, up = torch.chunk(mcore[mc + "mlp.linear_fc1.weight"], 2, dim=0)
        yield hf + "mlp.gate_proj.weight", gate.clone()
        yield hf + "mlp.up_proj.weight", up.clone()
        yield hf + "mlp.down_proj.weight", mcore[mc + "mlp.linear_fc2.weight"]

    def _layer_mlp_to_mcore(self, layer: int, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        """The MLP of layer ``layer`` (families whose layers' MLPs differ override it)."""
        return self._mlp_to_mcore(get, hf, mc)

    def _layer_mlp_to_hf(self, layer: int, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        return self._mlp_to_hf(mcore, hf, mc)

    # ------------------------------------------------------------------ conversion
    def hf_to_mcore(self, get: GetTensor) -> Iterator[Tuple[str, Tensor]]:
        """Yield full megatron tensors, reading HF tensors lazily through ``get(name)``."""
        yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
        for i in range(self.arch.num_layers):
            hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
            yield mc + "input_layernorm.weight", get(hf + "input_layernorm.weight")
            yield from self._attention_to_mcore(get, hf, mc)
            yield mc + "pre_mlp_layernorm.weight", get(hf + "post_attention_layernorm.weight")
            yield from self._layer_mlp_to_mcore(i, get, hf, mc)
        yield "decoder.final_layernorm.weight", get("model.norm.weight")
        if not self.arch.tie_word_embeddings:
            yield "output_layer.weight", get("lm_head.weight")

    def mcore_to_hf(self, mcore: Dict[str, Tensor]) -> Iterator[Tuple[str, Tensor]]:
        """Yield HF tensors from a full megatron state dict."""
        yield "model.embed_tokens.weight", mcore["embedding.word_embeddings.weight"]
        for i in range(self.arch.num_layers):
            hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
            yield hf + "input_layernorm.weight", mcore[mc + "input_layernorm.weight"]
            yield from self._attention_to_hf(mcore, hf, mc)
            yield hf + "post_attention_layernorm.weight", mcore[mc + "pre_mlp_layernorm.weight"]
            yield from self._layer_mlp_to_hf(i, mcore, hf, mc)
        yield "model.norm.weight", mcore["decoder.final_layernorm.weight"]
        if not self.arch.tie_word_embeddings:
            yield "lm_head.weight", mcore["output_layer.weight"]
