"""Per-rank lazy HF loading: a rank reads only its layers and its rows / columns of each tensor
(safetensors ``get_slice``), gets exactly the shard the full path produces (a copy: bit for
bit), and its host memory while loading stays near its shard, not the model."""

import pytest
import torch
from helpers.families import FAMILIES, family_config, make_family_checkpoint

from megatron_psrl.checkpoint.loading import hf_full_state_dict, hf_rank_state_dict
from megatron_psrl.checkpoint.sharding import shard_state_dict
from megatron_psrl.engine.memory import PeakMemory, heap_bytes_in_use
from megatron_psrl.model import ModelArchitecture

LAYOUTS = [(2, 1), (2, 2), (1, 2), (2, (1, 3)), (1, 4)]  # (TP, PP or each stage's layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_shard_equals_the_full_path(family, tmp_path):
    hf_dir = make_family_checkpoint(family_config(family, num_hidden_layers=4), str(tmp_path / "hf"),
                                    max_shard_size="40KB")  # several files: slices come from each
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    full = hf_full_state_dict(hf_dir, arch)
    for tp, split in LAYOUTS:
        expected = shard_state_dict(full, arch, tp, split)
        for (r, p), shard in expected.items():
            got = hf_rank_state_dict(hf_dir, arch, r, tp, p, split)
            assert set(got) == set(shard), (tp, split, r, p, sorted(set(got) ^ set(shard)))
            for name, t in shard.items():
                assert torch.equal(got[name], t), (tp, split, r, p, name)


def test_a_rank_loads_near_its_shard_size(tmp_path):
    if heap_bytes_in_use() is None:
        pytest.skip("needs glibc's mallinfo2 to measure the heap")
    cfg = family_config("llama-llama3", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=16000)
    hf_dir = make_family_checkpoint(cfg, str(tmp_path / "hf"))
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    # The full path: every rank read the whole state dict and cloned every rank's shard.
    with PeakMemory(torch.device("cpu"), mode="ops") as full_mem:
        full = hf_full_state_dict(hf_dir, arch)
        model_bytes = sum(t.numel() * t.element_size() for t in full.values())
        shard_state_dict(full, arch, 2, 2)[(1, 1)]
    del full
    with PeakMemory(torch.device("cpu"), mode="ops") as rank_mem:
        shard = hf_rank_state_dict(hf_dir, arch, 1, 2, 1, 2)  # TP=2 x PP=2: a quarter of the layers' bytes
    shard_bytes = sum(t.numel() * t.element_size() for t in shard.values())
    rank_peak = rank_mem.peak_bytes - rank_mem.start_bytes
    assert shard_bytes < 0.45 * model_bytes
    # the shard plus at most one slice being assembled (fc1's gate and up halves)
    assert rank_peak < 1.3 * shard_bytes, (rank_peak, shard_bytes, model_bytes)
    assert full_mem.peak_bytes - full_mem.start_bytes >= 0.9 * model_bytes
