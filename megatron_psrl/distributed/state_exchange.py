"""Fixed-size prefix states between the ranks of one exchange group (linear-attention layers).

A softmax layer's fragment imports the per-token K/V rows of the prefix chains other ranks
compute (:mod:`megatron_psrl.distributed.kv_exchange`); a linear-attention layer imports one
state per chain: the recurrent state and conv tail at the chain's last token (the chain's end
is a segment end on the sender: the layer cuts there, ``LinearPrefixHook.linear_cuts``). The
chains and their order are the step's K/V exchange's (``StepExchange.send`` / ``recv``): one
message per (sender, receiver) and layer, ``[chains, *row_shape]`` rows
(:meth:`PrefixState.pack_rows` of a fixed state: one row per chain, whatever its length).

Unlike K/V rows, a state depends on the state it started from: a fragment that continues a
chain of another rank in the same step can compute its layer only once that chain's state is
here. So the exchange is point to point, not an all-to-all of the whole group:

1. **before** the layer computes, a rank receives every message that holds a chain it reads now
   (a *peer* chain): those come from fragments earlier in the step's stream, i.e. lower ranks
   of the group, which never wait for this one (:meth:`StateLink.receive_before`);
2. **after** it computed, one group of operations (``batch_isend_irecv``): its messages to every
   reader, and the messages that hold only *replica* chains (kept in its cache for later steps;
   they may come from a higher rank, which sends them after its own compute)
   (:meth:`StateLink.send_after`). Every rank waits for its group before the next layer, so a
   pair's operations of one layer end before the next layer's start, in the same order on both
   sides (NCCL's semantics, ``nccl_emulation``).

Backward: a reader's received rows are leaves whose gradient (the sum over its root segments
that start from them; zeros for a chain whose state no root starts from) goes back to the sender
as soon as autograd has it (:meth:`StateLink.return_grad`); the sender's
:class:`SendStates` (in its graph through a zero anchor on the layer's output) waits for the
gradients of its peer chains and hands them to the states it sent, whose backward then runs
back through the sender's delta rule. Replica chains' gradients accumulate in the reader's cache
and go back with the replica gradients of every layer (``ReturnReplicaGrads``). The dependency
between ranks follows the stream: a layer of a step runs on the group's ranks one after the
other where fragments continue each other (no overlap; a K/V exchange's peers can overlap).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_psrl.kvcache.prefix_state import GRAD_DTYPE, PrefixState

Tensor = torch.Tensor


class StateLink:
    """One micro-batch's state messages with the other ranks of its exchange group (the same
    in every linear layer): how many chains' states it sends to and receives from each rank."""

    def __init__(self, group, send_counts: Dict[int, int], grads_from: Sequence[int],
                 recv_counts: Dict[int, int], before: Sequence[int], device: torch.device):
        self.group = group
        self.send_counts = {int(r): int(n) for r, n in send_counts.items() if n}
        """Chains whose states go to each rank (group ranks), in the plan's order."""
        self.grads_from = sorted(int(r) for r in grads_from)
        """Ranks that read a chain of this rank now: their gradients come back in backward."""
        self.recv_counts = {int(r): int(n) for r, n in recv_counts.items() if n}
        self.before = sorted(int(r) for r in before)
        """Ranks whose message holds a chain read now: received before the layer computes."""
        self.device = device

    @property
    def after_compute(self) -> bool:
        """Something to send, or a replica-only message to receive, after the layer computed."""
        return bool(self.send_counts) or any(r not in self.before for r in self.recv_counts)

    def _peer(self, r: int) -> int:
        return dist.get_global_rank(self.group, r)

    def _run(self, ops: List[Tuple[bool, Tensor, int]]) -> None:
        """Post ``(is_send, tensor, group rank)`` as one group and wait for it."""
        if not ops:
            return
        p2p = [dist.P2POp(dist.isend if is_send else dist.irecv, t, self._peer(r), self.group) for is_send, t, r in ops]
        for work in dist.batch_isend_irecv(p2p):
            work.wait()

    def _buffers(self, ranks: Sequence[int], state: PrefixState) -> Dict[int, Tensor]:
        return {r: torch.empty((self.recv_counts[r],) + state.row_shape, dtype=state.dtype, device=self.device)
                for r in ranks}

    def receive_before(self, state: PrefixState) -> Dict[int, Tensor]:
        """The messages that hold chains read now (``[chains, *row_shape]`` per sending rank)."""
        got = self._buffers(self.before, state)
        self._run([(False, t, r) for r, t in got.items()])
        return got

    def send_after(self, rows: Dict[int, Tensor], state: PrefixState) -> Dict[int, Tensor]:
        """Send ``rows`` (``[chains, *row_shape]`` per reading rank) and receive the replica-only
        messages, as one group; returns those."""
        got = self._buffers([r for r in self.recv_counts if r not in self.before], state)
        ops = [(True, rows[r].detach().to(state.dtype).contiguous(), r) for r in sorted(rows)]
        self._run(sorted(ops + [(False, t, r) for r, t in got.items()], key=lambda op: op[2]))
        return got

    def return_grad(self, src: int, grad: Tensor) -> None:
        """Backward: the gradient of the rows received from ``src`` goes back to it (fp32)."""
        self._run([(True, grad.to(GRAD_DTYPE).contiguous(), src)])

    def returned_grads(self, state: PrefixState) -> Dict[int, Tensor]:
        """Backward: the gradients of the rows sent to every rank that reads them now."""
        got = {r: torch.empty((self.send_counts[r],) + state.row_shape, dtype=GRAD_DTYPE, device=self.device)
               for r in self.grads_from}
        self._run([(False, t, r) for r, t in got.items()])
        return got


class SendStates(torch.autograd.Function):
    """``rows`` (``{rank: [chains, *row_shape]}`` flattened in rank order) -> a zero scalar the
    layer adds to its output: the forward sends the states (and receives the replica-only
    messages, ``box``), the backward hands the readers' returned gradients to the rows sent."""

    @staticmethod
    def forward(ctx, rows: Tensor, link: StateLink, state: PrefixState, box: list):
        offsets, at = {}, 0
        for r in sorted(link.send_counts):
            offsets[r] = (at, link.send_counts[r])
            at += link.send_counts[r]
        box.append(link.send_after({r: rows[a:a + n] for r, (a, n) in offsets.items()}, state))
        ctx.link, ctx.state, ctx.offsets, ctx.like = link, state, offsets, (rows.shape, rows.dtype)
        return rows.new_zeros(())

    @staticmethod
    def backward(ctx, grad_anchor: Tensor):
        shape, dtype = ctx.like
        grad = torch.zeros(shape, dtype=GRAD_DTYPE, device=ctx.link.device)
        for r, back in ctx.link.returned_grads(ctx.state).items():
            a, n = ctx.offsets[r]
            grad[a:a + n] = back
        return grad.to(dtype), None, None, None


def send_states(rows: Tensor, link: StateLink, state: PrefixState, differentiable: bool):
    """``(anchor or None, replica-only messages received)``: :class:`SendStates` with a graph
    (``differentiable``: a zero anchor to add to the layer's output), else the plain send."""
    box: list = []
    if differentiable and torch.is_grad_enabled() and link.send_counts:
        anchor = SendStates.apply(rows, link, state, box)
        return anchor, box[0]
    with torch.no_grad():
        at, parts = 0, {}
        for r in sorted(link.send_counts):
            parts[r] = rows[at:at + link.send_counts[r]]
            at += link.send_counts[r]
        return None, link.send_after(parts, state)


def received_leaf(rows: Tensor, link: StateLink, src: int) -> Tensor:
    """The rows received from ``src`` as a leaf whose gradient goes back to ``src`` (the hook
    fires once, with the gradient summed over every use)."""
    rows.requires_grad_(True)
    rows.register_hook(lambda g: link.return_grad(src, g))
    return rows
