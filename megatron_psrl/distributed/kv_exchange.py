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
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _all_to_all(send: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group) -> Tensor:
    """Rows ``send`` split by ``send_counts`` per destination -> rows received per source (see
    the module docstring: an empty split travels as one padding row, dropped on arrival)."""
    send_counts, recv_counts = list(map(int, send_counts)), list(map(int, recv_counts))
    row_shape = tuple(send.shape[1:])
    send = send.contiguous()
    if all(send_counts) and all(recv_counts):
        out = send.new_empty((sum(recv_counts),) + row_shape)
        dist.all_to_all_single(out, send, recv_counts, send_counts, group=group)
        return out
    pad = send.new_zeros((1,) + row_shape)
    pieces, offset = [], 0
    for count in send_counts:
        pieces.append(send[offset:offset + count] if count else pad)
        offset += count
    padded_recv = [max(count, 1) for count in recv_counts]
    out = send.new_empty((sum(padded_recv),) + row_shape)
    dist.all_to_all_single(out, torch.cat(pieces), padded_recv, [max(count, 1) for count in send_counts],
                           group=group)
    kept, offset = [], 0
    for count, padded in zip(recv_counts, padded_recv):
        if count:
            kept.append(out[offset:offset + count])
        offset += padded
    return torch.cat(kept) if kept else out[:0]


class ExchangeKV(torch.autograd.Function):
    """``(k, v) -> (k, v, received)``: send rows of k/v, receive other ranks' rows.

    ``received`` is ``[n_recv, 2, ng, hn]`` (K then V of every received row, sources in rank
    order, rows in the order each sender listed them)."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, send_rows: Tensor, send_counts: List[int], recv_counts: List[int], group):
        kv = torch.stack([k.index_select(0, send_rows), v.index_select(0, send_rows)], dim=1)  # [n_send, 2, ng, hn]
        received = _all_to_all(kv, send_counts, recv_counts, group)
        ctx.save_for_backward(send_rows)
        ctx.counts = (send_counts, recv_counts)
        ctx.group = group
        ctx.shape, ctx.dtype = k.shape, k.dtype
        return k.view_as(k), v.view_as(v), received

    @staticmethod
    def backward(ctx, grad_k: Optional[Tensor], grad_v: Optional[Tensor], grad_received: Optional[Tensor]):
        (send_rows,) = ctx.saved_tensors
        send_counts, recv_counts = ctx.counts
        ng_hn = ctx.shape[1:]
        if grad_received is None:  # this rank attended to none of the rows it received
            grad_received = torch.zeros((int(sum(recv_counts)), 2) + tuple(ng_hn), dtype=ctx.dtype,
                                        device=send_rows.device)
        # What each owner gets back: the gradients of the rows it sent (reverse direction).
        back = _all_to_all(grad_received, recv_counts, send_counts, ctx.group)  # [n_send, 2, ng, hn]
        gk = grad_k.clone() if grad_k is not None else back.new_zeros(ctx.shape)
        gv = grad_v.clone() if grad_v is not None else back.new_zeros(ctx.shape)
        gk.index_add_(0, send_rows, back[:, 0].to(gk.dtype))
        gv.index_add_(0, send_rows, back[:, 1].to(gv.dtype))
        return gk, gv, None, None, None, None


def exchange_kv(k: Tensor, v: Tensor, send_rows: Tensor, send_counts: List[int], recv_counts: List[int], group,
                differentiable: bool):
    """:class:`ExchangeKV` (``differentiable``) or the same transfer without autograd."""
    if differentiable and torch.is_grad_enabled():
        return ExchangeKV.apply(k, v, send_rows, send_counts, recv_counts, group)
    with torch.no_grad():
        kv = torch.stack([k.index_select(0, send_rows), v.index_select(0, send_rows)], dim=1)
        return k, v, _all_to_all(kv, send_counts, recv_counts, group)


def return_replica_grads(send: Tensor, send_counts: List[int], recv_counts: List[int], group) -> Tensor:
    """Send replica gradients ``[n_send, layers, 2, ng, hn]`` to their owners; returns what this
    rank receives (``[n_recv, layers, 2, ng, hn]``) as owner."""
    with torch.no_grad():
        return _all_to_all(send, send_counts, recv_counts, group)
