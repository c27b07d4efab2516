"""The dynamic-block KV cache of mechanism 2: what cached prefixes keep, and their gradients.

What a layer keeps for a cached source is the model family's :class:`PrefixState`
(:mod:`megatron_psrl.kvcache.prefix_state`: softmax K and V rows, a latent and a RoPE key, or a
fixed-size recurrent state). The rank's layers are grouped into pools, one per distinct state
(:class:`CachePool`): a pool of per-token rows is paged in blocks of ``block_size`` slots, a
pool of fixed states in single slots, and a slot spans *every* layer of its pool
(``[layers, blocks, block slots, slot elems]``), so one block table per block kind serves all
layers. A cached source owns a block table per block kind and pool: its values (K and V) and
their fp32 gradients (dK and dV). Layer ``l`` of a source is read with one gather over the
slots its block table names, gradients are accumulated with one ``index_add_``; this is how
every attention backend reads cached prefixes. A softmax model has one pool, whose slot is one
token's K (or V) of every layer.

Lifetimes follow reference counts the planner computes: values are freed once the last
reader (including a reader that recomputes its forward later) has read them; gradient blocks
are allocated by the first step that writes them (a reader's backward) and freed right after
the producer's backward has consumed them. The pools never grow past
the byte budget: :meth:`allocate` raises :class:`CacheBudgetError`, and the memory planner
(``megatron_psrl.schedule.memory``) makes sure a plan never asks for more.

The block size is chosen per step and pool from the rows the pool keeps of the step's sources
(``choose_block_size``): the size class that minimises padding waste plus a per-block table
cost. A sliding-window layer's pool keeps only the rows some reader's window reaches
(``PrefixState.window``, ``allocate(..., reach=...)``), so its blocks are smaller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_psrl.errors import PsrlError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.kvcache.prefix_state import (
    ALL_ROLES,
    GRAD_DTYPE,
    GRADS,
    GRADS_ONLY,
    VALUES,
    VALUES_ONLY,
    CachePool,
    PrefixState,
    cache_pools,
)

Tensor = torch.Tensor

BLOCK_SIZE_CLASSES = (16, 32, 64, 128, 256, 512)
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
    """What this rank's KV cache stores: its layers and what each keeps for a cached prefix
    (:class:`~megatron_psrl.kvcache.prefix_state.PrefixState`), grouped into pools."""

    num_layers: int
    """Layers of this rank (its pipeline stage)."""

    num_groups: int
    """Key/value heads of this tensor-parallel rank (softmax layers)."""

    head_dim: int
    """Per-head width (softmax layers)."""

    dtype: torch.dtype
    """Storage dtype (the model's)."""

    device: torch.device
    """Where the pool lives."""

    layer_offset: int = 1
    """megatron layer number of this rank's first layer (1-based)."""

    layer_numbers: Tuple[int, ...] = ()
    """megatron layer numbers of this rank's layers when they are not one contiguous range
    (virtual pipeline stages: a rank holds every ``pp``-th chunk); empty: contiguous."""

    states: Tuple[PrefixState, ...] = ()
    """What each of this rank's layers keeps for a cached prefix, in :attr:`layers` order (the
    model family's); empty: softmax K/V of ``num_groups`` x ``head_dim`` in every layer."""

    def __post_init__(self) -> None:
        if self.states and len(self.states) != self.num_layers:
            raise ValueError(f"KVGeometry: {len(self.states)} prefix states for {self.num_layers} layers")

    @property
    def layers(self) -> Tuple[int, ...]:
        """megatron layer numbers of this rank's layers, in pool order."""
        return self.layer_numbers or tuple(range(self.layer_offset, self.layer_offset + self.num_layers))

    def index(self, layer: int) -> int:
        """Position of megatron layer ``layer`` in this rank's pool."""
        if self.layer_numbers:
            return self.layer_numbers.index(layer)
        return layer - self.layer_offset

    # (derived once: the memory plan asks for the pools per source and per simulated decision,
    # the attention hook for a layer's state in every layer of every micro-batch; the fields are
    # not changed after construction)
    @cached_property
    def layer_states(self) -> Tuple[PrefixState, ...]:
        """Every layer's :class:`PrefixState`, in :attr:`layers` order."""
        return self.states or (PrefixState.softmax(self.num_groups, self.head_dim, dtype=self.dtype),) * self.num_layers

    @cached_property
    def pools(self) -> Tuple[CachePool, ...]:
        """The cache's storage pools: one per distinct state among this rank's layers."""
        return cache_pools(self.layer_states, self.layers)

    def state_of(self, layer: int) -> PrefixState:
        """What megatron layer ``layer`` keeps."""
        return self.layer_states[self.index(layer)]

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
        states = model_prefix_states(arch, tensor_parallel_size, dtype)
        return cls(num_layers=len(numbers), num_groups=arch.num_kv_heads // tensor_parallel_size,
                   head_dim=arch.head_dim, dtype=dtype, device=device, layer_offset=numbers[0],
                   layer_numbers=() if contiguous else numbers, states=tuple(states[n - 1] for n in numbers))

    @classmethod
    def for_pipeline_planning(cls, arch, tensor_parallel_size: int, pipeline, dtype: torch.dtype,
                              device: torch.device, virtual_pipeline_size: int = 1) -> "KVGeometry":
        """The K/V shape every stage of a pipeline plans its memory with: of every state its
        layers keep (softmax K/V, a linear layer's recurrent state), as many layers as the
        stage with most of them has; the largest stage itself when it has the most of every
        state (every model whose layers keep one state). Stages tell each other nothing about
        their plans, yet they must take the same keep-graph / recompute / duplicate decisions
        (a recompute travels through all of them), so they plan alike; a stage with fewer
        layers uses less than it planned, and a stage without some state's layers leaves its
        pool out (:meth:`BlockKVCache.begin_step` sizes a stage's pools by state)."""
        from megatron_psrl.model.stages import stage_counts

        counts = stage_counts(arch, pipeline)
        pp = len(counts) // virtual_pipeline_size
        stages = [[n for vs in range(p, len(counts), pp) for n in range(1 + sum(counts[:vs]), 1 + sum(counts[:vs + 1]))]
                  for p in range(pp)]
        states = model_prefix_states(arch, tensor_parallel_size, dtype)
        kinds = list(dict.fromkeys(states))  # (in the order of their first layer)
        per_stage = [[sum(states[n - 1] == kind for n in numbers) for kind in kinds] for numbers in stages]
        most = [max(column) for column in zip(*per_stage)]
        largest = max(stages, key=lambda numbers: sum(states[n - 1].nbytes(1) for n in numbers))
        if per_stage[stages.index(largest)] == most:
            return cls(num_layers=len(largest), num_groups=arch.num_kv_heads // tensor_parallel_size,
                       head_dim=arch.head_dim, dtype=dtype, device=device,
                       states=tuple(states[n - 1] for n in largest))
        union = tuple(kind for kind, n in zip(kinds, most) for _ in range(n))
        return cls(num_layers=len(union), num_groups=arch.num_kv_heads // tensor_parallel_size,
                   head_dim=arch.head_dim, dtype=dtype, device=device, states=union)

    def _single_pool(self, what: str) -> CachePool:
        pools = self.pools
        if len(pools) != 1:
            raise ValueError(f"{what} is defined for a cache of one pool; this one has {len(pools)} "
                             f"(read KVGeometry.pools)")
        return pools[0]

    @property
    def grad_slots_per_token(self) -> int:
        """Pool slots one token of a gradient takes in a cache of one pool: gradients
        accumulate in fp32 whatever the model dtype (a bf16 sum over hundreds of readers would
        lose about 1e-2), so in a bf16 or fp16 pool of equally wide K and V each gradient row
        spans two slots (read as fp32 through a view)."""
        pool = self._single_pool("grad_slots_per_token")
        return pool.slots_per_unit(pool.state.kinds(GRADS)[0])

    @property
    def row_bytes_per_token(self) -> int:
        """Bytes of one token's values (every per-token field: K and V, or a latent and its
        RoPE key) over this rank's layers: what a reader gathers and the exchange moves."""
        return sum(len(p.layers) * p.state.nbytes(1, (VALUES,)) for p in self.pools if p.state.per_token)

    @property
    def fixed_bytes_per_source(self) -> int:
        """Bytes of one source's fixed-size values (recurrent states) over this rank's layers."""
        return sum(len(p.layers) * p.state.nbytes(1, (VALUES,)) for p in self.pools if not p.state.per_token)

    def read_bytes(self, length: int, reach: Tuple[int, Optional[int]] = (0, None)) -> int:
        """Bytes of the values a reader gathers from a source of ``length`` tokens, all layers
        (``reach``: ``CachedSource.reach``, a sliding-window layer's kept rows at most)."""
        return sum(len(p.layers) * p.state.nbytes(p.kept_rows(length, *reach), VALUES_ONLY) for p in self.pools)

    def grad_bytes(self, length: int, reach: Tuple[int, Optional[int]] = (0, None)) -> int:
        """Bytes of the fp32 gradients a source of ``length`` tokens keeps, all layers."""
        return sum(len(p.layers) * p.state.nbytes(p.kept_rows(length, *reach), GRADS_ONLY) for p in self.pools)

    def reader_bytes(self, length: int, reach: Tuple[int, Optional[int]] = (0, None)) -> int:
        """Bytes a reader's graph keeps for a source of ``length`` tokens, all layers: the values
        it gathers (a window's kept rows at most) and what it derives from them (latent
        attention: the prefix's per-head keys and values, :meth:`PrefixState.reader_nbytes`)."""
        return sum(len(p.layers) * p.state.reader_nbytes(p.kept_rows(length, *reach)) for p in self.pools)

    def derived_read_bytes(self, length: int, reach: Tuple[int, Optional[int]] = (0, None)) -> int:
        """Bytes a reader's graph keeps for a source of ``length`` tokens even when it gathers
        again in backward: of the layers that derive K/V from their rows (latent attention,
        its rows and their up-projection) and of the fixed-size states (always read as copies)."""
        return sum(len(p.layers) * p.state.reader_nbytes(p.kept_rows(length, *reach)) for p in self.pools
                   if p.state.derived_elems or not p.state.per_token)

    def layer_read_bytes(self, length: int, reach: Tuple[int, Optional[int]] = (0, None)) -> int:
        """Bytes of one layer's values and fp32 gradients of a source of ``length`` tokens (the
        widest layer's): what a reader that gathers again in backward holds at a time (a latent
        layer's reader also the gradient of its up-projected K/V, as a softmax reader's dK/dV)."""
        return max(p.state.nbytes(p.kept_rows(length, *reach), ALL_ROLES)
                   + p.state.derived_nbytes(p.kept_rows(length, *reach)) for p in self.pools)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token of one kind (K, V, dK or dV; all equally wide) over all layers,
        in a cache of one softmax pool (:attr:`row_bytes_per_token` is K and V together)."""
        pool = self._single_pool("bytes_per_token")
        return len(pool.layers) * pool.slot_bytes

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block in a cache of one pool (:meth:`CachePool.block_bytes` for each)."""
        return self._single_pool("block_bytes").block_bytes(block_size)


def model_prefix_states(arch, tensor_parallel_size: int, dtype: torch.dtype) -> Tuple[PrefixState, ...]:
    """What every layer of the model keeps for a cached prefix (megatron layer order): its
    family's answer (:meth:`megatron_psrl.model.families.ModelFamily.prefix_states`)."""
    states = tuple(arch.family.prefix_states(arch, tensor_parallel_size, dtype))
    if len(states) != arch.num_layers:
        raise ValueError(f"model family {arch.model_type!r} gave {len(states)} prefix states for "
                         f"{arch.num_layers} layers")
    return states


@dataclass
class CacheMetrics:
    """Per-step statistics (logged and written to --log-json)."""

    block_size: int = 0
    pool_blocks: int = 0
    peak_blocks_used: int = 0
    peak_pool_blocks: Tuple[int, ...] = ()
    """Each pool's most blocks in use at once (what the memory plan's ``pool_sizes`` predict)."""
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
    """Block pools for the cached prefixes of one step on one rank (:attr:`KVGeometry.pools`)."""

    def __init__(self, geometry: KVGeometry, budget_bytes: int):
        self.geometry = geometry
        self.budget_bytes = int(budget_bytes)
        self.pools = geometry.pools
        min_bytes = sum(p.block_bytes(BLOCK_SIZE_CLASSES[0]) for p in self.pools)
        if self.budget_bytes < min_bytes:
            raise CacheBudgetError(
                f"--kv-cache-budget {self.budget_bytes} bytes cannot hold one KV block: the smallest block "
                f"({'; '.join(p.describe_block(BLOCK_SIZE_CLASSES[0]) for p in self.pools)}) needs {min_bytes} bytes"
            )
        self._pool_of_layer = {layer: j for j, p in enumerate(self.pools) for layer in p.layers}
        rows = [p for p in self.pools if p.state.per_token]
        self._counted_layer = (rows or self.pools)[0].layers[0]
        """The layer whose reads count the tokens read (one count per source read)."""
        self._storage: List[Optional[Tensor]] = [None] * len(self.pools)
        """Per pool ``[layers, blocks, block slots, slot elems]`` in the model dtype."""
        self.block_size = BLOCK_SIZE_CLASSES[0]
        self.block_sizes: Tuple[int, ...] = (BLOCK_SIZE_CLASSES[0],) * len(self.pools)
        """Tokens per block of each pool this step."""
        self._free: List[List[int]] = [[] for _ in self.pools]
        self._tables: Dict[Tuple[int, int, str], np.ndarray] = {}
        self._slots: Dict[Tuple[int, int, str], Tensor] = {}
        self._roles: Dict[int, set] = {}
        self._host: Dict[Tuple[int, int, str], Tuple[Tensor, int]] = {}
        """Host offload: a block kind of a source in host memory, ``([layers, blocks, block slots,
        slot elems] host buffer, slots)``, its blocks given back to the pool (:meth:`offload`)."""
        self._unread: Dict[Tuple[int, int], int] = {}
        """``(source, pool)`` -> leading rows of the source the pool keeps nothing of (no reader's
        sliding window reaches them: ``PrefixState.unread_rows``); 0 where absent."""
        self.metrics = CacheMetrics()

    # ------------------------------------------------------------------ step lifecycle
    def max_blocks(self, block_size: int) -> int:
        """Blocks of ``block_size`` the budget holds (a cache of one pool)."""
        return self.budget_bytes // self.geometry.block_bytes(block_size)

    def begin_step(self, block_size: int, pool_blocks: int, pool_sizes: Optional[Sequence[int]] = None,
                   pool_states: Optional[Sequence[PrefixState]] = None,
                   pool_block_sizes: Optional[Sequence[int]] = None) -> None:
        """(Re)allocate the pools for this step: ``pool_sizes`` blocks in each (one pool:
        ``pool_blocks``) of ``pool_block_sizes`` tokens each (None: ``block_size`` in every
        pool; a sliding window's pool has smaller blocks, ``MemoryPlan.pool_block_sizes``).
        ``pool_states``: the state of each size's pool, when the sizes are those of a plan made
        for other layers (a pipeline's planning geometry,
        :meth:`KVGeometry.for_pipeline_planning`): each of this cache's pools takes the sizes
        of its state's."""
        sizes = tuple(int(n) for n in pool_sizes) if pool_sizes is not None else (int(pool_blocks),)
        tokens = tuple(int(b) for b in pool_block_sizes) if pool_block_sizes else (int(block_size),) * len(sizes)
        if pool_states is not None:
            if len(pool_states) != len(sizes) or len(tokens) != len(sizes):
                raise ValueError(f"{len(sizes)} pool sizes and {len(tokens)} block sizes for {len(pool_states)} "
                                 "pool states")
            by_state = dict(zip(pool_states, zip(sizes, tokens)))
            missing = [p.state for p in self.pools if p.state not in by_state]
            if missing:
                raise ValueError(f"the memory plan sizes no pool of the prefix states {missing}")
            sizes, tokens = (tuple(by_state[p.state][i] for p in self.pools) for i in (0, 1))
        if len(sizes) != len(self.pools) or len(tokens) != len(self.pools):
            raise ValueError(f"{len(sizes)} pool sizes for a cache of {len(self.pools)} pools")
        needed = sum(n * p.block_bytes(bs) for n, p, bs in zip(sizes, self.pools, tokens))
        if needed > self.budget_bytes:
            raise CacheBudgetError(
                f"the step needs {sum(sizes)} KV blocks of {'/'.join(map(str, sorted(set(tokens))))} tokens "
                f"({needed} bytes) but --kv-cache-budget is {self.budget_bytes} bytes"
            )
        for j, (p, n) in enumerate(zip(self.pools, sizes)):
            shape = (len(p.layers), n, p.block_slots(tokens[j]), p.slot_elems)
            if self._storage[j] is None or tuple(self._storage[j].shape) != shape:
                self._storage[j] = None  # release the old pool before allocating the new one
                self._storage[j] = torch.zeros(shape, dtype=p.state.dtype, device=self.geometry.device)
            self._free[j] = list(range(n - 1, -1, -1))
        self.block_size = block_size
        self.block_sizes = tokens
        self._tables.clear()
        self._slots.clear()
        self._roles.clear()
        self._host.clear()
        self._unread.clear()
        self.metrics = CacheMetrics(block_size=block_size, pool_blocks=sum(sizes))

    def end_step(self) -> None:
        if self._tables or self._host:
            raise RuntimeError(f"KV cache still holds sources {sorted({k[0] for k in (*self._tables, *self._host)})} "
                               f"at step end")

    def release_pool(self) -> None:
        self._storage = [None] * len(self.pools)

    @property
    def pool(self) -> Optional[Tensor]:
        """The storage of a cache of one pool (``[layers, blocks, block slots, slot elems]``)."""
        if len(self.pools) != 1:
            raise ValueError(f"a cache of {len(self.pools)} pools has no single storage tensor")
        return self._storage[0]

    @property
    def pool_blocks_in_use(self) -> Tuple[int, ...]:
        """Blocks allocated now in each pool."""
        return tuple((t.shape[1] if t is not None else 0) - len(free) for t, free in zip(self._storage, self._free))

    @property
    def blocks_in_use(self) -> int:
        return sum(self.pool_blocks_in_use)

    def _record_use(self) -> None:
        per_pool = self.pool_blocks_in_use
        used = sum(per_pool)
        m = self.metrics
        m.peak_blocks_used = max(m.peak_blocks_used, used)
        m.peak_pool_blocks = tuple(max(a, b) for a, b in zip(m.peak_pool_blocks or (0,) * len(per_pool), per_pool))
        if m.pool_blocks:
            m.utilisation_samples.append(used / m.pool_blocks)

    # ------------------------------------------------------------------ allocation
    def allocate(self, source_id: int, length: int, kinds: Sequence[str] = ALL_ROLES,
                 reach: Tuple[int, Optional[int]] = (0, None)) -> None:
        """Block tables for a source of ``length`` tokens in every pool, for the given roles
        (:data:`~megatron_psrl.kvcache.prefix_state.VALUES`, ``GRADS``); gradient blocks start
        at zero. ``reach``: the source's first depth and its readers' shallowest
        (``CachedSource.reach``): a sliding-window pool keeps only the rows from the first
        some reader's window reaches (:meth:`CachePool.kept_rows`), values and gradients alike."""
        wanted = [(j, kind) for role in kinds for j, p in enumerate(self.pools) for kind in p.state.kinds(role)]
        kept = [p.kept_rows(length, *reach) for p in self.pools]
        for j, p in enumerate(self.pools):
            unread = length - kept[j]
            if self._unread.setdefault((source_id, j), unread) != unread:
                raise ValueError(f"source {source_id}: its blocks were allocated keeping rows from "
                                 f"{self._unread[(source_id, j)]} on, now from {unread}")
            needed = sum(p.blocks(kind, kept[j], self.block_sizes[j]) for i, kind in wanted if i == j)
            if needed > len(self._free[j]):
                raise CacheBudgetError(f"KV cache full: source {source_id} needs {needed} blocks, "
                                       f"{len(self._free[j])} free")
        self._roles.setdefault(source_id, set()).update(kinds)
        for j, kind in wanted:
            p = self.pools[j]
            n_slots, per_block = p.slots(kind, kept[j]), p.block_slots(self.block_sizes[j])
            blocks = self._take_blocks((source_id, j, kind), p.blocks(kind, kept[j], self.block_sizes[j]), n_slots)
            if p.state.is_grad(kind):  # (a host index on a device tensor would copy it pageable, and wait)
                self._storage[j].index_fill_(1, host_to_device(blocks, self.geometry.device), 0)
            self.metrics.allocated_slots += len(blocks) * per_block
            self.metrics.used_slots += n_slots
        self._record_use()

    def _take_blocks(self, key: Tuple[int, int, str], n_blocks: int, n_slots: int) -> np.ndarray:
        """``n_blocks`` free blocks of pool ``key[1]`` for a source's block kind: its block table
        and its first ``n_slots`` slots."""
        j = key[1]
        per_block = self.pools[j].block_slots(self.block_sizes[j])
        blocks = np.array([self._free[j].pop() for _ in range(n_blocks)], dtype=np.int64)
        self._tables[key] = blocks
        slots = (blocks[:, None] * per_block + np.arange(per_block)[None, :]).reshape(-1)[:n_slots]
        self._slots[key] = host_to_device(slots, self.geometry.device)
        return blocks

    # ------------------------------------------------------------------ host offload
    def on_device(self) -> set:
        """Sources with blocks in the pools."""
        return {k[0] for k in self._tables}

    def on_host(self) -> set:
        """Sources offloaded to host memory (:meth:`offload`)."""
        return {k[0] for k in self._host}

    def offload(self, source_id: int, link) -> int:
        """A source's blocks (every role it holds, all layers) copied into host buffers through
        ``link`` (a :class:`~megatron_psrl.host_copy.HostLink`) and given back to their pools;
        returns the bytes moved. Its gather is queued before anything that writes those blocks
        again, and the link keeps the gathered copy alive until it is on the host."""
        moved = 0
        for key in [k for k in self._tables if k[0] == source_id]:
            blocks = self._tables.pop(key)
            slots = self._slots.pop(key)
            j = key[1]
            gathered = self._storage[j].index_select(1, host_to_device(blocks, self.geometry.device))
            self._host[key] = (link.to_host(gathered), len(slots))
            moved += gathered.numel() * gathered.element_size()
            self._free[j].extend(int(b) for b in blocks[::-1])
        self._record_use()
        return moved

    def restore(self, source_id: int, link) -> int:
        """An offloaded source back in blocks of its pools (new ones: its block tables change),
        copied inside ``link.side()`` (the caller fences and waits before it is read); returns
        the bytes moved."""
        keys = [k for k in self._host if k[0] == source_id]
        for j in {k[1] for k in keys}:
            needed = sum(self._host[k][0].shape[1] for k in keys if k[1] == j)
            if needed > len(self._free[j]):
                raise CacheBudgetError(f"KV cache full: offloaded source {source_id} needs {needed} blocks back, "
                                       f"{len(self._free[j])} free")
        back = []
        for key in keys:  # (block tables on the current stream, which reads them)
            host, n_slots = self._host.pop(key)
            back.append((key, host, self._take_blocks(key, host.shape[1], n_slots)))
        with link.side():  # (the copies and the scatter into the pool on the link's stream)
            for key, host, blocks in back:
                values = link.to_device(host, (host.shape, tuple(host.stride()), host.dtype, self.geometry.device))
                self._storage[key[1]].index_copy_(1, host_to_device(blocks, self.geometry.device), values)
        self._record_use()
        return sum(host.numel() * host.element_size() for _, host, _ in back)

    def free(self, source_id: int, kinds: Sequence[str]) -> None:
        """Return a source's blocks of the given roles to their pools."""
        for role in kinds:
            for j, p in enumerate(self.pools):
                for kind in p.state.kinds(role):
                    blocks = self._tables.pop((source_id, j, kind), None)
                    self._slots.pop((source_id, j, kind), None)
                    self._host.pop((source_id, j, kind), None)  # (offloaded: its host copy goes)
                    if blocks is not None:
                        self._free[j].extend(int(b) for b in blocks[::-1])
            self._roles.get(source_id, set()).discard(role)
        if not self._roles.get(source_id, True):
            self._roles.pop(source_id)
            for j in range(len(self.pools)):
                self._unread.pop((source_id, j), None)
        self._record_use()

    def holds(self, source_id: int, kind: str) -> bool:
        """The source holds blocks of this role."""
        return kind in self._roles.get(source_id, ())

    def block_table(self, source_id: int, kind: str) -> np.ndarray:
        """Blocks of one block kind of a source (in the first pool that keeps that kind)."""
        for j, p in enumerate(self.pools):
            if (source_id, j, kind) in self._tables:
                return self._tables[(source_id, j, kind)]
        raise KeyError((source_id, kind))

    def first_kept_row(self, source_id: int, layer: int) -> int:
        """The source's first row layer ``layer`` keeps: 0, or in a sliding-window pool the
        first some reader's window reaches (the rows before it are neither stored nor read)."""
        return self._unread.get((source_id, self._pool_of_layer[layer]), 0)

    # ------------------------------------------------------------------ data
    def _slot_view(self, layer: int, grads: bool) -> Tuple[int, Tensor]:
        """``(pool, [slots, slot elems])`` flat slot view of one layer (no copy); ``grads``: as
        fp32 (a gradient's row spans its consecutive slots)."""
        j = self._pool_of_layer[layer]
        p = self.pools[j]
        view = self._storage[j][p.layers.index(layer)].view(-1, p.slot_elems)
        return j, (view.view(GRAD_DTYPE) if grads else view)

    def write(self, source_id: int, layer: int, *fields: Tensor, start: int = 0) -> None:
        """A source's values of one layer (each field ``[n, *shape]``: its rows from ``start``
        on; or ``[*shape]`` for a fixed state) into its blocks; rows the layer does not keep
        (:meth:`first_kept_row`) are left out."""
        j, view = self._slot_view(layer, grads=False)
        skip = self._unread.get((source_id, j), 0) - start
        if skip < 0:
            raise ValueError(f"source {source_id}, layer {layer}: rows from {start} on written, the cache keeps "
                             f"them from {start + skip} on")
        for kind, tensor in zip(self.pools[j].state.kinds(VALUES), fields):
            view.index_copy_(0, self._slots[(source_id, j, kind)],
                             tensor.detach()[skip:].to(view.dtype).reshape(-1, view.shape[1]))

    def _slots_from(self, source_id: int, j: int, kind: str, start: int) -> Tensor:
        """Slots of a source's field in pool ``j`` from its token ``start`` on (at or after
        the first row the pool keeps: a reader outside every planned window is a planning error)."""
        slots = self._slots[(source_id, j, kind)]
        start -= self._unread.get((source_id, j), 0)
        if start < 0:
            raise ValueError(f"source {source_id}: rows {start + self._unread[(source_id, j)]}.. read in a pool "
                             f"that keeps them from {self._unread[(source_id, j)]} on (no planned window reaches them)")
        return slots[self.pools[j].slots(kind, start):] if start else slots

    def read(self, source_id: int, layer: int, count: bool = True, start: int = 0) -> Tuple[Tensor, ...]:
        """Gather a source's values of one layer through its block tables: a copy of every
        field, ``[n, *shape]`` (``[*shape]`` for a fixed state); ``count``: in the hit metrics
        (a recomputation's second read is not); ``start``: its rows from there on only (those a
        sliding window reaches)."""
        j, view = self._slot_view(layer, grads=False)
        state = self.pools[j].state
        out = tuple(view.index_select(0, self._slots_from(source_id, j, f.name, start)).view(
            (-1,) + f.shape if state.per_token else f.shape) for f in state.fields)
        if count:
            self.metrics.reads += 1
            if layer == self._counted_layer:
                self.metrics.tokens_read += out[0].shape[0]
        return out

    def accumulate_grad(self, source_id: int, layer: int, *grads: Optional[Tensor], start: int = 0) -> None:
        """Add gradients (``None``: none for that field) to a source's gradient blocks of one
        layer, in fp32 (``start``: of its rows from there on, as :meth:`read` gave them)."""
        j, view = self._slot_view(layer, grads=True)
        for kind, grad in zip(self.pools[j].state.kinds(GRADS), grads):
            if grad is not None:
                view.index_add_(0, self._slots_from(source_id, j, kind, start), grad.float().reshape(-1, view.shape[1]))

    def read_grad(self, source_id: int, layer: int) -> Tuple[Tensor, ...]:
        """A source's accumulated gradients of one layer: fp32 copies, one per field with a
        gradient, ``[n, *shape]`` (``[*shape]`` for a fixed state): its rows from
        :meth:`first_kept_row` on (the others' gradient is zero: no reader reads them)."""
        j, view = self._slot_view(layer, grads=True)
        state = self.pools[j].state
        return tuple(view.index_select(0, self._slots[(source_id, j, f.grad_kind)]).view(
            (-1,) + f.shape if state.per_token else f.shape) for f in state.fields if f.has_grad)


# ---------------------------------------------------------------------- a source's every layer at once
# Functions of any cache with the per-layer API (``read``, ``read_grad``, ``write``,
# ``accumulate_grad``, ``first_kept_row`` and a ``geometry``): head sends and replica gradients move a source's rows
# of every layer as one tensor.
def source_row_shape(geometry: KVGeometry) -> Tuple[int, ...]:
    """``(layers, *row_shape)`` of one token of a source over every layer of this rank
    (:func:`source_rows`; :attr:`PrefixState.row_shape`); a cache of per-token pools of one row
    shape only (softmax K/V, sliding-window layers' included)."""
    pools = geometry.pools
    if not all(p.state.per_token for p in pools) or len({p.state.row_shape for p in pools}) != 1:
        raise NotImplementedError("moving a source's every layer as one row needs per-token pools of one row "
                                  f"shape; this cache has {[p.state.storage.value for p in pools]}")
    return (geometry.num_layers,) + pools[0].state.row_shape


def whole_grad(cache, source_id: int, layer: int) -> Tuple[Tensor, ...]:
    """``cache.read_grad`` of every row of the source: the rows a sliding-window layer does not
    keep (no reader reached them) have a zero gradient."""
    grads = cache.read_grad(source_id, layer)
    skip = cache.first_kept_row(source_id, layer)
    return tuple(torch.cat([g.new_zeros((skip,) + tuple(g.shape[1:])), g]) for g in grads) if skip else grads


def source_rows(cache, source_id: int, grads: bool = False) -> Tensor:
    """``[n, layers, *row_shape]``: a source's values (or fp32 gradients) of every layer of this
    rank, each token's fields in one row (:meth:`PrefixState.pack_rows`)."""
    source_row_shape(cache.geometry)  # (refuses caches it does not apply to)
    if grads:  # (every row: those a window's pool does not keep with a zero gradient)
        read = lambda s, layer: whole_grad(cache, s, layer)  # noqa: E731
    else:
        read = lambda s, layer: cache.read(s, layer, count=False)  # noqa: E731
    g = cache.geometry
    return torch.stack([g.state_of(layer).pack_rows(read(source_id, layer)) for layer in g.layers], dim=1)


def write_source_rows(cache, source_id: int, rows: Tensor) -> None:
    """``cache.write`` every layer of a source from ``[n, layers, *row_shape]`` rows."""
    g = cache.geometry
    for li, layer in enumerate(g.layers):
        cache.write(source_id, layer, *g.state_of(layer).unpack_rows(rows[:, li]))


def accumulate_source_grad_rows(cache, source_id: int, rows: Tensor) -> None:
    """``cache.accumulate_grad`` every layer of a source from ``[n, layers, *row_shape]`` rows."""
    g = cache.geometry
    for li, layer in enumerate(g.layers):
        cache.accumulate_grad(source_id, layer, *g.state_of(layer).unpack_rows(rows[:, li]))


def source_grad_elems(geometry: KVGeometry, length: int) -> int:
    """Elements of a source's fp32 gradients over every layer of this rank, flattened
    (:func:`source_grad_flat`): per-token rows and fixed states alike."""
    return sum(geometry.state_of(layer).flat_elems(length) for layer in geometry.layers)


def source_grad_flat(cache, source_id: int) -> Tensor:
    """1-D: a source's accumulated fp32 gradients of every layer, layer after layer
    (:meth:`PrefixState.pack_flat`)."""
    g = cache.geometry
    return torch.cat([g.state_of(layer).pack_flat(whole_grad(cache, source_id, layer)) for layer in g.layers])


def accumulate_source_grad_flat(cache, source_id: int, length: int, flat: Tensor) -> None:
    """``cache.accumulate_grad`` every layer of a source of ``length`` tokens from
    :func:`source_grad_flat`'s layout."""
    g, at = cache.geometry, 0
    for layer in g.layers:
        state = g.state_of(layer)
        n = state.flat_elems(length)
        cache.accumulate_grad(source_id, layer, *state.unpack_flat(flat[at:at + n], length))
        at += n
