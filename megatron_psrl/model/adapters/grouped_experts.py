"""The routed experts of an MoE layer in megatron's three expert modules' layouts, mapped both
ways (docs/moe.md, "Grouped GEMM").

Checkpoints, the Hugging Face adapters and the weight stream name experts one by one, as
megatron's ``SequentialMLP`` holds them (the *sequential* layout), below a layer's
``mlp.experts.``:

- ``local_experts.{i}.linear_fc1.weight`` ``[2f, h]`` (``[gate; up]``) and
  ``local_experts.{i}.linear_fc2.weight`` ``[h, f]``.

``--moe-grouped-gemm`` builds one of the other two (megatron-core 0.16,
``megatron/core/transformer/moe/experts.py``):

- *grouped*, the legacy ``GroupedMLP`` (grouped_gemm kernels; the local layer spec, or TE older
  than 1.7): two parameters for all ``E`` local experts, ``weight1`` ``[h, E * 2f]`` and
  ``weight2`` ``[E * f, h]``. Its forward reads them as ``weight1.view(E, h, 2f)`` and
  ``weight2.view(E, f, h)``, so expert ``i``'s block is ``weight1.view(E, h, 2f)[i] ==
  fc1_i.T`` (its columns ``[gate | up]``, as its GLU chunks them) and ``weight2.view(E, f, h)[i]
  == fc2_i.T``: the parameters are the per-expert transposes stacked in memory, *not* the
  experts side by side along ``weight1``'s columns;
- *te_grouped*, ``TEGroupedMLP`` (Transformer Engine's ``GroupedLinear``, the TE layer spec):
  ``linear_fc1.weight{i}`` ``[2f, h]`` and ``linear_fc2.weight{i}`` ``[h, f]``, each expert's
  weight as the sequential layout holds it, under another name (and TE's ``_extra_state`` per
  linear, which holds no weight).

Expert tensor parallelism is 1 in megatron_psrl (whole experts on every rank that holds them;
expert parallelism splits the experts instead): ``f`` is the whole ``moe_ffn_hidden_size``
and ``E`` the rank's local experts. The maps are copies and reshapes only, so a round trip is
bit for bit. torch_dist checkpoints need none of this: megatron's ``sharded_state_dict`` of
all three modules writes the same per-expert tensors.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Mapping, Tuple

import torch

Tensor = torch.Tensor

SEQUENTIAL, GROUPED, TE_GROUPED = "sequential", "grouped", "te_grouped"
EXPERT_LAYOUTS = (SEQUENTIAL, GROUPED, TE_GROUPED)

_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)weight([12])$")
_TE_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


def expert_layout(names: Iterable[str]) -> str:
    """The expert layout of a state dict (or a model's parameter names): ``grouped`` if it holds
    ``mlp.experts.weight1``, ``te_grouped`` if ``mlp.experts.linear_fc1.weight0``, else
    ``sequential`` (a dense model too)."""
    for name in names:
        if _GROUPED.match(name):
            return GROUPED
        if _TE_GROUPED.match(name):
            return TE_GROUPED
    return SEQUENTIAL


def _sequential_experts(state: Dict[str, Tensor]) -> Dict[str, Dict[int, Dict[str, Tensor]]]:
    """``{layer's experts prefix: {expert: {"linear_fc1": [2f, h], "linear_fc2": [h, f]}}}``."""
    layers: Dict[str, Dict[int, Dict[str, Tensor]]] = {}
    for name, tensor in state.items():
        m = _SEQUENTIAL.match(name)
        if m is not None:
            layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    for prefix, experts in layers.items():
        if sorted(experts) != list(range(len(experts))) or any(len(e) != 2 for e in experts.values()):
            raise ValueError(f"{prefix}: experts {sorted(experts)} are not 0..E-1, each with linear_fc1 and linear_fc2")
    return layers


def to_expert_layout(state: Dict[str, Tensor], layout: str) -> Dict[str, Tensor]:
    """``state`` (experts in the sequential layout) with its experts in ``layout``; every other
    tensor as it is. Grouped tensors are new (contiguous) tensors; te_grouped ones the same."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert layout {layout!r}; choose from {EXPERT_LAYOUTS}")
    if layout == SEQUENTIAL:
        return dict(state)
    out = {name: t for name, t in state.items() if _SEQUENTIAL.match(name) is None}
    for prefix, experts in _sequential_experts(state).items():
        ordered = [experts[i] for i in range(len(experts))]
        if layout == TE_GROUPED:
            for i, expert in enumerate(ordered):
                out[f"{prefix}linear_fc1.weight{i}"] = expert["linear_fc1"]
                out[f"{prefix}linear_fc2.weight{i}"] = expert["linear_fc2"]
            continue
        h = ordered[0]["linear_fc1"].shape[1]
        # weight1: [E, h, 2f] in memory (expert i's fc1 transposed), seen as [h, E * 2f]
        out[prefix + "weight1"] = torch.stack([e["linear_fc1"].t() for e in ordered]).reshape(h, -1)
        # weight2: [E, f, h] in memory (expert i's fc2 transposed), seen as [E * f, h]
        out[prefix + "weight2"] = torch.stack([e["linear_fc2"].t() for e in ordered]).reshape(-1, h)
    return out


def _grouped_experts(weight1: Tensor, weight2: Tensor, ffn_hidden_size: int) -> Iterable[Tuple[Tensor, Tensor]]:
    """``(fc1 [2f, h], fc2 [h, f])`` of every expert of a ``GroupedMLP``'s two parameters."""
    h, f = weight1.shape[0], ffn_hidden_size
    if weight2.shape[0] % f or weight1.shape[1] != 2 * weight2.shape[0] or weight2.shape[1] != h:
        raise ValueError(f"GroupedMLP weights {tuple(weight1.shape)} / {tuple(weight2.shape)} are not E experts of "
                         f"a gated MLP of width {f} over hidden size {h}")
    num_experts = weight2.shape[0] // f
    w1 = weight1.reshape(num_experts, h, 2 * f)  # [E, h, 2f]
    w2 = weight2.reshape(num_experts, f, h)  # [E, f, h]
    for i in range(num_experts):
        yield w1[i].t().contiguous(), w2[i].t().contiguous()


def from_expert_layout(state: Mapping[str, Tensor], ffn_hidden_size: int) -> Mapping[str, Tensor]:
    """``state`` with its experts, in any of the three layouts (:func:`expert_layout`), in the
    sequential one; every other tensor as it is. ``ffn_hidden_size``: one expert's width ``f``
    (``moe_ffn_hidden_size``: a GroupedMLP's shapes alone do not tell ``E`` from ``f``).
    Already sequential: ``state`` itself, untouched (a streamed mapping is not read here; only
    its names are)."""
    layout = expert_layout(state)
    if layout == SEQUENTIAL:
        return state
    pattern = _GROUPED if layout == GROUPED else _TE_GROUPED
    out = {name: t for name, t in state.items() if pattern.match(name) is None}
    if layout == TE_GROUPED:
        for name, tensor in state.items():
            m = _TE_GROUPED.match(name)
            if m is not None:
                out[f"{m.group(1)}local_experts.{m.group(3)}.{m.group(2)}.weight"] = tensor
        return out
    for prefix in sorted({m.group(1) for m in map(_GROUPED.match, state) if m is not None}):
        experts = _grouped_experts(state[prefix + "weight1"], state[prefix + "weight2"], ffn_hidden_size)
        for i, (fc1, fc2) in enumerate(experts):
            out[f"{prefix}local_experts.{i}.linear_fc1.weight"] = fc1
            out[f"{prefix}local_experts.{i}.linear_fc2.weight"] = fc2
    return out


__all__ = ["EXPERT_LAYOUTS", "GROUPED", "SEQUENTIAL", "TE_GROUPED", "expert_layout", "from_expert_layout",
           "to_expert_layout"]
