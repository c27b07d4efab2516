"""Prefix gradients that readers on other ranks return are sent and summed in fp32, in a bf16
model: the owner's gradient is the exact sum rounded once (4 ranks over gloo, the overlapped
exchange under the blockwise tree attention, in the session's launch pool; see the script)."""

from __future__ import annotations

import os

import pytest
from helpers.torchrun import run_torchrun

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "kv_exchange_fp32_grads.py")


@pytest.mark.slow
def test_returned_prefix_gradients_are_summed_in_fp32():
    out = run_torchrun(SCRIPT, nproc=4)
    assert out.count("OK overlapped") == 4, out[-3000:]
