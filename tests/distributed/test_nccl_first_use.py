"""NCCL creates a group's communicator at its first operation, by all members together: a rank
whose first operation on a group waits behind a member busy elsewhere hangs there. The
emulation (``PSRL_EMULATE_NCCL=1``) catches that first-step deadlock, planted in the script; a
group warmed up as ``initialize_parallel`` warms megatron's passes; and start-up itself passes
under the rule (4 ranks over gloo, in the session's launch pool)."""

from __future__ import annotations

import os

import pytest
from helpers.torchrun import run_torchrun

from megatron_psrl.distributed.nccl_emulation import EMULATE_ENV

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "nccl_first_use.py")


@pytest.mark.slow
def test_the_emulation_catches_a_lazy_communicator_deadlock_and_warm_groups_pass():
    out = run_torchrun(SCRIPT, nproc=4, env={EMULATE_ENV: "1"})
    for rank in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"rank {rank} lazy: "))
        assert "timeout: NCCL emulation" in line and "first operation on group" in line, out[-3000:]
        assert f"rank {rank}'s first operation" in line and "waited 3 s for the group's 1 other members" in line, line
        assert f"rank {rank} warmed: received [{'7.0, 7.0' if rank == 1 else '0.0, 0.0'}]" in out, out[-3000:]
    for rank in (2, 3):
        assert f"rank {rank} lazy: barrier" in out and f"rank {rank} warmed: barrier" in out, out[-3000:]
