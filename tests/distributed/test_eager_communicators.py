"""On CUDA the default process group is bound to the rank's GPU (``device_id``), so NCCL makes
every communicator eagerly; ``initialize_parallel`` also runs one collective per group at
start-up (here checked without a GPU: the arguments it passes, and the groups it warms)."""

import torch
import torch.distributed as dist

from megatron_psrl.distributed import setup


def test_the_cuda_process_group_is_bound_to_its_device(monkeypatch):
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    setup._init_process_group(torch.device("cuda", 3), 1.0)
    assert seen["device_id"] == torch.device("cuda", 3) and seen["backend"] == "cpu:gloo,cuda:nccl"
    seen.clear()
    setup._init_process_group(torch.device("cpu"), 1.0)
    assert "device_id" not in seen and seen["backend"] == "gloo"


def test_warm_up_runs_one_collective_per_group_in_a_shared_order(monkeypatch):
    groups = [object(), object(), object()]
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append((group, tuple(t.shape))))
    setup.warm_up_groups(torch.device("cpu"), groups)
    assert calls == [(g, (1,)) for g in groups]


def test_blocked_time_is_the_hosts_wait_on_gloo_and_the_streams_on_cuda():
    """``ExchangeInFlight``'s exposed-time reading: on CUDA ``work.wait()`` returns at once (the
    stream waits, not the host), so a host clock around it would read nothing; CUDA events time
    the stream's stall instead. On the host clock here."""
    import time

    from megatron_psrl.distributed.kv_exchange import BlockedTime

    blocked = BlockedTime(torch.device("cpu"))
    with blocked:
        time.sleep(0.05)
    assert not blocked.cuda and 0.05 <= blocked.seconds < 1.0
    assert BlockedTime(torch.device("cuda", 0)).cuda  # (events, read with a synchronize: benchmarks only)
