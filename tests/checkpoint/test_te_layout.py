"""torch_dist checkpoints written on CPU (local layer spec) hold every tensor under the names
megatron's Transformer Engine layer spec asks for on GPU, so a CPU- or converter-written
checkpoint loads into a TE model: the input and pre-MLP norms under the fused linear layers'
``layer_norm_weight`` names, and an ``_extra_state`` object for each TE linear layer (which TE
fills with its FP8 metadata, None here). The TE spec itself cannot be built without Transformer
Engine; its names are restated from megatron-core's ``TELayerNormColumnParallelLinear`` /
``TERowParallelLinear`` (what ``get_gpt_layer_with_transformer_engine_spec`` puts in a layer)."""

import pytest
from helpers.hf_reference import make_hf_checkpoint
from torch.distributed.checkpoint import FileSystemReader

from megatron_psrl.checkpoint.convert import hf_to_mcore
from megatron_psrl.model import tiny_config

TE_LAYER_KEYS = (
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv._extra_state", "self_attention.linear_proj.weight",
    "self_attention.linear_proj._extra_state", "mlp.linear_fc1.weight", "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1._extra_state", "mlp.linear_fc2.weight", "mlp.linear_fc2._extra_state",
)
"""A dense layer's parameters and TE state under the TE spec (layers stacked: one key each)."""


@pytest.mark.parametrize("family", ["debug-llama", "tiny-qwen3"])
def test_a_cpu_written_checkpoint_has_the_transformer_engine_names(tmp_path, family):
    config = tiny_config(family)
    hf = make_hf_checkpoint(config, seed=0, directory=str(tmp_path / "hf"))
    hf_to_mcore(hf, str(tmp_path / "ckpt"), tp=1, progress=False, ckpt_format="torch_dist")
    keys = set(FileSystemReader(str(tmp_path / "ckpt" / "release")).read_metadata().state_dict_metadata)
    # sharded objects (``_extra_state``) are stored one per layer: ``<key>/shard_<layer>_<layers>``
    model_keys = {(k[len("model."):] if k.startswith("model.") else k).split("/shard_")[0] for k in keys}
    expected = {f"decoder.layers.{k}" for k in TE_LAYER_KEYS} | {"decoder.final_layernorm.weight",
                                                                  "embedding.word_embeddings.weight"}
    if config.get("model_type") == "qwen3":  # TE's q/k norms: TENorm, the same names as the local spec's
        expected |= {"decoder.layers.self_attention.q_layernorm.weight", "decoder.layers.self_attention.k_layernorm.weight"}
    missing = sorted(expected - model_keys)
    assert not missing, (missing, sorted(model_keys))
    # the local spec's separate norm modules are not what it stores (TE has none of them)
    assert not {k for k in model_keys if "input_layernorm" in k or "pre_mlp_layernorm" in k}
