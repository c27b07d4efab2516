"""benchmarks/bench_hybrid.py's cached-bytes table: what it prints holds (the bytes the cache
allocates are the spec's, a hybrid's prefix costs a fixed state plus its softmax layers' K/V,
the break-even length separates the two regimes)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_hybrid  # noqa: E402

from megatron_psrl.kvcache import KVGeometry  # noqa: E402
from megatron_psrl.model.architecture import ModelArchitecture  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402


@pytest.mark.parametrize("name", ["debug-qwen3.5-text", "qwen3.5-27b-class"])
def test_cached_bytes_are_a_fixed_state_plus_the_softmax_layers_rows(name):
    config = tiny_config(name)
    arch = ModelArchitecture.from_hf_config(config)
    geometry = KVGeometry.for_model(arch, 1, 1, torch.bfloat16, torch.device("meta"))
    linear, softmax = len(arch.linear_attention_layers), arch.num_layers - len(arch.linear_attention_layers)
    twin = bench_hybrid.softmax_twin(config)
    for length in (1024, 4096):  # whole blocks: no rounding
        hybrid = bench_hybrid.cached_prefix_bytes(config, length)
        assert hybrid == geometry.read_bytes(length)
        full = bench_hybrid.cached_prefix_bytes(twin, length)
        assert hybrid - geometry.fixed_bytes_per_source == full * softmax // (linear + softmax)
    state = geometry.fixed_bytes_per_source  # the same whatever the length
    assert bench_hybrid.cached_prefix_bytes(config, 8192) - bench_hybrid.cached_prefix_bytes(config, 4096) \
        == (bench_hybrid.cached_prefix_bytes(twin, 8192) - bench_hybrid.cached_prefix_bytes(twin, 4096)) \
        * softmax // (linear + softmax)
    assert state > 0


def test_the_break_even_length_separates_the_regimes():
    config = tiny_config("qwen3.5-27b-class")
    twin = bench_hybrid.softmax_twin(config)
    at = bench_hybrid.break_even_length(config)
    assert 256 < at < 2048  # the printed table's rows on either side
    assert bench_hybrid.cached_prefix_bytes(config, at) <= bench_hybrid.cached_prefix_bytes(twin, at)
    before = at - bench_hybrid.BLOCK_SIZE
    assert bench_hybrid.cached_prefix_bytes(config, before) > bench_hybrid.cached_prefix_bytes(twin, before)
