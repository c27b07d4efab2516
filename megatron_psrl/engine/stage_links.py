"""A pipeline stage's links to its neighbours: activations forward, their gradients back.

Every stage of a pipeline holds the same plan and packs the same micro-batches, so a receiver
knows the shape of every message before it arrives (``[t, 1, h]`` of the pack, a sequence-
parallel shard of it with tensor parallelism). Nothing is exchanged but the tensors: no shape
messages, and no host synchronisation. (megatron-core 0.16's ``P2PCommunicator`` with
``variable_seq_lengths`` first sends the shapes, then calls ``torch.cuda.synchronize()`` and
reads them with ``.tolist()``, and synchronises again after the batched transfer
(``batch_p2p_sync``): every transfer waited for the stage's own queued compute.)

**When a send goes.** A send is not posted on its own: it waits in the outbox and goes with the
stage's next receive, in one batch (``batch_isend_irecv``: its sends and receives do not wait
for each other), or alone right before a model run that receives nothing (the first stage's
forward, the last stage's backward), or before any other communication, or at the end of the
step (:meth:`StageLinks.flush`). In the 1F1B order this is megatron's own pairing
(``send_forward_recv_backward`` in the steady state, ``send_backward_recv_forward`` after a
backward): the two neighbours each wait for both of their messages at once, which NCCL needs
(between two ranks, operations run in the order posted, and a send completes only when its
receive runs: a stage sending its forward output while its neighbour sends a gradient back would
hang if each posted its send alone first; ``PSRL_EMULATE_NCCL`` reproduces that on gloo).

**Virtual stages** (several model chunks per rank) take no outbox: their order receives one
iteration ahead, so a send held until the next receive would deadlock. Their stream says what
goes together (:class:`~megatron_psrl.schedule.instructions.Transfer`, lowered by
:mod:`megatron_psrl.schedule.interleaved`), and :meth:`StageLinks.transfer` posts it as one batch.

**What a wait costs.** :attr:`StageLinks.blocked` adds up the time the stage stood waiting on its
transfers (the pipeline bubble's numerator): on the host clock on CPU, where ``wait()`` blocks;
on CUDA, where ``wait()`` only orders the compute stream after the transfer and returns, as the
time the stream stood still (CUDA events, read once after the step).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_psrl.distributed.kv_exchange import BlockedTime

Tensor = torch.Tensor


class StageLinks:
    """Batched sends and receives of known shapes between a stage and its two neighbours in
    ``group`` (the pipeline group; with virtual stages the last stage's next is the first)."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype):
        self.group = group
        self.device = device
        self.dtype = dtype
        """Dtype of every message (megatron's ``pipeline_dtype``: the hidden states')."""
        size, me = dist.get_world_size(group), dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (me + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (me - 1) % size)
        self._outbox: List[dist.P2POp] = []
        self.blocked = BlockedTime(device)
        """Time spent waiting on transfers (see the module docstring); a new one per step."""
        self.messages = 0
        """Tensors sent and received since the last :meth:`reset` (a test reads it)."""

    def reset(self) -> None:
        """A new step: its own waits."""
        self.blocked = BlockedTime(self.device)
        self.messages = 0

    def send_forward(self, output: Tensor) -> None:
        """``output`` (detached) goes to the next stage with this stage's next transfer."""
        self._outbox.append(dist.P2POp(dist.isend, output.detach().contiguous(), self.next_rank, self.group))

    def send_backward(self, input_grad: Tensor) -> None:
        """``input_grad`` goes to the previous stage with this stage's next transfer."""
        self._outbox.append(dist.P2POp(dist.isend, input_grad.contiguous(), self.prev_rank, self.group))

    def recv_forward(self, shape: Sequence[int]) -> Tensor:
        """The previous stage's output, ``shape``, with whatever waits in the outbox."""
        return self._receive(shape, self.prev_rank)

    def recv_backward(self, shape: Sequence[int]) -> Tensor:
        """The gradient of this stage's output, ``shape``, from the next stage (with the outbox)."""
        return self._receive(shape, self.next_rank)

    def flush(self) -> None:
        """Post whatever waits in the outbox, alone, and wait for it."""
        if self._outbox:
            self._post([])

    def transfer(self, sends: Sequence[Tuple[Tensor, int]],
                 receives: Sequence[Tuple[Sequence[int], int]]) -> List[Tensor]:
        """One batch: each ``(tensor, peer)`` of ``sends`` sent, each ``(shape, peer)`` of
        ``receives`` received into a new buffer (``peer``: a global rank, the previous or the
        next stage), in the order given, posted together and waited for; the buffers."""
        buffers = [torch.empty(tuple(shape), dtype=self.dtype, device=self.device) for shape, _ in receives]
        ops = [dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, b, peer, self.group) for b, (_, peer) in zip(buffers, receives)]
        self._post(ops)
        return buffers

    def _receive(self, shape: Sequence[int], peer: int) -> Tensor:
        buffer = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        self._post([dist.P2POp(dist.irecv, buffer, peer, self.group)])
        return buffer

    def _post(self, receives: List[dist.P2POp]) -> None:
        ops, self._outbox = self._outbox + receives, []
        self.messages += len(ops)
        with self.blocked:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
