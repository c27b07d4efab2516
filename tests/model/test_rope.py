"""RopeConfig.inv_freq / attention_scaling against transformers' own RoPE initialisation.

Every case is written in both config layouts: transformers >= 5 (``rope_parameters`` holding
``rope_theta``) and the older one (top-level ``rope_theta`` + ``rope_scaling``), and compared
with what the transformers rotary-embedding module of the family computes from that config
(and with ``ROPE_INIT_FUNCTIONS`` for the scaled types).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megatron_psrl.model.architecture import ModelArchitecture, RopeConfig

BASE = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128, max_position_embeddings=131072)

# (name, model_type, theta, scaling dict or None)
CASES = [
    ("default", "llama", 10000.0, None),
    ("default-large-theta", "qwen2", 1_000_000.0, None),
    ("linear", "llama", 10000.0, dict(rope_type="linear", factor=4.0)),
    ("linear-old-type-key", "mistral", 10000.0, dict(type="linear", factor=2.5)),
    ("llama3.1", "llama", 500000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)),
    ("llama3-small-context", "llama", 10000.0, dict(rope_type="llama3", factor=16.0, low_freq_factor=2.0,
                                                    high_freq_factor=8.0, original_max_position_embeddings=64)),
    ("yarn-qwen2.5", "qwen2", 1_000_000.0, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
    ("yarn-betas", "qwen3", 10000.0, dict(rope_type="yarn", factor=8.0, beta_fast=16.0, beta_slow=2.0,
                                          original_max_position_embeddings=4096)),
    ("yarn-no-truncate", "qwen2", 10000.0, dict(rope_type="yarn", factor=3.0, truncate=False,
                                                original_max_position_embeddings=2048)),
    ("yarn-attention-factor", "llama", 10000.0, dict(rope_type="yarn", factor=4.0, attention_factor=1.3,
                                                     original_max_position_embeddings=1024)),
    ("yarn-mscale", "llama", 10000.0, dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.707,
                                           original_max_position_embeddings=4096)),
]


def _layouts(model_type, theta, scaling):
    new = dict(BASE, model_type=model_type, rope_parameters=dict(rope_theta=theta, **(scaling or {})))
    if scaling is None:
        new["rope_parameters"]["rope_type"] = "default"
    old = dict(BASE, model_type=model_type, rope_theta=theta)
    if scaling is not None:
        old["rope_scaling"] = dict(scaling)
    return {"rope_parameters": new, "rope_theta+rope_scaling": old}


def _hf_rope(config_dict):
    """(inv_freq, attention_scaling) of the transformers rotary module for this config."""
    cfg = AutoConfig.for_model(**copy.deepcopy(config_dict))
    import importlib

    family = cfg.model_type
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))
    rotary = rotary_cls(cfg)
    return cfg, rotary.inv_freq.float(), float(rotary.attention_scaling)


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_theta+rope_scaling"])
@pytest.mark.parametrize("name,model_type,theta,scaling", CASES, ids=[c[0] for c in CASES])
def test_inv_freq_and_scaling_match_transformers(name, model_type, theta, scaling, layout):
    config = _layouts(model_type, theta, scaling)[layout]
    hf_cfg, hf_inv, hf_scale = _hf_rope(config)

    rope = RopeConfig.from_hf(copy.deepcopy(config))
    expected_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    assert rope.rope_type == expected_type
    ours = rope.inv_freq(config["head_dim"])
    assert ours.dtype == torch.float32 and ours.shape == hf_inv.shape
    torch.testing.assert_close(ours, hf_inv, rtol=1e-6, atol=0)
    assert rope.attention_scaling() == pytest.approx(hf_scale, rel=1e-12)

    if expected_type != "default":  # also the init function itself
        inv, scale = ROPE_INIT_FUNCTIONS[expected_type](hf_cfg, None)
        torch.testing.assert_close(ours, inv.float(), rtol=1e-6, atol=0)
        assert rope.attention_scaling() == pytest.approx(scale, rel=1e-12)

    # the architecture carries the same RoPE, and folds yarn's cos/sin scaling into softmax_scale
    arch = ModelArchitecture.from_hf_config(copy.deepcopy(config))
    torch.testing.assert_close(arch.rope.inv_freq(arch.head_dim), hf_inv, rtol=1e-6, atol=0)
    assert arch.softmax_scale() == pytest.approx(hf_scale**2 / config["head_dim"] ** 0.5, rel=1e-12)


def test_saved_config_layout_round_trips():
    """What transformers writes to config.json (from either input layout) parses to the same RoPE."""
    for name, model_type, theta, scaling in CASES:
        layouts = _layouts(model_type, theta, scaling)
        ropes = []
        for config in layouts.values():
            saved = AutoConfig.for_model(**copy.deepcopy(config)).to_dict()
            ropes.append(RopeConfig.from_hf(saved))
            ropes.append(RopeConfig.from_hf(copy.deepcopy(config)))
        for r in ropes[1:]:
            assert r == ropes[0], name


def test_yarn_defaults_original_context_to_max_position_embeddings():
    config = dict(BASE, model_type="qwen2", max_position_embeddings=4096,
                  rope_scaling=dict(rope_type="yarn", factor=2.0), rope_theta=10000.0)
    rope = RopeConfig.from_hf(copy.deepcopy(config))
    assert rope.original_max_position_embeddings == 4096
    _, hf_inv, hf_scale = _hf_rope(config)
    torch.testing.assert_close(rope.inv_freq(128), hf_inv, rtol=1e-6, atol=0)
    assert rope.attention_scaling() == pytest.approx(hf_scale)


def test_scaling_actually_changes_frequencies():
    """Guard against a test that passes because every type returns the default."""
    default = RopeConfig(theta=10000.0).inv_freq(64)
    for rope in (
        RopeConfig(rope_type="linear", factor=4.0),
        RopeConfig(rope_type="llama3", factor=8.0, original_max_position_embeddings=64),
        RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    ):
        assert not torch.allclose(rope.inv_freq(64), default)


@pytest.mark.parametrize("scaling", [
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
    dict(rope_type="yarn", factor=2.0),
], ids=["llama3", "yarn"])
def test_missing_original_context_defaults_like_transformers(scaling):
    """transformers >= 5 fills original_max_position_embeddings from max_position_embeddings."""
    config = dict(BASE, model_type="llama", max_position_embeddings=2048, rope_theta=10000.0, rope_scaling=scaling)
    _, hf_inv, hf_scale = _hf_rope(config)
    rope = RopeConfig.from_hf(copy.deepcopy(config))
    torch.testing.assert_close(rope.inv_freq(128), hf_inv, rtol=1e-6, atol=0)
    assert rope.attention_scaling() == pytest.approx(hf_scale, rel=1e-12)


@pytest.mark.parametrize("rope_type", ["linear", "llama3", "yarn"])
def test_scaling_without_factor_is_refused(rope_type):
    from megatron_psrl.model.architecture import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=f"{rope_type}.*factor"):
        RopeConfig.from_hf(dict(rope_theta=1e4, max_position_embeddings=4096,
                                rope_scaling=dict(rope_type=rope_type, original_max_position_embeddings=1024)))
