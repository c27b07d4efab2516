"""A pipeline stage's transfers: the project's links post a send with the next receive, in one
batch, and never synchronise the device; the bubble on CUDA is the time the stage's stream
stood waiting over the step's device time (drained at both ends). Simulated with a fake clock
and a fake device queue (``torch.cuda.synchronize`` advances the clock by the queued work), so
it runs on CPU, deterministically."""

import pytest
import torch
import torch.distributed as dist

from megatron_psrl.engine import pipeline
from megatron_psrl.engine.stage_links import StageLinks

WAIT, COMPUTE, TAIL = 0.05, 0.2, 0.1


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"now": 0.0, "queued": 0.0}

    def synchronize(device=None):
        state["now"] += state["queued"]
        state["queued"] = 0.0

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(pipeline, "_clock", lambda: state["now"])
    return state


class _StreamWaits:
    """A stage's links whose transfers made its stream stand still ``WAIT`` seconds in all (what
    their CUDA events measure); the host never waited."""

    class blocked:
        seconds = WAIT

    def reset(self):
        pass


def test_bubble_fraction_over_the_step_device_time(fake_cuda, monkeypatch):
    state = fake_cuda
    runner = object.__new__(pipeline.PipelineStepRunner)
    runner.device, runner.pp_group, runner.pp_size = torch.device("cuda"), None, 1
    runner.links = _StreamWaits()
    monkeypatch.setattr(pipeline.dist, "all_reduce", lambda t, group=None: t)

    def step():
        # queued on the stream: compute, the wait for a neighbour, the last kernels (still queued
        # when the executor returns: the host ran ahead)
        state["queued"] += COMPUTE + WAIT + TAIL
        return "out"

    assert runner._measure(step) == "out"
    # the step's time runs until its kernels finished; only the neighbour wait is bubble
    assert state["now"] == pytest.approx(COMPUTE + WAIT + TAIL)
    assert runner.last_bubble == pytest.approx(WAIT / (COMPUTE + WAIT + TAIL))


class _Op:
    def __init__(self, op, tensor, peer, group):
        self.kind = "send" if op is dist.isend else "recv"
        self.tensor, self.peer = tensor, peer


@pytest.fixture
def links(monkeypatch):
    """A stage's links between ranks 0 (previous) and 2 (next), the batches it posts recorded."""
    batches = []

    class _Done:
        def wait(self):
            pass

    def batch_isend_irecv(ops):
        batches.append([(op.kind, op.peer, tuple(op.tensor.shape)) for op in ops])
        return [_Done()]

    def no_sync(device=None):
        raise AssertionError("a pipeline transfer synchronised the device")

    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    out = object.__new__(StageLinks)
    out.group, out.device, out.dtype, out.prev_rank, out.next_rank = None, torch.device("cpu"), torch.float32, 0, 2
    out._outbox = []
    out.reset()
    return out, batches


def test_a_send_goes_with_the_next_receive_in_one_batch(links):
    """1F1B's steady state: a forward's output goes with the receive of a backward's gradient
    (megatron's send_forward_recv_backward), and the input's gradient with the next forward's
    input (send_backward_recv_forward): no message of shapes, no device synchronisation."""
    links, batches = links
    links.send_forward(torch.ones(5, 1, 8))
    assert batches == []  # held until the stage's next transfer
    grad = links.recv_backward((5, 1, 8))
    assert grad.shape == (5, 1, 8)
    links.send_backward(torch.ones(7, 1, 8))
    links.recv_forward((3, 1, 8))
    assert batches == [[("send", 2, (5, 1, 8)), ("recv", 2, (5, 1, 8))],
                       [("send", 0, (7, 1, 8)), ("recv", 0, (3, 1, 8))]]
    assert links.messages == 4


def test_a_held_send_goes_alone_when_nothing_is_received(links):
    links, batches = links
    links.flush()
    assert batches == []  # nothing waits: nothing posted
    links.send_forward(torch.ones(2, 1, 8))
    links.flush()
    assert batches == [[("send", 2, (2, 1, 8))]]


def test_the_links_flush_before_other_communication_and_at_the_end(links):
    from megatron_psrl.schedule import instructions as ins

    links, batches = links
    flush = pipeline._LinksFlush(links, before_every_instruction=False)
    links.send_forward(torch.ones(2, 1, 8))
    flush.before(ins.ForwardKeep(1), None)  # a model run receives (or flushes) itself
    flush.before(ins.ReleaseKV((0,)), None)  # local
    assert batches == []
    flush.before(ins.SendHeads(1), None)  # communicates: what waits goes first
    assert batches == [[("send", 2, (2, 1, 8))]]
    links.send_backward(torch.ones(2, 1, 8))
    flush.end(None)
    assert len(batches) == 2
    lockstep = pipeline._LinksFlush(links, before_every_instruction=True)  # expert parallelism
    links.send_forward(torch.ones(2, 1, 8))
    lockstep.before(ins.ForwardKeep(2), None)
    assert len(batches) == 3


def test_a_transfer_posts_its_sends_and_receives_as_one_batch(links):
    """Virtual stages: a Transfer instruction's operations, in its order, one batch, buffers of
    the shapes given (no shape message, no device synchronisation)."""
    links, batches = links
    received = links.transfer([(torch.ones(5, 1, 8), 2), (torch.ones(4, 1, 8), 0)], [((3, 1, 8), 0), ((6, 1, 8), 2)])
    assert [tuple(t.shape) for t in received] == [(3, 1, 8), (6, 1, 8)]
    assert batches == [[("send", 2, (5, 1, 8)), ("send", 0, (4, 1, 8)), ("recv", 0, (3, 1, 8)), ("recv", 2, (6, 1, 8))]]
    assert links.messages == 4
