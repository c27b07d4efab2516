"""Mixture-of-experts models on megatron-core's MoELayer: settings checks, the CPU runtime, and
expert-parallel sharding of state dicts (docs/moe.md).

An MoE layer is megatron's ``MoELayer``: a ``TopKRouter`` (``mlp.router.weight``, replicated)
and the experts, ``SequentialMLP`` of megatron's ``MLP`` (``mlp.experts.local_experts.{j}.
linear_fc1/linear_fc2``) on CPU and with the local spec, or the grouped-GEMM experts on GPU.
With expert parallelism (EP) each rank of an expert-parallel group holds ``E / EP``
consecutive experts, renumbered from 0 (``local_experts.{j}`` is global expert
``ep_rank * E / EP + j``); a full state dict names experts by their global index.

Dropless top-k routing is per token: a token's experts and weights depend on its hidden state
only, so a prefix token computed once for every sample through it gets exactly its per-sample
output, and the two prefix-sharing mechanisms stay exact. What depends on the batch's
composition is refused with prefix sharing: capacity-factor token dropping (which tokens are
dropped depends on the other tokens of the batch). The router losses count a shared token once
per sample: :mod:`megatron_psrl.model.moe_losses`.
"""

from __future__ import annotations

import contextlib
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_psrl.compat import install_cpu_moe_shims
from megatron_psrl.data.validation import RoutingShape
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.sequence_parallel import sequence_parallel_group, shard_rows, tensor_parallel_rank_and_size
from megatron_psrl.options import MOE_TOKEN_DISPATCHERS

Tensor = torch.Tensor

TOKEN_DISPATCHERS = MOE_TOKEN_DISPATCHERS
"""megatron's token dispatchers supported (``--moe-token-dispatcher-type``); ``flex`` (DeepEP /
HybridEP) is GPU-only and not wired in."""

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def check_moe_settings(arch: ModelArchitecture, overrides: Mapping[str, object], device: torch.device,
                       tensor_parallel_size: int = 1) -> None:
    """Refuse MoE settings that this device or megatron_psrl cannot run (one line each)."""
    if tensor_parallel_size > 1 and not overrides.get("sequence_parallel"):
        raise ConfigurationError("mixture-of-experts models under tensor parallelism need --sequence-parallel "
                                 "(megatron's MoE layers and token dispatchers take each tensor-parallel rank's "
                                 "share of the rows)")
    ep = int(overrides.get("expert_model_parallel_size", 1) or 1)
    if arch.num_experts % ep:
        raise ConfigurationError(f"--expert-model-parallel-size {ep} must divide the model's {arch.num_experts} experts")
    dispatcher = overrides.get("moe_token_dispatcher_type", "allgather")
    if dispatcher not in TOKEN_DISPATCHERS:
        raise ConfigurationError(f"--moe-token-dispatcher-type must be one of {TOKEN_DISPATCHERS}, got {dispatcher!r}")
    if overrides.get("moe_grouped_gemm") and torch.device(device).type != "cuda":
        raise ConfigurationError("--moe-grouped-gemm needs CUDA (its kernels are GPU-only); on CPU the experts run "
                                 "one by one (megatron's SequentialMLP)")
    if overrides.get("moe_grouped_gemm") and arch.linear_bias:
        raise ConfigurationError(f"--moe-grouped-gemm with {arch.model_type}'s expert biases is not supported (the "
                                 "grouped layouts' conversions carry weights only); its experts run one by one")
    if overrides.get("moe_expert_capacity_factor") is not None:
        raise ConfigurationError("capacity-factor token dropping is not supported: which tokens an expert drops "
                                 "depends on the other tokens of the batch, so prefix sharing would change them")


def keep_expert_bias_counts_to_the_trainer(model: torch.nn.Module) -> None:
    """Switch off megatron's own token count of its routers' expert-bias update
    (``TopKRouter._apply_expert_bias``; the bias still selects experts). It counts each computed
    row once, where the per-sample run counts a shared token once per sample: the trainer
    counts them weighted when it updates the bias (``--moe-router-enable-expert-bias``,
    :mod:`megatron_psrl.model.moe_losses`), and otherwise the bias is frozen and nothing needs
    counting (megatron 0.16's count also fails on sequence parallelism's padding mask, which it
    applies to the ``[tokens, E]`` map without a trailing dimension)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.enable_expert_bias = False


def install_moe_runtime(device: torch.device) -> None:
    """What megatron's MoE layer needs on ``device`` (CPU: :func:`~megatron_psrl.compat.install_cpu_moe_shims`)."""
    install_cpu_moe_shims(torch.device(device))


def expert_index(name: str):
    """``(prefix, expert index, suffix)`` of an expert parameter's name, or None."""
    m = _EXPERT.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def local_experts(shard: Dict[str, Tensor], arch: ModelArchitecture, ep_rank: int, ep: int) -> Dict[str, Tensor]:
    """This expert-parallel rank's part of a shard whose experts carry global indices: its
    ``E / ep`` experts renumbered from 0, every other tensor as it is."""
    if ep == 1:
        return shard
    per_rank = arch.num_experts // ep
    first = ep_rank * per_rank
    out: Dict[str, Tensor] = {}
    for name, tensor in shard.items():
        parts = expert_index(name)
        if parts is None:
            out[name] = tensor
        elif first <= parts[1] < first + per_rank:
            out[f"{parts[0]}{parts[1] - first}{parts[2]}"] = tensor
    return out


def global_experts(shards: Mapping[int, Dict[str, Tensor]], arch: ModelArchitecture) -> Dict[str, Tensor]:
    """Inverse of :func:`local_experts`: the shards of every expert-parallel rank (by EP rank)
    merged into one state dict with global expert indices."""
    ep = len(shards)
    per_rank = arch.num_experts // ep
    out: Dict[str, Tensor] = {}
    for ep_rank in sorted(shards):
        for name, tensor in shards[ep_rank].items():
            parts = expert_index(name)
            if parts is None:
                out.setdefault(name, tensor)
            else:
                out[f"{parts[0]}{parts[1] + ep_rank * per_rank}{parts[2]}"] = tensor
    return out


def moe_layer_pattern(config) -> List[int]:
    """megatron's per-layer pattern of a model's config (``moe_layer_freq``): 1 an MoE layer, 0
    a dense MLP, for each of its ``num_layers`` layers (all pipeline stages)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def moe_layer_index(config, layer_number: int) -> int:
    """The MoE layer index (0-based, over the MoE layers only, in layer order: the second
    dimension of router-replay routes and of the router losses' counts) of megatron layer
    ``layer_number`` (1-based, global), an MoE layer. Without dense layers it is
    ``layer_number - 1``."""
    return sum(moe_layer_pattern(config)[:layer_number - 1])


def is_expert_parameter(name: str) -> bool:
    """A parameter of one expert (megatron marks them ``allreduce = False``: their gradients are
    summed over the expert-data-parallel group, not the data-parallel one)."""
    return ".mlp.experts." in name


# ---------------------------------------------------------------------- expert-parallel lockstep
Pass = Tuple[str, int]
"""A micro-batch pass of one rank: ``(kind, micro-batch)``. Kinds: ``N`` a forward without a
graph; ``P`` a forward whose backward follows at once; ``K`` a forward whose graph is kept for a
later backward; ``B`` that later backward (of the ``K`` of the same micro-batch)."""


def lockstep_ticks(sequences: Sequence[Sequence[Pass]]) -> List[Tuple[str, List[bool], int]]:
    """The common schedule of the MoE all-to-alls of an expert-parallel group.

    ``sequences[r]``: rank r's passes in order. In a forward the MoE layers send tokens to the
    ranks of their experts; in the backward the gradients of exactly those tokens go back, so
    every rank must run the backward of the same forward tick at the same time. Returns ticks
    ``(kind, [rank r runs its own pass], forward tick a B tick undoes)``; a rank without its own
    pass in a tick runs an empty one (a forward of one zero token, whose backward, with a zero
    gradient, runs at that forward's B tick). ``N`` and ``P`` passes of several ranks share a
    tick; a ``K`` forward has a tick of its own (ranks back-propagate kept graphs in the order
    their prefix sharing needs, which differs between ranks), and so has its ``B``.
    Deterministic: every rank computes the same ticks from the same sequences."""
    n = len(sequences)
    pos = [0] * n
    kept: Dict[Tuple[int, int], int] = {}  # (rank, micro-batch) -> tick of its K forward
    ticks: List[Tuple[str, List[bool], int]] = []
    while any(pos[r] < len(sequences[r]) for r in range(n)):
        nxt = [tuple(sequences[r][pos[r]]) if pos[r] < len(sequences[r]) else None for r in range(n)]
        kinds = {x[0] for x in nxt if x is not None}
        if "B" in kinds:  # the first rank's pending backward, alone
            r = next(r for r, x in enumerate(nxt) if x is not None and x[0] == "B")
            own = [q == r for q in range(n)]
            ticks.append(("B", own, kept.pop((r, nxt[r][1]))))
        elif kinds & {"P", "N"}:  # every rank with such a pass next, together
            kind = "P" if "P" in kinds else "N"
            own = [x is not None and x[0] == kind for x in nxt]
            ticks.append((kind, own, -1))
        else:  # a kept forward, alone
            r = next(r for r, x in enumerate(nxt) if x is not None)
            own = [q == r for q in range(n)]
            kept[(r, nxt[r][1])] = len(ticks)
            ticks.append(("K", own, -1))
        for r in range(n):
            pos[r] += own[r]
    return ticks


def moe_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """megatron MoE layers of ``model`` in forward order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


Unit = Tuple[List[torch.nn.Module], bool]
"""MoE layers that run as one unit of a model's forward: ``(layers, checkpointed)``; a
checkpointed unit recomputes its forward (its all-to-alls too) inside its backward."""


def recompute_units(chunks: Sequence[torch.nn.Module]) -> List[Unit]:
    """The MoE layers of ``chunks`` (a rank's model chunks, in forward order) grouped as megatron's
    full activation recomputation checkpoints their transformer layers
    (``TransformerBlock._checkpointed_forward``): ``uniform``, every ``recompute_num_layers``
    layers of a block one checkpointed unit; ``block``, its first ``recompute_num_layers`` layers
    one unit each, the rest not checkpointed. Without full recomputation: one unit, not
    checkpointed. (Selective recomputation of ``moe`` checkpoints inside ``MoELayer.forward``,
    which an empty pass runs as it is.)"""
    from megatron.core.transformer.transformer_block import TransformerBlock

    units: List[Unit] = []

    def add(layers: List[torch.nn.Module], checkpointed: bool) -> None:
        if not layers:
            return  # no all-to-all to mirror
        if not checkpointed and units and not units[-1][1]:
            units[-1][0].extend(layers)
        else:
            units.append((list(layers), checkpointed))

    for chunk in chunks:
        for block in [m for m in chunk.modules() if isinstance(m, TransformerBlock)]:
            cfg = block.config
            per_layer = [moe_layers(layer) for layer in block.layers]
            if cfg.recompute_granularity != "full" or not block.training:  # (megatron's condition too)
                add([m for ms in per_layer for m in ms], False)
            elif cfg.recompute_method == "uniform":
                n = cfg.recompute_num_layers
                for start in range(0, len(per_layer), n):
                    add([m for ms in per_layer[start:start + n] for m in ms], True)
            elif cfg.recompute_method == "block":
                for idx, ms in enumerate(per_layer):
                    add(ms, idx < cfg.recompute_num_layers)
            else:
                raise ValueError(f"unknown recompute_method {cfg.recompute_method!r}")
    return units


class ExpertLockstep:
    """Runs this rank's passes of a step in the common schedule of its expert-parallel group
    (:func:`lockstep_ticks`), with empty passes where other ranks run theirs.

    With expert parallelism every MoE layer exchanges tokens with the other ranks of its group
    (all-to-all) in its forward and its backward, while prefix sharing gives ranks different
    numbers of micro-batches and different orders of forward and backward passes. The runner
    calls :meth:`own` before each of its passes (for a ``P`` pass before its forward) and
    :meth:`finish` at the end of the step.

    Ranks of the group with the same ``peer_key`` (the tensor-parallel ranks of one data-parallel
    rank, whose layers split every pass between them) run the same passes, together: they are
    one participant of the schedule."""

    def __init__(self, layers: Sequence[torch.nn.Module], group, mine: Sequence[Pass], hidden_size: int,
                 dtype: torch.dtype, device: torch.device, units: Optional[Sequence[Unit]] = None,
                 peer_key: int = 0):
        import torch.distributed as dist

        self.layers, self.hidden_size, self.dtype, self.device = list(layers), hidden_size, dtype, device
        self.units: List[Unit] = list(units) if units is not None else [(self.layers, False)]
        """The MoE layers as the model's forward runs them (:func:`recompute_units`): an empty
        pass checkpoints the units the model checkpoints, so that its backward repeats the
        forward's all-to-alls where a recomputing backward of the model does."""
        everyone: List[Tuple[int, List[Pass]]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
        dist.all_gather_object(everyone, (peer_key, list(mine)), group=group)  # one small collective per step
        participants: Dict[int, List[Pass]] = {}
        for key, passes in everyone:
            if participants.setdefault(key, passes) != passes:
                raise RuntimeError(f"expert-parallel lockstep: ranks of participant {key} planned different passes")
        me = list(participants).index(peer_key)
        self.ticks = [(kind, own[me], ref) for kind, own, ref in lockstep_ticks(list(participants.values()))]
        self.next = 0
        self.held: Dict[int, Tensor] = {}
        self.empty_passes = 0
        """Empty forward passes run so far."""

    def own(self, kind: str) -> None:
        """Run the empty passes due before this rank's next own pass (of ``kind``)."""
        while True:
            if self.next >= len(self.ticks):
                raise RuntimeError(f"expert-parallel lockstep: an unplanned {kind} pass")
            tick, own, ref = self.ticks[self.next]
            self.next += 1
            if own:
                if tick != kind:
                    raise RuntimeError(f"expert-parallel lockstep: planned {tick}, ran {kind}")
                return
            self._empty(tick, self.next - 1, ref)

    def finish(self) -> None:
        """The empty passes after this rank's last own pass."""
        while self.next < len(self.ticks):
            tick, own, ref = self.ticks[self.next]
            self.next += 1
            if own:
                raise RuntimeError("expert-parallel lockstep: a planned pass was not run")
            self._empty(tick, self.next - 1, ref)
        assert not self.held, "expert-parallel lockstep: an empty graph was not back-propagated"

    def _empty(self, kind: str, tick: int, ref: int) -> None:
        # (the last own pass's routes are for its tokens; the zero token is no token of the step.
        # A B tick too: with recomputation its backward routes the zero token again)
        with native_routing(self.layers), ExpertLoad.uncounted():
            if kind == "B":
                out = self.held.pop(ref)
                torch.autograd.backward(out, torch.zeros_like(out))
                return
            self.empty_passes += 1
            self._empty_forward(kind, tick)

    def _empty_forward(self, kind: str, tick: int) -> None:
        # One zero token (megatron's router cannot reshape zero tokens): whichever experts it
        # reaches, its output and every gradient it contributes (the backward's incoming
        # gradient is zero) are exactly zero. A checkpointed unit (activation recomputation)
        # runs under megatron's checkpoint as the model's does: its backward first repeats the
        # unit's forward, all-to-alls included.
        from megatron.core import tensor_parallel

        grad = kind != "N"
        with torch.set_grad_enabled(grad):
            x = torch.zeros(1, 1, self.hidden_size, dtype=self.dtype, device=self.device, requires_grad=grad)
            for layers, checkpointed in self.units:
                run = _unit_forward(layers)
                if checkpointed and grad:
                    x = tensor_parallel.checkpoint(run, layers[0].config.distribute_saved_activations, x)
                else:
                    x = run(x)
        if kind == "P":
            torch.autograd.backward(x, torch.zeros_like(x))
        elif kind == "K":
            self.held[tick] = x


def _unit_forward(layers: Sequence[torch.nn.Module]):
    def run(x: Tensor) -> Tensor:
        for layer in layers:
            x = layer(x)[0]
        return x

    return run


# ---------------------------------------------------------------------- expert load
class ExpertLoad:
    """Tokens routed to each expert of every MoE layer of a model over one step (``--log-json``
    ``moe_expert_load``), counted by forward hooks on the routers (megatron's ``TopKRouter``
    returns ``(probs, routing_map)``; ``routing_map`` ``[tokens, E]`` marks each token's top k;
    rows megatron's ``padding_mask`` marks, the padding of sequence parallelism, are not counted).

    ``with ExpertLoad(model) as load: <the step>``, then :meth:`counts`. A token counts once
    per layer however many passes compute it: only forwards with autograd on are counted, so a
    graph-less forward that a backward recomputes (a dropped graph; megatron's activation
    recomputation, whose first forward runs without autograd) counts at its recomputation,
    and the expert-parallel lockstep's empty passes (one zero token each, no token of the step:
    :meth:`uncounted`) not at all. The routers see this rank's tokens (with expert
    parallelism too: they route before the dispatcher sends tokens away; with sequence
    parallelism this tensor-parallel rank's share of them); the last layer routes only the rows
    the loss head reads when it computes those alone."""

    _uncounted_depth = 0

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_psrl.model.gpt import model_chunks

        routers = [m for chunk in model_chunks(model) for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.layer_numbers = [r.layer_number for r in routers]
        """The MoE layers counted (megatron's layer numbers, from 1), in the rows' order."""
        self.num_experts = routers[0].config.num_moe_experts if routers else 0
        self._counts: Optional[Tensor] = None  # [layers, E] int64 on the routers' device: no sync per pass
        self._handles = [r.register_forward_hook(self._hook(row)) for row, r in enumerate(routers)]

    def _hook(self, row: int):
        def count(module, args, output) -> None:
            if ExpertLoad._uncounted_depth or not torch.is_grad_enabled():
                return
            routing_map = output[1]
            pad = args[1] if len(args) > 1 else None  # megatron's padding_mask (sequence parallelism)
            if pad is not None:
                routing_map = routing_map & ~pad.reshape(-1, 1)
            if self._counts is None:
                self._counts = torch.zeros(len(self.layer_numbers), self.num_experts, dtype=torch.int64,
                                           device=routing_map.device)
            self._counts[row] += routing_map.sum(dim=0)

        return count

    @staticmethod
    @contextlib.contextmanager
    def uncounted():
        """A context whose router passes no :class:`ExpertLoad` counts."""
        ExpertLoad._uncounted_depth += 1
        try:
            yield
        finally:
            ExpertLoad._uncounted_depth -= 1

    def counts(self, device: Optional[torch.device] = None) -> Tensor:
        """int64 ``[MoE layers, E]``: tokens routed to each expert so far (zeros before any)."""
        if self._counts is None:
            return torch.zeros(len(self.layer_numbers), self.num_experts, dtype=torch.int64, device=device)
        return self._counts if device is None else self._counts.to(device)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "ExpertLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def expert_load_summary(counts: Tensor) -> List[List[float]]:
    """``[[max, mean], ...]`` tokens per expert of each MoE layer (rows of ``counts``, ``[layers,
    E]``): the busiest expert's tokens and the average over all ``E`` (top-k routing: ``k`` x
    the tokens routed / ``E``)."""
    c = counts.double()
    return [[int(m), round(float(a), 4)] for m, a in zip(c.max(dim=1).values.tolist(), c.mean(dim=1).tolist())]


# ---------------------------------------------------------------------- router replay
def routing_shape(arch: ModelArchitecture) -> RoutingShape:
    """What the samples' ``routed_experts`` must look like for ``arch``: ``[tokens, MoE layers,
    top-k]`` ids in ``[0, E)``, one route per MoE layer in layer order (a model with dense
    first layers, ``dense_mlp_layers``, has none for those); a dense model takes none."""
    if not arch.is_moe:
        return RoutingShape(0, 0, 0, model=f"dense {arch.model_type} model")
    return RoutingShape(len(arch.moe_layers), arch.moe_router_topk, arch.num_experts,
                        model=f"{arch.model_type} model")


def tree_token_sources(tree) -> np.ndarray:
    """int64 ``[T]``: a batch token of every tree token (any sample through it: with routes in
    the tree's keys, every sample through a tree token has the same routes there)."""
    source = np.empty(tree.num_tree_tokens, dtype=np.int64)
    source[tree.sample_token_index] = np.arange(tree.batch.num_tokens, dtype=np.int64)
    return source


def _pack_replay_class():
    """megatron's ``RouterReplay`` that also follows the last layer's row skip (defined lazily:
    megatron is imported only when a model is built)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class PackRouterReplay(RouterReplay):
        """``REPLAY_FORWARD`` of the routes of a pack's rows, where the router may see only the rows
        ``rows`` of the pack: the model's last layer computes only the rows the loss head reads
        (``TreeAttentionMetadata.output_rows``), so its router then routes those rows only."""

        rows: Optional[Tensor] = None
        """int64 ``[n]``: the pack rows this router sees when it sees fewer than all (ascending)."""

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            target = self.target_topk_idx
            if (self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or target is None
                    or scores.shape[0] == target.shape[0]):
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if self.rows is None or scores.shape[0] != self.rows.shape[0]:
                raise RuntimeError(f"router replay: routes for {target.shape[0]} tokens, the router sees "
                                   f"{scores.shape[0]}")
            top_indices = target.index_select(0, self.rows)  # [n, k]: the rows the layer computes
            return scores.gather(1, top_indices), top_indices

    return PackRouterReplay


class RouterReplayer:
    """Sets the rollout's routes into the routers of one model, micro-batch by micro-batch.

    megatron-core's router replay (``TopKRouter.router_replay``, a ``RouterReplay``; action
    ``REPLAY_FORWARD``): the router takes the given top-k ids instead of its own and gathers its
    own scores at them (the logits, softmaxed over the k: Qwen3-MoE's renormalised top-k; or the
    full softmax's probabilities without ``norm_topk_prob``), so gradients reach the router.

    What is not used of it, and why: the process-wide instance list and its static setters
    (every model built in the process registers there, and a layer's place in it is not its
    layer number), and ``REPLAY_BACKWARD``'s queue of targets for recomputation (it pops them in
    forward order; cached prefixes run backward passes out of that order). Instead the routers
    of this model are found by walking it (its layer numbers index the routes), and a
    recomputed backward gets its micro-batch's routes set again by the step runner
    (:meth:`set`). The last layer may route only the rows the loss head reads
    (``PackRouterReplay.rows``)."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from megatron_psrl.model.gpt import model_chunks

        replay_class = _pack_replay_class()
        self.replays: List[Tuple[int, bool, object]] = []
        self.sequence_parallel = False
        """The routers see their tensor-parallel rank's share of a pack's rows (sequence parallelism)."""
        """``(MoE layer index, the model's last layer, its router's replay)`` of every router."""
        for chunk in model_chunks(model):
            for module in chunk.modules():
                if not isinstance(module, TopKRouter):
                    continue
                if module.config.moe_router_fusion:  # the fused kernel never consults router_replay
                    raise ConfigurationError("router replay needs megatron's unfused router (moe_router_fusion off)")
                if not isinstance(module.router_replay, replay_class):
                    module.router_replay = replay_class()
                    # This model's replays are reached through the model: the process-wide list
                    # would also hold every other model's routers, and keep them alive.
                    RouterReplay.global_router_replay_instances.remove(module.router_replay)
                # The routes are per MoE layer: a model with dense layers has none for those
                # (layer numbers count from 1, over all pipeline stages).
                last = module.layer_number == module.config.num_layers
                self.replays.append((moe_layer_index(module.config, module.layer_number), last,
                                     module.router_replay))
                self.sequence_parallel = sequence_parallel_group(module.config) is not None
        self._tree = None
        self._sources: Optional[np.ndarray] = None

    def pack_routes(self, tree, tree_tokens: np.ndarray, device: torch.device) -> Optional[Tensor]:
        """int64 ``[t, L, k]`` routes of the pack rows ``tree_tokens``, gathered like their token
        ids, or None when the tree's samples carry none. A token without a route (a sample's
        final token, whose output no log-prob reads) takes experts ``0..k-1``."""
        routes = tree.batch.routed_experts
        if routes is None:
            return None
        if not self.replays:
            raise ConfigurationError("the samples carry routed_experts, but the model has no router to replay them in")
        if self._tree is not tree:  # one scatter per tree, not per micro-batch
            self._tree, self._sources = tree, tree_token_sources(tree)
        rows = routes[self._sources[tree_tokens]].astype(np.int64)  # [t, L, k]
        missing = rows[:, 0, 0] < 0
        if missing.any():
            rows[missing] = np.arange(rows.shape[2], dtype=np.int64)
        return host_to_device(rows, device)

    def set(self, routes: Optional[Tensor], output_rows: Optional[np.ndarray] = None) -> None:
        """The routes ``[t, L, k]`` of the next forward's t tokens (``output_rows``: the rows the
        last layer may compute alone), or None: every router takes its own top-k again."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rows = None
        if routes is not None and output_rows is not None:
            rows = host_to_device(output_rows, routes.device, np.int64)
        if routes is not None and self.sequence_parallel:
            # the routers see this tensor-parallel rank's share of the (padded) rows; padding rows
            # go to experts 0..k-1 (their output is read by nothing)
            rank, tp = tensor_parallel_rank_and_size()
            routes = shard_rows(routes, rank, tp, fill=torch.arange(routes.shape[2], device=routes.device))
        for layer, last, replay in self.replays:
            replay.clear_indices()  # (also empties the REPLAY_BACKWARD queue, unused here)
            replay.rows = rows if last else None
            if routes is None:
                replay.clear_router_replay_action()
                continue
            if layer >= routes.shape[1]:
                raise ConfigurationError(f"routes for {routes.shape[1]} MoE layers, but the model has MoE layer "
                                         f"{layer} (0-based)")
            replay.set_target_indices(routes[:, layer].contiguous())  # [t, k]
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def native_routing(layers: Sequence[torch.nn.Module]):
    """A context in which the MoE ``layers``' routers take their own top-k (replay suspended)."""
    stack = contextlib.ExitStack()
    for layer in layers:
        replay = getattr(getattr(layer, "router", None), "router_replay", None)
        if replay is not None and replay.router_replay_action is not None:
            action = replay.router_replay_action
            replay.clear_router_replay_action()
            stack.callback(replay.set_router_replay_action, action)
    return stack


__all__ = ["TOKEN_DISPATCHERS", "ExpertLoad", "ExpertLockstep", "expert_load_summary", "RouterReplayer", "native_routing", "routing_shape",
           "tree_token_sources", "Pass", "Unit", "lockstep_ticks", "moe_layers", "recompute_units", "check_moe_settings", "expert_index", "global_experts", "install_moe_runtime",
           "is_expert_parameter", "keep_expert_bias_counts_to_the_trainer", "local_experts", "moe_layer_index",
           "moe_layer_pattern"]
