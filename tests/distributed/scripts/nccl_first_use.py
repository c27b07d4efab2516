"""NCCL's lazy communicators under the emulation (``PSRL_EMULATE_NCCL=1``), 4 ranks over gloo.

A group made after start-up (ranks 0, 1, 2) is first used by ranks 0 and 1 (a send and a
receive between them) while rank 2 first waits in a barrier of every rank, which ranks 0 and 1
reach only after their send: under NCCL the group's communicator is made at its first operation
by all its members together, so ranks 0 and 1 hang there and rank 2 in the barrier. The
emulation ends ranks 0 and 1 with a timeout naming the group (``lazy: timeout: ...``). The same
program on a group warmed up the way ``initialize_parallel`` warms megatron's groups (one
collective on it by every member first) passes (``warmed: received ...``). Start-up itself ran
under the rule: every megatron group was warmed before any other operation.

    PSRL_EMULATE_NCCL=1 torchrun --nproc_per_node 4 nccl_first_use.py
"""

import os

import torch
import torch.distributed as dist

from megatron_psrl.distributed import nccl_emulation
from megatron_psrl.distributed.setup import initialize_parallel, shutdown_parallel, warm_up_groups
from megatron_psrl.errors import CollectiveTimeoutError

assert nccl_emulation.enabled(), "run with PSRL_EMULATE_NCCL=1"
os.environ[nccl_emulation.TIMEOUT_ENV] = "3"  # a hang is reported after 3 s
layout = initialize_parallel(1, 1, seed=0, device="cpu", timeout_minutes=1)
rank = layout.rank
assert layout.world_size == 4


def program(group) -> str:
    if rank in (0, 1):
        try:
            got = torch.zeros(2)
            if rank == 0:
                dist.send(torch.full((2,), 7.0), 1, group=group)
            else:
                dist.recv(got, 0, group=group)
            result = f"received {got.tolist()}"
        except CollectiveTimeoutError as exc:
            result = f"timeout: {exc}"
        dist.barrier()
        return result
    dist.barrier()  # rank 2 (a member) waits here first; rank 3 is no member
    return "barrier"


lazy = dist.new_group([0, 1, 2])
print(f"rank {rank} lazy: {program(lazy)}", flush=True)
warmed = dist.new_group([0, 1, 2])
warm_up_groups(layout.device, [warmed])
print(f"rank {rank} warmed: {program(warmed)}", flush=True)
dist.barrier()
shutdown_parallel()
