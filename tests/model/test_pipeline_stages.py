"""How pipeline stages split the layers (Megatron-LM's rule) and the shards of an uneven split."""

import pytest
import torch
from helpers.families import family_config

from megatron_psrl.checkpoint.sharding import merge_state_dicts, shard_state_dict, stage_layers
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.kvcache import KVGeometry
from megatron_psrl.model import ModelArchitecture
from megatron_psrl.model.stages import pipeline_layer_counts


def test_even_split_and_megatron_first_last_stage_flags():
    assert pipeline_layer_counts(8, 1) == (8,)
    assert pipeline_layer_counts(8, 4) == (2, 2, 2, 2)
    assert pipeline_layer_counts(9, 4, first=3) == (3, 2, 2, 2)
    assert pipeline_layer_counts(8, 4, first=1, last=1) == (1, 3, 3, 1)
    assert pipeline_layer_counts(8, 2, last=3) == (5, 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=8, pp=3), "8 layers cannot be split evenly over 3"),
    (dict(num_layers=8, pp=4, first=3), "5 layers left after the first/last stage's cannot be split evenly over 3"),
    (dict(num_layers=8, pp=1, first=2), "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size"),
    (dict(num_layers=8, pp=2, last=8), "--decoder-last-pipeline-num-layers 8: must be between 1 and 7"),
    (dict(num_layers=8, pp=2, first=3, last=3), "hold 6 layers, the model has 8"),
])
def test_impossible_splits_name_the_flag_and_the_numbers(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        pipeline_layer_counts(**kwargs)


def test_uneven_shards_round_trip_bit_for_bit_and_hold_their_layers():
    arch = ModelArchitecture.from_hf_config(family_config("qwen3-tied", num_hidden_layers=4))
    gen = torch.Generator().manual_seed(0)
    from megatron_psrl.model.adapters import get_adapter

    shapes = get_adapter(arch).hf_shapes()
    full = dict(get_adapter(arch).hf_to_mcore(lambda n: torch.randn(shapes[n], generator=gen)))
    split = (1, 3)
    shards = shard_state_dict(full, arch, 2, split)
    assert list(stage_layers(arch, 1, split)) == [1, 2, 3]
    assert {k for k in shards[(0, 0)] if k.startswith("decoder.layers.")} == {
        k for k in full if k.startswith("decoder.layers.0.")}
    assert "decoder.layers.2.mlp.linear_fc2.weight" in shards[(1, 1)]  # global layer 3
    assert "output_layer.weight" in shards[(0, 1)]  # the tied copy on the last stage
    merged = merge_state_dicts(shards, arch, 2, split)
    assert set(merged) == set(full)
    for name, tensor in full.items():  # a reshard is copies: exact
        assert torch.equal(merged[name], tensor), name


def test_kv_geometry_numbers_a_stage_layers_as_megatron_does():
    arch = ModelArchitecture.from_hf_config(family_config("llama-llama3", num_hidden_layers=4))
    g = KVGeometry.for_model(arch, 1, (1, 3), torch.float32, torch.device("cpu"), pipeline_rank=1)
    assert (g.num_layers, g.layer_offset) == (3, 2)
    g = KVGeometry.for_model(arch, 1, 2, torch.float32, torch.device("cpu"), pipeline_rank=1)
    assert (g.num_layers, g.layer_offset) == (2, 3)
