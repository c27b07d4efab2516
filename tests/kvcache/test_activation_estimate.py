"""The activation estimate the KV cache manager charges for a kept graph, on every tiny config:
an exact count of the tensors autograd saves, and an upper bound of the heap bytes a forward
pass keeps alive.

The heap figure is measured in a fresh process per config (tests/kvcache/scripts): it is
process-wide, so another test's leftovers would move it.
"""

import json
import os

import pytest
from helpers.launch_pool import run_python
from helpers.torchrun import script_env

from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.tiny import TINY_CONFIGS, tiny_config
from megatron_psrl.schedule.memory import (
    ALLOCATOR_MARGIN,
    activation_bytes_per_token,
    saved_activation_bytes_per_token,
)

pytestmark = pytest.mark.slow  # measurements in fresh processes

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "measure_activations.py")


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def measured(request):
    proc = run_python(SCRIPT, [request.param], env=script_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ModelArchitecture.from_hf_config(tiny_config(request.param)), json.loads(proc.stdout.splitlines()[-1])


def test_count_is_what_autograd_saves(measured):
    """A count, not a measurement: the same on every machine (both dtypes, both sharing modes)."""
    arch, rows = measured
    for key, row in rows.items():
        dtype_bytes = 4 if key.endswith("float32") else 2
        assert row["saved"] == saved_activation_bytes_per_token(arch, 1, dtype_bytes), (key, row)


def test_estimate_bounds_the_heap_a_forward_keeps(measured):
    """Held heap bytes per token (after a warm-up of the same size, which fills the BLAS
    library's per-process buffer pool) are at most the estimate; the estimate is no looser than
    the allocator margin plus 15% (what the graph's output and rounding add at 1,024 tokens)."""
    arch, rows = measured
    estimate = activation_bytes_per_token(arch, 1, 4)
    for key, row in rows.items():
        if "held" in row:
            assert row["held"] <= estimate <= (ALLOCATOR_MARGIN + 0.15) * row["held"], (key, row, estimate)
