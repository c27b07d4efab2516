"""The overlapped prefix K/V exchange (all-to-all started asynchronously, the attention over the
local keys computed while it runs, the received rows merged in by log-sum-exp; their gradients
sent back asynchronously from the attention's backward) equals the synchronous exchange: the
same attention output and gradients (2 ranks over gloo, torchrun; see the script)."""

from __future__ import annotations

import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "kv_exchange_overlap.py")
CASES = ("both ways", "one way with a replica", "replicas only", "both ways:float64", "both ways:bfloat16",
         "one way with a replica:no grad", "both ways:dense", "both ways:received first",
         "one way with a replica:query subset")


@pytest.mark.slow  # a 2-rank torchrun launch
def test_overlapped_exchange_attention_equals_synchronous(distributed_launches):
    out = distributed_launches("kv-exchange-overlap")  # SCRIPT, 2 ranks (one launch with others: conftest.py)
    for case in CASES:
        assert out.count(f"OK [{case}]") == 2, (case, out[-3000:])
