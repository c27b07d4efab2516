"""Per-micro-batch attention metadata handed to every layer through megatron's packed_seq_params.

Megatron-core threads ``packed_seq_params`` from ``GPTModel``/``TransformerBlock`` down to the
core attention of every layer, untouched. :class:`TreeAttentionMetadata` extends megatron's
:class:`PackedSeqParams` with the tree plan, so it is built once per micro-batch and shared by
all layers. Its ``qkv_format`` stays ``"sbhd"`` on purpose: megatron then applies RoPE with
the per-token frequencies we pass (the position ids of tree tokens), instead of restarting
positions at every ``cu_seqlens`` boundary as it does for ``"thd"``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_psrl.attention.plan import AttentionPlan
from megatron_psrl.host_copy import host_to_device


@runtime_checkable
class CachedPrefixKV(Protocol):
    """One external source's K/V that the attention reads itself (instead of a ``(k, v)`` pair).

    A kernel that saves its inputs for the backward pass would otherwise keep a private copy of
    every cached prefix it read alive for as long as the graph lives. The ``torch`` backend
    reads such a source in its forward, does not save it, reads it again in its backward and
    hands the gradients back with :meth:`add_grad`; other backends call :meth:`materialize`.
    """

    def read(self, again: bool = False, start: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` ``[n, ng, hn]`` copies (``again``: the backward pass's re-read; ``start``:
        of the rows from there on, a sliding window's, ``[n - start, ng, hn]``)."""

    def add_grad(self, grad_key: torch.Tensor, grad_value: torch.Tensor, start: int = 0) -> None:
        """Add the gradients of ``(k, v)`` (fp32 or the model dtype; of the rows from ``start``
        on) to the source's dK/dV."""

    def materialize(self, start: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` tensors (of the rows from ``start`` on) whose autograd gradients reach the
        source (kernels that take tensors)."""


@dataclass(frozen=True)
class PrefixCopies:
    """A cached prefix a hook hands over to be copied (tensors in the graph), gathered once the
    attention knows which of its rows it reads (a sliding window reads only the last ones)."""

    source: CachedPrefixKV
    """The cached prefix."""

    grads: bool
    """Copies whose gradients reach the source (:meth:`CachedPrefixKV.materialize`), or plain
    copies (:meth:`CachedPrefixKV.read`: a forward without gradients)."""

    def take(self, start: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of the rows from ``start`` on."""
        return self.source.materialize(start=start) if self.grads else self.source.read(start=start)


@runtime_checkable
class ArrivingPrefixKV(Protocol):
    """One external source's K/V still in flight from another rank (the overlapped cross-rank
    exchange, :class:`megatron_psrl.distributed.kv_exchange.ReceivedKV`).

    Its rows are ``buffer[offset:offset + length]`` (the layer's transport rows; the
    ``exchange.unpack(rows)`` views are K and V, of the rows or of their gradients), valid once
    ``exchange.wait()`` returned. The ``torch`` backend attends to every other source first,
    then waits, then attends to these rows and merges by log-sum-exp; in its backward it
    computes their gradients first and hands the whole buffer's gradient (padding and unread
    rows zero) to ``exchange.return_grad``, which starts sending them back while the rest of
    the backward runs. Other backends call :meth:`materialize` (wait, then copies)."""

    buffer: torch.Tensor
    offset: int
    length: int
    exchange: object
    """``wait()`` (block until the rows are here), ``unpack(rows)``, ``return_grad(grad_buffer)``."""

    def materialize(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` after waiting, tensors whose autograd gradients reach ``buffer``."""


@runtime_checkable
class PrefixKVHook(Protocol):
    """How mechanism 2 plugs into attention: cached prefix K/V in, this pack's K/V out.

    Layer numbers are megatron's (1-based, global across pipeline stages). K/V are post-RoPE
    ``[tokens, ng, hn]`` for this tensor-parallel rank's groups.
    """

    def external_kv(self, layer_number: int) -> Sequence[Union[Tuple[torch.Tensor, torch.Tensor], CachedPrefixKV,
                                                                ArrivingPrefixKV]]:
        """K/V of every external source of the plan, in ``plan.external_lengths`` order: a
        ``(k, v)`` pair, :class:`PrefixCopies` to gather, a :class:`CachedPrefixKV` the
        attention reads itself, or an :class:`ArrivingPrefixKV` still in flight."""

    def on_kv(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Called with this pack's K/V, e.g. to store a prefix for later micro-batches. May
        return the K/V the attention must use instead (the same values, through an autograd
        function that exchanges prefix K/V with other ranks), or None.

        A hook may also define ``after_attention(layer_number)``, called once the layer's
        attention ran: an overlapped exchange then waits for rows no attention waited for
        (replicas only, or peers no query of a query-subset plan reads)."""


@dataclass
class TreeAttentionMetadata(PackedSeqParams):
    """megatron PackedSeqParams carrying a tree-packed micro-batch's attention plan."""

    plan: Optional[AttentionPlan] = None
    """Which keys every query of the pack attends to (segments + ancestor blocks)."""

    backend: Optional[str] = None
    """Attention backend for this micro-batch (``torch``, ``dense``, ``flash``, ``te``);
    None uses the core attention module's default."""

    kv_hook: Optional[PrefixKVHook] = None
    """Mechanism 2: supplies cached prefix K/V and receives this pack's K/V. None for M1."""

    output_rows: Optional[np.ndarray] = None
    """int64, ascending: the pack rows whose final hidden states are read (the loss head's
    rows). The model's last layer then computes only these rows past its K/V projection
    (``PsrlTransformerLayer``) and the model returns ``[len(output_rows), 1, h]``; None: every row."""

    query_rows: Optional[torch.Tensor] = None
    """Set by the last layer on its own copy (:meth:`for_output_rows`): core attention computes
    the outputs of these pack rows only (``[n]`` on the device), with ``plan`` their
    query-subset plan; the keys and values are still every row's."""

    def __post_init__(self) -> None:
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format != "sbhd":
            raise ValueError("TreeAttentionMetadata must keep qkv_format='sbhd' (see module doc)")
        if self.plan is None:
            raise ValueError("TreeAttentionMetadata needs an AttentionPlan")
        if self.plan.external_lengths and self.kv_hook is None:
            raise ValueError("a plan with external K/V sources needs a kv_hook to supply them")
        if self.query_rows is not None and len(self.query_rows) != self.plan.num_tokens:
            raise ValueError("query_rows needs the plan of those rows (AttentionPlan.select_queries)")

    def for_output_rows(self, device: torch.device) -> "TreeAttentionMetadata":
        """This metadata for the layer that computes ``output_rows`` only: their query-subset
        plan and ``query_rows`` on ``device`` (built once per micro-batch: a recomputed layer
        asks again)."""
        cached = self.__dict__.get("_rows_view")
        if cached is None or cached.query_rows.device != torch.device(device):
            rows = np.ascontiguousarray(self.output_rows, dtype=np.int64)
            cached = dataclasses.replace(self, plan=self.plan.select_queries(rows), output_rows=None,
                                         query_rows=host_to_device(rows, device))
            self.__dict__["_rows_view"] = cached
        return cached
