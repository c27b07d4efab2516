"""The routed experts (and the shared expert) of a mixture-of-experts layer: the part of the
Hugging Face <-> megatron-core mapping common to the MoE families (docs/moe.md).

Hugging Face names (as on the Hub, and as ``save_pretrained`` writes them), below
``model.layers.{l}.`` and the family's MoE block (``mlp.`` for Qwen2-MoE / Qwen3-MoE,
``block_sparse_moe.`` for Mixtral): the router ``gate.weight`` ``[E, h]`` and every expert on
its own, ``experts.{i}.{gate,up,down}.weight`` with the family's projection names
(``gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral ``w1`` / ``w3`` / ``w2``). megatron's
MoELayer: ``mlp.router.weight`` and ``mlp.experts.local_experts.{i}.linear_fc1.weight``
(``[gate; up]``) / ``linear_fc2.weight``, ``i`` the global expert index in a full state dict
(expert parallelism renumbers them per rank, ``megatron_psrl.model.moe.local_experts``), and a
shared expert (Qwen2-MoE) as ``mlp.shared_experts.linear_fc1.weight`` / ``linear_fc2.weight`` /
``gate_weight``.

transformers >= 5 keeps the experts fused in memory, under ``mlp.`` for every family
(``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` ``[E, 2I, h]``, ``mlp.experts.down_proj``
``[E, h, I]``); :func:`unfuse_experts` names such a state dict (a model's ``state_dict()`` or
its gradients) as the family's checkpoints do.

megatron's grouped-GEMM expert modules (``GroupedMLP``'s ``weight1`` / ``weight2``,
``TEGroupedMLP``'s ``linear_fc1.weight{i}``) hold the same tensors in other layouts:
:meth:`RoutedExpertsMixin.hf_to_mcore_layout` converts into either, and
:meth:`~RoutedExpertsMixin.mcore_to_hf` reads any of them
(:mod:`~megatron_psrl.model.adapters.grouped_experts`).
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Optional, Tuple

import torch

from megatron_psrl.model.adapters.base import GetTensor, Tensor
from megatron_psrl.model.adapters.grouped_experts import from_expert_layout, to_expert_layout

_FUSED = re.compile(r"^(.*\.)mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(.*\.)mlp\.gate\.weight$")


class RoutedExpertsMixin:
    """The MoE MLP of an adapter: a router and ``E`` SwiGLU experts, and the hooks of a shared
    expert (none here). Listed before the family's attention adapter in the bases."""

    hf_moe_block: str = "mlp."
    """The MoE block's name prefix within a layer, on the Hub."""

    hf_expert_projections: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """One expert's gate, up and down projections' names, on the Hub."""

    def hf_mlp_shapes(self) -> Dict[str, Tuple[int, ...]]:
        a = self.arch
        h, f = a.hidden_size, a.moe_ffn_hidden_size
        gate, up, down = self.hf_expert_projections
        shapes = {self.hf_moe_block + "gate.weight": (a.num_experts, h)}
        for i in range(a.num_experts):
            p = f"{self.hf_moe_block}experts.{i}."
            shapes.update({f"{p}{gate}.weight": (f, h), f"{p}{up}.weight": (f, h), f"{p}{down}.weight": (h, f)})
        shapes.update(self.hf_shared_expert_shapes())
        return shapes

    def _mlp_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        gate, up, down = self.hf_expert_projections
        yield mc + "mlp.router.weight", get(hf + self.hf_moe_block + "gate.weight")
        for i in range(self.arch.num_experts):
            src, dst = f"{hf}{self.hf_moe_block}experts.{i}.", f"{mc}mlp.experts.local_experts.{i}."
            # [gate; up]: [2f, h]
            yield dst + "linear_fc1.weight", torch.cat([get(f"{src}{gate}.weight"), get(f"{src}{up}.weight")], 0)
            yield dst + "linear_fc2.weight", get(f"{src}{down}.weight")
        yield from self._shared_expert_to_mcore(get, hf, mc)

    def _mlp_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        gate, up, down = self.hf_expert_projections
        yield hf + self.hf_moe_block + "gate.weight", mcore[mc + "mlp.router.weight"]
        for i in range(self.arch.num_experts):
            src, dst = f"{mc}mlp.experts.local_experts.{i}.", f"{hf}{self.hf_moe_block}experts.{i}."
            gate_w, up_w = torch.chunk(mcore[src + "linear_fc1.weight"], 2, dim=0)  # 2 x [f, h]
            yield f"{dst}{gate}.weight", gate_w.clone()
            yield f"{dst}{up}.weight", up_w.clone()
            yield f"{dst}{down}.weight", mcore[src + "linear_fc2.weight"]
        yield from self._shared_expert_to_hf(mcore, hf, mc)

    def hf_to_mcore_layout(self, get: GetTensor, layout: str) -> Dict[str, Tensor]:
        """The full megatron state dict of :meth:`hf_to_mcore` with the routed experts in
        ``layout`` (``sequential``, ``grouped`` or ``te_grouped``: megatron's expert modules)."""
        return to_expert_layout(dict(self.hf_to_mcore(get)), layout)

    def mcore_to_hf(self, mcore: Dict[str, Tensor]) -> Iterator[Tuple[str, Tensor]]:
        """Hugging Face tensors of a full megatron state dict whose routed experts are in any of
        megatron's layouts (one by one, ``GroupedMLP``'s or ``TEGroupedMLP``'s)."""
        yield from super().mcore_to_hf(from_expert_layout(mcore, self.arch.moe_ffn_hidden_size))

    # ------------------------------------------------------------------ shared expert hooks
    def hf_shared_expert_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shapes of one layer's shared-expert tensors (none without a shared expert)."""
        return {}

    def _shared_expert_to_mcore(self, get: GetTensor, hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        return iter(())

    def _shared_expert_to_hf(self, mcore: Dict[str, Tensor], hf: str, mc: str) -> Iterator[Tuple[str, Tensor]]:
        return iter(())


def _infer_model_type(state: Dict[str, Tensor]) -> str:
    """The MoE family of an in-memory transformers state dict, from its attention and MLP: gpt-oss
    has attention sinks; Mixtral is the one without q/k norms (Qwen3-MoE), q/k/v biases or a
    shared expert (Qwen2-MoE). Qwen2-MoE and Qwen3-MoE name experts alike, so either of them is
    answered as ``qwen3_moe``."""
    if any(k.endswith("self_attn.sinks") for k in state):
        return "gpt_oss"
    attention = any(k.endswith("self_attn.q_proj.weight") for k in state)
    qwen = any(k.endswith(("self_attn.q_norm.weight", "self_attn.q_proj.bias")) or ".mlp.shared_expert" in k
               for k in state)
    return "mixtral" if attention and not qwen else "qwen3_moe"


def unfuse_experts(state: Dict[str, Tensor], model_type: Optional[str] = None) -> Dict[str, Tensor]:
    """A state dict with transformers' in-memory fused experts (``mlp.experts.gate_up_proj``
    ``[E, 2I, h]``, ``mlp.experts.down_proj`` ``[E, h, I]``, router ``mlp.gate.weight``) named
    per expert as the checkpoints of ``model_type`` are (Qwen: ``mlp.experts.{i}.{gate,up,down}_proj
    .weight``; Mixtral: ``block_sparse_moe.experts.{i}.{w1,w3,w2}.weight`` and
    ``block_sparse_moe.gate.weight``); other tensors unchanged. Views, no copy.

    ``model_type`` None: read from the state dict's attention and MLP tensors
    (:func:`_infer_model_type`)."""
    # imported here: the families refer to the adapter classes of this package
    from megatron_psrl.model.families.registry import get_family

    adapter = get_family(model_type or _infer_model_type(state)).adapter  # the family's checkpoint names
    if getattr(adapter, "hf_experts_fused", False):  # its checkpoints keep them fused too (gpt-oss)
        return dict(state)
    block, (gate, up, down) = adapter.hf_moe_block, adapter.hf_expert_projections
    out: Dict[str, Tensor] = {}
    for name, tensor in state.items():
        router = _ROUTER.match(name)
        m = _FUSED.match(name)
        if router is not None:
            out[f"{router.group(1)}{block}gate.weight"] = tensor
        elif m is None:
            out[name] = tensor
        elif m.group(2) == "down_proj":  # [E, h, I]
            for i in range(tensor.shape[0]):
                out[f"{m.group(1)}{block}experts.{i}.{down}.weight"] = tensor[i]
        else:  # gate_up_proj [E, 2I, h]: gate rows first
            for i in range(tensor.shape[0]):
                gate_w, up_w = torch.chunk(tensor[i], 2, dim=0)
                out[f"{m.group(1)}{block}experts.{i}.{gate}.weight"] = gate_w
                out[f"{m.group(1)}{block}experts.{i}.{up}.weight"] = up_w
    return out
