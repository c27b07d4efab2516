"""Point-to-point programs run on plain gloo and under the NCCL emulation (``PSRL_EMULATE_NCCL=1``,
megatron_psrl/distributed/nccl_emulation.py), 2 ranks; each prints ``<program> <mode>: <result>``.

- ``crossed``: each rank posts its receive from the other ahead of its own send. gloo runs both
  at once and passes; under NCCL each rank's receive blocks the pair's stream ahead of its send:
  the emulation ends it with a timeout naming the receive.
- ``grouped``: the same operations posted as one group (``batch_isend_irecv``): passes both ways.
- ``coalesced``: the same operations inside a coalescing manager: passes both ways.
- ``tags``: rank 0 sends two messages with tags 1 and 2, rank 1 receives tag 2 first. gloo
  matches by tag; under NCCL tags do not count and the first receive gets the first message.

    torchrun --nproc_per_node 2 nccl_p2p_semantics.py
"""

import os

import torch
import torch.distributed as dist

from megatron_psrl.distributed import nccl_emulation
from megatron_psrl.distributed.setup import initialize_parallel, shutdown_parallel
from megatron_psrl.errors import CollectiveTimeoutError

os.environ[nccl_emulation.TIMEOUT_ENV] = "3"  # a hang is reported after 3 s
layout = initialize_parallel(1, 1, seed=0, device="cpu", timeout_minutes=1)
rank, peer = layout.rank, 1 - layout.rank


def crossed(group):
    got = torch.zeros(2)
    recv = dist.irecv(got, peer, group=group)
    send = dist.isend(torch.full((2,), float(rank)), peer, group=group)
    recv.wait()
    send.wait()
    return f"received {got.tolist()}"


def grouped(group):
    got = torch.zeros(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer, group),
                                    dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer, group)])
    for work in works:
        work.wait()
    return f"received {got.tolist()} ({len(works)} requests)"


def coalesced(group):
    got = torch.zeros(2)
    with dist._coalescing_manager(group, async_ops=True) as cm:
        works = [dist.irecv(got, peer, group=group), dist.isend(torch.full((2,), float(rank)), peer, group=group)]
    cm.wait()  # (gloo: the operations' own requests; emulated: the group's)
    for work in works:
        work.wait()
    return f"received {got.tolist()}"


def tags(group):
    if rank == 0:
        dist.send(torch.tensor([1.0]), 1, group=group, tag=1)
        dist.send(torch.tensor([2.0]), 1, group=group, tag=2)
        return "sent"
    second, first = torch.zeros(1), torch.zeros(1)
    w2 = dist.irecv(second, 0, group=group, tag=2)
    w1 = dist.irecv(first, 0, group=group, tag=1)
    w2.wait()
    w1.wait()
    return f"tag-2 receive got {second.item():g}"


for mode in ("gloo", "emulated"):
    os.environ[nccl_emulation.EMULATE_ENV] = "1" if mode == "emulated" else "0"
    if mode == "emulated":
        assert nccl_emulation.install(3.0)
    for program in (crossed, grouped, coalesced, tags):
        group = dist.new_group([0, 1])  # a group of its own: a hung program leaves its pair stream blocked
        try:
            result = program(group)
        except CollectiveTimeoutError as exc:
            result = f"timeout: {exc}"
        print(f"{program.__name__} {mode}: {result}", flush=True)
        dist.barrier()
nccl_emulation.uninstall()
shutdown_parallel()
