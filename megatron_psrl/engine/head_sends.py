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
   whether it imports the copy's head (posting the receive of the head if it does), and every
   home posts the receives of those flags;
2. after its forward, the exported source goes to every rank that said yes (the first
   ``length`` rows of the head for a copy that imports fewer), and the home posts the receives
   of their gradients; an import micro-batch waits for its heads and writes them into its
   sources in the KV cache;
3. an import micro-batch's backward (after all its readers') sends the fp32 dK/dV of the whole
   head back; the exported source's backward (the last of its rank's schedule) waits for them.

Every send precedes every wait that could depend on it: flags go first, exported heads run
forward before any import on their rank and backward after every import's backward (the plan
checks it), so no rank waits for one that waits for it. Between a pair of ranks the messages
of each phase are posted in transfer order on both sides, and the phases follow each other, so
they also match where tags do not count (NCCL). The forward-only passes (log-probs) run phases
1 and 2.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_psrl.kvcache.manager import BlockKVCache
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
        self.row_shape = (geometry.num_layers, 2, geometry.num_groups, geometry.head_dim)
        g = plan.config.exchange_group_size
        my_group = rank // g
        self.entry_id: Dict[Tuple[int, int], int] = {}
        for t, transfer in enumerate(plan.head_sends):
            for j in range(len(transfer.imports)):
                self.entry_id[(t, j)] = len(self.entry_id)
        self.imports: Dict[Tuple[int, int], List[int]] = {}  # (transfer, import) -> sources it fills
        self.exports: Dict[int, int] = {}  # transfer -> the exported source
        for s, src in rank_plan.sources.items():
            if src.imported is not None:
                self.imports.setdefault(src.imported, []).append(s)
            if src.exported is not None:
                self.exports[src.exported] = s
        self._sends: List = []
        self._heads: Dict[Tuple[int, int], Tuple[Tensor, object]] = {}  # received K/V and their work
        self._flags: Dict[int, List[Tuple[int, int, Tensor, object]]] = {}  # transfer -> (rank, import, flag, work)
        self._grads: Dict[int, List[Tuple[int, Tensor, object]]] = {}  # transfer -> (import length, grad, work)
        device = geometry.device
        # Phase 1: flags (sends, then the home's receives), then the receives of the heads.
        for (t, j), e in self.entry_id.items():
            transfer = self.plan.head_sends[t]
            if transfer.imports[j].group != my_group or transfer.home_rank == rank:
                continue
            wanted = (t, j) in self.imports
            self._send(torch.tensor([int(wanted)], dtype=torch.int64, device=device), transfer.home_rank, e, _FLAG)
        for t in sorted(self.exports):
            for j, h in enumerate(plan.head_sends[t].imports):
                for r in range(h.group * g, h.group * g + g):
                    if r != rank:
                        flag = torch.zeros(1, dtype=torch.int64, device=device)
                        work = self._recv(flag, r, self.entry_id[(t, j)], _FLAG)
                        self._flags.setdefault(t, []).append((r, j, flag, work))
        for t, j in sorted(self.imports):
            transfer = plan.head_sends[t]
            buf = torch.empty((transfer.imports[j].length,) + self.row_shape, dtype=geometry.dtype, device=device)
            self._heads[(t, j)] = (buf, self._recv(buf, transfer.home_rank, self.entry_id[(t, j)], _KV))

    # ------------------------------------------------------------------ point to point
    def _tag(self, entry: int, kind: int) -> int:
        return 3 * entry + kind

    def _send(self, tensor: Tensor, dst: int, entry: int, kind: int):
        work = dist.isend(tensor, dist.get_global_rank(self.group, dst), group=self.group, tag=self._tag(entry, kind))
        self._sends.append((tensor, work))  # (the tensor lives until the send is done)
        return work

    def _recv(self, tensor: Tensor, src: int, entry: int, kind: int):
        return dist.irecv(tensor, dist.get_global_rank(self.group, src), group=self.group, tag=self._tag(entry, kind))

    # ------------------------------------------------------------------ phase 2
    def _stacked(self, s: int, grads: bool) -> Tensor:
        """``[n, layers, 2, ng, hn]``: a source's K/V (or fp32 dK/dV) of every layer of this rank."""
        read = self.cache.read_grad if grads else (lambda s, layer: self.cache.read(s, layer, count=False))
        return torch.stack([torch.stack(read(s, layer), dim=1) for layer in self.cache.geometry.layers], dim=1)

    def after_forward(self, i: int) -> None:
        """Micro-batch ``i`` ran forward: send the heads it exports to every rank that asked,
        and (training) post the receives of their gradients (the sent rows are a copy: the
        step's next instruction releases the source's K/V)."""
        for t in sorted(t for t, s in self.exports.items() if self.plan.ranks[self.rank].sources[s].producer == i):
            s = self.exports[t]
            rows = self._stacked(s, grads=False).contiguous()
            for r, j, flag, work in self._flags.get(t, []):
                work.wait()
                if not int(flag.item()):
                    continue
                length = self.plan.head_sends[t].imports[j].length
                self._send(rows[:length], r, self.entry_id[(t, j)], _KV)
                if self.with_grads:
                    grad = torch.empty((length,) + self.row_shape, dtype=torch.float32, device=rows.device)
                    self._grads.setdefault(t, []).append(
                        (length, grad, self._recv(grad, r, self.entry_id[(t, j)], _GRAD)))

    def receive(self, i: int) -> None:
        """The import micro-batch ``i``: wait for its heads and write them into its sources
        (allocated already); a source's rows are its tokens' positions in the head."""
        index = self.plan.index
        for (t, j), sources in sorted(self.imports.items()):
            if self.plan.ranks[self.rank].sources[sources[0]].producer != i:
                continue
            buf, work = self._heads.pop((t, j))
            work.wait()
            for s in sources:
                rows = torch.as_tensor(index.position[self.plan.ranks[self.rank].sources[s].tokens], device=buf.device)
                chunk = buf.index_select(0, rows)
                for li, layer in enumerate(self.cache.geometry.layers):
                    self.cache.write(s, layer, chunk[:, li, 0], chunk[:, li, 1])

    # ------------------------------------------------------------------ phase 3
    def return_grads(self, i: int) -> None:
        """The backward of the import micro-batch ``i`` (after all its readers'): every head's
        accumulated dK/dV go back to its home, fp32, zero where no reader attended."""
        rank_plan = self.plan.ranks[self.rank]
        for (t, j), sources in sorted(self.imports.items()):
            if rank_plan.sources[sources[0]].producer != i:
                continue
            transfer = self.plan.head_sends[t]
            grad = torch.zeros((transfer.imports[j].length,) + self.row_shape, dtype=torch.float32,
                               device=self.cache.geometry.device)
            for s in sources:
                rows = torch.as_tensor(self.plan.index.position[rank_plan.sources[s].tokens], device=grad.device)
                grad.index_copy_(0, rows, self._stacked(s, grads=True))
            self._send(grad, transfer.home_rank, self.entry_id[(t, j)], _GRAD)

    def collect_grads(self, i: int) -> None:
        """Before the backward of micro-batch ``i``: the gradients every importer returned for the
        heads it exports, added to their dK/dV."""
        layers = self.cache.geometry.layers
        for t in sorted(t for t, s in self.exports.items() if self.plan.ranks[self.rank].sources[s].producer == i):
            s = self.exports[t]
            n = self.plan.head_sends[t].length
            for length, grad, work in self._grads.pop(t, []):
                work.wait()
                if length < n:  # a copy that imports fewer rows returns fewer
                    grad = torch.cat([grad, grad.new_zeros((n - length,) + self.row_shape)])
                for li, layer in enumerate(layers):
                    self.cache.accumulate_grad(s, layer, grad[:, li, 0], grad[:, li, 1])

    def finish(self) -> None:
        """The step's sends are complete (their buffers may go)."""
        for _, work in self._sends:
            work.wait()
        self._sends.clear()

