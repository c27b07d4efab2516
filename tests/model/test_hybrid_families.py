"""Qwen3-Next and Qwen3.5 (dense, MoE, text-only and multimodal wrappers): config parsing and
refusals, megatron's config fields, the adapter against transformers' own checkpoints, and
the Hugging Face -> megatron -> Hugging Face round trip, bit for bit, with the wrappers' vision
tower carried through."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers.hybrid import WRAPPERS, make_hybrid_checkpoint, read_safetensors

from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from megatron_psrl.checkpoint.passthrough import PASSTHROUGH_FILE
from megatron_psrl.errors import CheckpointError, UnsupportedModelError
from megatron_psrl.kvcache.prefix_state import PrefixState
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.families import get_family, registered_families
from megatron_psrl.model.tiny import HYBRID_CONFIGS, MOE_CONFIGS, TINY_CONFIGS, tiny_config

HYBRID = [(f.model_type, name) for f in registered_families() if f.has_linear_attention for name in f.tiny_configs]
TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")




@pytest.fixture(scope="module")
def hybrid_checkpoints(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = make_hybrid_checkpoint(tiny_config(name), str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def test_the_five_types_are_registered_apart_from_the_dense_and_moe_configs():
    assert tuple(t for t, _ in HYBRID) == TYPES
    assert set(HYBRID_CONFIGS) == {n for _, n in HYBRID}
    assert not set(HYBRID_CONFIGS) & (set(TINY_CONFIGS) | set(MOE_CONFIGS))
    assert [get_family(t).is_moe for t in TYPES] == [True, False, False, True, True]


@pytest.mark.parametrize("model_type,name", HYBRID)
def test_config_parses_layer_types_and_linear_fields(model_type, name):
    config = tiny_config(name)
    arch = ModelArchitecture.from_hf_config(config)
    assert arch.layer_kinds == ("linear_attention",) * 3 + ("full_attention",)
    assert arch.linear_attention_layers == (0, 1, 2)
    assert (arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim,
            arch.linear_value_head_dim, arch.linear_conv_kernel_dim) == (2, 4, 8, 8, 4)
    assert arch.attention_output_gate and arch.zero_centered_norms and arch.qk_norm
    assert arch.rope.partial_rotary_factor == 0.25 and arch.rope.inv_freq(arch.head_dim).numel() == 2
    assert arch.hf_config == config  # the wrapper's whole config, written back by mcore-to-hf
    assert ModelArchitecture.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    if arch.is_moe:
        assert arch.moe_shared_expert_gate and arch.moe_shared_expert_ffn_hidden_size == 48


def test_default_layer_pattern_follows_full_attention_interval():
    config = dict(tiny_config("debug-qwen3.5-text"), num_hidden_layers=6, full_attention_interval=3)
    del config["layer_types"]
    arch = ModelArchitecture.from_hf_config(config)
    assert arch.layer_kinds == ("linear_attention", "linear_attention", "full_attention") * 2


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "field 'layer_types': layer types ['sliding_attention']"),
    (dict(layer_types=["full_attention"] * 3), "layer_types names 3 layers"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(linear_num_value_heads=3), "not a multiple of linear_num_key_heads"),
    (dict(linear_conv_kernel_dim=None), "linear_conv_kernel_dim"),
    (dict(full_attention_interval=0, layer_types=None), "full_attention_interval"),
])
def test_refusals_name_the_field(change, message):
    config = dict(tiny_config("debug-qwen3.5-text"), **change)
    with pytest.raises((UnsupportedModelError, KeyError), match=re.escape(message)):
        ModelArchitecture.from_hf_config(config)


def test_wrapper_refusals_read_the_text_config():
    config = tiny_config("debug-qwen3.5")
    with pytest.raises(UnsupportedModelError, match="needs a 'text_config'"):
        ModelArchitecture.from_hf_config({k: v for k, v in config.items() if k != "text_config"})
    moe = tiny_config("debug-qwen3.5-moe")
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):  # a dense wrapper with experts
        ModelArchitecture.from_hf_config(dict(config, text_config=moe["text_config"]))


def test_other_families_refuse_linear_attention_layers():
    config = dict(tiny_config("tiny-qwen3"), layer_types=["linear_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="field 'layer_types'"):
        ModelArchitecture.from_hf_config(config)


def test_transformer_config_fields():
    from megatron_psrl.model.gpt import build_transformer_config

    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-next"))
    config = build_transformer_config(arch)
    assert config.experimental_attention_variant == "gated_delta_net"
    assert config.linear_attention_freq == [1, 1, 1, 0]
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
            config.linear_value_head_dim, config.linear_conv_kernel_dim) == (2, 4, 8, 8, 4)
    assert config.attention_output_gate and config.layernorm_zero_centered_gamma and config.qk_layernorm
    assert config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size == 48


@pytest.mark.parametrize("tp,dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_prefix_states_softmax_and_recurrent(tp, dtype):
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3.5-text"))
    states = arch.family.prefix_states(arch, tp, dtype)
    softmax = PrefixState.softmax(2 // tp, 16, dtype=dtype)
    # (the recurrent state is kept in fp32 whatever the model dtype: the kernels carry it so)
    recurrent = PrefixState.recurrent(4 // tp, 8, 8, (2 * 16 + 32) // tp, 4, dtype=torch.float32)
    assert states == (recurrent,) * 3 + (softmax,)


@pytest.mark.parametrize("model_type,name", HYBRID)
def test_adapter_names_transformers_checkpoint_and_round_trips_it(model_type, name, hybrid_checkpoints):
    """The adapter's names and shapes are those transformers saves; its conversion both ways is
    bit for bit; the vision tower (wrappers) is outside the adapter's names."""
    hf = read_safetensors(hybrid_checkpoints(name))
    arch = ModelArchitecture.from_hf_config(tiny_config(name))
    adapter = get_adapter(arch)
    carried = {k for k in hf if k.startswith("model.visual.")}
    assert bool(carried) == (model_type in WRAPPERS)
    assert {k: tuple(v.shape) for k, v in hf.items() if k not in carried} == adapter.hf_shapes()
    mcore = dict(adapter.hf_to_mcore(hf.__getitem__))
    assert sum(t.numel() for t in mcore.values()) == arch.num_parameters()
    back = dict(adapter.mcore_to_hf(mcore))
    assert set(back) == set(hf) - carried and all(torch.equal(back[k], hf[k]) for k in back)


@pytest.mark.parametrize("model_type,name", HYBRID)
@pytest.mark.parametrize("tp", [1, 2])
def test_legacy_round_trip_is_bit_exact_with_the_vision_tower(model_type, name, tp, hybrid_checkpoints, tmp_path):
    src = hybrid_checkpoints(name)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    hf_to_mcore(src, str(ckpt), tp=tp, progress=False, ckpt_format="legacy")
    assert (ckpt / "release" / PASSTHROUGH_FILE).exists() == (model_type in WRAPPERS)
    mcore_to_hf(str(ckpt), str(back), progress=False)
    a, b = read_safetensors(src), read_safetensors(str(back))
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((back / "config.json").read_text()) == json.loads(open(os.path.join(src, "config.json")).read())


def test_a_checkpoint_without_the_vision_tower_takes_it_from_the_template(hybrid_checkpoints, tmp_path):
    """A checkpoint holding the model only (as training saves one): mcore-to-hf refuses in one
    line without --hf-template, and takes the vision tower from it with one."""
    src = hybrid_checkpoints("debug-qwen3.5")
    ckpt, model_only = tmp_path / "ckpt", tmp_path / "model-only"
    hf_to_mcore(src, str(ckpt), progress=False, ckpt_format="legacy")
    mcore_to_mcore(str(ckpt), str(model_only), ckpt_format="legacy")
    assert not (model_only / "release" / PASSTHROUGH_FILE).exists()
    with pytest.raises(CheckpointError, match="--hf-template") as exc:
        mcore_to_hf(str(model_only), str(tmp_path / "refused"), progress=False)
    assert "\n" not in str(exc.value)
    mcore_to_hf(str(model_only), str(tmp_path / "back"), hf_template=src, progress=False)
    a, b = read_safetensors(src), read_safetensors(str(tmp_path / "back"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _with_mtp_layer(src: str, dst, text_config: bool) -> dict:
    """A copy of the checkpoint ``src`` as released ones are: ``mtp_num_hidden_layers`` 1 and
    ``mtp.*`` tensors (a draft head transformers does not build); returns those tensors."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    config = json.loads(open(os.path.join(dst, "config.json")).read())
    (config["text_config"] if text_config else config)["mtp_num_hidden_layers"] = 1
    open(os.path.join(dst, "config.json"), "w").write(json.dumps(config))
    gen = torch.Generator().manual_seed(3)
    mtp = {"mtp.fc.weight": torch.randn(8, 16, generator=gen), "mtp.norm.weight": torch.randn(8, generator=gen),
           "mtp.layers.0.mlp.up_proj.weight": torch.randn(4, 8, generator=gen).to(torch.bfloat16)}
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    assert files == ["model.safetensors"], files  # (one shard: the tiny checkpoints)
    path = os.path.join(dst, "model.safetensors")
    save_file(dict(read_safetensors(str(dst)), **mtp), path, metadata={"format": "pt"})
    return mtp


@pytest.mark.parametrize("name,text_config", [("debug-qwen3.5-text", False), ("debug-qwen3.5", True),
                                              ("debug-qwen3-next", False)])
def test_released_checkpoints_with_mtp_layers_load_and_carry_them_through(name, text_config, hybrid_checkpoints,
                                                                          tmp_path):
    """Every released Qwen3.5 / Qwen3-Next config has one multi-token-prediction layer: it is
    accepted, not built (the model's parameters are those without it), and its ``mtp.*``
    tensors come back from the round trip bit for bit."""
    src = tmp_path / "released"
    mtp = _with_mtp_layer(hybrid_checkpoints(name), src, text_config)
    config = json.loads((src / "config.json").read_text())
    arch = ModelArchitecture.from_hf_config(config)
    assert arch.mtp_layers == 1
    assert arch.num_parameters() == ModelArchitecture.from_hf_config(tiny_config(name)).num_parameters()
    assert get_adapter(arch).hf_passthrough_prefixes[-1] == "mtp."
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    hf_to_mcore(str(src), str(ckpt), progress=False, ckpt_format="legacy")
    mcore_to_hf(str(ckpt), str(back), progress=False)
    a, b = read_safetensors(str(src)), read_safetensors(str(back))
    assert set(a) == set(b) and set(mtp) <= set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_qwen3_5_moe_routing_is_renormalised_whatever_the_config_says():
    """transformers' Qwen3.5-MoE router always renormalises its top-k weights (it has no
    ``norm_topk_prob``); Qwen3-Next's reads the field."""
    for name in ("debug-qwen3.5-moe-text", "debug-qwen3.5-moe"):
        config = tiny_config(name)
        if "text_config" in config:
            config = dict(config, text_config=dict(config["text_config"], norm_topk_prob=False))
        else:
            config = dict(config, norm_topk_prob=False)
        assert ModelArchitecture.from_hf_config(config).moe_norm_topk_prob
    assert not ModelArchitecture.from_hf_config(dict(tiny_config("debug-qwen3-next"), norm_topk_prob=False)).moe_norm_topk_prob
