"""gpt-oss adapter: biased attention with a sink per head, a biased router and fused experts.

Hugging Face names (the Hub's bf16 checkpoints, ``save_pretrained`` and transformers' memory
alike), below ``model.layers.{l}.``: ``self_attn.{q,k,v,o}_proj.{weight,bias}``,
``self_attn.sinks`` ``[np]``; ``mlp.router.weight`` ``[E, h]`` and ``.bias`` ``[E]``; the experts
fused, *input-major*: ``mlp.experts.gate_up_proj`` ``[E, h, 2I]`` whose columns interleave gate
and up (gate ``[..., 0::2]``, up ``[..., 1::2]``), ``gate_up_proj_bias`` ``[E, 2I]`` (the same
interleave), ``down_proj`` ``[E, I, h]``, ``down_proj_bias`` ``[E, h]``.

megatron: ``self_attention.linear_qkv.{weight,bias}`` (grouped q/k/v rows),
``self_attention.linear_proj.{weight,bias}``, ``self_attention.core_attention.softmax_offset``
(the sinks), ``mlp.router.{weight,bias}``, and per expert
``mlp.experts.local_experts.{i}.linear_fc1.{weight,bias}`` (``[gate; up]``: the interleaved
columns split, transposed) and ``linear_fc2.{weight,bias}``. Pure copies both ways: a round
trip is bit exact. A per-rank load under expert parallelism reads only its experts' rows of the
fused tensors (:attr:`GptOssAdapter.hf_fused_expert_tensors`, ``checkpoint.loading._stage_cut``).
"""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch

from megatron_psrl.model.adapters.base import GetTensor, Tensor
from megatron_psrl.model.adapters.experts import RoutedExpertsMixin
from megatron_psrl.model.adapters.qwen import Qwen2Adapter

_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssAdapter(RoutedExpertsMixin, Qwen2Adapter):
    """gpt-oss: Qwen2's layout (Llama's with q/k/v biases) plus the output projection's bias,
    sinks, a biased router and fused, interleaved experts."""

    hf_experts_fused = True
    """The checkpoints keep the experts fused (transformers' memory names are the Hub's)."""
    reads_rank_slices = False  # the stage's tensors read whole and cut; of the fused experts, the rank's rows
    hf_fused_expert_tensors = tuple(f"mlp.experts.{name}" for name in _EXPERTS)

    # ------------------------------------------------------------------ names and shapes
    def hf_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        a = self.arch
        return dict(super().hf_layer_shapes(), **{
            "self_attn.o_proj.bias": (a.hidden_size,), "self_attn.sinks": (a.num_attention_heads,)})

    def hf_mlp_shapes(self) -> Dict[str, Tuple[int, ...]]:
        a = self.arch
        e, h, f = a.num_experts, a.hidden_size, a.moe_ffn_hidden_size
        return {"mlp.router.weight": (e, h), "mlp.router.bias": (e,),
                "mlp.experts.gate_up_proj": (e, h, 2 * f), "mlp.experts.gate_up_proj_bias": (e, 2 * f),
                "mlp.experts.down_proj": (e, f, h), "mlp.experts.down_proj_bias": (e, h)}

    # ------------------------------------------------------------------ attention
    def _attention_extras_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield from super()._attention_extras_to_mcore(get, hf, mc)  # (q, k, v biases)
        attn = hf + "self_attn."
        yield mc + "self_attention.linear_proj.bias", get(attn + "o_proj.bias")
        yield mc + "self_attention.core_attention.softmax_offset", get(attn + "sinks")

    def _attention_extras_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield from super()._attention_extras_to_hf(mcore, hf, mc)
        yield hf + "self_attn.o_proj.bias", mcore[mc + "self_attention.linear_proj.bias"]
        yield hf + "self_attn.sinks", mcore[mc + "self_attention.core_attention.softmax_offset"]

    # ------------------------------------------------------------------ experts
    def _mlp_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        yield mc + "mlp.router.weight", get(hf + "mlp.router.weight")
        yield mc + "mlp.router.bias", get(hf + "mlp.router.bias")
        # every expert, or those of expert_rows alone (a per-rank load reads only their rows)
        first, stop = self.expert_rows or (0, self.arch.num_experts)
        gate_up, gate_up_bias, down, down_bias = (get(f"{hf}mlp.experts.{name}") for name in _EXPERTS)
        for i in range(first, stop):  # (global expert indices; row j of the tensors read)
            dst, j = f"{mc}mlp.experts.local_experts.{i}.", i - first
            # [h, 2I] interleaved -> [gate; up] rows [2I, h]
            yield dst + "linear_fc1.weight", torch.cat([gate_up[j, :, 0::2].t(), gate_up[j, :, 1::2].t()], 0)
            yield dst + "linear_fc1.bias", torch.cat([gate_up_bias[j, 0::2], gate_up_bias[j, 1::2]], 0)
            yield dst + "linear_fc2.weight", down[j].t().contiguous()  # [I, h] -> [h, I]
            yield dst + "linear_fc2.bias", down_bias[j].clone()

    def _mlp_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        a = self.arch
        e, h, f = a.num_experts, a.hidden_size, a.moe_ffn_hidden_size
        yield hf + "mlp.router.weight", mcore[mc + "mlp.router.weight"]
        yield hf + "mlp.router.bias", mcore[mc + "mlp.router.bias"]
        for i in range(e):  # (each megatron tensor read once: the weight stream hands each out once)
            src = f"{mc}mlp.experts.local_experts.{i}."
            fc1 = mcore[src + "linear_fc1.weight"]
            if i == 0:
                gate_up, gate_up_bias = fc1.new_empty(e, h, 2 * f), fc1.new_empty(e, 2 * f)
                down, down_bias = fc1.new_empty(e, f, h), fc1.new_empty(e, h)
            gate, up = torch.chunk(fc1, 2, dim=0)  # 2 x [I, h]
            gate_up[i, :, 0::2], gate_up[i, :, 1::2] = gate.t(), up.t()
            gate_bias, up_bias = torch.chunk(mcore[src + "linear_fc1.bias"], 2, dim=0)
            gate_up_bias[i, 0::2], gate_up_bias[i, 1::2] = gate_bias, up_bias
            down[i] = mcore[src + "linear_fc2.weight"].t()
            down_bias[i] = mcore[src + "linear_fc2.bias"]
        for name, tensor in zip(_EXPERTS, (gate_up, gate_up_bias, down, down_bias)):
            yield f"{hf}mlp.experts.{name}", tensor
