"""Prefix heads sent between ranks in a step (a tree split between exchange groups).

A transferred head (:class:`~megatron_psrl.schedule.plan.HeadSend`) is computed once, by its
home rank, in an ordinary micro-batch that produces an *exported* source; every other rank
whose micro-batches read a copy of that head receives its post-RoPE K/V of every layer in an
``import`` micro-batch, and returns the dK/dV its readers accumulated in that micro-batch's
backward; the home adds them before the exported source's backward injects them. So the
parameters get, for the head, the sum over every reader on every rank: what recomputing the
head in every copy would have given them (the gradients of the copies add up in the
data-parallel gradient sum), with the head computed once.

The plan of a step names the home of every transfer and the exchange group of every copy, but
not which ranks of that group read the copy's head (that is the group's own plan, which the
home does not make). The protocol needs nothing more, point-to-point over the data x context
parallel group (a rank's index there is its placement rank), in three phases:

1. at the start of the step every rank of a copy's group tells the home, with one flag,
   whether it imports the copy's head;
2. once its last exported source has run forward, a rank sends every head it exports to every
   rank that said yes (the first ``length`` rows of the head for a copy that imports fewer) and
   receives the heads it imports (a rank that exports none posts its receives at the start);
   an import micro-batch waits for its heads and writes them into its sources in the KV cache;
3. once its last import micro-batch has run backward, a rank sends the fp32 dK/dV of every head
   it imported back to its home and receives those of the heads it exports (a rank that imports
   none posts its receives with phase 2); the exported sources' backwards (the last of their
   rank's schedule) wait for them.

Each phase's messages between two ranks (both ways) are posted as ONE group
(``batch_isend_irecv``), in (transfer, import) order on both sides, and the phases follow each
other on every rank. That is what NCCL needs: it ignores tags, runs a pair of ranks' operations
one after the other in the order they were posted and completes a send only when the peer's
matching receive runs, so two ranks that each import a head from the other, or a home that
waits for one head's gradients while the other rank still waits for a second head, would hang
with messages posted one by one (``PSRL_EMULATE_NCCL=1`` reproduces it on gloo:
:mod:`megatron_psrl.distributed.nccl_emulation`). No rank waits for a group that another rank
can only post after waiting for it: on every rank exported heads run forward before any import
and backward after every import's backward (the plan checks it), so phase 2 is posted before
any wait on it, and phase 3 before the only wait on it, at the end of the schedule. The
forward-only passes (log-probs) run phases 1 and 2.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.host_copy import host_to_device
from megatron_psrl.kvcache.manager import (
    BlockKVCache,
    accumulate_source_grad_rows,
    source_row_shape,
    source_rows,
    write_source_rows,
)
from megatron_psrl.schedule.plan import StepPlan

Tensor = torch.Tensor

_FLAG, _KV, _GRAD = range(3)


class HeadSends:
    """One rank's part in a step's head sends (module docstring)."""

    def __init__(self, plan: StepPlan, rank: int, cache: BlockKVCache, group, with_grads: bool):
        self.plan, self.rank, self.cache, self.group, self.with_grads = plan, rank, cache, group, with_grads
        if dist.get_rank(group) != rank:
            raise RuntimeError(f"placement rank {rank} is rank {dist.get_rank(group)} of the head-send group")
        rank_plan = plan.ranks[rank]
        geometry = cache.geometry
        self.imports: Dict[Tuple[int, int], List[int]] = {}  # (transfer, import) -> sources it fills
        self.exports: Dict[int, int] = {}  # transfer -> the exported source
        for s, src in rank_plan.sources.items():
            if src.imported is not None:
                self.imports.setdefault(src.imported, []).append(s)
            if src.exported is not None:
                self.exports[src.exported] = s
        self._exports_left = {rank_plan.sources[s].producer for s in self.exports.values()}
        self._imports_left = {rank_plan.sources[s[0]].producer for s in self.imports.values()}
        self._rows: Dict[int, Tensor] = {}  # transfer -> its exported K/V rows (a copy)
        self._grads_out: Dict[Tuple[int, int], Tensor] = {}  # (transfer, import) -> dK/dV to return
        self._heads: Dict[Tuple[int, int], Tensor] = {}  # received K/V
        self._flags: Dict[int, List[Tuple[int, int, Tensor]]] = {}  # transfer -> (rank, import, flag)
        self._grads: Dict[int, List[Tuple[int, int, Tensor]]] = {}  # transfer -> (rank, import, grad)
        self._posted: Dict[Tuple[str, int], List] = {}  # (phase, peer) -> the requests of its group
        self._keep: List[Tensor] = []  # sent tensors (alive until the step's sends are done)
        self.entry_id: Dict[Tuple[int, int], int] = {}  # (transfer, import) -> its messages' tags
        for t, transfer in enumerate(plan.head_sends):
            for j in range(len(transfer.imports)):
                self.entry_id[(t, j)] = len(self.entry_id)
        self._post("flags", self._flag_messages())
        for t, j in sorted(self.imports):
            length = plan.head_sends[t].imports[j].length
            self._heads[(t, j)] = torch.empty((length,) + self.row_shape, dtype=geometry.dtype, device=geometry.device)
        if not self._exports_left:
            self._post_heads()

    # ------------------------------------------------------------------ point to point
    def _post(self, phase: str, messages: Dict[int, List[Tuple[bool, Tensor, int]]]) -> None:
        """Post every peer's messages of ``phase`` (``(is_send, tensor, tag)``, in order) as one
        group. (NCCL ignores the tags: the order matches; gloo matches by them.)"""
        for peer in sorted(messages):
            ops = [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, dist.get_global_rank(self.group, peer),
                              self.group, tag) for is_send, tensor, tag in messages[peer]]
            self._keep += [tensor for is_send, tensor, _ in messages[peer] if is_send]
            self._posted[(phase, peer)] = dist.batch_isend_irecv(ops)

    def _tag(self, t: int, j: int, kind: int) -> int:
        return 3 * self.entry_id[(t, j)] + kind

    def _wait(self, phase: str, peer: int) -> None:
        """Wait for the group of ``phase`` with ``peer`` (once: a gloo request waited on twice waits
        for a second message)."""
        for work in self._posted.pop((phase, peer), ()):
            work.wait()

    def _flag_messages(self) -> Dict[int, List[Tuple[bool, Tensor, int]]]:
        """Phase 1: a flag to the home of every copy of this rank's group (1: it imports the head);
        the home receives one from every other rank of every copy's group."""
        g = self.plan.config.exchange_group_size
        device = self.cache.geometry.device
        messages: Dict[int, List[Tuple[bool, Tensor, int]]] = {}
        for t, transfer in enumerate(self.plan.head_sends):
            for j, h in enumerate(transfer.imports):
                if transfer.home_rank == self.rank:
                    for r in range(h.group * g, h.group * g + g):
                        if r != self.rank:
                            flag = torch.zeros(1, dtype=torch.int64, device=device)
                            self._flags.setdefault(t, []).append((r, j, flag))
                            messages.setdefault(r, []).append((False, flag, self._tag(t, j, _FLAG)))
                elif h.group == self.rank // g:
                    wanted = host_to_device(np.array([int((t, j) in self.imports)], dtype=np.int64), device)
                    messages.setdefault(transfer.home_rank, []).append((True, wanted, self._tag(t, j, _FLAG)))
        return messages

    def _post_heads(self) -> None:
        """Phase 2 (every export computed): the heads this rank exports to the ranks that asked,
        the heads it imports from their homes; and phase 3 too if it imports none."""
        messages: Dict[int, List[Tuple[bool, Tensor, int]]] = {}
        for t in sorted(self.exports):
            for r, j, flag in self._flags.get(t, []):
                self._wait("flags", r)
                if int(flag.item()):
                    length = self.plan.head_sends[t].imports[j].length
                    messages.setdefault(r, []).append((True, self._rows[t][:length], self._tag(t, j, _KV)))
                    if self.with_grads:
                        grad = torch.empty((length,) + self.row_shape, dtype=torch.float32, device=self._rows[t].device)
                        self._grads.setdefault(t, []).append((r, j, grad))
        for (t, j), buf in sorted(self._heads.items()):
            messages.setdefault(self.plan.head_sends[t].home_rank, []).append((False, buf, self._tag(t, j, _KV)))
        self._post("heads", messages)
        self._rows.clear()
        if self.with_grads and not self._imports_left:
            self._post_grads()

    def _post_grads(self) -> None:
        """Phase 3 (every import's backward done): the dK/dV of every imported head to its home,
        the exported heads' from their importers."""
        messages: Dict[int, List[Tuple[bool, Tensor, int]]] = {}
        for (t, j), grad in sorted(self._grads_out.items()):
            messages.setdefault(self.plan.head_sends[t].home_rank, []).append((True, grad, self._tag(t, j, _GRAD)))
        for t in sorted(self._grads):
            for r, j, grad in self._grads[t]:
                messages.setdefault(r, []).append((False, grad, self._tag(t, j, _GRAD)))
        self._post("grads", messages)
        self._grads_out.clear()

    @property
    def row_shape(self):
        """``(layers, *row_shape)``: one token of a head, every layer of this rank."""
        return source_row_shape(self.cache.geometry)

    # ------------------------------------------------------------------ phase 2
    def _stacked(self, s: int, grads: bool) -> Tensor:
        """``[n, layers, *row_shape]``: a source's values (or fp32 gradients) of every layer of this rank."""
        return source_rows(self.cache, s, grads=grads)

    def after_forward(self, i: int) -> None:
        """Micro-batch ``i`` ran forward: keep a copy of the heads it exports (the step's next
        instruction releases the source's K/V); after the last export, phase 2 (module docstring)."""
        if i not in self._exports_left:
            return
        for t, s in self.exports.items():
            if self.plan.ranks[self.rank].sources[s].producer == i:
                self._rows[t] = self._stacked(s, grads=False).contiguous()
        self._exports_left.discard(i)
        if not self._exports_left:
            self._post_heads()

    def receive(self, i: int) -> None:
        """The import micro-batch ``i``: wait for its heads and write them into its sources
        (allocated already); a source's rows are its tokens' positions in the head."""
        index = self.plan.index
        for (t, j), sources in sorted(self.imports.items()):
            if self.plan.ranks[self.rank].sources[sources[0]].producer != i:
                continue
            self._wait("heads", self.plan.head_sends[t].home_rank)
            buf = self._heads.pop((t, j))
            for s in sources:
                rows = host_to_device(index.position[self.plan.ranks[self.rank].sources[s].tokens], buf.device)
                write_source_rows(self.cache, s, buf.index_select(0, rows))

    # ------------------------------------------------------------------ phase 3
    def return_grads(self, i: int) -> None:
        """The backward of the import micro-batch ``i`` (after all its readers'): every head's
        accumulated dK/dV, fp32, zero where no reader attended, to go back to its home; after
        the last import, phase 3 (module docstring)."""
        if i not in self._imports_left:
            return
        rank_plan = self.plan.ranks[self.rank]
        for (t, j), sources in sorted(self.imports.items()):
            if rank_plan.sources[sources[0]].producer != i:
                continue
            transfer = self.plan.head_sends[t]
            grad = torch.zeros((transfer.imports[j].length,) + self.row_shape, dtype=torch.float32,
                               device=self.cache.geometry.device)
            for s in sources:
                rows = host_to_device(self.plan.index.position[rank_plan.sources[s].tokens], grad.device)
                grad.index_copy_(0, rows, self._stacked(s, grads=True))
            self._grads_out[(t, j)] = grad
        self._imports_left.discard(i)
        if not self._imports_left:
            self._post_grads()

    def collect_grads(self, i: int) -> None:
        """Before the backward of micro-batch ``i``: the gradients every importer returned for the
        heads it exports, added to their dK/dV."""
        for t in sorted(t for t, s in self.exports.items() if self.plan.ranks[self.rank].sources[s].producer == i):
            s = self.exports[t]
            n = self.plan.head_sends[t].length
            for r, _, grad in self._grads.pop(t, []):
                self._wait("grads", r)
                if len(grad) < n:  # a copy that imports fewer rows returns fewer
                    grad = torch.cat([grad, grad.new_zeros((n - len(grad),) + self.row_shape)])
                accumulate_source_grad_rows(self.cache, s, grad)

    def finish(self) -> None:
        """The step's messages are complete (their buffers may go)."""
        for phase, peer in list(self._posted):
            self._wait(phase, peer)
        self._keep.clear()
