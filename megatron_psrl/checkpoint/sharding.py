"""Split a full megatron-core GPT state dict into tensor/pipeline-parallel shards and merge back.

Rules follow megatron's parallel layers (names of the local layer spec):

| parameter | split |
|---|---|
| ``embedding.word_embeddings.weight``, ``output_layer.weight`` | vocab rows (padded to a multiple of TP) |
| ``linear_qkv.weight/bias`` | by key/value group (each rank: its groups' q, k, v rows) |
| ``linear_fc1.weight`` | gate and up halves split separately, then stacked per rank |
| ``linear_proj.weight``, ``linear_fc2.weight`` | input columns |
| ``core_attention.softmax_offset`` (attention sinks, gpt-oss) | by query heads |
| norms, q/k norms, MoE router, shared-expert gate, ``linear_proj.bias`` | replicated |
| routed experts (``mlp.experts.``) | replicated: whole on every TP rank (expert TP = 1; expert
  parallelism splits them instead, ``megatron_psrl.model.moe.local_experts``) |

A shared expert (``mlp.shared_experts.linear_fc1/fc2``) splits like the dense MLP, as megatron's
``SharedExpertMLP`` (the attention's tensor parallelism) does.

Latent attention (megatron's ``MLASelfAttention``, local spec): its down-projections
(``linear_q_down_proj``, ``linear_kv_down_proj``: column-parallel, their output gathered) and
up-projections (``linear_q_up_proj``, ``linear_q_proj``, ``linear_kv_up_proj``: per head) split
their output rows in equal blocks (``rows``); the latents' norms are replicated.

A Gated DeltaNet layer (``self_attention.`` of a linear-attention layer, megatron's
``GatedDeltaNet``): ``in_proj.weight`` ``[q; k; v; z; beta; alpha]`` and ``conv1d.weight``
``[q; k; v]`` split each part by heads, then stack the rank's parts in the same order
(``parts``); ``dt_bias`` / ``A_log`` by value heads (``rows``); ``out_proj.weight`` by input
columns; ``out_norm.weight`` (per head width) replicated. With an output gate
(``attention_output_gate``) a group's ``linear_qkv`` rows also hold its queries' gates: the
per-group split is the same.

Pipeline stage p holds layers ``[p*L/PP, (p+1)*L/PP)`` renumbered from 0 (megatron's legacy
checkpoint convention), the embedding on the first stage, the final norm and output layer on
the last; with tied embeddings and PP > 1 the last stage holds a copy of the (padded)
embedding as ``output_layer.weight``, as megatron does.
"""

from __future__ import annotations

import re
from typing import Dict, List

import torch

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.stages import PipelineSplit, stage_counts

Tensor = torch.Tensor
LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
"""A megatron decoder-layer parameter name: group 1 the layer number, group 2 the rest."""
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_LATENT_PROJECTIONS = tuple(f"self_attention.{p}.weight" for p in (
    "linear_q_down_proj", "linear_q_up_proj", "linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj"))
"""Latent attention's column-parallel projections: output rows in equal blocks."""


def shard_kind(name: str) -> str:
    """How tensor parallelism splits the megatron parameter ``name``: ``vocab`` (rows, padded
    vocabulary), ``qkv`` (per query group), ``fc1`` (gate and up halves separately), ``parts``
    (a Gated DeltaNet projection's parts separately, :func:`gdn_parts`), ``rows`` (plain row
    blocks), ``row`` (columns) or ``replicated`` (routed experts too: expert tensor parallelism
    is 1)."""
    if name in _VOCAB:
        return "vocab"
    if ".mlp.experts." in name:  # routed experts: expert tensor parallelism 1
        return "replicated"
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("self_attention.in_proj.weight", "self_attention.conv1d.weight")):
        return "parts"
    if name.endswith(("self_attention.dt_bias", "self_attention.A_log", "core_attention.softmax_offset")
                     + _LATENT_PROJECTIONS):
        return "rows"  # (per head: a Gated DeltaNet's value heads, attention sinks' query heads)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight", "self_attention.out_proj.weight")):
        return "row"
    return "replicated"


def gdn_parts(name: str, arch: ModelArchitecture) -> List[int]:
    """Row counts of the parts of a Gated DeltaNet ``in_proj`` (q, k, v, z, beta, alpha) or
    ``conv1d`` (q, k, v) weight, each split by heads under tensor parallelism."""
    qk = arch.linear_num_key_heads * arch.linear_key_head_dim
    v, nv = arch.linear_num_value_heads * arch.linear_value_head_dim, arch.linear_num_value_heads
    return [qk, qk, v, v, nv, nv] if name.endswith("in_proj.weight") else [qk, qk, v]


def _tp_split(name: str, t: Tensor, arch: ModelArchitecture, tp: int) -> List[Tensor]:
    kind = shard_kind(name)
    if kind == "replicated" or (tp == 1 and kind != "vocab"):
        return [t] * tp
    if kind == "vocab":
        padded = arch.padded_vocab_size(tp)
        if t.shape[0] < padded:
            t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])], 0)
        return [c.clone() for c in torch.chunk(t, tp, dim=0)]
    if kind == "qkv":
        ng = arch.num_kv_heads
        grouped = t.reshape(ng, -1, *t.shape[1:])
        return [c.reshape(-1, *t.shape[1:]).clone() for c in torch.chunk(grouped, tp, dim=0)]
    if kind == "fc1":
        gate, up = torch.chunk(t, 2, dim=0)
        return [torch.cat([g, u], 0) for g, u in zip(torch.chunk(gate, tp, 0), torch.chunk(up, tp, 0))]
    if kind == "parts":
        pieces = [torch.chunk(p, tp, 0) for p in torch.split(t, gdn_parts(name, arch), 0)]
        return [torch.cat([p[r] for p in pieces], 0) for r in range(tp)]
    if kind == "rows":
        return [c.clone() for c in torch.chunk(t, tp, dim=0)]
    return [c.clone() for c in torch.chunk(t, tp, dim=1)]  # row parallel


def tp_shard(name: str, tensor: Tensor, arch: ModelArchitecture, tp: int, tp_rank: int) -> Tensor:
    """Tensor-parallel rank ``tp_rank``'s shard of the full tensor of ``name``."""
    return _tp_split(name, tensor, arch, tp)[tp_rank]


def tp_merge(name: str, shards: List[Tensor], arch: ModelArchitecture) -> Tensor:
    """The full tensor of ``name`` from its tensor-parallel shards (inverse of the split)."""
    kind = shard_kind(name)
    if kind == "replicated":
        return shards[0]
    if kind == "vocab":
        return torch.cat(shards, 0)[: arch.vocab_size].clone()
    if len(shards) == 1:
        return shards[0]
    if kind == "qkv":
        per = [s.reshape(arch.num_kv_heads // len(shards), -1, *s.shape[1:]) for s in shards]
        return torch.cat(per, 0).reshape(-1, *shards[0].shape[1:])
    if kind == "fc1":
        halves = [torch.chunk(s, 2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    if kind == "parts":
        local = [n // len(shards) for n in gdn_parts(name, arch)]
        pieces = [torch.split(s, local, 0) for s in shards]
        return torch.cat([pieces[r][i] for i in range(len(local)) for r in range(len(shards))], 0)
    if kind == "rows":
        return torch.cat(shards, 0)
    return torch.cat(shards, 1)


def stage_layers(arch: ModelArchitecture, pp_rank: int, pp: PipelineSplit) -> range:
    """Global (0-based) indices of the layers pipeline stage ``pp_rank`` holds."""
    counts = stage_counts(arch, pp)
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def shard_state_dict(
    full: Dict[str, Tensor], arch: ModelArchitecture, tp: int, pp: PipelineSplit
) -> Dict[tuple, Dict[str, Tensor]]:
    """Full state dict -> ``{(tp_rank, pp_rank): shard}`` for every rank of a TP x PP grid."""
    counts = stage_counts(arch, pp)
    n = len(counts)
    if arch.num_kv_heads % tp:
        raise ConfigurationError(f"tensor parallel size {tp} must divide the {arch.num_kv_heads} key/value heads")
    stage_of = [p for p, c in enumerate(counts) for _ in range(c)]
    offsets = [sum(counts[:p]) for p in range(n)]
    shards: Dict[tuple, Dict[str, Tensor]] = {(r, p): {} for r in range(tp) for p in range(n)}
    for name, tensor in full.items():
        pieces = _tp_split(name, tensor, arch, tp)
        m = LAYER_NAME.match(name)
        if m:
            layer = int(m.group(1))
            p = stage_of[layer]
            stages = [(p, f"decoder.layers.{layer - offsets[p]}.{m.group(2)}")]
        elif name == "embedding.word_embeddings.weight":
            stages = [(0, name)]
            if arch.tie_word_embeddings and n > 1:
                stages.append((n - 1, "output_layer.weight"))
        else:  # final norm, untied output layer
            stages = [(n - 1, name)]
        for p, local_name in stages:
            for r in range(tp):
                shards[(r, p)][local_name] = pieces[r]
    return shards


def merge_state_dicts(
    shards: Dict[tuple, Dict[str, Tensor]], arch: ModelArchitecture, tp: int, pp: PipelineSplit
) -> Dict[str, Tensor]:
    """Inverse of :func:`shard_state_dict` (drops the tied output copy of the last stage)."""
    counts = stage_counts(arch, pp)
    full: Dict[str, Tensor] = {}
    for p in range(len(counts)):
        offset = sum(counts[:p])
        for name in shards[(0, p)]:
            if name.endswith("_extra_state"):
                continue
            if arch.tie_word_embeddings and name == "output_layer.weight":
                continue
            m = LAYER_NAME.match(name)
            global_name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name
            full[global_name] = tp_merge(name, [shards[(r, p)][name] for r in range(tp)], arch)
    return full


def expected_shard_shapes(arch: ModelArchitecture, tp: int, pp: PipelineSplit) -> Dict[tuple, Dict[str, tuple]]:
    """``{(tp_rank, pp_rank): {name: shape}}`` of a checkpoint of ``arch`` saved with TP x PP:
    the shapes the HF layout implies, converted and sharded on the meta device (no memory)."""
    from megatron_psrl.model.adapters import get_adapter

    adapter = get_adapter(arch)
    shapes = adapter.hf_shapes()
    full = dict(adapter.hf_to_mcore(lambda name: torch.empty(shapes[name], device="meta")))
    return {key: {name: tuple(t.shape) for name, t in shard.items()}
            for key, shard in shard_state_dict(full, arch, tp, pp).items()}
