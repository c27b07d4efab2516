"""Model families as bundles: the registry, each bundle's debug configs, prefix states, and a
family added by registering one bundle (nothing else edited)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict

import pytest
import torch

from megatron_psrl.kvcache.prefix_state import PrefixState
from megatron_psrl.model import architecture
from megatron_psrl.model.adapters import LlamaStyleAdapter, get_adapter
from megatron_psrl.model.architecture import ModelArchitecture, UnsupportedModelError
from megatron_psrl.model.families import (
    TINY_BASE,
    LlamaLikeFamily,
    ModelFamily,
    get_family,
    register_family,
    registered_families,
    unregister_family,
)
from megatron_psrl.model.gpt import build_layer_spec, build_transformer_config
from megatron_psrl.model.tiny import MOE_CONFIGS, SHAPE_CONFIGS, TINY_CONFIGS, tiny_config
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.memory import (
    activation_bytes_per_token,
    attention_saved_bytes_per_token,
    saved_activation_bytes_per_token,
)

SEVEN = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
"""Qwen3-Next and Qwen3.5 (tests/model/test_hybrid_families.py)."""
LATER = ("gpt_oss",)
"""Registered after the hybrids (tests/model/test_moe_families.py)."""
LATENT = ("deepseek_v3",)
"""DeepSeek-V3's latent attention (tests/model/test_deepseek.py); Kimi K2's ``kimi_k2`` is its alias."""
GROUPED = ("glm4_moe",)
"""Grouped sigmoid routing (tests/model/test_glm4_moe.py)."""
DEBUG_CONFIGS = [(f.model_type, name) for f in registered_families() for name in f.tiny_configs]


def test_registry_lists_the_families_in_order():
    assert tuple(f.model_type for f in registered_families()) == SEVEN + HYBRIDS + LATER + LATENT + GROUPED
    assert architecture.SUPPORTED_MODEL_TYPES == SEVEN + HYBRIDS + LATER + LATENT + ("kimi_k2",) + GROUPED
    assert architecture.MOE_MODEL_TYPES == ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe_text",
                                            "qwen3_5_moe", "gpt_oss", "deepseek_v3", "kimi_k2", "glm4_moe")
    for family in registered_families():
        assert isinstance(family, ModelFamily)
        assert get_family(family.model_type) is family
        assert family.tiny_configs, f"{family.model_type} has no debug config"


def test_tiny_module_is_a_view_of_the_bundles():
    plain = [f for f in registered_families() if not f.has_linear_attention]
    dense = {n: c for f in plain for n, c in f.tiny_configs.items() if not f.hf_has_moe_layers(c)}
    moe = {n: c for f in plain for n, c in f.tiny_configs.items() if f.hf_has_moe_layers(c)}
    assert TINY_CONFIGS == dense and MOE_CONFIGS == moe
    # DeepSeek-V3's configs may have no MoE layer (first_k_dense_replace >= num_hidden_layers)
    assert "debug-deepseek-v3" in TINY_CONFIGS and "debug-deepseek-v3-moe" in MOE_CONFIGS
    assert all(f.hf_has_moe_layers(c) == f.is_moe for f in plain if not f.moe_layers_optional
               for c in f.tiny_configs.values())
    assert set(SHAPE_CONFIGS) == {"qwen2.5-1.5b-shape", "qwen3-next-80b-a3b", "qwen3.5-27b-class", "gpt-oss-120b-class",
                                  "deepseek-v3-class", "glm-4.5-air-class", "qwen3-30b-a3b-class"}
    assert set(get_family("qwen2").shape_configs) == {"qwen2.5-1.5b-shape"}


@pytest.mark.parametrize("model_type,name", DEBUG_CONFIGS)
def test_debug_config_parses_and_round_trips(model_type, name):
    family = get_family(model_type)
    config = tiny_config(name)
    assert config == family.tiny_configs[name] and config is not family.tiny_configs[name]  # a copy
    arch = ModelArchitecture.from_hf_config(config)
    assert arch.model_type == model_type and arch.family is family
    assert arch.is_moe == family.hf_has_moe_layers(config)
    assert ModelArchitecture.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    # the bundle's adapter converts the family's state dict both ways, bit for bit
    adapter = get_adapter(arch)
    assert type(adapter) is family.adapter
    gen = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(shape, generator=gen) for k, shape in adapter.hf_shapes().items()}
    mcore = dict(adapter.hf_to_mcore(hf.__getitem__))
    back = dict(adapter.mcore_to_hf(mcore))
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("model_type,name", [(t, n) for t, n in DEBUG_CONFIGS if t not in HYBRIDS])
@pytest.mark.parametrize("tp,dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_prefix_states_one_softmax_state_per_layer(model_type, name, tp, dtype):
    arch = ModelArchitecture.from_hf_config(tiny_config(name))
    if arch.multi_latent_attention:  # (its default, the latent: tests/model/test_deepseek.py)
        arch = dataclasses.replace(arch, latent_cache="per-head")
    states = arch.family.prefix_states(arch, tp, dtype)
    assert len(states) == arch.num_layers
    # (latent attention's per-head values are narrower than its keys)
    # (gpt-oss's sliding layers carry their window: their rows are cut to what a window reaches)
    expected = [PrefixState.softmax(arch.num_kv_heads // tp, arch.head_dim, arch.v_head_dim or arch.head_dim,
                                    dtype=dtype, window=arch.sliding_window if i in arch.sliding_window_layers else None)
                for i in range(arch.num_layers)]
    assert list(states) == expected


# ---------------------------------------------------------------------- a family added by one bundle
class _ToyFamily(LlamaLikeFamily):
    """A Llama-like family of a made-up ``model_type`` that refuses ``toy_bias`` and keeps half-width
    values in its prefix state (so the test can tell its prefix states from the default)."""

    def hf_attention_fields(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if hf.get("toy_bias"):
            raise UnsupportedModelError("toy_bias is not supported")
        return super().hf_attention_fields(hf)

    def prefix_states(self, arch, tensor_parallel_size, dtype):
        state = PrefixState.softmax(arch.num_kv_heads // tensor_parallel_size, arch.head_dim,
                                    value_dim=arch.head_dim // 2, dtype=dtype)
        return (state,) * arch.num_layers


_TOY_CONFIG = dict(TINY_BASE, model_type="toy_llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                   head_dim=16)


@pytest.fixture
def toy_family():
    family = register_family(_ToyFamily(model_type="toy_llama", adapter=LlamaStyleAdapter,
                                        tiny_configs={"debug-toy": _TOY_CONFIG}))
    try:
        yield family
    finally:
        unregister_family("toy_llama")
    assert "toy_llama" not in architecture.SUPPORTED_MODEL_TYPES


def test_unregistered_model_type_is_refused():
    with pytest.raises(UnsupportedModelError, match="unsupported model type 'toy_llama'"):
        ModelArchitecture.from_hf_config(dict(_TOY_CONFIG))
    with pytest.raises(UnsupportedModelError, match="unsupported model type 'toy_llama'"):
        get_family("toy_llama")


def test_registering_twice_is_refused(toy_family):
    with pytest.raises(ValueError, match="already registered"):
        register_family(_ToyFamily(model_type="toy_llama", adapter=LlamaStyleAdapter))


def test_a_registered_bundle_is_a_supported_family(toy_family):
    assert architecture.SUPPORTED_MODEL_TYPES[-1] == "toy_llama"
    assert "toy_llama" not in architecture.MOE_MODEL_TYPES
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-toy"))
    assert arch.model_type == "toy_llama" and arch.family is toy_family
    assert type(get_adapter(arch)) is LlamaStyleAdapter
    with pytest.raises(UnsupportedModelError, match="toy_bias is not supported"):
        ModelArchitecture.from_hf_config(dict(_TOY_CONFIG, toy_bias=True))

    # its prefix states are its own
    states = arch.family.prefix_states(arch, 2, torch.bfloat16)
    assert states == (PrefixState.softmax(1, 16, value_dim=8, dtype=torch.bfloat16),) * arch.num_layers

    # the model, the memory plan and the cost model take it as the Llama it is shaped like
    llama = ModelArchitecture.from_hf_config(dict(_TOY_CONFIG, model_type="llama"))
    for tp, b in ((1, 4), (2, 2)):
        assert saved_activation_bytes_per_token(arch, tp, b) == saved_activation_bytes_per_token(llama, tp, b)
        assert attention_saved_bytes_per_token(arch, tp, b) == attention_saved_bytes_per_token(llama, tp, b)
        assert activation_bytes_per_token(arch, tp, b) == activation_bytes_per_token(llama, tp, b)
    toy_cost, llama_cost = CostModel.for_architecture(arch), CostModel.for_architecture(llama)
    assert toy_cost.name == "toy_llama"
    assert toy_cost.to_dict() == dict(llama_cost.to_dict(), name="toy_llama")
    config = build_transformer_config(arch)
    assert (config.num_query_groups, config.kv_channels, config.gated_linear_unit) == (2, 16, True)
    assert repr(build_layer_spec(arch)) == repr(build_layer_spec(llama))


def test_memory_plan_and_cost_model_delegate_to_the_bundle():
    for name in sorted(TINY_CONFIGS) + sorted(MOE_CONFIGS):
        arch = ModelArchitecture.from_hf_config(tiny_config(name))
        family = arch.family
        assert saved_activation_bytes_per_token(arch, 1, 2) == family.saved_activation_bytes_per_token(arch, 1, 2)
        assert attention_saved_bytes_per_token(arch, 1, 4) == family.attention_saved_bytes_per_token(arch, 1, 4)
        assert CostModel.for_architecture(arch) == dataclasses.replace(
            CostModel.from_model_dims(family.cost_dims(arch)), read_flops_per_token=family.read_flops_per_token(arch))
        assert arch.mlp_parameters() == family.mlp_parameters(arch)
    with pytest.raises(ValueError, match="models the attention backends"):
        saved_activation_bytes_per_token(arch, 1, 2, backend="dense")
