"""Parsing Hugging Face configs into ModelArchitecture, and refusing what is not supported."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from megatron_psrl.model.architecture import ModelArchitecture, UnsupportedModelError
from megatron_psrl.model.tiny import TINY_CONFIGS, tiny_config

# Config.json excerpts of real models of every family (sizes as published).
REAL = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False, torch_dtype="bfloat16"),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                       max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=131072,
                       use_sliding_window=False, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_act="silu",
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         use_sliding_window=False, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     attention_bias=False, use_sliding_window=False, tie_word_embeddings=False, dtype="bfloat16"),
    "mistral-7b-v0.1": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                            max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
                            sliding_window=4096, tie_word_embeddings=False, torch_dtype="bfloat16"),
}
EXPECTED = {
    # name: (head_dim, qkv_bias, qk_norm, tied, sliding_window, rope_type, hf parameter count)
    "llama-3.1-8b": (128, False, False, False, None, "llama3", 8_030_261_248),
    "qwen2.5-7b": (128, True, False, False, None, "default", 7_615_616_512),
    "qwen2.5-0.5b": (64, True, False, True, None, "default", 494_032_768),
    "qwen3-8b": (128, False, True, False, None, "default", 8_190_735_360),
    "mistral-7b-v0.1": (128, False, False, False, 4096, "default", 7_241_732_096),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_parse(name):
    arch = ModelArchitecture.from_hf_config(copy.deepcopy(REAL[name]))
    head_dim, qkv_bias, qk_norm, tied, window, rope_type, params = EXPECTED[name]
    cfg = REAL[name]
    assert (arch.model_type, arch.vocab_size, arch.hidden_size, arch.num_layers) == (
        cfg["model_type"], cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"])
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.ffn_hidden_size) == (
        cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"])
    assert (arch.head_dim, arch.qkv_bias, arch.qk_norm, arch.tie_word_embeddings) == (head_dim, qkv_bias, qk_norm, tied)
    assert arch.sliding_window == window and arch.rope.rope_type == rope_type
    assert arch.rms_norm_eps == cfg["rms_norm_eps"] and arch.torch_dtype == "bfloat16"
    assert arch.num_parameters() == params  # the published model sizes
    assert arch.hf_config == cfg


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_configs_match_the_hf_model(name):
    """Every named tiny config builds in transformers, with the parameter count we compute."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(name)
    arch = ModelArchitecture.from_hf_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**copy.deepcopy(cfg)))
    unique = {id(p): p.numel() for p in model.parameters()}
    assert arch.num_parameters() == sum(unique.values())
    assert arch.rope_head_dim == model.config.head_dim  # (latent attention: transformers' head_dim is the RoPE part)
    assert arch.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)


def test_head_dim_defaults_to_hidden_over_heads():
    cfg = tiny_config("debug-llama")
    del cfg["head_dim"]
    assert ModelArchitecture.from_hf_config(cfg).head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg = tiny_config("debug-llama")
    del cfg["num_key_value_heads"]
    assert ModelArchitecture.from_hf_config(cfg).num_kv_heads == cfg["num_attention_heads"]


def test_dict_round_trip():
    for name in TINY_CONFIGS:
        arch = ModelArchitecture.from_hf_config(tiny_config(name))
        again = ModelArchitecture.from_dict(json.loads(json.dumps(arch.to_dict())))
        assert again == arch


@pytest.mark.parametrize(
    "vocab,tp,padded", [(256, 1, 256), (256, 2, 256), (251, 1, 251), (251, 2, 252), (251, 4, 252), (151936, 8, 151936),
                        (32001, 8, 32008), (5, 8, 8)]
)
def test_padded_vocab_size(vocab, tp, padded):
    arch = ModelArchitecture.from_hf_config(dict(tiny_config("debug-llama"), vocab_size=vocab))
    assert arch.padded_vocab_size(tp) == padded
    assert padded % tp == 0 and 0 <= padded - vocab < tp


# ------------------------------------------------------------------------------- refusals
MOE = [
    ("qwen2_moe-incomplete", dict(model_type="qwen2_moe", num_experts=60, moe_intermediate_size=1408,
                                  num_experts_per_tok=4),
     ["qwen2_moe", "shared_expert_intermediate_size"]),
    ("mixtral-no-key", dict(model_type="mixtral"), ["mixtral", "missing field 'num_local_experts'"]),
    ("dbrx", dict(model_type="dbrx", num_experts=16), ["dbrx", "mixture-of-experts"]),
    ("llama-with-experts", dict(model_type="llama", num_experts=4), ["num_experts"]),
    ("deepseek-v2", dict(model_type="deepseek_v2", n_routed_experts=256), ["n_routed_experts"]),
]


@pytest.mark.parametrize("name,override,words", MOE, ids=[m[0] for m in MOE])
def test_moe_is_refused_by_name(name, override, words):
    cfg = dict(tiny_config("debug-llama"), **override)
    with pytest.raises(UnsupportedModelError) as err:
        ModelArchitecture.from_hf_config(cfg)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "phi", "opt", "bert"])
def test_layernorm_and_other_families_are_refused(model_type):
    cfg = dict(model_type=model_type, vocab_size=100, n_embd=64, n_layer=2, n_head=2)
    with pytest.raises(UnsupportedModelError, match=f"unsupported model type '{model_type}'"):
        ModelArchitecture.from_hf_config(cfg)


def test_missing_model_type_is_refused():
    cfg = tiny_config("debug-llama")
    del cfg["model_type"]
    with pytest.raises(UnsupportedModelError, match="<missing>"):
        ModelArchitecture.from_hf_config(cfg)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", "proportional"])
def test_unknown_rope_scaling_is_refused(rope_type):
    cfg = dict(tiny_config("debug-llama"), rope_scaling=dict(rope_type=rope_type, factor=2.0))
    with pytest.raises(UnsupportedModelError, match=f"RoPE scaling type '{rope_type}'"):
        ModelArchitecture.from_hf_config(cfg)
    cfg = dict(tiny_config("debug-llama"), rope_parameters=dict(rope_type=rope_type, rope_theta=1e4, factor=2.0))
    with pytest.raises(UnsupportedModelError, match=f"RoPE scaling type '{rope_type}'"):
        ModelArchitecture.from_hf_config(cfg)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_non_silu_activation_is_refused(act):
    with pytest.raises(UnsupportedModelError, match=f"activation '{act}'"):
        ModelArchitecture.from_hf_config(dict(tiny_config("tiny-mistral"), hidden_act=act))


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-qwen3"])
def test_sliding_window_layers_are_refused(family):
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelArchitecture.from_hf_config(dict(tiny_config(family), use_sliding_window=True, sliding_window=128))
    # present but unused (the Qwen default) is fine
    arch = ModelArchitecture.from_hf_config(dict(tiny_config(family), use_sliding_window=False, sliding_window=128))
    assert arch.sliding_window is None


@pytest.mark.parametrize("family,key", [("debug-llama", "attention_bias"), ("debug-llama", "mlp_bias"),
                                        ("tiny-mistral", "attention_bias"), ("tiny-qwen3", "attention_bias")])
def test_unsupported_biases_are_refused(family, key):
    with pytest.raises(UnsupportedModelError, match=key):
        ModelArchitecture.from_hf_config(dict(tiny_config(family), **{key: True}))


def test_heads_not_a_multiple_of_groups_is_refused():
    with pytest.raises(UnsupportedModelError, match="multiple of num_key_value_heads"):
        ModelArchitecture.from_hf_config(dict(tiny_config("debug-llama"), num_attention_heads=6, num_key_value_heads=4))


def test_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelArchitecture.from_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        ModelArchitecture.from_hf_dir(str(tmp_path))
    cfg = tiny_config("debug-llama")
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="intermediate_size"):
        ModelArchitecture.from_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(tiny_config("debug-llama"), model_type="gpt2")))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelArchitecture.from_hf_dir(str(tmp_path))
