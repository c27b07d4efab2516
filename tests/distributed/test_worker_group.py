"""How a torchrun worker's rank takes its group's token (megatron_psrl/distributed/worker_group.py)
when torchrun's store still holds a dead group's record: only a live rank 0 answering with the
published token is believed. In this process, on a HashStore and localhost ports; the restart
itself is covered by tests/reliability/test_launch.py."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_psrl.distributed import worker_group
from megatron_psrl.errors import CollectiveTimeoutError

KEY = "/megatron_psrl/group/0"


def _dead_port() -> int:
    """A localhost port nothing listens on (a dead rank 0's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def quick_probe(monkeypatch):
    monkeypatch.setattr(worker_group, "_PROBE_SECONDS", 0.2)


def test_only_a_live_rank_0_with_the_published_token_answers(quick_probe):
    live = worker_group._TokenServer("live-token")
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers (another program)
    try:
        assert worker_group._answers("127.0.0.1", live.port, "live-token")
        assert not worker_group._answers("127.0.0.1", live.port, "dead-token")  # the port, reused
        assert not worker_group._answers("127.0.0.1", _dead_port(), "dead-token")
        started = time.monotonic()
        assert not worker_group._answers("127.0.0.1", silent.getsockname()[1], "dead-token")
        assert time.monotonic() - started < 5  # bounded by the probe's timeout
    finally:
        live.close()
        silent.close()


def test_a_dead_groups_record_is_read_again_until_rank_0_replaces_it(quick_probe):
    store = dist.HashStore()
    store.set(KEY, f"127.0.0.1 {_dead_port()} dead-token")
    live = worker_group._TokenServer("live-token")

    def publish_late():  # this group's rank 0, slower to start than its peer
        time.sleep(0.5)
        store.set(KEY, f"127.0.0.1 {live.port} live-token")

    publisher = threading.Thread(target=publish_late)
    publisher.start()
    try:
        assert worker_group._confirmed_token(store, KEY, timedelta(seconds=30)) == "live-token"
    finally:
        publisher.join()
        live.close()
    # closed (its group ended): the record is dead from now on
    assert not worker_group._answers("127.0.0.1", live.port, "live-token")


def test_a_group_whose_rank_0_never_comes_ends_in_one_line(quick_probe, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    store = dist.HashStore()
    store.set(KEY, f"127.0.0.1 {_dead_port()} dead-token")
    with pytest.raises(CollectiveTimeoutError) as failure:
        worker_group._confirmed_token(store, KEY, timedelta(seconds=1))
    message = str(failure.value)
    assert "\n" not in message and message.startswith("rank 0 of this worker group did not come up"), message
    assert "127.0.0.1:29555" in message
