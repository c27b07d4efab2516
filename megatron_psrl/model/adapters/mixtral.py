"""Mixtral adapter: Mistral attention (no bias, no q/k norm), every MLP a router and ``E``
SwiGLU experts of width ``intermediate_size``.

Hugging Face names (Hub and ``save_pretrained``), below ``model.layers.{l}.block_sparse_moe.``:
the router ``gate.weight`` ``[E, h]`` and experts ``experts.{i}.w1.weight`` (gate, ``[I, h]``),
``w3.weight`` (up, ``[I, h]``), ``w2.weight`` (down, ``[h, I]``). transformers >= 5 holds them
in memory under ``mlp.`` and fused (:func:`~megatron_psrl.model.adapters.experts.unfuse_experts`).
megatron's MoELayer: ``mlp.router.weight``, ``mlp.experts.local_experts.{i}.linear_fc1.weight``
(``[w1; w3]``) / ``linear_fc2.weight`` (``w2``).
"""

from __future__ import annotations

from megatron_psrl.model.adapters.base import LlamaStyleAdapter
from megatron_psrl.model.adapters.experts import RoutedExpertsMixin


class MixtralAdapter(RoutedExpertsMixin, LlamaStyleAdapter):
    """Mixtral: Mistral's layout with a mixture-of-experts MLP in every layer."""

    hf_moe_block = "block_sparse_moe."
    hf_expert_projections = ("w1", "w3", "w2")
