"""Checkpoint parameter names are the local layer spec's, whichever spec the model uses."""

from megatron_psrl.checkpoint import canonical_name


def test_transformer_engine_fused_norm_names_map_to_local_names():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    for local in ("decoder.layers.0.input_layernorm.weight", "decoder.layers.1.self_attention.linear_qkv.weight",
                  "decoder.layers.1.self_attention.q_layernorm.weight", "embedding.word_embeddings.weight"):
        assert canonical_name(local) == local
