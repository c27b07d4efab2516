"""The pipeline's transfers under NCCL's rules, for every stage count and micro-batch count:
each stage's 1F1B stream (``one_f_one_b``) driven through real :class:`StageLinks` as the
runner drives them (a model run receives, or posts what waits, then holds its send), the
batches recorded, then played against NCCL's point-to-point semantics: between two ranks the
n-th send is the n-th receive, a send completes only when its receive is posted (a rendezvous),
and a rank posts its next batch only when every operation of the current one has completed.
The step must finish (no rank waits forever) and every message must meet its own receive.

Posting each send alone, right after its run (as a plain send would), hangs already at two
stages and two micro-batches: the planted case checks the simulation catches that.

Virtual stages (several model chunks per rank): each stage's interleaved stream
(``interleaved_1f1b``) run by a stand-in of the executor, its :class:`Transfer` instructions
through :meth:`StageLinks.transfer`, then played the same way, for 2 to 4 stages, 2 and 3
chunks and 1 to ``3 x stages`` micro-batches. The same order with 1F1B's rule (a send held for
the stage's next receive) hangs: the second planted case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_psrl.engine.stage_links import StageLinks
from megatron_psrl.schedule import instructions as ins
from megatron_psrl.schedule.interleaved import interleaved_1f1b


class _Op:
    def __init__(self, op, tensor, peer, group):
        self.kind = "send" if op is dist.isend else "recv"
        self.tensor, self.peer = tensor, peer


class _Done:
    def wait(self):
        pass


def _recording(monkeypatch):
    """``(posted, current)``: every batch the links post goes to ``posted[current["rank"]]`` as
    ``[(kind, peer, message)]``, a send's message its tensor's value, a receive's the next of
    ``current["expect"]`` (what it must get)."""
    posted, current = {}, {}

    def batch_isend_irecv(ops):
        expect = iter(current.get("expect", ()))  # (a batch of sends only receives nothing)
        posted[current["rank"]].append([(op.kind, op.peer, op.tensor.flatten()[0].item() if op.kind == "send"
                                         else next(expect)) for op in ops])
        return [_Done()]

    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    return posted, current


def _links(rank: int, stages: int) -> StageLinks:
    links = object.__new__(StageLinks)
    links.group, links.device, links.dtype = None, torch.device("cpu"), torch.float32
    links.prev_rank, links.next_rank, links._outbox = (rank - 1) % stages, (rank + 1) % stages, []
    links.reset()
    return links


def _recorded_batches(monkeypatch, stages: int, micro_batches: int, hold_sends: bool = True):
    """Per rank, the batches its links post over a 1F1B step: ``[(kind, peer, message)]``."""
    posted, current = _recording(monkeypatch)
    steps = [ins.LoweredStep(i, (ins.ForwardBackward(i),)) for i in range(micro_batches)]
    for rank in range(stages):
        current["rank"], posted[rank] = rank, []
        links = _links(rank, stages)
        first, last = rank == 0, rank == stages - 1
        for x in ins.flatten(ins.one_f_one_b(steps, rank, stages)):
            i = x.micro_batch
            forward = isinstance(x, ins.ForwardKeep)
            # the message's identity travels as its value: 2i for an activation, 2i + 1 for its gradient
            receives = not first if forward else not last
            if receives:
                current["expect"] = [2.0 * i + (0 if forward else 1)]  # what the receive must get
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


def _message_id(micro_batch: int, boundary: int, gradient: bool) -> float:
    """A message's identity, sent as its value."""
    return float((micro_batch * 100 + boundary) * 2 + gradient)


def _interleaved_batches(monkeypatch, stages: int, chunks: int, micro_batches: int):
    """Per rank, the batches its links post over an interleaved step, its stream run by a
    stand-in of the executor that checks what the executor needs: a forward's input and a
    backward's output gradient received (and its own forward run) before the run, and a
    transfer sending only what its runs made; at the end nothing left over."""
    posted, current = _recording(monkeypatch)
    steps = [ins.LoweredStep(i, (ins.ForwardBackward(i),)) for i in range(micro_batches)]
    parts = stages * chunks
    for rank in range(stages):
        current["rank"], posted[rank] = rank, []
        links = _links(rank, stages)
        made, inbox, forwarded, ran = set(), set(), set(), []
        for x in interleaved_1f1b(steps, rank, stages, chunks):
            if isinstance(x, ins.Transfer):
                for m in x.sends:  # (micro-batch, the sender's chunk, gradient): what the executor looks up
                    made.remove((m.micro_batch, m.sender_chunk(stages), m.gradient))
                current["expect"] = [_message_id(m.micro_batch, m.boundary, m.gradient) for m in x.receives]
                peers = {False: links.next_rank, True: links.prev_rank}  # a send's direction, a receive's source
                links.transfer([(torch.full((1,), _message_id(m.micro_batch, m.boundary, m.gradient)), peers[m.gradient])
                                for m in x.sends], [((1,), peers[not m.gradient]) for m in x.receives])
                inbox.update((m.micro_batch, m.receiver_chunk(stages), m.gradient) for m in x.receives)
                continue
            i, v, backward = x.micro_batch, x.chunk, isinstance(x, ins.Backward)
            part = v * stages + rank
            if backward:
                forwarded.remove((i, v))
                if part + 1 < parts:
                    inbox.remove((i, v, True))
                if part > 0:
                    made.add((i, v, True))
            else:
                forwarded.add((i, v))
                if part > 0:
                    inbox.remove((i, v, False))
                if part + 1 < parts:
                    made.add((i, v, False))
            ran.append((backward, i, v))
        assert not (made or inbox or forwarded), (made, inbox, forwarded)
        assert sorted(ran) == sorted((b, i, v) for b in (False, True) for i in range(micro_batches)
                                     for v in range(chunks))
    return posted


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_interleaved_transfers_finish_under_nccl_rules(monkeypatch, stages, chunks):
    for micro_batches in range(1, 3 * stages + 1):
        posted = _interleaved_batches(monkeypatch, stages, chunks, micro_batches)
        assert _finishes_under_nccl_rules(posted), (stages, chunks, micro_batches)
        sends = sorted(m for plan in posted.values() for batch in plan for kind, _, m in batch if kind == "send")
        boundaries = range(stages * chunks - 1)
        assert sends == sorted(_message_id(i, b, g) for i in range(micro_batches) for b in boundaries
                               for g in (False, True))


def test_interleaved_steady_state_batches_four_operations(monkeypatch):
    """With at least as many micro-batches as stages: megatron's pairing, a forward's output and
    a backward's input gradient sent, the next two runs' inputs received, in one batch."""
    posted = _interleaved_batches(monkeypatch, 3, 2, 6)
    assert max(len(batch) for batch in posted[1]) == 4
    assert [kind for kind, _, _ in max(posted[1], key=len)] == ["send", "send", "recv", "recv"]


def _interleaved_with_outbox(monkeypatch, stages: int, chunks: int, micro_batches: int):
    """The interleaved order's model runs with 1F1B's rule instead of its transfers: a run
    receives its input (with the held sends) or posts what waits, then holds its own send."""
    posted, current = _recording(monkeypatch)
    steps = [ins.LoweredStep(i, (ins.ForwardBackward(i),)) for i in range(micro_batches)]
    parts = stages * chunks
    for rank in range(stages):
        current["rank"], posted[rank] = rank, []
        links = _links(rank, stages)
        for x in interleaved_1f1b(steps, rank, stages, chunks):
            if isinstance(x, ins.Transfer):
                continue
            i, part, backward = x.micro_batch, x.chunk * stages + rank, isinstance(x, ins.Backward)
            source = part + 1 if backward else part - 1
            if 0 <= source < parts:
                current["expect"] = [_message_id(i, min(part, source), backward)]
                (links.recv_backward if backward else links.recv_forward)((1,))
            else:
                links.flush()
            target = part - 1 if backward else part + 1
            if 0 <= target < parts:
                (links.send_backward if backward else links.send_forward)(
                    torch.full((1,), _message_id(i, min(part, target), backward)))
        links.flush()
    return posted


def test_the_outbox_rule_hangs_on_the_interleaved_order(monkeypatch):
    """The planted case: 1F1B's pairing on the interleaved order (why its transfers are instructions)."""
    assert not _finishes_under_nccl_rules(_interleaved_with_outbox(monkeypatch, 3, 2, 6))
