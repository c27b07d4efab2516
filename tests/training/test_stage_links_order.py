"""The pipeline's transfers under NCCL's rules, for every stage count and micro-batch count:
each stage's 1F1B stream (``one_f_one_b``) driven through real :class:`StageLinks` as the
runner drives them (a model run receives, or posts what waits, then holds its send), the
batches recorded, then played against NCCL's point-to-point semantics: between two ranks the
n-th send is the n-th receive, a send completes only when its receive is posted (a rendezvous),
and a rank posts its next batch only when every operation of the current one has completed.
The step must finish (no rank waits forever) and every message must meet its own receive.

Posting each send alone, right after its run (as a plain send would), hangs already at two
stages and two micro-batches: the planted case checks the simulation catches that."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_psrl.engine.stage_links import StageLinks
from megatron_psrl.schedule import instructions as ins


class _Op:
    def __init__(self, op, tensor, peer, group):
        self.kind = "send" if op is dist.isend else "recv"
        self.tensor, self.peer = tensor, peer


def _recorded_batches(monkeypatch, stages: int, micro_batches: int, hold_sends: bool = True):
    """Per rank, the batches its links post over a 1F1B step: ``[(kind, peer, message)]``."""
    posted = {}
    current = {}

    class _Done:
        def wait(self):
            pass

    def batch_isend_irecv(ops):
        posted[current["rank"]].append([(op.kind, op.peer, op.tensor.flatten()[0].item() if op.kind == "send"
                                         else current["expect"]) for op in ops])
        return [_Done()]

    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    steps = [ins.LoweredStep(i, (ins.ForwardBackward(i),)) for i in range(micro_batches)]
    for rank in range(stages):
        current["rank"], posted[rank] = rank, []
        links = object.__new__(StageLinks)
        links.group, links.device, links.dtype = None, torch.device("cpu"), torch.float32
        links.prev_rank, links.next_rank, links._outbox = rank - 1, rank + 1, []
        links.reset()
        first, last = rank == 0, rank == stages - 1
        for x in ins.flatten(ins.one_f_one_b(steps, rank, stages)):
            i = x.micro_batch
            forward = isinstance(x, ins.ForwardKeep)
            # the message's identity travels as its value: 2i for an activation, 2i + 1 for its gradient
            receives = not first if forward else not last
            if receives:
                current["expect"] = 2.0 * i + (0 if forward else 1)  # what the receive must get
                (links.recv_forward if forward else links.recv_backward)((1,))
            else:
                links.flush()  # as the runner does before a run that receives nothing
            if forward and not last:
                links.send_forward(torch.full((1,), 2.0 * i))
            elif not forward and not first:
                links.send_backward(torch.full((1,), 2.0 * i + 1))
            if not hold_sends:
                links.flush()
        links.flush()
    return posted


def _finishes_under_nccl_rules(posted) -> bool:
    """Play the batches: True when every rank completes all of them (see the module docstring);
    a message meeting another's receive fails the test."""
    sent, received, batches = {}, {}, {}
    for rank, plan in posted.items():
        tagged = []
        for batch in plan:
            ops = []
            for kind, peer, message in batch:
                count = sent if kind == "send" else received
                key = (rank, peer) if kind == "send" else (peer, rank)
                n = count.get(key, 0)
                count[key] = n + 1
                ops.append((kind, key, n, message))
            tagged.append(ops)
        batches[rank] = tagged
    position = {r: 0 for r in batches}
    waiting = {r: set(range(len(b[0]))) if b else set() for r, b in batches.items()}
    while any(position[r] < len(batches[r]) for r in batches):
        progress = False
        for r in batches:
            for k in list(waiting[r]):
                kind, key, n, message = batches[r][position[r]][k]
                peer = key[1] if kind == "send" else key[0]
                if position[peer] >= len(batches[peer]):
                    continue
                for j in list(waiting[peer]):
                    kind2, key2, n2, message2 = batches[peer][position[peer]][j]
                    if kind2 != kind and key2 == key and n2 == n:
                        assert message2 == message, f"message {message} met the receive of {message2}"
                        waiting[r].discard(k)
                        waiting[peer].discard(j)
                        progress = True
                        break
        for r in batches:
            while position[r] < len(batches[r]) and not waiting[r]:
                position[r] += 1
                progress = True
                if position[r] < len(batches[r]):
                    waiting[r] = set(range(len(batches[r][position[r]])))
        if not progress:
            return False
    return True


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_1f1b_transfers_finish_under_nccl_rules(monkeypatch, stages):
    for micro_batches in range(1, 3 * stages + 1):
        posted = _recorded_batches(monkeypatch, stages, micro_batches)
        assert _finishes_under_nccl_rules(posted), (stages, micro_batches)
        # every activation and gradient went exactly once
        sends = sorted(m for plan in posted.values() for batch in plan for kind, _, m in batch if kind == "send")
        assert sends == sorted([2.0 * i for i in range(micro_batches)] * (stages - 1)
                               + [2.0 * i + 1 for i in range(micro_batches)] * (stages - 1))


def test_sends_posted_alone_hang_under_nccl_rules(monkeypatch):
    """The planted case: each send posted on its own right after its run (no outbox)."""
    assert not _finishes_under_nccl_rules(_recorded_batches(monkeypatch, 2, 2, hold_sends=False))
