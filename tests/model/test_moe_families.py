"""Qwen2-MoE (routed experts + a sigmoid-gated shared expert), Mixtral, gpt-oss (sliding-window
and full layers with attention sinks, biases, clamped-SwiGLU experts) and GLM-4.5 (grouped
sigmoid routing with an expert bias, an ungated shared expert, a dense first layer) on
megatron-core's MoELayer: config parsing and refusals, the bit-exact HF <-> megatron conversion
(in memory, and through the converter's torch_dist checkpoint), and exactness with prefix
sharing against the per-sample Hugging Face reference at EP = 1 (docs/moe.md). Qwen3-MoE:
tests/model/test_moe.py; GLM-4.5's own cases: tests/model/test_glm4_moe.py."""

import copy
import json
import os
import re

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import make_family_checkpoint
from helpers.hf_reference import (
    assert_grads_close,
    hf_grads_to_mcore,
    load_hf_model,
    per_sample_logprobs,
    per_sample_loss_and_grads,
)
from helpers.torchrun import REPO_ROOT, run_torchrun

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.model.adapters import get_adapter, unfuse_experts
from megatron_psrl.model.architecture import ModelArchitecture, UnsupportedModelError
from megatron_psrl.model.gpt import moe_config_fields
from megatron_psrl.model.tiny import tiny_config

FAMILIES = {"qwen2_moe": "debug-qwen2-moe", "mixtral": "debug-mixtral", "gpt_oss": "debug-gpt-oss",
            "glm4_moe": "debug-glm4-moe", "deepseek_v3": "debug-deepseek-v3-moe"}
MICRO_BATCH = 32  # below the longest trees: cached prefixes (mechanism 2) in every step (as test_moe.py)
LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_expert_parallel.py")

# The published config.json files (the fields that matter here).
QWEN15_MOE_A27B = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=151936,
                       hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                       decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", max_position_embeddings=8192,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False, sliding_window=32768,
                       max_window_layers=21, tie_word_embeddings=False, torch_dtype="bfloat16",
                       router_aux_loss_coef=0.001)
MIXTRAL_8X7B = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    num_local_experts=8, num_experts_per_tok=2, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False,
                    torch_dtype="bfloat16", router_aux_loss_coef=0.02, output_router_logits=False)
GPT_OSS_120B = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
                    intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, num_local_experts=128, num_experts_per_tok=4, experts_per_token=4,
                    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18,
                    attention_bias=True, hidden_act="silu", swiglu_limit=7.0, rms_norm_eps=1e-5,
                    max_position_embeddings=131072, initial_context_length=4096, rope_theta=150000,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=4096),
                    tie_word_embeddings=False, torch_dtype="bfloat16", router_aux_loss_coef=0.9)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """``model_type -> save_pretrained folder`` of the debug config (built once, lazily)."""
    cache = {}

    def get(model_type):
        if model_type not in cache:
            cache[model_type] = make_family_checkpoint(tiny_config(FAMILIES[model_type]),
                                                       str(tmp_path_factory.mktemp(f"hf-{model_type}")), seed=3)
        return cache[model_type]

    return get


@pytest.fixture(scope="module")
def records():
    return random_tree_records(seed=5, num_roots=3)


# ------------------------------------------------------------------------------- architecture
def test_published_configs_parse():
    qwen = ModelArchitecture.from_hf_config(copy.deepcopy(QWEN15_MOE_A27B))
    assert (qwen.num_experts, qwen.moe_ffn_hidden_size, qwen.moe_router_topk, qwen.moe_norm_topk_prob) == (
        60, 1408, 4, False)
    assert (qwen.moe_shared_expert_ffn_hidden_size, qwen.moe_shared_expert_gate) == (5632, True)
    assert qwen.qkv_bias and not qwen.qk_norm and qwen.sliding_window is None
    assert 14.2e9 < qwen.num_parameters() < 14.4e9  # the published size (14.3B total)
    active = qwen.num_parameters() - qwen.num_layers * (qwen.mlp_parameters() - qwen.active_mlp_parameters())
    assert 2.6e9 < active < 2.8e9  # "A2.7B"
    mixtral = ModelArchitecture.from_hf_config(copy.deepcopy(MIXTRAL_8X7B))
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.moe_router_topk, mixtral.moe_norm_topk_prob) == (
        8, 14336, 2, True)
    assert mixtral.moe_shared_expert_ffn_hidden_size is None and not mixtral.qkv_bias and not mixtral.qk_norm
    assert 46.6e9 < mixtral.num_parameters() < 46.8e9  # 46.7B total
    active = mixtral.num_parameters() - mixtral.num_layers * (mixtral.mlp_parameters() - mixtral.active_mlp_parameters())
    assert 12.8e9 < active < 13.0e9  # 12.9B active per token
    oss = ModelArchitecture.from_hf_config(copy.deepcopy(GPT_OSS_120B))
    assert (oss.num_experts, oss.moe_ffn_hidden_size, oss.moe_router_topk, oss.moe_norm_topk_prob) == (
        128, 2880, 4, True)
    assert oss.sliding_window == 128 and oss.sliding_window_layers == tuple(range(0, 36, 2))
    assert oss.attention_sinks and oss.linear_bias and oss.qkv_bias and oss.sample_length_limit is None
    assert (oss.rope.rope_type, oss.rope.factor, oss.rope.truncate, oss.rope.theta) == ("yarn", 32.0, False, 150000.0)
    assert 116.7e9 < oss.num_parameters() < 116.9e9  # the published size (116.8B total)
    active = oss.num_parameters() - oss.num_layers * (oss.mlp_parameters() - oss.active_mlp_parameters())
    assert 5.1e9 < active - oss.vocab_size * oss.hidden_size < 5.2e9  # 5.13B active (the input embedding not counted)
    for arch in (qwen, mixtral, oss):  # as psrl_model.json stores it (GLM-4.5-Air: test_glm4_moe.py)
        assert ModelArchitecture.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch


def test_router_and_shared_expert_settings():
    """HF norm_topk_prob (Qwen2-MoE default false; Mixtral always renormalises) -> megatron's
    moe_router_pre_softmax; Qwen2-MoE's shared expert -> SharedExpertMLP with its sigmoid gate."""
    qwen = moe_config_fields(ModelArchitecture.from_hf_config(tiny_config("debug-qwen2-moe")))
    assert (qwen["moe_router_score_function"], qwen["moe_router_pre_softmax"]) == ("softmax", True)
    assert (qwen["moe_shared_expert_intermediate_size"], qwen["moe_shared_expert_gate"]) == (48, True)
    cfg = tiny_config("debug-qwen2-moe")
    del cfg["norm_topk_prob"]  # transformers' default: false
    assert moe_config_fields(ModelArchitecture.from_hf_config(cfg))["moe_router_pre_softmax"] is True
    cfg["norm_topk_prob"] = True
    assert moe_config_fields(ModelArchitecture.from_hf_config(cfg))["moe_router_pre_softmax"] is False
    mixtral = moe_config_fields(ModelArchitecture.from_hf_config(tiny_config("debug-mixtral")))
    assert (mixtral["moe_router_pre_softmax"], mixtral["moe_shared_expert_intermediate_size"]) == (False, None)
    assert mixtral["moe_ffn_hidden_size"] == 32 and not mixtral["moe_shared_expert_gate"]


def test_mixtral_sliding_window_is_read_as_mistral():
    """As the dense Mistral path: a sliding window is kept (samples longer than it are refused
    when a batch is read); none in Mixtral-8x7B."""
    assert ModelArchitecture.from_hf_config(dict(tiny_config("debug-mixtral"), sliding_window=4096)).sliding_window == 4096
    assert ModelArchitecture.from_hf_config(tiny_config("debug-mixtral")).sliding_window is None
    # Qwen2-MoE: a sliding_window value is inert unless use_sliding_window (as Qwen2)
    assert ModelArchitecture.from_hf_config(dict(tiny_config("debug-qwen2-moe"), sliding_window=0)).sliding_window is None


@pytest.mark.parametrize("name", sorted(FAMILIES.values()) + ["qwen2-moe-no-qkv-bias"])
def test_the_debug_configs_match_the_hf_models(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(name) if name in FAMILIES.values() else dict(tiny_config("debug-qwen2-moe"), qkv_bias=False)
    arch = ModelArchitecture.from_hf_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**copy.deepcopy(cfg)))
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert (arch.num_experts, arch.moe_router_topk) == (8, 2)
    in_memory = unfuse_experts({k: torch.empty(v.shape) for k, v in model.state_dict().items()}, arch.model_type)
    shapes = get_adapter(arch).hf_shapes()
    assert set(in_memory) == set(shapes)  # (untied embeddings)
    assert all(tuple(in_memory[k].shape) == s for k, s in shapes.items())


REFUSED = [
    ("qwen2_moe", dict(mlp_only_layers=[1]), ["dense MLP layers", "[1]", "mlp_only_layers"]),
    ("qwen2_moe", dict(decoder_sparse_step=2), ["dense MLP layers", "[0]", "decoder_sparse_step"]),
    ("qwen2_moe", dict(use_sliding_window=True), ["use_sliding_window"]),
    ("qwen2_moe", dict(shared_expert_intermediate_size=None), ["qwen2_moe", "shared_expert_intermediate_size"]),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), ["shared_expert_intermediate_size"]),
    ("qwen2_moe", dict(num_experts_per_tok=9), ["num_experts_per_tok"]),
    ("qwen2_moe", dict(hidden_act="gelu"), ["activation", "gelu"]),
    ("mixtral", dict(router_jitter_noise=0.01), ["router_jitter_noise"]),
    ("mixtral", dict(attention_bias=True), ["attention_bias"]),
    ("mixtral", dict(num_local_experts=None), ["mixtral", "mixture-of-experts", "num_local_experts"]),
    ("mixtral", dict(num_experts_per_tok=0), ["num_experts_per_tok"]),
    ("gpt_oss", dict(quantization_config=dict(quant_method="mxfp4")), ["quantization_config", "mxfp4"]),
    ("gpt_oss", dict(attention_bias=False), ["attention_bias"]),
    ("gpt_oss", dict(swiglu_limit=5.0), ["swiglu_limit"]),
    ("gpt_oss", dict(layer_types=["sliding_attention", "chunked_attention"]), ["layer_types", "chunked_attention"]),
    ("gpt_oss", dict(sliding_window=0), ["sliding_window"]),
    ("gpt_oss", dict(layer_types=["sliding_attention"]), ["layer_types", "num_hidden_layers"]),
    # GLM-4.5 (grouped routing): DeepSeek-V2's routers, a group score megatron computes otherwise
    # (its best k / topk_group experts, HF's best 2), megatron's sigmoid renormalisation rule
    ("glm4_moe", dict(topk_method="greedy"), ["topk_method 'greedy'", "noaux_tc"]),
    ("glm4_moe", dict(scoring_func="softmax"), ["scoring_func 'softmax'", "sigmoid"]),
    ("glm4_moe", dict(num_experts_per_tok=4), ["num_experts_per_tok 4 and topk_group 1", "= 4 experts", "best 2"]),
    ("glm4_moe", dict(norm_topk_prob=False), ["norm_topk_prob False", "renormalises"]),
    ("glm4_moe", dict(n_group=3), ["n_group 3 must divide n_routed_experts 8"]),
    ("glm4_moe", dict(first_k_dense_replace=3), ["first_k_dense_replace", "num_hidden_layers=3"]),
    ("glm4_moe", dict(moe_layer_freq=2), ["moe_layer_freq 2"]),
    ("glm4_moe", dict(n_routed_experts=None), ["glm4_moe", "n_routed_experts"]),
    ("glm4_moe", dict(mlp_bias=True), ["mlp_bias"]),
]


@pytest.mark.parametrize("model_type,override,words", REFUSED,
                         ids=[f"{t}-{next(iter(o))}-{next(iter(o.values()))}" for t, o, _ in REFUSED])
def test_unsupported_variants_are_refused(model_type, override, words, tmp_path):
    cfg = {k: v for k, v in dict(tiny_config(FAMILIES[model_type]), **override).items() if v is not None}
    with pytest.raises(UnsupportedModelError) as err:
        ModelArchitecture.from_hf_config(cfg)
    for word in words:
        assert word in str(err.value)
    assert "\n" not in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # from a folder: the same, with its path
    with pytest.raises(UnsupportedModelError, match=str(tmp_path)):
        ModelArchitecture.from_hf_dir(str(tmp_path))


# ------------------------------------------------------------------------------- conversion
def test_hf_megatron_round_trip_is_bit_exact(family, hf_dirs):
    """What save_pretrained wrote (the Hub's per-expert names) -> megatron -> HF names again,
    bit for bit; transformers' in-memory fused experts name the same tensors (family given, or
    read from the state dict)."""
    from safetensors.torch import load_file

    from megatron_psrl.checkpoint.loading import hf_full_state_dict, hf_memory_state_dict

    hf_dir = hf_dirs(family)
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    on_disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    expert = {"qwen2_moe": "mlp.experts.7.down_proj.weight", "mixtral": "block_sparse_moe.experts.7.w2.weight",
              "gpt_oss": "mlp.experts.down_proj_bias", "glm4_moe": "mlp.experts.7.down_proj.weight",
              "deepseek_v3": "mlp.experts.7.down_proj.weight"}[family]
    assert f"model.layers.1.{expert}" in on_disk
    assert set(on_disk) == set(get_adapter(arch).hf_keys())
    mcore = hf_full_state_dict(hf_dir, arch, strict=True)
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in mcore
    assert "decoder.layers.1.mlp.router.weight" in mcore
    if family in ("glm4_moe", "deepseek_v3"):  # layer 0 dense; the router's expert bias, fp32, bit for bit
        assert mcore["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * arch.ffn_hidden_size, 64)
        assert mcore["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
        assert mcore["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (2 * 32, 64)
    if family == "qwen2_moe":
        assert mcore["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (2 * 48, 64)
        assert mcore["decoder.layers.1.mlp.shared_experts.gate_weight"].shape == (1, 64)
        assert "decoder.layers.1.self_attention.linear_qkv.bias" in mcore
    back = dict(get_adapter(arch).mcore_to_hf(mcore))
    assert set(back) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(back[name], tensor), name
    if family == "gpt_oss":  # sinks, biases, the router's bias; experts fused on disk too
        assert mcore["decoder.layers.1.self_attention.core_attention.softmax_offset"].shape == (4,)
        assert mcore["decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.bias"].shape == (2 * 32,)
        assert "decoder.layers.1.mlp.router.bias" in mcore and "decoder.layers.1.self_attention.linear_proj.bias" in mcore
    memory = load_hf_model(hf_dir).state_dict()
    router = "router" if family == "gpt_oss" else "gate"
    assert "model.layers.1.mlp.experts.gate_up_proj" in memory and f"model.layers.1.mlp.{router}.weight" in memory
    for model_type in (family, None):
        in_memory = unfuse_experts(memory, model_type)
        for name, tensor in on_disk.items():
            assert torch.equal(in_memory[name], tensor), name
    from_memory = hf_memory_state_dict(memory, arch, strict=True)
    assert set(from_memory) == set(mcore) and all(torch.equal(from_memory[k], mcore[k]) for k in mcore)


def test_converter_round_trip_is_bit_exact(family, hf_dirs, tmp_path):
    """hf-to-mcore (torch_dist) then mcore-to-hf reproduces every tensor and config.json."""
    from safetensors.torch import load_file

    from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    src = hf_dirs(family)
    hf_to_mcore(src, str(tmp_path / "ckpt"), progress=False)
    mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    a = load_file(os.path.join(src, "model.safetensors"))
    b = {}
    for f in sorted(os.listdir(tmp_path / "back")):
        if f.endswith(".safetensors"):
            b.update(load_file(str(tmp_path / "back" / f)))
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    with open(os.path.join(src, "config.json")) as f:
        assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.load(f)


def test_gpt_oss_legacy_tensor_parallel_round_trip_is_bit_exact(hf_dirs, tmp_path):
    """A legacy checkpoint of two tensor-parallel shards: each holds its heads' sinks and q/k/v
    biases, the output bias whole (added after the reduce), the experts whole; merged back, every
    tensor is the original."""
    from safetensors.torch import load_file

    from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf
    from megatron_psrl.checkpoint.sharding import shard_state_dict

    src = hf_dirs("gpt_oss")
    hf_to_mcore(src, str(tmp_path / "ckpt"), tp=2, ckpt_format="legacy", progress=False)
    mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    arch = ModelArchitecture.from_hf_dir(src)
    from megatron_psrl.checkpoint.loading import hf_full_state_dict

    full = hf_full_state_dict(src, arch)
    shards = shard_state_dict(full, arch, 2, 1)
    name = "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert torch.equal(torch.cat([shards[(0, 0)][name], shards[(1, 0)][name]]), full[name])
    bias = "decoder.layers.0.self_attention.linear_proj.bias"
    assert torch.equal(shards[(1, 0)][bias], full[bias])


# ------------------------------------------------------------------------------- exactness
def _actor(hf_dir, **overrides):
    return PolicyActor(hf_dir, ActorConfig(device="cpu", micro_batch_tokens=MICRO_BATCH, loss=LOSS,
                                           optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0),
                                           **overrides))


@pytest.mark.parametrize("model_type,dispatcher", [("qwen2_moe", "allgather"), ("mixtral", "alltoall"),
                                                   ("gpt_oss", "alltoall")])
def test_logprobs_loss_and_gradients_equal_the_per_sample_reference(model_type, dispatcher, hf_dirs, records):
    """Prefix sharing (mechanisms 1 and 2: micro-batches of 32 tokens, cached prefixes) with
    dropless top-k routing at EP = 1: log-probs, the loss and every gradient (router, every
    expert, and Qwen2-MoE's shared expert and its gate included) equal the per-sample HF
    computation (fp32). (GLM-4.5: tests/model/test_glm4_moe.py, the mixed workload at a tight
    KV budget.)"""
    hf_dir = hf_dirs(model_type)
    hf_model = load_hf_model(hf_dir)
    batch = samples_from_dicts(records, source="records")
    actor = _actor(hf_dir, moe_token_dispatcher_type=dispatcher)
    ours = actor.compute_logprobs(records)
    for a, b in zip(ours, per_sample_logprobs(hf_model, batch)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    result = actor.forward_backward(records)
    actor.engine.optimizer.reduce_gradients()
    grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}
    ref_loss, ref_grads = per_sample_loss_and_grads(hf_model, batch, LOSS.clip_eps, LOSS.kl_coef, LOSS.entropy_coef,
                                                    LOSS.loss_agg)
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    assert result.metrics["micro_batches"] > 1 and result.metrics["tokens_computed"] < batch.num_tokens
    assert "kv_block_size" in result.metrics  # cached prefix K/V were used (mechanism 2)
    ref = hf_grads_to_mcore(ref_grads, actor.arch)
    assert any(".mlp.router." in n for n in ref) and any(".local_experts.7." in n for n in ref)
    if model_type == "qwen2_moe":
        for name in ("shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight",
                     "shared_experts.gate_weight"):
            assert ref[f"decoder.layers.0.mlp.{name}"].abs().max() > 0, name  # gradients that matter
    assert_grads_close(grads, ref, rtol=1e-5)
    actor.close()


def test_qwen2_moe_checkpoint_and_hf_export_round_trip(hf_dirs, records, tmp_path):
    """EP = 1: a trained step's weights, the shared expert and its gate included, survive a
    torch_dist checkpoint and an HF export (which loads into transformers)."""
    from safetensors.torch import load_file

    config = ActorConfig(device="cpu", micro_batch_tokens=MICRO_BATCH, optimizer=OptimizerSettings(lr=1e-3))
    actor = PolicyActor(hf_dirs("qwen2_moe"), config)
    actor.train_step(records)
    actor.save(str(tmp_path / "ckpt"))
    again = PolicyActor(str(tmp_path / "ckpt"), config)
    names = [name for name, _ in actor.model.named_parameters()]
    assert any(name.endswith("shared_experts.gate_weight") for name in names)
    for (name, a), b in zip(actor.model.named_parameters(), again.model.parameters()):
        assert torch.equal(a, b), name
    out = actor.export_hf(str(tmp_path / "hf"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    hf = actor.state_dict_hf()
    assert set(exported) == set(hf) and "model.layers.1.mlp.shared_expert_gate.weight" in exported
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
    reloaded = unfuse_experts(load_hf_model(out).state_dict(), "qwen2_moe")
    assert all(torch.equal(reloaded[k], hf[k]) for k in hf)
    again.close()
    actor.close()


# (GLM-4.5 at EP = 2: test_router_replay.py, replayed routes; test_sequence_parallel.py, TP = 2 x EP = 2)
@pytest.mark.slow  # two processes
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_expert_parallel_under_torchrun(model_type, hf_dirs):
    """EP = DP = 2 over gloo (the script of test_moe.py): every rank's log-probs, loss, gradients
    (Qwen2-MoE's shared expert is dense: summed over DP) and SGD step match the per-sample
    reference, with empty passes running (asserted inside the script)."""
    out = run_torchrun(SCRIPT, [hf_dirs(model_type), "16", "tree", "3"], nproc=2, timeout=600)
    reports = re.findall(r"rank (\d) ep_rank \d: .*?empty passes (\d+)", out)
    assert sorted(rank for rank, _ in reports) == ["0", "1"], out[-3000:]
    assert sum(int(empty) for _, empty in reports) > 0, reports
