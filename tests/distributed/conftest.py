"""The 2-rank torchrun scripts of test_kv_exchange.py, test_kv_exchange_overlap.py and
test_megatron_optimizer.py (and two of test_nccl_emulation.py) share launches (``distributed_launches(case)``: the case's output,
every rank's), started by the first of those tests that needs one.

The two kv_exchange scripts start their process group themselves (``dist.init_process_group``
on torchrun's store, unscoped): a second such start in one launch would read the first one's
connection keys and hang, so each goes to a launch of its own, first in it; the optimizer
cases (``initialize_parallel``: keys scoped by the start's own token) join the first."""

import os

import pytest
from helpers.torchrun import SharedLaunches

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
CASES = {  # id: (script, arguments, the tests that read it: "file::name" or a prefix of it, launch)
    "kv-exchange-splits": ("kv_exchange_splits.py", [],
                           "test_kv_exchange.py::test_exchange_with_empty_splits_pads_them", "a"),
    "kv-exchange-overlap": ("kv_exchange_overlap.py", [],
                            "test_kv_exchange_overlap.py::test_overlapped_exchange_attention_equals_synchronous", "b"),
    "calibration": ("megatron_optimizer_steps.py", ["--case", "calibration"],
                    "test_megatron_optimizer.py::test_megatron_optimizer_over_gloo[calibration-", "a"),
    "param-gather": ("megatron_optimizer_steps.py", ["--case", "param-gather"],
                     "test_megatron_optimizer.py::test_megatron_optimizer_over_gloo[param-gather-", "a"),
    "grad-overlap": ("megatron_optimizer_steps.py", ["--case", "grad-overlap"],
                     "test_megatron_optimizer.py::test_megatron_optimizer_over_gloo[grad-overlap-", "a"),
    "nccl-p2p": ("nccl_p2p_semantics.py", [], "test_nccl_emulation.py::test_the_emulation_catches_", "a"),
    "head-sends-both-ways": ("head_sends_both_ways.py", [], "test_nccl_emulation.py::test_head_sends_", "a"),
}


@pytest.fixture(scope="session")
def distributed_launches(request):
    selected = [f"{item.path.name}::{item.name}" for item in request.session.items
                if os.path.dirname(str(item.path)) == os.path.dirname(os.path.abspath(__file__))]
    shared = SharedLaunches({case for case, (_, _, test, _) in CASES.items()
                             if any(name.startswith(test) for name in selected)})
    for case, (script, args, _, launch) in CASES.items():
        shared.add(case, 2, os.path.join(SCRIPTS, script), lambda args=args: args, group=launch)
    return shared.check
