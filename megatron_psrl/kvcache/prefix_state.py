"""What a shared prefix keeps for one layer: the one place that knows block kinds and row layouts.

A cached source (a prefix chain one micro-batch computes and later micro-batches, or other
ranks, read) keeps, for every layer of the model, what a reader of that layer needs instead of
recomputing the prefix. That is a property of the layer's mixer, so the model family supplies
it per layer (:class:`PrefixState`), and every other part of the system asks the spec:

- the KV cache (:mod:`megatron_psrl.kvcache.manager`) stores it: per-token rows in paged
  blocks, or a fixed-size state in slots (:class:`CachePool`), under one byte budget;
- the memory plan and the cost model count its bytes (:meth:`PrefixState.nbytes`,
  :meth:`CachePool.blocks`);
- the transports (the per-layer exchange between ranks, head sends, replica gradients) move a
  token's fields as one flat row (:meth:`PrefixState.pack_rows` / :meth:`PrefixState.unpack_rows`).

Three shapes cover the model families in use:

==========================  ==============================  ===========  ==============  ======================
layer                       fields                          storage      reader          tap
==========================  ==============================  ===========  ==============  ======================
softmax attention (GQA)     ``k`` [ng, hk], ``v`` [ng, hv]  per token    concatenates    core attention (RoPE'd)
latent attention (MLA)      ``latent`` [r], ``rope_key``    per token    projects up,    before the K/V
                            [hr]                                         concatenates    up-projection
linear attention (delta     ``state`` [nh, dk, dv],         fixed size   takes the       inside the recurrent
rule, Mamba-like)           ``conv`` [kernel - 1, c]                     innermost       mixer
==========================  ==============================  ===========  ==============  ======================

A sliding-window softmax layer (gpt-oss) keeps the softmax fields with its window
(:attr:`PrefixState.window`): a distinct state, so its layers form a pool of their own, in which a
source keeps only the rows some reader's window reaches (:meth:`PrefixState.unread_rows`,
:meth:`CachePool.kept_rows`).

The plan speaks of a source's blocks by *role* only (:data:`VALUES`, what readers read;
:data:`GRADS`, the fp32 gradients readers accumulate for the producer's backward); which
block kinds a role means for a layer is this module's business (:meth:`PrefixState.kinds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property, reduce
from typing import Dict, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor

VALUES = "values"
"""A source's role: what its readers read (K/V rows, a latent, a recurrent state)."""

GRADS = "grads"
"""A source's role: the gradients its readers accumulate (fp32), injected into its backward."""

ALL_ROLES = (VALUES, GRADS)
"""Every block a source holds, in allocation order."""

RELEASE_ALL = (GRADS, VALUES)
"""Every block of a source, in the order a producer's backward releases them."""

VALUES_ONLY = (VALUES,)
"""A source's values only (released after their last reader; forward-only passes)."""

GRADS_ONLY = (GRADS,)
"""A source's gradients only: an owner whose prefix only other ranks read."""

GRAD_DTYPE = torch.float32
"""Gradients of cached prefixes accumulate in fp32 whatever the model dtype: a bf16 sum over
hundreds of readers would lose about 1e-2."""

_GRAD_PREFIX = "g"


class Storage(str, Enum):
    """How a layer's prefix is stored."""

    ROWS = "rows"
    """One row per prefix token (softmax K/V, a latent): paged blocks, bytes grow with length."""

    FIXED = "fixed"
    """One state per source whatever its length (a recurrent matrix and a convolution tail)."""


class Combine(str, Enum):
    """How a reader combines the prefixes of its ancestors."""

    CONCAT = "concat"
    """Attend to every ancestor's rows (outermost first), merged by log-sum-exp."""

    INNERMOST = "innermost"
    """Start from the nearest ancestor's final state (it already summarises the outer ones)."""


class Tap(str, Enum):
    """Where in the layer the prefix is written and read."""

    CORE_ATTENTION = "core_attention"
    """megatron's core-attention slot: K and V after RoPE (and after any up-projection)."""

    BEFORE_UP_PROJECTION = "before_up_projection"
    """Latent attention: the compressed K/V latent and the decoupled RoPE key, before the
    up-projection that every reader re-runs (its weight gradient accumulating exactly)."""

    RECURRENT_MIXER = "recurrent_mixer"
    """Inside a linear-attention mixer: the recurrence's state and the short convolution's tail."""


@dataclass(frozen=True)
class StateField:
    """One tensor a layer keeps for a cached source."""

    name: str
    """Block kind of the values (the gradient's kind is ``"g" + name``)."""

    shape: Tuple[int, ...]
    """Per token for :attr:`Storage.ROWS` (e.g. ``(ng, hn)``), the whole state for
    :attr:`Storage.FIXED` (e.g. ``(nh, dk, dv)``)."""

    has_grad: bool = True
    """Readers return a gradient for it (a fixed position table would not)."""

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith(_GRAD_PREFIX):
            raise ValueError(f"a state field's name must be non-empty and not start with {_GRAD_PREFIX!r}: "
                             f"{self.name!r}")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ValueError(f"state field {self.name!r}: every dimension must be positive, got {self.shape}")

    @property
    def elems(self) -> int:
        """Elements per token (rows) or of the whole state (fixed)."""
        return math.prod(self.shape)

    @property
    def grad_kind(self) -> str:
        return _GRAD_PREFIX + self.name


@dataclass(frozen=True)
class PrefixState:
    """What a cached prefix keeps for one layer (supplied per layer by the model family)."""

    fields: Tuple[StateField, ...]
    """The tensors kept, in transport order (a flat row is their concatenation)."""

    storage: Storage = Storage.ROWS
    """Per-token rows or a fixed-size state."""

    combine: Combine = Combine.CONCAT
    """How a reader combines its ancestors."""

    tap: Tap = Tap.CORE_ATTENTION
    """Where the layer writes and reads it."""

    dtype: torch.dtype = torch.float32
    """Storage dtype of the values (the model's); gradients are :data:`GRAD_DTYPE`."""

    window: Optional[int] = None
    """A sliding-window layer's window in keys (a query at depth ``p`` sees its ancestors at
    depths ``p - window + 1 .. p``; :func:`megatron_psrl.attention.window.layer_window`): a
    cached source keeps only the rows some reader's window reaches (:meth:`unread_rows`), so
    these layers get a pool of their own. None: every row is kept."""

    derived_elems: int = 0
    """Elements per token (rows) a reader derives from a row and keeps in its graph, in the model
    dtype (latent attention: this rank's heads' up-projected keys and values, which the
    attention saves for backward); 0: the reader attends to the rows themselves."""

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if not names:
            raise ValueError("a prefix state keeps at least one field")
        if len(set(names)) != len(names):
            raise ValueError(f"prefix state fields must have distinct names: {names}")
        if (self.storage is Storage.ROWS) != (self.combine is Combine.CONCAT):
            raise ValueError(f"{self.storage.value} storage goes with the "
                             f"{'concat' if self.storage is Storage.ROWS else 'innermost'} combine, "
                             f"not {self.combine.value}")
        if self.window is not None and (self.window < 1 or self.storage is not Storage.ROWS):
            raise ValueError(f"a window of {self.window} keys: windows are positive and cut per-token rows only")

    def unread_rows(self, length: int, first_depth: int, reader_depth: Optional[int]) -> int:
        """Leading rows of a source (``length`` tokens at depths ``first_depth ..``) that no
        reader of this layer reaches, kept neither as values nor as gradients: a windowed
        layer's reader whose shallowest query descending from the source sits at depth
        ``reader_depth`` reads the rows at depths ``reader_depth - window + 1`` and later (all
        of them: the source's whole length when its window ends before the source does).
        0 for a layer without a window, or when the readers are not all known
        (``reader_depth`` None: e.g. other ranks read the source)."""
        if self.window is None or reader_depth is None:
            return 0
        return min(int(length), max(0, int(reader_depth) - self.window + 1 - int(first_depth)))

    # ------------------------------------------------------------------ the three families
    @classmethod
    def softmax(cls, num_groups: int, key_dim: int, value_dim: Optional[int] = None,
                dtype: torch.dtype = torch.float32, window: Optional[int] = None) -> "PrefixState":
        """Softmax attention: post-RoPE K ``[ng, key_dim]`` and V ``[ng, value_dim]`` per token
        (``value_dim`` defaults to ``key_dim``; DeepSeek-V3's per-head K/V are 192 and 128);
        ``window``: a sliding-window layer's (:attr:`window`)."""
        value_dim = key_dim if value_dim is None else value_dim
        return cls((StateField("k", (num_groups, key_dim)), StateField("v", (num_groups, value_dim))),
                   dtype=dtype, window=window)

    @classmethod
    def latent(cls, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype = torch.float32, num_heads: int = 0,
               key_dim: int = 0, value_dim: int = 0) -> "PrefixState":
        """Latent attention: the normalised K/V latent and the shared RoPE key per token, kept
        before the up-projection (``kv_lora_rank + rope_dim`` numbers a token, whole on every
        tensor-parallel rank). A reader projects them up to its ``num_heads`` heads' keys
        (``key_dim``, the RoPE key appended) and values (``value_dim``) and keeps those in its
        graph (:attr:`derived_elems`)."""
        return cls((StateField("latent", (kv_lora_rank,)), StateField("rope_key", (rope_dim,))),
                   tap=Tap.BEFORE_UP_PROJECTION, dtype=dtype, derived_elems=num_heads * (key_dim + value_dim))

    @classmethod
    def recurrent(cls, num_heads: int, key_dim: int, value_dim: int, conv_channels: int, conv_kernel: int,
                  dtype: torch.dtype = torch.float32) -> "PrefixState":
        """Linear attention: the recurrence's state ``[nh, dk, dv]`` after the prefix's last
        token and the short convolution's last ``conv_kernel - 1`` inputs ``[kernel - 1, c]``."""
        fields = (StateField("state", (num_heads, key_dim, value_dim)),)
        if conv_kernel > 1:
            fields += (StateField("conv", (conv_kernel - 1, conv_channels)),)
        return cls(fields, storage=Storage.FIXED, combine=Combine.INNERMOST, tap=Tap.RECURRENT_MIXER, dtype=dtype)

    # ------------------------------------------------------------------ kinds
    @property
    def per_token(self) -> bool:
        return self.storage is Storage.ROWS

    def kinds(self, role: str) -> Tuple[str, ...]:
        """Block kinds a role means for this layer: the fields (:data:`VALUES`) or the
        gradients of those that have one (:data:`GRADS`)."""
        if role == VALUES:
            return tuple(f.name for f in self.fields)
        if role == GRADS:
            return tuple(f.grad_kind for f in self.fields if f.has_grad)
        raise ValueError(f"unknown role {role!r}; roles: {ALL_ROLES}")

    def field(self, kind: str) -> StateField:
        """The field a block kind stores (its values or its gradient)."""
        for f in self.fields:
            if kind in (f.name, f.grad_kind):
                return f
        raise KeyError(f"no block kind {kind!r} in a prefix state of {[f.name for f in self.fields]}")

    @staticmethod
    def is_grad(kind: str) -> bool:
        return kind.startswith(_GRAD_PREFIX)

    def kind_bytes(self, kind: str) -> int:
        """Bytes of one token's (rows) or the whole state's (fixed) block kind, one layer."""
        dtype = GRAD_DTYPE if self.is_grad(kind) else self.dtype
        return self.field(kind).elems * _itemsize(dtype)

    def nbytes(self, length: int, roles: Sequence[str] = ALL_ROLES) -> int:
        """Bytes one layer keeps for a source of ``length`` tokens (exact, no block padding)."""
        per = sum(self.kind_bytes(k) for role in roles for k in self.kinds(role))
        return per * (int(length) if self.per_token else 1)

    def derived_nbytes(self, length: int) -> int:
        """Bytes of what a reader derives from a source of ``length`` tokens, one layer
        (:attr:`derived_elems`, in the model dtype)."""
        return self.derived_elems * _itemsize(self.dtype) * (int(length) if self.per_token else 0)

    def reader_nbytes(self, length: int) -> int:
        """Bytes a reader's graph keeps for a source of ``length`` tokens, one layer: the values
        it read and what it derives from them (:attr:`derived_elems`)."""
        return self.nbytes(length, (VALUES,)) + self.derived_nbytes(length)

    # ------------------------------------------------------------------ transport rows
    @property
    def row_elems(self) -> int:
        """Elements of one row: every field of one token (rows) or of the state (fixed)."""
        return sum(f.elems for f in self.fields)

    @property
    def stacked(self) -> bool:
        """Every field has one shape (softmax K and V of equal width): a row stacks them."""
        return len({f.shape for f in self.fields}) == 1

    @property
    def row_shape(self) -> Tuple[int, ...]:
        """Shape of one transport row: ``(fields, *shape)`` when the fields stack (softmax K/V:
        ``(2, ng, hn)``), else ``(row_elems,)``, the fields flattened side by side."""
        return (len(self.fields),) + self.fields[0].shape if self.stacked else (self.row_elems,)

    def pack_rows(self, tensors: Sequence[Tensor], rows: Optional[Tensor] = None) -> Tensor:
        """``[n, *row_shape]``: the fields (each ``[t, *shape]``; ``rows``: only those rows) of
        every token, in field order."""
        if len(tensors) != len(self.fields):
            raise ValueError(f"expected {len(self.fields)} tensors ({[f.name for f in self.fields]}), "
                             f"got {len(tensors)}")
        picked = [t if rows is None else t.index_select(0, rows) for t in tensors]
        if self.stacked:
            return torch.stack(picked, dim=1)
        # (the field's width, not -1: a rank may send no rows)
        return torch.cat([t.reshape(t.shape[0], f.elems) for t, f in zip(picked, self.fields)], dim=1)

    def unpack_rows(self, rows: Tensor) -> Tuple[Tensor, ...]:
        """Views ``[..., *shape]`` of every field of rows ``[..., *row_shape]`` (leading
        dimensions kept: ``[n, layers, *row_shape]`` gives ``[n, layers, *shape]``)."""
        if self.stacked:
            axis = rows.dim() - len(self.row_shape)
            return tuple(rows.select(axis, i) for i in range(len(self.fields)))
        out, at = [], 0
        for f in self.fields:
            out.append(rows[..., at:at + f.elems].unflatten(-1, f.shape))
            at += f.elems
        return tuple(out)

    def flat_elems(self, length: int) -> int:
        """Elements of every field of a source of ``length`` tokens, flattened (:meth:`pack_flat`)."""
        return self.row_elems * (int(length) if self.per_token else 1)

    def pack_flat(self, tensors: Sequence[Tensor]) -> Tensor:
        """1-D: every field of one source (``[n, *shape]`` rows, or the ``[*shape]`` state)
        flattened, in field order: a fixed state and per-token rows in one transport."""
        return torch.cat([t.reshape(-1) for t in tensors])

    def unpack_flat(self, flat: Tensor, length: int) -> Tuple[Tensor, ...]:
        """Views of every field of :meth:`pack_flat`'s output for a source of ``length`` tokens."""
        out, at = [], 0
        for f in self.fields:
            n = f.elems * (int(length) if self.per_token else 1)
            out.append(flat[at:at + n].view(((int(length),) + f.shape) if self.per_token else f.shape))
            at += n
        return tuple(out)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class CachePool:
    """One storage pool of the KV cache: the layers of a rank that keep the same
    :class:`PrefixState`, in blocks of one byte width.

    A *slot* is ``slot_bytes`` of every layer of the pool; a block is ``block_size`` slots for
    rows and one slot for fixed states. A token's field (rows) or a state's field (fixed) takes
    ``kind_bytes / slot_bytes`` consecutive slots of its block table; ``slot_bytes`` is the
    greatest common divisor of those widths, so fields of different widths (K 192 and V 128 per
    head, a latent and a RoPE key, fp32 gradients in a bf16 pool) share one pool without
    padding. Softmax K/V of equal width: a slot is one token's K (or V), a gradient takes
    ``4 / itemsize`` slots."""

    state: PrefixState
    """What each layer of the pool keeps."""

    layers: Tuple[int, ...]
    """megatron layer numbers of the pool's layers (1-based), in storage order."""

    @cached_property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one layer (computed once per pool: the memory planner asks for
        it for every block of every plan it weighs)."""
        kinds = [k for role in ALL_ROLES for k in self.state.kinds(role)]
        width = reduce(math.gcd, (self.state.kind_bytes(k) for k in kinds))
        if self.state.kinds(GRADS) and width % _itemsize(GRAD_DTYPE):
            raise ValueError(f"prefix state fields {[f.name for f in self.state.fields]} of "
                             f"{[self.state.kind_bytes(k) for k in kinds]} bytes have no common width that "
                             f"holds whole fp32 gradient elements")
        return width

    @property
    def slot_elems(self) -> int:
        """Elements of the storage dtype in one slot of one layer."""
        return self.slot_bytes // _itemsize(self.state.dtype)

    def slots_per_unit(self, kind: str) -> int:
        """Slots one token (rows) or the whole state (fixed) of a block kind takes."""
        return self.state.kind_bytes(kind) // self.slot_bytes

    def slots(self, kind: str, length: int) -> int:
        """Slots a source of ``length`` tokens takes for one block kind."""
        return self.slots_per_unit(kind) * (int(length) if self.state.per_token else 1)

    def kept_rows(self, length: int, first_depth: int = 0, reader_depth: Optional[int] = None) -> int:
        """Rows (tokens) of a source the pool keeps: all of them, less a windowed layer's
        :meth:`PrefixState.unread_rows`."""
        return int(length) - self.state.unread_rows(length, first_depth, reader_depth)

    def block_slots(self, block_size: int) -> int:
        """Slots in one block: ``block_size`` for rows; one for a fixed state."""
        return int(block_size) if self.state.per_token else 1

    def blocks(self, kind: str, length: int, block_size: int) -> int:
        """Blocks a source of ``length`` tokens takes for one block kind."""
        return -(-self.slots(kind, length) // self.block_slots(block_size))

    def source_blocks(self, length: int, roles: Sequence[str], block_size: int) -> int:
        """Blocks a source of ``length`` tokens takes for the given roles."""
        return sum(self.blocks(k, length, block_size) for role in roles for k in self.state.kinds(role))

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block over every layer of the pool."""
        return self.block_slots(block_size) * len(self.layers) * self.slot_bytes

    def describe_block(self, block_size: int) -> str:
        """One block's shape in words (error messages)."""
        shapes = {f.shape for f in self.state.fields}
        if self.state.window is not None:
            return f"{block_size} tokens x {len(self.layers)} layers of a {self.state.window}-token window"
        if self.state.tap is Tap.CORE_ATTENTION and len(shapes) == 1 and len(next(iter(shapes))) == 2:
            ng, hn = next(iter(shapes))
            return f"{block_size} tokens x {len(self.layers)} layers x {ng} kv heads x {hn} dims"
        unit = f"{block_size} tokens" if self.state.per_token else "one state slot"
        return (f"{unit} x {len(self.layers)} layers x {self.slot_bytes} bytes "
                f"({'/'.join(f.name for f in self.state.fields)})")


def cache_pools(states: Sequence[PrefixState], layers: Sequence[int]) -> Tuple[CachePool, ...]:
    """The pools of a rank whose layer ``layers[i]`` keeps ``states[i]``: one per distinct
    state, layers in the given order, pools in the order of their first layer."""
    if len(states) != len(layers):
        raise ValueError(f"{len(states)} prefix states for {len(layers)} layers")
    by_state: Dict[PrefixState, list] = {}
    for state, layer in zip(states, layers):
        by_state.setdefault(state, []).append(int(layer))
    return tuple(CachePool(state, tuple(ls)) for state, ls in by_state.items())


__all__ = [
    "ALL_ROLES",
    "CachePool",
    "Combine",
    "GRADS",
    "GRADS_ONLY",
    "GRAD_DTYPE",
    "PrefixState",
    "RELEASE_ALL",
    "StateField",
    "Storage",
    "Tap",
    "VALUES",
    "VALUES_ONLY",
    "cache_pools",
]
