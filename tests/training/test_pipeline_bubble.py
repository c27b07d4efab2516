"""The pipeline bubble on CUDA counts waits, not compute. CUDA kernels are queued
asynchronously and megatron's p2p calls synchronise the device, so a timer around a transfer
also ran while the stage's own queued kernels finished. Simulated here with a fake clock and a
fake device queue (``torch.cuda.synchronize`` advances the clock by the queued compute), so it
runs on CPU, deterministically."""

import pytest
import torch

from megatron_psrl.engine import pipeline

WAIT, COMPUTE, TAIL = 0.05, 0.2, 0.1


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"now": 0.0, "queued": 0.0}

    def synchronize(device=None):
        state["now"] += state["queued"]
        state["queued"] = 0.0

    def communicate(self, *args, **kwargs):  # megatron's: synchronise, then wait for the neighbour
        torch.cuda.synchronize()
        state["now"] += WAIT

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(pipeline, "_clock", lambda: state["now"])
    monkeypatch.setattr(pipeline.P2PCommunicator, "_communicate", communicate)
    p2p = object.__new__(pipeline._TimedP2P)
    p2p.device, p2p.wait_s = torch.device("cuda"), 0.0
    return state, p2p


def test_transfer_time_excludes_the_stage_queued_compute(fake_cuda):
    state, p2p = fake_cuda
    for _ in range(4):
        state["queued"] += COMPUTE  # a micro-batch's kernels, launched
        p2p._communicate()
    assert p2p.wait_s == pytest.approx(4 * WAIT)
    assert state["now"] == pytest.approx(4 * (COMPUTE + WAIT))  # the compute did happen


def test_bubble_fraction_over_the_step_device_time(fake_cuda, monkeypatch):
    state, p2p = fake_cuda
    runner = object.__new__(pipeline.PipelineStepRunner)
    runner.p2p, runner.device, runner.pp_group, runner.pp_size = p2p, torch.device("cuda"), None, 1
    monkeypatch.setattr(pipeline.dist, "all_reduce", lambda t, group=None: t)

    def step():
        state["queued"] += COMPUTE
        p2p._communicate()
        state["queued"] += TAIL  # the last kernels, still queued when the executor returns
        return "out"

    assert runner._measure(step) == "out"
    # the step's time runs until its kernels finished; only the neighbour wait is bubble
    assert runner.last_bubble == pytest.approx(WAIT / (COMPUTE + WAIT + TAIL))
