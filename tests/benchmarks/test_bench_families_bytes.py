"""benchmarks/bench_families.py's cached-bytes table: what it prints holds (DeepSeek-V3's per-head
K/V per token is 128 heads x (192 + 128) numbers a layer, the latent 512 + 64, bf16: the 71x the
docs quote; the latent is what the cache keeps by default)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_families  # noqa: E402

from megatron_psrl.model.architecture import ModelArchitecture  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402


def test_deepseek_v3_per_head_and_latent_bytes_per_token():
    row = bench_families.bytes_row("deepseek-v3-class")
    assert row["layers"] == 61
    assert row["kv_row"] == 61 * 128 * (192 + 128) * 2
    assert row["latent"] == 61 * (512 + 64) * 2
    assert round(row["kv_row"] / row["latent"], 1) == 71.1
    default = ModelArchitecture.from_hf_config(tiny_config("deepseek-v3-class"))
    assert bench_families.row_bytes(default, torch.bfloat16) == row["latent"]


def test_a_softmax_family_has_no_latent_column():
    row = bench_families.bytes_row("gpt-oss-120b-class")
    assert row["latent"] is None and row["kv_row"] == 36 * 2 * 8 * 64 * 2  # K and V, 8 groups of 64, bf16
