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


HYBRID_LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, (1, 3), 2), (1, 4, 2)]  # (TP, PP or each stage's layers, EP)


@pytest.fixture(scope="module")
def whole_tensor_checkpoints(tmp_path_factory):
    from helpers.hybrid import make_hybrid_checkpoint

    from megatron_psrl.model.tiny import tiny_config

    return {name: make_hybrid_checkpoint(tiny_config(name), str(tmp_path_factory.mktemp(name)))
            for name in ("debug-qwen3-next", "debug-qwen3.5", "debug-deepseek-v3")}


class _CountingReader:
    """Records which tensors a rank's load reads (whole or sliced)."""

    def __init__(self, monkeypatch):
        from megatron_psrl.checkpoint import hf_io

        self.names = []
        self.bytes = {}  # tensor name -> bytes read of it
        get, get_slice = hf_io.HFCheckpointReader.get, hf_io.HFCheckpointReader.get_slice

        def counted_get(reader, name, *a, **k):
            return self.count(name, get(reader, name, *a, **k))

        def counted_slice(reader, name, *a, **k):
            return self.count(name, get_slice(reader, name, *a, **k))

        monkeypatch.setattr(hf_io.HFCheckpointReader, "get", counted_get)
        monkeypatch.setattr(hf_io.HFCheckpointReader, "get_slice", counted_slice)

    def count(self, name, tensor):
        self.names.append(name)
        self.bytes[name] = self.bytes.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def clear(self):
        self.names.clear()
        self.bytes.clear()


@pytest.mark.parametrize("name", ["debug-qwen3-next", "debug-qwen3.5", "debug-deepseek-v3"])
def test_whole_tensor_rank_reads_its_stage_and_experts_only(name, whole_tensor_checkpoints, monkeypatch):
    """A family whose layouts are not per-group slices (gated queries, Gated DeltaNet's fused
    projections, latent attention's replicated down-projections) reads its stage's layers and its expert-parallel rank's experts whole, cuts each
    converted tensor: the shard of the full path bit for bit, and nothing of other stages' layers
    or other ranks' experts is read."""
    import re

    from megatron_psrl.model.moe import local_experts
    from megatron_psrl.model.stages import stage_counts

    hf_dir = whole_tensor_checkpoints[name]
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    full = hf_full_state_dict(hf_dir, arch)
    reads = _CountingReader(monkeypatch)
    for tp, split, ep in HYBRID_LAYOUTS:
        if ep > 1 and not arch.is_moe:
            continue
        counts = stage_counts(arch, split)
        for (r, p), shard in shard_state_dict(full, arch, tp, split).items():
            layers = range(sum(counts[:p]), sum(counts[:p + 1]))
            for ep_rank in range(ep):
                expected = local_experts(shard, arch, ep_rank, ep) if arch.is_moe else shard
                reads.clear()
                got = hf_rank_state_dict(hf_dir, arch, r, tp, p, split, ep_rank, ep)
                assert set(got) == set(expected), (tp, split, r, p, sorted(set(got) ^ set(expected)))
                for key, t in expected.items():
                    assert torch.equal(got[key], t), (tp, split, r, p, key)
                for read in reads.names:
                    m = re.match(r"^.*?layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?", read)
                    if m:
                        assert int(m.group(1)) in layers, (read, p)
                        if m.group(2) is not None:
                            assert int(m.group(2)) // (arch.num_experts // ep) == ep_rank, (read, ep_rank)


def test_gpt_oss_ranks_read_their_rows_of_the_fused_experts(tmp_path, monkeypatch):
    """gpt-oss stores each layer's experts fused (``mlp.experts.gate_up_proj`` [E, h, 2I], its
    bias, ``down_proj`` [E, I, h], its bias): under expert parallelism a rank reads its experts'
    rows of them only (``get_slice`` on the expert dimension: half the expert bytes at EP = 2),
    and its shard equals the whole-read path's bit for bit (with TP and PP too)."""
    from megatron_psrl.model.adapters import get_adapter
    from megatron_psrl.model.moe import local_experts
    from megatron_psrl.model.stages import stage_counts

    hf_dir = make_family_checkpoint(family_config("gpt-oss"), str(tmp_path / "hf"), max_shard_size="40KB")
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    full = hf_full_state_dict(hf_dir, arch)
    shapes = get_adapter(arch).hf_shapes()
    size = full["embedding.word_embeddings.weight"].element_size()  # (every tensor's dtype)
    fused = get_adapter(arch).hf_fused_expert_tensors
    assert len(fused) == 4
    reads = _CountingReader(monkeypatch)
    for tp, split, ep in [(1, 1, 2), (2, 2, 2), (1, 1, 1)]:
        counts = stage_counts(arch, split)
        for (r, p), shard in shard_state_dict(full, arch, tp, split).items():
            layers = range(sum(counts[:p]), sum(counts[:p + 1]))
            whole = sum(torch.Size(shapes[f"model.layers.{i}.{s}"]).numel() * size for i in layers for s in fused)
            for ep_rank in range(ep):
                reads.clear()
                got = hf_rank_state_dict(hf_dir, arch, r, tp, p, split, ep_rank, ep)
                expected = local_experts(shard, arch, ep_rank, ep)
                assert set(got) == set(expected), (tp, split, ep, sorted(set(got) ^ set(expected)))
                for key, t in expected.items():
                    assert torch.equal(got[key], t), (tp, split, ep, key)
                expert_bytes = sum(n for name, n in reads.bytes.items() if ".mlp.experts." in name)
                assert expert_bytes * ep == whole, (tp, split, ep, ep_rank, expert_bytes, whole)
