"""The prefix K/V exchange never hands NCCL's all-to-all an empty split or tensor (R6), and
moves the same rows and gradients (2 ranks over gloo, torchrun; see the script). Before the
fix the recorded splits held zeros (``[0, 0]`` sends from a rank with nothing to send)."""

from __future__ import annotations

import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "kv_exchange_splits.py")


@pytest.mark.slow  # a 2-rank torchrun launch
def test_exchange_with_empty_splits_pads_them(distributed_launches):
    out = distributed_launches("kv-exchange-splits")  # SCRIPT, 2 ranks (one launch with others: conftest.py)
    for pattern in ("one way, nothing kept", "self and one peer", "nothing at all on rank 1", "every split filled"):
        assert out.count(f"OK {pattern}") == 2, out[-3000:]
