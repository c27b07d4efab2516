"""Stream the policy's weights, tensor by tensor, to an inference engine or a file.

A rollout engine (vLLM, SGLang) takes new weights one named tensor at a time, so the whole
model never has to sit in one process's host memory. :func:`iter_hf_weights` yields
``(Hugging Face name, full tensor)`` pairs; behind it, the megatron tensors are assembled in
buckets of about ``bucket_bytes``:

- a tensor-parallel shard is gathered over the TP group (``dist.all_gather``) only on the
  pipeline rank that holds it, and merged with the same rules that shard checkpoints
  (:mod:`megatron_psrl.checkpoint.sharding`: vocabulary padding dropped, per-group q/k/v rows,
  gate and up halves); which parameters are split, and along which dimension, comes from the
  parameters themselves (megatron's ``tensor_model_parallel`` / ``partition_dim``) and must
  agree with those rules; a replicated tensor (a norm) is TP rank 0's copy, broadcast, so that
  every rank streams the same bytes (as a merged checkpoint holds them);
- an expert of a mixture-of-experts layer under expert parallelism (EP > 1; each EP rank
  holds ``E / EP`` experts, renumbered from 0: :func:`~megatron_psrl.model.moe.local_experts`)
  is named by its global index (``ep_rank * E / EP + j``) and broadcast by the EP rank that
  holds it over the expert-model-parallel group, one tensor at a time in the bucket's order;
- the owning pipeline stage then broadcasts it over the PP group;
- the family adapter (:meth:`~megatron_psrl.model.adapters.base.LlamaStyleAdapter.mcore_to_hf`)
  converts it to Hugging Face names and layouts: the one converter checkpoints use too.

Who receives what: every rank of a model-parallel group (its TP x PP ranks, and with expert
parallelism its EP ranks too: those hold the other experts) receives every tensor, in the same
order. Data- and context-parallel replicas hold the same weights and each streams from its own
replica, with no traffic between replicas (a caller that needs one copy only, such as
:meth:`~megatron_psrl.rl.actor.PolicyActor.export_hf`, streams on the ranks of
:func:`streams_one_copy`). With EP > 1 the ranks of an expert-parallel group are data-parallel
ranks of the dense weights: each streams the dense tensors of its own replica (equal bit for
bit) and the experts of all of them; with TP > 1 (sequence parallelism) an expert-parallel group
also holds tensor-parallel ranks of one replica, which hold different experts (whole: expert
tensor parallelism 1), so experts skip the TP merge and come from their holder alone.
Every rank of a model-parallel group must consume the stream to its end, at the same pace: each
bucket is a few collectives inside the group. Tensors are snapshots, never views of the live
parameters, equal bit for bit to what the model holds.

Host memory: a rank holds about one bucket of full tensors at a time, plus the tensor being
converted (the q/k/v split copies one layer's fused weight), plus whatever the consumer keeps;
never the whole model (a tensor larger than ``bucket_bytes`` is a bucket of its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_psrl.checkpoint.sharding import LAYER_NAME, shard_kind, tp_merge
from megatron_psrl.checkpoint.state_dict import canonical_name, canonical_state_dict
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.moe import expert_index, is_expert_parameter
from megatron_psrl.model.stages import stage_counts

if TYPE_CHECKING:
    from megatron_psrl.engine.engine import Engine

Tensor = torch.Tensor
Device = Union[str, torch.device, None]

DEFAULT_BUCKET_BYTES = 256 * 1024**2
"""Bytes of full tensors assembled per bucket by default: large enough that the collectives'
latency is negligible next to their bandwidth, small next to a 7B model's 15 GB."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where one full megatron tensor lives and what it looks like."""

    stage: int  # (virtual) pipeline stage whose chunk holds it
    local_name: str  # its name inside that chunk
    shard_shape: Tuple[int, ...]
    dtype: torch.dtype
    split: bool  # tensor-parallel split (gathered over the TP group)
    full_shape: Tuple[int, ...]
    ep_owner: int = -1  # an expert: the expert-parallel rank holding it (-1: every EP rank holds it)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.full_shape:
            n *= d
        return n * self.dtype.itemsize


class WeightStream:
    """The plan of one stream on this rank: every full megatron tensor's owner and shape, and
    this rank's shards. Built collectively (every rank of the model-parallel group)."""

    def __init__(self, engine: Engine):
        layout, arch = engine.layout, engine.arch
        self.engine, self.arch = engine, arch
        self.tp, self.pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
        self.pp_rank = layout.pp_rank
        self.device = layout.device
        engine.params_ready()
        counts = stage_counts(arch, engine.pipeline_split)
        offsets = [sum(counts[:p]) for p in range(len(counts))]
        self.local: Dict[str, Tensor] = {}
        mine: Dict[str, tuple] = {}
        for stage, chunk in engine.stage_chunks():
            params = {canonical_name(n): p for n, p in chunk.named_parameters()}
            for local_name, tensor in canonical_state_dict(chunk).items():
                if arch.tie_word_embeddings and local_name == "output_layer.weight":
                    continue  # the last stage's copy of the tied embedding (the first stage's is the one)
                m = LAYER_NAME.match(local_name)
                name = f"decoder.layers.{int(m.group(1)) + offsets[stage]}.{m.group(2)}" if m else local_name
                split = self._split_of(local_name, params.get(local_name))
                self.local[name] = tensor
                mine[name] = (stage, local_name, tuple(tensor.shape), tensor.dtype, split)
        if self.pp > 1:  # names and shapes only (a few kB): non-owners learn what they receive
            everyone: List[Optional[dict]] = [None] * self.pp
            with layout.monitor.phase("weight stream plan over pipeline-parallel ranks"):
                dist.all_gather_object(everyone, mine, group=parallel_state.get_pipeline_model_parallel_group())
            mine = {k: v for part in everyone for k, v in part.items()}
        self.ep_rank, self.ep = 0, 1
        if arch.is_moe:
            self.ep_rank = parallel_state.get_expert_model_parallel_rank()
            self.ep = parallel_state.get_expert_model_parallel_world_size()
        self.entries: Dict[str, _Entry] = {}
        for name, (stage, local_name, shape, dtype, split) in mine.items():
            meta = [torch.empty(shape, dtype=dtype, device="meta")] * (self.tp if split else 1)
            full = tuple(tp_merge(local_name, meta, arch).shape)
            parts = expert_index(name) if self.ep > 1 else None
            if parts is None:
                self.entries[name] = _Entry(stage, local_name, shape, dtype, split, full)
                continue
            # every EP rank holds E / EP experts of the same shapes, local j being global
            # ep_rank * E / EP + j: the plan names all of them, each with its holder
            if parts[1] >= arch.num_experts // self.ep:
                raise RuntimeError(f"{name}: local expert {parts[1]} on an expert-parallel rank of {self.ep}, "
                                   f"which holds {arch.num_experts // self.ep} of {arch.num_experts} experts")
            for ep_rank in range(self.ep):
                self.entries[self._global_expert(parts, ep_rank)] = _Entry(stage, local_name, shape, dtype, split,
                                                                           full, ep_owner=ep_rank)
            if name in self.local:
                self.local[self._global_expert(parts, self.ep_rank)] = self.local.pop(name)

    def _global_expert(self, parts: Tuple[str, int, str], ep_rank: int) -> str:
        """The full-state-dict name of expert ``parts`` (its local index) of ``ep_rank``."""
        return f"{parts[0]}{ep_rank * (self.arch.num_experts // self.ep) + parts[1]}{parts[2]}"

    def _split_of(self, local_name: str, param: Optional[torch.nn.Parameter]) -> bool:
        """Whether a tensor is split over TP, from the parameter's own attributes; a layer
        whose split disagrees with the merge rules would be merged wrongly, so it is an error."""
        split = bool(param is not None and getattr(param, "tensor_model_parallel", False))
        if is_expert_parameter(local_name):  # parallel layers over the expert TP group, of one rank
            split = False
        kind = shard_kind(local_name)
        if split != (kind != "replicated"):
            raise RuntimeError(f"{local_name}: tensor_model_parallel={split}, but the checkpoint sharding rules "
                               f"treat it as {kind}: the weight stream cannot merge its shards")
        if split:
            dim = getattr(param, "partition_dim", None)
            expected = 1 if kind == "row" else 0
            # megatron's GatedDeltaNet marks its conv, dt_bias and A_log tensor_model_parallel
            # without a partition_dim; they are split by rows (per part: ``parts``)
            if dim is None and kind in ("parts", "rows"):
                dim = 0
            if dim != expected:
                raise RuntimeError(f"{local_name}: partition_dim={dim}, the sharding rules split dimension {expected}")
        return split

    # ------------------------------------------------------------------ order and buckets
    def hf_order(self) -> List[str]:
        """The megatron names in the order the family adapter reads them (a dry run on meta
        tensors), each once."""
        order: List[str] = []
        entries = self.entries

        class Recorder(Mapping):
            def __getitem__(self, name: str) -> Tensor:
                if name not in entries:
                    raise KeyError(f"the Hugging Face conversion needs {name}, which the model does not hold")
                order.append(name)
                return torch.empty(entries[name].full_shape, dtype=entries[name].dtype, device="meta")

            def __iter__(self):
                return iter(entries)

            def __len__(self) -> int:
                return len(entries)

        for _ in get_adapter(self.arch).mcore_to_hf(Recorder()):
            pass
        if len(set(order)) != len(order):  # the streamed mapping hands each tensor out once
            raise RuntimeError("the Hugging Face conversion reads a megatron tensor twice")
        return order

    def buckets(self, names: Sequence[str], bucket_bytes: int) -> List[List[str]]:
        """Consecutive runs of ``names`` of at most ``bucket_bytes`` (a larger tensor alone)."""
        out: List[List[str]] = []
        size = 0
        for name in names:
            nbytes = self.entries[name].nbytes
            if out and out[-1] and size + nbytes <= bucket_bytes:
                out[-1].append(name)
                size += nbytes
            else:
                out.append([name])
                size = nbytes
        return out

    # ------------------------------------------------------------------ collectives
    def fetch(self, names: Sequence[str], device: Device = "cpu") -> Dict[str, Tensor]:
        """The full tensors of one bucket, on every rank of the model-parallel group. The
        collectives of a bucket are issued together (asynchronously) and then waited for."""
        # The phase covers this bucket's collectives only, not the consumer's work between
        # buckets (a generator's open context would outlive a consumer that stops early).
        with self.engine.layout.monitor.phase(f"weight stream over tensor-, pipeline- and expert-parallel ranks "
                                              f"(bucket from {names[0]})"):
            full = self._gather(names)
        if device is not None:
            full = {n: t.to(device) for n, t in full.items()}
        return {n: full[n] for n in names}

    def _gather(self, names: Sequence[str]) -> Dict[str, Tensor]:
        entries = self.entries
        owned = [n for n in names if entries[n].stage % self.pp == self.pp_rank]
        held = [n for n in owned if entries[n].ep_owner in (-1, self.ep_rank)]  # all of owned without EP
        full: Dict[str, Tensor] = {}
        gathers, copies = [], []
        tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        for name in held:  # the same order on every rank of the TP group (the experts aside)
            local = self.local[name]
            if entries[name].ep_owner >= 0:  # a whole expert (expert TP 1): the EP broadcast below
                full[name] = local.clone()  # (the TP ranks of an EP group hold different experts)
                continue
            if entries[name].split and self.tp > 1:
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                gathers.append((name, shards, dist.all_gather(shards, local.contiguous(), group=tp_group,
                                                              async_op=True)))
                continue
            if tuple(local.shape) == entries[name].full_shape:  # replicated, or TP=1 without padding
                full[name] = local.clone()  # a snapshot: the next optimizer step must not change it
            else:
                full[name] = self._fresh(tp_merge(entries[name].local_name, [local], self.arch), local)
            if self.tp > 1:  # TP rank 0's copy, as a merge takes it: every rank streams the same bytes
                copies.append(dist.broadcast(full[name], src=dist.get_global_rank(tp_group, 0), group=tp_group,
                                             async_op=True))
        for work in copies:
            work.wait()
        gathers.reverse()
        while gathers:  # popped, so that each tensor's shards are freed once it is merged
            name, shards, work = gathers.pop()
            work.wait()
            full[name] = tp_merge(entries[name].local_name, shards, self.arch)
            del shards
        if self.ep > 1:  # the owning stage's experts, each from the EP rank that holds it
            group = parallel_state.get_expert_model_parallel_group()
            works = []
            for name in owned:  # the same order on every rank of the group (they share a pipeline rank)
                e = entries[name]
                if e.ep_owner < 0:
                    continue
                if e.ep_owner != self.ep_rank:
                    full[name] = torch.empty(e.full_shape, dtype=e.dtype, device=self.device)
                works.append(dist.broadcast(full[name], src=dist.get_global_rank(group, e.ep_owner), group=group,
                                            async_op=True))
            for work in works:
                work.wait()
        if self.pp > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            works = []
            for name in names:  # the same order on every rank of the group
                e = entries[name]
                owner = e.stage % self.pp
                if owner != self.pp_rank:
                    full[name] = torch.empty(e.full_shape, dtype=e.dtype, device=self.device)
                works.append(dist.broadcast(full[name], src=dist.get_global_rank(group, owner), group=group,
                                            async_op=True))
            for work in works:
                work.wait()
        return full

    @staticmethod
    def _fresh(t: Tensor, local: Tensor) -> Tensor:
        """A copy when ``t`` shares memory with the live parameter (a snapshot must not change
        with the next optimizer step)."""
        if t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            return t.clone()
        return t

    def iter_full(self, names: Sequence[str], bucket_bytes: int, device: Device) -> Iterator[Tuple[str, Tensor]]:
        """``(megatron name, full tensor)`` of ``names``, fetched one bucket at a time."""
        for bucket in self.buckets(names, bucket_bytes):
            ready = self.fetch(bucket, device)
            for name in bucket:
                yield name, ready.pop(name)  # dropped here, so only the consumer keeps it alive


class _StreamedState(Mapping):
    """A read-once mapping over the stream, for the adapter's ``mcore_to_hf``: reading a name
    fetches its bucket when needed, and hands the tensor over (the mapping forgets it)."""

    def __init__(self, stream: WeightStream, order: List[str], bucket_bytes: int, device: Device):
        self._names = order
        self._buckets = iter(stream.buckets(order, bucket_bytes))
        self._stream, self._device = stream, device
        self._ready: Dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._ready:
            bucket = next(self._buckets, None)
            if bucket is None or name not in bucket:  # the dry run planned another order
                raise RuntimeError(f"weight stream out of order at {name}")
            self._ready.update(self._stream.fetch(bucket, self._device))
        return self._ready.pop(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _check_bucket(bucket_bytes: int) -> int:
    if int(bucket_bytes) < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return int(bucket_bytes)


def streams_one_copy(engine: Engine) -> bool:
    """Whether this rank takes part when one copy of the weights is streamed (e.g.
    :meth:`~megatron_psrl.rl.actor.PolicyActor.export_hf`, rank 0 writing it): the ranks of
    rank 0's model-parallel group. Data- and context-parallel rank 0; with expert parallelism
    (an MoE model, EP > 1) expert-data-parallel rank 0, i.e. rank 0's expert-parallel group (and
    their TP / PP ranks), which is data-parallel for the dense weights: each of its ranks holds
    experts the others stream."""
    layout = engine.layout
    if engine.arch.is_moe and parallel_state.get_expert_model_parallel_world_size() > 1:
        return parallel_state.get_expert_data_parallel_rank() == 0
    return layout.dp_rank == 0 and layout.cp_rank == 0


def iter_hf_weights(engine: Engine, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    device: Device = "cpu") -> Iterator[Tuple[str, Tensor]]:
    """Yield ``(Hugging Face name, tensor)`` for every weight of the model, in the family
    adapter's order (embedding, layer by layer, final norm, output layer), equal bit for bit to
    what the model holds, on every rank of the model-parallel group (see the module docstring:
    all of them must consume the whole stream).

    ``bucket_bytes``: full tensors assembled per round of collectives, and so about the host
    memory the stream holds. ``device``: where the yielded tensors live: ``"cpu"`` (default),
    another device, or None for the engine's device (e.g. CUDA tensors for a colocated
    inference engine)."""
    bucket_bytes = _check_bucket(bucket_bytes)
    stream = WeightStream(engine)
    yield from get_adapter(engine.arch).mcore_to_hf(_StreamedState(stream, stream.hf_order(), bucket_bytes, device))


def iter_hf_weight_buckets(engine: Engine, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                           device: Device = "cpu") -> Iterator[List[Tuple[str, Tensor]]]:
    """:func:`iter_hf_weights` grouped in lists of at most ``bucket_bytes`` (a larger tensor
    alone), for engines that load a list of named tensors per call (SGLang's
    ``update_weights_from_tensor``, vLLM's ``load_weights``)."""
    bucket: List[Tuple[str, Tensor]] = []
    size = 0
    for name, tensor in iter_hf_weights(engine, bucket_bytes, device):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def iter_mcore_weights(engine: Engine, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       device: Device = "cpu") -> Iterator[Tuple[str, Tensor]]:
    """Yield ``(megatron name, full tensor)`` for every tensor of the model's state dict
    (global layer numbers, TP shards merged, experts gathered over the expert-parallel group
    under their global indices, vocabulary padding dropped, the tied output copy left out), as
    :func:`iter_hf_weights` does for Hugging Face names."""
    bucket_bytes = _check_bucket(bucket_bytes)
    stream = WeightStream(engine)
    order = stream.hf_order()
    planned = set(order)
    order += sorted(n for n in stream.entries if n not in planned)  # tensors no HF name maps to, if any
    yield from stream.iter_full(order, bucket_bytes, device)


__all__ = ["DEFAULT_BUCKET_BYTES", "WeightStream", "iter_hf_weight_buckets", "iter_hf_weights",
           "iter_mcore_weights", "streams_one_copy"]
