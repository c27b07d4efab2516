"""Prefix K/V exchange between the ranks of one exchange group (cross-rank prefix sharing).

Two operations, both ``all_to_all_single`` over the group with sizes every rank knows from the
deterministic plan (so every rank issues the same collectives in the same order, and none
waits for a message that is never sent):

- :class:`ExchangeKV` (per layer, inside the attention of a micro-batch step): every rank sends
  the post-RoPE K/V rows of its fragment that other ranks' fragments attend to now (*peer*
  chains) or later (*replica* chains, stored in the receiver's KV cache). As an autograd
  function its backward sends the gradients of the received rows back to their owners, who
  add them to the rows they sent: a rank that attends to another rank's prefix contributes
  exactly the dL/dK, dL/dV it would have contributed had the prefix been computed locally.
  The function returns the sender's own K/V unchanged as extra outputs: the attention reads
  them, which keeps the function in every rank's graph, so its backward (a collective) runs
  on every rank of the group, in layer order, even on a rank whose received rows are unused.
- :func:`return_replica_grads` (once per deferred backward): the dK/dV that readers
  accumulated in their replicas of a prefix, summed into the owner's gradient blocks before
  the owner's backward injects them.

NCCL on CUDA, gloo on CPU: ``all_to_all_single`` with uneven splits works on both, but not
with empty ones on NCCL: a split of zero rows, or a rank that sends or receives nothing, is a
known hang class of NCCL's all-to-all (pytorch/pytorch#146468, NVIDIA/nccl#1593), here all the
more likely as the backward exchange runs on the autograd thread. A cross-rank plan leaves
empty splits everywhere (a fragment reads from one peer, not all), so every empty split
carries one padding row instead (sender and receiver agree: one's send count is the other's
receive count), and no split and no tensor of the collective is ever empty. A step where no
rank of the group sends anything issues no collective at all (the plan's
``forward_collective`` / ``backward_collective``, the same on every rank).

Overlapped exchange (:func:`exchange_kv_start`, the default; ``--no-overlap-kv-exchange``
keeps the synchronous :func:`exchange_kv`): the forward all-to-all is started with
``async_op=True`` and :class:`ExchangeKVAsync` returns its receive buffer before it is filled;
the attention computes its queries over the keys it already has (its own fragment, cached
prefixes), then waits (:meth:`ExchangeInFlight.wait`), then attends to the received rows and merges
both by log-sum-exp (the ``torch`` backend; the others wait before their kernel). In the
backward the attention computes the received rows' gradients first and starts sending them
back (:meth:`ExchangeInFlight.return_grad`, again ``async_op=True``) before the rest of its backward;
:class:`ExchangeKVAsync`'s backward waits for them. The same rules hold: the receive buffer
keeps the padding rows (every split is ``max(count, 1)`` rows, which is what the synchronous
path sends too), and every rank issues one collective per layer and direction, in layer
order, whether its attention started it or the exchange's backward did.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_psrl.kvcache.prefix_state import GRAD_DTYPE, PrefixState

Tensor = torch.Tensor


def _all_to_all(send: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group) -> Tensor:
    """Rows ``send`` split by ``send_counts`` per destination -> rows received per source (see
    the module docstring: an empty split travels as one padding row, dropped on arrival)."""
    out = send.new_empty((sum(padded_counts(recv_counts)),) + tuple(send.shape[1:]))
    dist.all_to_all_single(out, _pad_rows(send, send_counts), padded_counts(recv_counts), padded_counts(send_counts),
                           group=group)
    return _unpad_rows(out, recv_counts)


def kv_state(k: Tensor, v: Tensor) -> PrefixState:
    """The transport layout of a softmax layer's K ``[t, ng, hk]`` and V ``[t, ng, hv]``."""
    return PrefixState.softmax(k.shape[1], k.shape[2], v.shape[2], dtype=k.dtype)


def _rows_to_send(k: Tensor, v: Tensor, send_rows: Tensor, state: PrefixState) -> Tensor:
    """``[n_send, *row_shape]``: the K and V rows ``send_rows`` of ``k`` / ``v`` in the layer
    state's transport layout (:meth:`PrefixState.pack_rows`)."""
    return state.pack_rows((k, v), send_rows)


def _add_returned_grads(grad_k: Optional[Tensor], grad_v: Optional[Tensor], shapes, send_rows: Tensor,
                        back: Tensor, state: PrefixState, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """The gradients of ``k`` / ``v`` (``shapes``, ``dtype``): what reached them here (None:
    nothing) plus the fp32 gradients ``back`` ``[n_send, *row_shape]`` the readers returned for
    the rows sent, summed in fp32 and rounded once (a bf16 sum over many readers would lose
    about 1e-2, as in the KV cache)."""
    back_k, back_v = state.unpack_rows(back)
    # (copies: autograd's incoming gradients are not added to in place)
    gk = grad_k.to(GRAD_DTYPE, copy=True) if grad_k is not None else back.new_zeros(shapes[0], dtype=GRAD_DTYPE)
    gv = grad_v.to(GRAD_DTYPE, copy=True) if grad_v is not None else back.new_zeros(shapes[1], dtype=GRAD_DTYPE)
    gk.index_add_(0, send_rows, back_k.to(GRAD_DTYPE))
    gv.index_add_(0, send_rows, back_v.to(GRAD_DTYPE))
    return gk.to(dtype), gv.to(dtype)


class ExchangeKV(torch.autograd.Function):
    """``(k, v) -> (k, v, received)``: send rows of k/v, receive other ranks' rows.

    ``received`` is ``[n_recv, *row_shape]`` (the layer state's transport rows,
    :attr:`PrefixState.row_shape`), sources in rank order, rows in the order each sender listed
    them."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, send_rows: Tensor, send_counts: List[int], recv_counts: List[int], group,
                state: PrefixState):
        kv = _rows_to_send(k, v, send_rows, state)
        received = _all_to_all(kv, send_counts, recv_counts, group)
        ctx.save_for_backward(send_rows)
        ctx.counts = (send_counts, recv_counts)
        ctx.group, ctx.state = group, state
        ctx.shapes, ctx.dtype = (k.shape, v.shape), k.dtype
        return k.view_as(k), v.view_as(v), received

    @staticmethod
    def backward(ctx, grad_k: Optional[Tensor], grad_v: Optional[Tensor], grad_received: Optional[Tensor]):
        (send_rows,) = ctx.saved_tensors
        send_counts, recv_counts = ctx.counts
        if grad_received is None:  # this rank attended to none of the rows it received
            grad_received = torch.zeros((int(sum(recv_counts)),) + ctx.state.row_shape, dtype=GRAD_DTYPE,
                                        device=send_rows.device)
        # What each owner gets back: the gradients of the rows it sent (reverse direction), in fp32.
        back = _all_to_all(grad_received.to(GRAD_DTYPE), recv_counts, send_counts, ctx.group)  # [n_send, *row_shape]
        gk, gv = _add_returned_grads(grad_k, grad_v, ctx.shapes, send_rows, back, ctx.state, ctx.dtype)
        return gk, gv, None, None, None, None, None


def exchange_kv(k: Tensor, v: Tensor, send_rows: Tensor, send_counts: List[int], recv_counts: List[int], group,
                differentiable: bool, state: Optional[PrefixState] = None):
    """:class:`ExchangeKV` (``differentiable``) or the same exchange without autograd
    (``state``: the layer's prefix state, by default the softmax state of ``k`` and ``v``)."""
    state = state or kv_state(k, v)
    if differentiable and torch.is_grad_enabled():
        return ExchangeKV.apply(k, v, send_rows, send_counts, recv_counts, group, state)
    with torch.no_grad():
        kv = _rows_to_send(k, v, send_rows, state)
        return k, v, _all_to_all(kv, send_counts, recv_counts, group)


def return_replica_grads(send: Tensor, send_counts: List[int], recv_counts: List[int], group) -> Tensor:
    """Send replica gradients ``[n_send, layers, *row_shape]`` to their owners; returns what this
    rank receives (``[n_recv, layers, *row_shape]``) as owner."""
    with torch.no_grad():
        return _all_to_all(send, send_counts, recv_counts, group)


# ---------------------------------------------------------------------- overlapped exchange
def padded_counts(counts: Sequence[int]) -> List[int]:
    """Rows every split occupies in a collective: an empty split travels as one padding row.

    The same splits as :func:`_all_to_all` (which pads only when some split is empty: without
    an empty split ``max(count, 1) == count``)."""
    return [max(int(c), 1) for c in counts]


def split_offsets(counts: Sequence[int]) -> List[int]:
    """First row of every source's split in a padded buffer (:func:`padded_counts`)."""
    offsets, at = [], 0
    for c in padded_counts(counts):
        offsets.append(at)
        at += c
    return offsets


def _pad_rows(rows: Tensor, counts: Sequence[int]) -> Tensor:
    """``rows`` (splits back to back, ``counts`` rows each) with one zero row per empty split."""
    counts = list(map(int, counts))
    if all(counts):
        return rows.contiguous()
    pad = rows.new_zeros((1,) + tuple(rows.shape[1:]))
    pieces, offset = [], 0
    for c in counts:
        pieces.append(rows[offset:offset + c] if c else pad)
        offset += c
    return torch.cat(pieces)


def _unpad_rows(padded: Tensor, counts: Sequence[int]) -> Tensor:
    """Drop the padding rows of a padded buffer (the inverse of :func:`_pad_rows`)."""
    counts = list(map(int, counts))
    if all(counts):
        return padded
    kept = [padded[o:o + c] for o, c in zip(split_offsets(counts), counts) if c]
    return torch.cat(kept) if kept else padded[:0]


class BlockedTime:
    """How long waits on a transfer blocked, for benchmarks: on the host clock where waiting
    blocks the host (gloo); on CUDA, where ``work.wait()`` only makes the compute stream wait
    for NCCL and returns at once, as the time the stream stood still, between two CUDA events
    around the wait (read at :attr:`seconds`, which synchronises: benchmarks only)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._host = 0.0
        self._events: List[Tuple[object, object]] = []
        self._t0 = 0.0

    def __enter__(self):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        else:
            self._host += time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        if not self.cuda:
            return self._host
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self._events) / 1000.0


class ExchangeInFlight:
    """One layer's prefix K/V all-to-all in flight (forward), and the return of the received
    rows' gradients (backward).

    ``buffer`` is the padded receive buffer (``[sum(max(recv, 1)), *row_shape]``, detached: the
    autograd output of :class:`ExchangeKVAsync` shares its storage); its rows are valid after
    :meth:`wait`, None after :meth:`release`. It holds no tensor of the graph (the autograd
    function's context holds it)."""

    def __init__(self, send: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group,
                 state: Optional[PrefixState] = None):
        self.state = state
        """The layer's prefix state: the layout of a row (:meth:`unpack`)."""
        self.send_counts, self.recv_counts = list(map(int, send_counts)), list(map(int, recv_counts))
        self.group = group
        self.offsets = split_offsets(self.recv_counts)
        """First row of every source's split in ``buffer``."""
        row_shape = tuple(send.shape[1:])
        self._send = _pad_rows(send, self.send_counts)  # kept alive until the exchange is done
        self.buffer = send.new_empty((sum(padded_counts(self.recv_counts)),) + row_shape)
        self.buffer_like = (tuple(self.buffer.shape), self.buffer.dtype, self.buffer.device)
        self._work = dist.all_to_all_single(self.buffer, self._send, padded_counts(self.recv_counts),
                                            padded_counts(self.send_counts), group=group, async_op=True)
        self._on_arrival: List[Callable[[Tensor], None]] = []
        self._grad_work = None
        self._grad_out: Optional[Tensor] = None
        self._grad_send: Optional[Tensor] = None
        self._blocked = BlockedTime(self.buffer.device)
        """Time the waits blocked (what the overlap left exposed), for benchmarks."""

    @property
    def arrived(self) -> bool:
        return self._work is None

    @property
    def wait_seconds(self) -> float:
        """Time the waits on this exchange blocked (:class:`BlockedTime`), for benchmarks."""
        return self._blocked.seconds

    def unpack(self, rows: Tensor) -> Tuple[Tensor, ...]:
        """Views of every field of received rows (or of their gradients) ``[n, *row_shape]``."""
        return self.state.unpack_rows(rows)

    def on_arrival(self, fn: Callable[[Tensor], None]) -> None:
        """Call ``fn(buffer)`` once the rows are here (at once if they are)."""
        if self._work is None:
            fn(self.buffer)
        else:
            self._on_arrival.append(fn)

    def wait(self) -> Tensor:
        """Block until the rows are here (once; later calls return at once); the buffer."""
        if self._work is not None:
            with self._blocked:
                self._work.wait()
            self._work, self._send = None, None
            callbacks, self._on_arrival = self._on_arrival, []
            for fn in callbacks:
                fn(self.buffer)
        return self.buffer

    def release(self) -> None:
        """Drop this side's reference to the received rows once every reader took its copy (the
        attention ran): a graph kept until the backward then holds no received rows."""
        self.wait()
        self.buffer = None

    # ------------------------------------------------------------------ backward
    @property
    def returning_grad(self) -> bool:
        """:meth:`return_grad` started the gradients' way back."""
        return self._grad_work is not None or self._grad_out is not None

    def return_grad(self, grad_buffer: Tensor) -> None:
        """Start sending the gradients of the received rows back to their owners (the padded
        layout of ``buffer``; padding rows carry zeros) in fp32, whatever the model dtype: the
        reverse all-to-all, asynchronous. :meth:`returned_grad` waits for it."""
        if self.returning_grad:
            raise RuntimeError("the gradients of this exchange were returned already")
        grad_buffer = grad_buffer.to(GRAD_DTYPE).contiguous()
        if tuple(grad_buffer.shape) != self.buffer_like[0]:
            raise ValueError(f"gradient of shape {tuple(grad_buffer.shape)} for a receive buffer of shape "
                             f"{self.buffer_like[0]}")
        self._grad_send = grad_buffer
        self._grad_out = grad_buffer.new_empty((sum(padded_counts(self.send_counts)),) + tuple(grad_buffer.shape[1:]))
        self._grad_work = dist.all_to_all_single(self._grad_out, grad_buffer, padded_counts(self.send_counts),
                                                 padded_counts(self.recv_counts), group=self.group, async_op=True)

    def returned_grad(self) -> Tensor:
        """``[n_send, *row_shape]``: the fp32 gradients of the rows this rank sent (waits for them)."""
        if self._grad_work is not None:
            with self._blocked:
                self._grad_work.wait()
            self._grad_work, self._grad_send = None, None
        out = _unpad_rows(self._grad_out, self.send_counts)
        self._grad_out = None
        return out


class ExchangeKVAsync(torch.autograd.Function):
    """:class:`ExchangeKV` with the exchange in flight when it returns: ``(k, v) -> (k, v,
    buffer)``, ``buffer`` the padded receive buffer (:class:`ExchangeInFlight`; valid after
    ``exchange.wait()``; source ``src``'s rows start at ``exchange.offsets[src]``). Its backward
    sends the received rows' gradients back, unless the attention started that already
    (:meth:`ExchangeInFlight.return_grad`), and adds the returned ones to the rows this rank sent."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, send_rows: Tensor, send_counts: List[int], recv_counts: List[int], group,
                box: list, state: PrefixState):
        kv = _rows_to_send(k, v, send_rows, state)
        exchange = ExchangeInFlight(kv, send_counts, recv_counts, group, state)
        box.append(exchange)
        ctx.save_for_backward(send_rows)
        ctx.exchange = exchange
        ctx.shapes, ctx.dtype = (k.shape, v.shape), k.dtype
        return k.view_as(k), v.view_as(v), exchange.buffer.view_as(exchange.buffer)

    @staticmethod
    def backward(ctx, grad_k: Optional[Tensor], grad_v: Optional[Tensor], grad_buffer: Optional[Tensor]):
        (send_rows,) = ctx.saved_tensors
        exchange: ExchangeInFlight = ctx.exchange
        if not exchange.returning_grad:  # the attention did not start it (e.g. no peer read here)
            if grad_buffer is None:
                shape, dtype, device = exchange.buffer_like
                grad_buffer = torch.zeros(shape, dtype=dtype, device=device)
            exchange.return_grad(grad_buffer)
        back = exchange.returned_grad()  # [n_send, *row_shape]
        ctx.exchange = None
        gk, gv = _add_returned_grads(grad_k, grad_v, ctx.shapes, send_rows, back, exchange.state, ctx.dtype)
        return gk, gv, None, None, None, None, None, None


def exchange_kv_start(k: Tensor, v: Tensor, send_rows: Tensor, send_counts: List[int], recv_counts: List[int],
                      group, differentiable: bool, state: Optional[PrefixState] = None):
    """Start the exchange: ``(k, v, buffer, exchange)``; ``buffer`` (the autograd tensor with
    :class:`ExchangeKVAsync` differentiable, else ``exchange.buffer``) is filled after
    ``exchange.wait()`` (``state``: the layer's prefix state, by default the softmax state of
    ``k`` and ``v``)."""
    state = state or kv_state(k, v)
    box: list = []
    if differentiable and torch.is_grad_enabled():
        k, v, buffer = ExchangeKVAsync.apply(k, v, send_rows, send_counts, recv_counts, group, box, state)
        return k, v, buffer, box[0]
    with torch.no_grad():
        kv = _rows_to_send(k, v, send_rows, state)
        exchange = ExchangeInFlight(kv, send_counts, recv_counts, group, state)
        return k, v, exchange.buffer, exchange


class ReceivedKV:
    """One received chain the attention reads (the attention's ``ArrivingPrefixKV``): rows
    ``offset:offset + length`` of ``buffer`` (``[n, *row_shape]``, :meth:`ExchangeInFlight.unpack`
    gives K and V), valid after ``exchange.wait()``."""

    __slots__ = ("exchange", "buffer", "offset", "length")

    def __init__(self, exchange: ExchangeInFlight, buffer: Tensor, offset: int, length: int):
        self.exchange, self.buffer, self.offset, self.length = exchange, buffer, int(offset), int(length)

    def materialize(self):
        """``(k, v)`` copies after waiting (autograd reaches ``buffer``), for kernels that take
        tensors: no overlap beyond what ran before this call."""
        self.exchange.wait()
        k, v = self.exchange.unpack(self.buffer[self.offset:self.offset + self.length])
        return k.clone(), v.clone()
