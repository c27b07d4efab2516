"""The dynamic-block KV cache of mechanism 2: prefix K/V and their gradients, in block pools.

One pool per step holds fixed-size blocks; a block stores ``block_size`` tokens of *one* of
K, V, dL/dK or dL/dV for *every* layer of this rank (``[layers, blocks, block_size, ng, hn]``),
so one block table per tensor kind serves all layers. A cached source (a prefix chain produced
by one micro-batch and read by later ones) owns four block tables. Layer ``l`` of a source is
read with one gather over the slots its block table names, gradients are accumulated with one
``index_add_``; this is how every attention backend reads cached K/V.

Lifetimes follow reference counts the planner computes: K/V blocks are freed once the last
reader (including a reader that recomputes its forward later) has read them; gradient blocks
are freed right after the producer's backward has consumed them. The pool never grows past
the byte budget: :meth:`allocate` raises :class:`CacheBudgetError`, and the memory planner
(``megatron_psrl.schedule.memory``) makes sure a plan never asks for more.

The block size is chosen per step from the lengths of the step's sources (``choose_block_size``):
the size class that minimises padding waste plus a per-block table cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_psrl.errors import PsrlError
from megatron_psrl.host_copy import host_to_device

Tensor = torch.Tensor

BLOCK_SIZE_CLASSES = (16, 32, 64, 128, 256, 512)
KINDS = ("k", "v", "gk", "gv")
_BLOCK_TABLE_COST_TOKENS = 2.0
"""A block costs as much as this many wasted token slots (table entry, gather bookkeeping)."""


class CacheBudgetError(PsrlError, MemoryError):
    """The KV cache budget cannot hold what was asked."""


def choose_block_size(lengths: Sequence[int], classes: Sequence[int] = BLOCK_SIZE_CLASSES) -> int:
    """Size class minimising ``sum(padding) + c * sum(blocks)`` over the source lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return int(classes[0])
    best, best_cost = int(classes[0]), float("inf")
    for bs in classes:
        blocks = -(-lengths // bs)
        cost = float((blocks * bs - lengths).sum() + _BLOCK_TABLE_COST_TOKENS * blocks.sum())
        if cost < best_cost:
            best, best_cost = int(bs), cost
    return best


@dataclass
class KVGeometry:
    """Shape of the cached tensors on this rank."""

    num_layers: int
    """Layers of this rank (its pipeline stage)."""

    num_groups: int
    """Key/value heads of this tensor-parallel rank."""

    head_dim: int
    """Per-head width."""

    dtype: torch.dtype
    """Storage dtype (the model's)."""

    device: torch.device
    """Where the pool lives."""

    layer_offset: int = 1
    """megatron layer number of this rank's first layer (1-based)."""

    layer_numbers: Tuple[int, ...] = ()
    """megatron layer numbers of this rank's layers when they are not one contiguous range
    (virtual pipeline stages: a rank holds every ``pp``-th chunk); empty: contiguous."""

    @property
    def layers(self) -> Tuple[int, ...]:
        """megatron layer numbers of this rank's layers, in pool order."""
        return self.layer_numbers or tuple(range(self.layer_offset, self.layer_offset + self.num_layers))

    def index(self, layer: int) -> int:
        """Position of megatron layer ``layer`` in this rank's pool."""
        if self.layer_numbers:
            return self.layer_numbers.index(layer)
        return layer - self.layer_offset

    @classmethod
    def for_model(cls, arch, tensor_parallel_size: int, pipeline, dtype: torch.dtype,
                  device: torch.device, pipeline_rank: int = 0, virtual_pipeline_size: int = 1) -> "KVGeometry":
        """This rank's K/V shape for a ModelArchitecture under TP x PP: the layers of stage
        ``pipeline_rank`` (``pipeline``: the (virtual) stage count or each one's layer count;
        with ``virtual_pipeline_size`` V, stage p holds virtual stages p, p + PP, ...),
        numbered from 1 as megatron numbers them."""
        from megatron_psrl.model.stages import stage_counts, virtual_stages

        counts = stage_counts(arch, pipeline)
        pp = len(counts) // virtual_pipeline_size
        numbers = tuple(n for vs in virtual_stages(pipeline_rank, pp, virtual_pipeline_size)
                        for n in range(1 + sum(counts[:vs]), 1 + sum(counts[:vs + 1])))
        contiguous = numbers == tuple(range(numbers[0], numbers[0] + len(numbers)))
        return cls(num_layers=len(numbers), num_groups=arch.num_kv_heads // tensor_parallel_size,
                   head_dim=arch.head_dim, dtype=dtype, device=device, layer_offset=numbers[0],
                   layer_numbers=() if contiguous else numbers)

    @classmethod
    def for_pipeline_planning(cls, arch, tensor_parallel_size: int, pipeline, dtype: torch.dtype,
                              device: torch.device, virtual_pipeline_size: int = 1) -> "KVGeometry":
        """The K/V shape every stage of a pipeline plans its memory with: the largest stage's.
        Stages tell each other nothing about their plans, yet they must take the same
        keep-graph / recompute / duplicate decisions (a recompute travels through all of them),
        so they plan alike; a stage with fewer layers uses less than it planned."""
        from megatron_psrl.model.stages import stage_counts

        counts = stage_counts(arch, pipeline)
        pp = len(counts) // virtual_pipeline_size
        layers = max(sum(counts[p::pp]) for p in range(pp))
        return cls(num_layers=layers, num_groups=arch.num_kv_heads // tensor_parallel_size, head_dim=arch.head_dim,
                   dtype=dtype, device=device)

    @property
    def grad_slots_per_token(self) -> int:
        """Pool slots one token of dK or dV takes: gradients accumulate in fp32 whatever the
        model dtype (a bf16 sum over hundreds of readers would lose about 1e-2), so in a bf16
        or fp16 pool each gradient row spans two slots (read as fp32 through a view)."""
        return max(1, 4 // torch.tensor([], dtype=self.dtype).element_size())

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token of one kind (K, V, dK or dV) over all layers."""
        return self.num_layers * self.num_groups * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


@dataclass
class CacheMetrics:
    """Per-step statistics (logged and written to --log-json)."""

    block_size: int = 0
    pool_blocks: int = 0
    peak_blocks_used: int = 0
    utilisation_samples: List[float] = field(default_factory=list)
    allocated_slots: int = 0
    used_slots: int = 0
    reads: int = 0
    tokens_read: int = 0
    tokens_recomputed: int = 0

    def to_dict(self) -> Dict[str, float]:
        util = self.utilisation_samples
        return {
            "kv_block_size": self.block_size,
            "kv_pool_blocks": self.pool_blocks,
            "kv_peak_utilisation": self.peak_blocks_used / self.pool_blocks if self.pool_blocks else 0.0,
            "kv_mean_utilisation": float(np.mean(util)) if util else 0.0,
            "kv_fragmentation": 1.0 - self.used_slots / self.allocated_slots if self.allocated_slots else 0.0,
            "kv_hit_rate": self.tokens_read / (self.tokens_read + self.tokens_recomputed)
            if (self.tokens_read + self.tokens_recomputed) else 1.0,
            "kv_tokens_recomputed": self.tokens_recomputed,
        }


class BlockKVCache:
    """Block pools for the cached prefix K/V of one step on one rank."""

    def __init__(self, geometry: KVGeometry, budget_bytes: int):
        self.geometry = geometry
        self.budget_bytes = int(budget_bytes)
        min_bytes = geometry.block_bytes(BLOCK_SIZE_CLASSES[0])
        if self.budget_bytes < min_bytes:
            raise CacheBudgetError(
                f"--kv-cache-budget {self.budget_bytes} bytes cannot hold one KV block: the smallest block "
                f"({BLOCK_SIZE_CLASSES[0]} tokens x {geometry.num_layers} layers x {geometry.num_groups} "
                f"kv heads x {geometry.head_dim} dims) needs {min_bytes} bytes"
            )
        self.pool: Optional[Tensor] = None
        self.block_size = BLOCK_SIZE_CLASSES[0]
        self._free: List[int] = []
        self._tables: Dict[Tuple[int, str], np.ndarray] = {}
        self._slots: Dict[Tuple[int, str], Tensor] = {}
        self._lengths: Dict[int, int] = {}
        self.metrics = CacheMetrics()

    # ------------------------------------------------------------------ step lifecycle
    def max_blocks(self, block_size: int) -> int:
        return self.budget_bytes // self.geometry.block_bytes(block_size)

    def begin_step(self, block_size: int, pool_blocks: int) -> None:
        """(Re)allocate the pool for this step: ``pool_blocks`` blocks of ``block_size``."""
        if pool_blocks > self.max_blocks(block_size):
            raise CacheBudgetError(
                f"the step needs {pool_blocks} KV blocks of {block_size} tokens "
                f"({pool_blocks * self.geometry.block_bytes(block_size)} bytes) but --kv-cache-budget is "
                f"{self.budget_bytes} bytes"
            )
        g = self.geometry
        shape = (g.num_layers, pool_blocks, block_size, g.num_groups, g.head_dim)
        if self.pool is None or tuple(self.pool.shape) != shape:
            self.pool = None  # release the old pool before allocating the new one
            self.pool = torch.zeros(shape, dtype=g.dtype, device=g.device)
        self.block_size = block_size
        self._free = list(range(pool_blocks - 1, -1, -1))
        self._tables.clear()
        self._slots.clear()
        self._lengths.clear()
        self.metrics = CacheMetrics(block_size=block_size, pool_blocks=pool_blocks)

    def end_step(self) -> None:
        if self._tables:
            raise RuntimeError(f"KV cache still holds sources {sorted({k[0] for k in self._tables})} at step end")

    def release_pool(self) -> None:
        self.pool = None

    @property
    def blocks_in_use(self) -> int:
        return (self.pool.shape[1] if self.pool is not None else 0) - len(self._free)

    def _record_use(self) -> None:
        used = self.blocks_in_use
        m = self.metrics
        m.peak_blocks_used = max(m.peak_blocks_used, used)
        if m.pool_blocks:
            m.utilisation_samples.append(used / m.pool_blocks)

    # ------------------------------------------------------------------ allocation
    def allocate(self, source_id: int, length: int, kinds: Sequence[str] = KINDS) -> None:
        """Block tables for ``length`` tokens of each kind; gradient blocks start at zero (and
        take :attr:`KVGeometry.grad_slots_per_token` slots per token)."""
        factor = self.geometry.grad_slots_per_token
        slots_of = {kind: length * (factor if kind.startswith("g") else 1) for kind in kinds}
        needed = sum(-(-n // self.block_size) for n in slots_of.values())
        if needed > len(self._free):
            raise CacheBudgetError(f"KV cache full: source {source_id} needs {needed} blocks, {len(self._free)} free")
        self._lengths[source_id] = length
        for kind in kinds:
            n_slots = slots_of[kind]
            n_blocks = -(-n_slots // self.block_size)
            blocks = np.array([self._free.pop() for _ in range(n_blocks)], dtype=np.int64)
            self._tables[(source_id, kind)] = blocks
            slots = (blocks[:, None] * self.block_size + np.arange(self.block_size)[None, :]).reshape(-1)[:n_slots]
            self._slots[(source_id, kind)] = host_to_device(slots, self.geometry.device)
            if kind.startswith("g"):
                self.pool[:, blocks] = 0
            self.metrics.allocated_slots += n_blocks * self.block_size
            self.metrics.used_slots += n_slots
        self._record_use()

    def free(self, source_id: int, kinds: Sequence[str]) -> None:
        """Return a source's blocks of the given kinds to the pool."""
        for kind in kinds:
            blocks = self._tables.pop((source_id, kind), None)
            self._slots.pop((source_id, kind), None)
            if blocks is not None:
                self._free.extend(int(b) for b in blocks[::-1])
        if not any(k[0] == source_id for k in self._tables):
            self._lengths.pop(source_id, None)
        self._record_use()

    def holds(self, source_id: int, kind: str) -> bool:
        return (source_id, kind) in self._tables

    def block_table(self, source_id: int, kind: str) -> np.ndarray:
        return self._tables[(source_id, kind)]

    # ------------------------------------------------------------------ data
    def _layer_view(self, layer: int) -> Tensor:
        """``[blocks * block_size, ng, hn]`` flat slot view of one layer (no copy)."""
        g = self.geometry
        return self.pool[g.index(layer)].view(-1, g.num_groups, g.head_dim)

    def write(self, source_id: int, layer: int, key: Tensor, value: Tensor) -> None:
        view = self._layer_view(layer)
        view.index_copy_(0, self._slots[(source_id, "k")], key.detach().to(view.dtype))
        view.index_copy_(0, self._slots[(source_id, "v")], value.detach().to(view.dtype))

    def read(self, source_id: int, layer: int, count: bool = True) -> Tuple[Tensor, Tensor]:
        """Gather a source's K/V of one layer through its block tables: ``[n, ng, hn]`` copies
        (``count``: in the hit metrics; a recomputation's second read is not)."""
        view = self._layer_view(layer)
        k = view.index_select(0, self._slots[(source_id, "k")])
        v = view.index_select(0, self._slots[(source_id, "v")])
        if count:
            self.metrics.reads += 1
            if layer == self.geometry.layer_offset:
                self.metrics.tokens_read += k.shape[0]
        return k, v

    def _grad_view(self, layer: int) -> Tensor:
        """``[slots, ng * hn / f]`` fp32 view of one layer's slots (f = grad_slots_per_token:
        a token's fp32 gradient row is its f consecutive slots of the source's table)."""
        g = self.geometry
        return self.pool[g.index(layer)].view(-1, g.num_groups * g.head_dim).view(torch.float32)

    def accumulate_grad(self, source_id: int, layer: int, grad_key: Optional[Tensor], grad_value: Optional[Tensor]) -> None:
        """Add ``[n, ng, hn]`` gradients to a source's dK / dV (in fp32)."""
        view = self._grad_view(layer)
        for kind, grad in (("gk", grad_key), ("gv", grad_value)):
            if grad is not None:
                view.index_add_(0, self._slots[(source_id, kind)], grad.float().reshape(-1, view.shape[1]))

    def read_grad(self, source_id: int, layer: int) -> Tuple[Tensor, Tensor]:
        """A source's accumulated dK, dV of one layer: ``[n, ng, hn]`` fp32 copies."""
        g, view = self.geometry, self._grad_view(layer)
        return tuple(view.index_select(0, self._slots[(source_id, kind)]).reshape(-1, g.num_groups, g.head_dim)
                     for kind in ("gk", "gv"))
