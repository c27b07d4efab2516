"""DeepSeek-V3 (and Kimi K2, ``kimi_k2``): latent attention's config parsing and refusals, the
softmax scale against transformers', megatron's model built from it, the adapter against
transformers' own checkpoints (with and without the query latent), a tensor-parallel
checkpoint's layout, and the multi-token-prediction layers carried through conversions.

Log-probs and gradients against transformers: tests/model/test_hf_equivalence.py (the
``deepseek-v3`` test families); training with prefix sharing: tests/training/test_exactness.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import pytest
import torch
from helpers.families import family_config, make_family_checkpoint
from helpers.hf_reference import load_hf_model
from helpers.hybrid import read_safetensors

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf
from megatron_psrl.checkpoint.passthrough import PASSTHROUGH_FILE
from megatron_psrl.data.synthetic import make_stepwise
from megatron_psrl.errors import ConfigurationError, UnsupportedModelError
from megatron_psrl.kvcache.prefix_state import PrefixState
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.families import get_family
from megatron_psrl.model.gpt import build_layer_spec, build_transformer_config
from megatron_psrl.model.tiny import tiny_config
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = make_family_checkpoint(family_config(name), str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def test_config_parses_latent_attention():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-deepseek-v3"))
    assert arch.multi_latent_attention and not arch.is_moe
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim) == (
        32, 24, 16, 8, 12)
    assert (arch.head_dim, arch.rope_head_dim, arch.num_kv_heads) == (24, 8, 4)  # query/key: nope + rope
    assert arch.rope.inv_freq(arch.rope_head_dim).numel() == 4
    no_q = ModelArchitecture.from_hf_config(family_config("deepseek-v3-q-proj"))
    assert no_q.q_lora_rank is None and no_q.rope.rope_type == "default" and no_q.tie_word_embeddings


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-q-proj"])
def test_softmax_scale_is_transformers_and_megatrons(name):
    """transformers' ``DeepseekV3Attention.scaling`` (YaRN's mscale_all_dim correction squared),
    and megatron's MLA core attention is built with it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model.builder import build_model

    cfg = family_config(name)
    arch = ModelArchitecture.from_hf_config(cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert arch.softmax_scale() == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert arch.rope.attention_scaling() == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    if name == "deepseek-v3":  # the correction is there to see
        assert arch.softmax_scale() > 1.2 / arch.head_dim ** 0.5 and arch.rope.attention_scaling() < 0.97
    initialize_parallel(1, 1, device="cpu")
    model = build_model(arch)
    attention = model.decoder.layers[0].self_attention
    assert attention.core_attention.softmax_scale == pytest.approx(arch.softmax_scale(), rel=1e-12)
    assert (attention.core_attention.head_dim, attention.core_attention.value_dim) == (24, arch.v_head_dim)
    assert attention.rope_mscale == arch.rope.attention_scaling()


@pytest.mark.parametrize("override,words", [
    (dict(attention_bias=True), ["attention_bias"]),
    (dict(rope_interleave=False), ["rope_interleave"]),
    (dict(num_key_value_heads=2), ["num_key_value_heads"]),
    (dict(first_k_dense_replace=1, topk_method="greedy"), ["topk_method 'greedy'", "noaux_tc"]),  # DeepSeek-V2's
    (dict(first_k_dense_replace=1, num_experts_per_tok=4), ["num_experts_per_tok 4 and topk_group 1", "best 2"]),
    (dict(qk_rope_head_dim=7), ["qk_rope_head_dim", "even"]),
    (dict(kv_lora_rank=0), ["kv_lora_rank"]),
], ids=["attention-bias", "rope-not-interleaved", "kv-heads", "greedy-router", "group-score", "odd-rope",
        "no-latent"])
def test_variants_not_implemented_are_refused_naming_the_field(override, words):
    cfg = {k: v for k, v in dict(tiny_config("debug-deepseek-v3"), **override).items() if v is not None}
    with pytest.raises(UnsupportedModelError) as err:
        ModelArchitecture.from_hf_config(cfg)
    for word in words:
        assert word in str(err.value)


def test_the_deepseek_v3_class_shape_parses_with_its_moe_layers():
    """DeepSeek-V3's config.json: 58 MoE layers after 3 dense ones, 256 experts top-8 from the best
    4 of 8 groups, one shared expert; 671.0B parameters (its multi-token-prediction layer not built)."""
    arch = ModelArchitecture.from_hf_config(tiny_config("deepseek-v3-class"))
    assert (arch.head_dim, arch.v_head_dim, arch.mtp_layers) == (192, 128, 1)
    assert arch.latent_attention_parameters() == (1536 * (7168 + 1 + 128 * 192) + 7168 * 576 + 512
                                                  + 512 * 128 * 256 + 128 * 128 * 7168)
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_router_num_groups, arch.moe_router_group_topk) == (
        256, 8, 8, 4)
    assert arch.dense_mlp_layers == [0, 1, 2] and len(arch.moe_layers) == 58
    assert arch.moe_shared_expert_ffn_hidden_size == 2048 and arch.moe_router_topk_scaling_factor == 2.5
    assert arch.moe_router_expert_bias and not arch.moe_shared_expert_gate
    assert arch.num_parameters() == 671_026_404_352


def test_transformers_defaults_fill_the_moe_fields():
    """A config without the optional MoE fields: DeepseekV3Config's defaults (first 3 layers
    dense, 8 groups keeping 4, routing weights scaled by 2.5, one shared expert)."""
    optional = ("first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
                "norm_topk_prob")
    cfg = {k: v for k, v in tiny_config("debug-deepseek-v3-moe").items() if k not in optional}
    arch = ModelArchitecture.from_hf_config(dict(cfg, num_hidden_layers=4, n_routed_experts=16,
                                                 num_experts_per_tok=8))
    assert arch.dense_mlp_layers == [0, 1, 2] and arch.moe_layers == (3,)
    assert (arch.moe_router_num_groups, arch.moe_router_group_topk) == (8, 4)
    assert arch.moe_router_topk_scaling_factor == 2.5 and arch.moe_shared_expert_ffn_hidden_size == 32
    dense = ModelArchitecture.from_hf_config(dict(cfg, num_hidden_layers=3))  # every layer dense
    assert not dense.is_moe and dense.family is arch.family


def test_the_moe_config_builds_dense_then_moe_layers():
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model.builder import build_model

    initialize_parallel(1, 1, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-deepseek-v3-moe"))
    model = build_model(arch)
    layers = model.decoder.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["MLP", "MoELayer", "MoELayer"]
    assert all(type(layer.self_attention).__name__ == "TreeMLASelfAttention" for layer in layers)
    router = layers[1].mlp.router
    assert router.score_function == "sigmoid" and router.expert_bias is not None
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()


def test_kimi_k2_is_deepseek_v3():
    """Kimi K2 ships ``model_type`` ``kimi_k2`` with DeepSeek-V3's architecture: the same bundle."""
    cfg = dict(tiny_config("debug-deepseek-v3"), model_type="kimi_k2")
    arch = ModelArchitecture.from_hf_config(cfg)
    assert arch.model_type == "kimi_k2" and arch.family is get_family("deepseek_v3")
    assert ModelArchitecture.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    assert type(get_adapter(arch)).__name__ == "DeepseekV3Adapter"


def test_prefix_state_and_layer_spec():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-deepseek-v3"))
    per_head = dataclasses.replace(arch, latent_cache="per-head")
    for tp, dtype in ((1, torch.float32), (2, torch.bfloat16)):
        size = 2 if dtype == torch.bfloat16 else 4
        state = PrefixState.softmax(4 // tp, 24, 12, dtype=dtype)  # K nope + rope, V narrower
        assert per_head.family.prefix_states(per_head, tp, dtype) == (state,) * 2
        assert state.nbytes(1, ("values",)) == 4 // tp * (24 + 12) * size
        # the default: the latent (24) and the RoPE key (8), whole on every rank; a reader also
        # keeps its heads' up-projected keys and values
        latent = arch.family.prefix_states(arch, tp, dtype)[0]
        assert latent.tap.value == "before_up_projection" and latent.kinds("values") == ("latent", "rope_key")
        assert latent.nbytes(1, ("values",)) == (24 + 8) * size
        assert latent.reader_nbytes(1) == (24 + 8 + 4 // tp * (24 + 12)) * size
    flops = CostModel.for_architecture(arch).read_flops_per_token  # r x n (nope + v), fwd + bwd, 2 layers
    assert flops == 3 * 2 * 24 * 4 * (16 + 12) * 2 and CostModel.for_architecture(per_head).read_flops_per_token == 0
    # every rank's planned cost charges the cached tokens its micro-batches read
    batch = make_stepwise(num_trajectories=1, turns=4, obs_len=(6, 10), action_len=(3, 6), system_len=10,
                          task_len=(6, 10), vocab_size=256, seed=3)
    plans = [plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=24, cost_model=CostModel.for_architecture(a)))
             for a in (arch, per_head)]
    rank = plans[0].ranks[0]
    read = sum(rank.sources[s].length for mb in rank.micro_batches for s in mb.reads)
    assert read > 0 and rank.planned_cost == pytest.approx(plans[1].ranks[0].planned_cost + flops * read)
    with pytest.raises(UnsupportedModelError, match="latent_cache 'both'"):
        dataclasses.replace(arch, latent_cache="both")
    config = build_transformer_config(arch)
    assert type(config).__name__ == "MLATransformerConfig" and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (32, 24, 16, 8, 12)
    assert build_layer_spec(arch).submodules.self_attention.module.__name__ == "TreeMLASelfAttention"
    with pytest.raises(ConfigurationError, match="transformer_impl 'local' only"):
        build_layer_spec(arch, "transformer_engine")


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-q-proj", "deepseek-v3-moe"])
def test_adapter_names_transformers_checkpoint_and_round_trips_it(name, checkpoints):
    hf = read_safetensors(checkpoints(name))
    arch = ModelArchitecture.from_hf_config(family_config(name))
    adapter = get_adapter(arch)
    assert {k: tuple(v.shape) for k, v in hf.items()} == adapter.hf_shapes()
    mcore = dict(adapter.hf_to_mcore(hf.__getitem__))
    biases = sum(t.numel() for k, t in mcore.items() if k.endswith("router.expert_bias"))  # buffers
    assert biases == (8 * 2 if arch.is_moe else 0)
    assert sum(t.numel() for t in mcore.values()) - biases == arch.num_parameters()
    back = dict(adapter.mcore_to_hf(mcore))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in back)


def test_tp2_checkpoint_has_megatrons_layout_and_loads_with_hf_logprobs(checkpoints, tmp_path):
    """Tensor parallelism splits every latent projection's output rows in two (megatron's
    column-parallel down- and up-projections); the latents' norms are whole on both ranks; a
    TP = 2 x PP = 2 checkpoint loads into a TP = 1 model with transformers' log-probs."""
    from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model import vocab_parallel_logprobs

    src = checkpoints("deepseek-v3")
    hf = read_safetensors(src)
    hf_to_mcore(src, str(tmp_path / "ck"), tp=2, pp=2, progress=False, ckpt_format="legacy")
    for r in range(2):
        shard = torch.load(tmp_path / "ck" / "release" / f"mp_rank_{r:02d}_000" / "model_optim_rng.pt")["model"]
        for hf_name, mc_name in (("kv_a_proj_with_mqa", "linear_kv_down_proj"), ("q_a_proj", "linear_q_down_proj"),
                                 ("kv_b_proj", "linear_kv_up_proj"), ("q_b_proj", "linear_q_up_proj")):
            full = hf[f"model.layers.0.self_attn.{hf_name}.weight"]
            rows = full.shape[0] // 2
            assert torch.equal(shard[f"decoder.layers.0.self_attention.{mc_name}.weight"], full[r * rows:(r + 1) * rows])
        assert torch.equal(shard["decoder.layers.0.self_attention.kv_layernorm.weight"],
                           hf["model.layers.0.self_attn.kv_a_layernorm.weight"])
    initialize_parallel(1, 1, device="cpu")
    arch, model, _ = load_model(ModelSource(checkpoint=str(tmp_path / "ck")))
    tokens = torch.randint(0, arch.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(tokens, torch.arange(30), TreeAttentionMetadata(plan=causal_plan([30])))[:, 0]
        lp, _ = vocab_parallel_logprobs(model.output_logits(hidden[:-1]), tokens[1:], arch.vocab_size)
        ref = torch.log_softmax(load_hf_model(src)(tokens[None]).logits[0, :-1].float(), -1)
    assert (lp - ref.gather(1, tokens[1:, None])[:, 0]).abs().max().item() <= 1e-4


def _with_mtp_layer(src: str, dst) -> dict:
    """A copy of ``src`` as DeepSeek-V3 is released: ``num_nextn_predict_layers`` 1, its layer's
    tensors stored as layer ``num_hidden_layers`` (a draft head transformers does not build)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    config = json.loads(open(os.path.join(dst, "config.json")).read())
    config["num_nextn_predict_layers"] = 1
    open(os.path.join(dst, "config.json"), "w").write(json.dumps(config))
    gen = torch.Generator().manual_seed(3)
    layer = f"model.layers.{config['num_hidden_layers']}."
    mtp = {layer + "eh_proj.weight": torch.randn(64, 128, generator=gen), layer + "enorm.weight": torch.randn(64),
           layer + "self_attn.kv_a_layernorm.weight": torch.randn(24, generator=gen).to(torch.bfloat16)}
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    assert files == ["model.safetensors"], files
    save_file(dict(read_safetensors(str(dst)), **mtp), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return mtp


def test_multi_token_prediction_layers_are_carried_through(checkpoints, tmp_path, caplog):
    """Accepted, not built (the model's parameters are those without it, one logged line), and
    its tensors come back from a round trip bit for bit; a model loads from the folder."""
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model.families import deepseek

    src = tmp_path / "released"
    mtp = _with_mtp_layer(checkpoints("deepseek-v3"), src)
    deepseek._MTP_LOGGED.discard("deepseek_v3")
    with caplog.at_level(logging.INFO, logger=deepseek.__name__):
        arch = ModelArchitecture.from_dict(ModelArchitecture.from_hf_dir(str(src)).to_dict())
        ModelArchitecture.from_hf_dir(str(src))
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "multi-token-prediction" in caplog.records[0].getMessage()
    assert arch.mtp_layers == 1 and arch.num_parameters() == ModelArchitecture.from_hf_config(
        tiny_config("debug-deepseek-v3")).num_parameters()
    assert get_adapter(arch).hf_passthrough_prefixes == ("model.layers.2.",)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    hf_to_mcore(str(src), str(ckpt), tp=2, progress=False, ckpt_format="legacy")
    assert (ckpt / "release" / PASSTHROUGH_FILE).exists()
    mcore_to_hf(str(ckpt), str(back), progress=False)
    a, b = read_safetensors(str(src)), read_safetensors(str(back))
    assert set(a) == set(b) and set(mtp) <= set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    initialize_parallel(1, 1, device="cpu")
    _, model, _ = load_model(ModelSource(hf_dir=str(src)))
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-q-proj"])
def test_saved_activation_count_is_what_autograd_saves(name):
    """The memory plan's count of what a forward keeps for backward (fp32 and bf16), against the
    storages ``saved_tensors_hooks`` sees (parameters excluded), on a tree pack; the debug config
    is also measured in a fresh process with the other tiny configs
    (tests/kvcache/test_activation_estimate.py; ``debug-deepseek-v3-moe`` with the other MoE
    configs, tests/kvcache/test_moe_activation_estimate.py)."""
    from megatron_psrl.attention import TreeAttentionMetadata, tree_plan
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model.builder import build_model
    from megatron_psrl.schedule.memory import saved_activation_bytes_per_token

    initialize_parallel(1, 1, device="cpu")
    arch = ModelArchitecture.from_hf_config(family_config(name))
    positions = torch.cat([torch.arange(12), 12 + torch.arange(6), 12 + torch.arange(6)])
    meta = TreeAttentionMetadata(plan=tree_plan([0, 12, 18], [12, 18, 24], [-1, 0, 0]))
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = build_model(arch, dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, arch.vocab_size, (24,)), positions, meta)
        assert sum(seen.values()) == 24 * saved_activation_bytes_per_token(arch, 1, size), dtype


def test_cost_model_charges_latent_attentions_flops():
    """Per key: ``QK^T`` over nope + rope and ``PV`` over the value width per head; per token: the
    latent projections and the MLP (through the stand-in's MLP width, rounded to whole columns)."""
    from megatron_psrl.schedule.cost import FORWARD_BACKWARD_FACTOR, CostModel

    arch = ModelArchitecture.from_hf_config(tiny_config("debug-deepseek-v3"))
    cost = CostModel.for_architecture(arch)
    n, layers, fb = arch.num_attention_heads, arch.num_layers, FORWARD_BACKWARD_FACTOR
    assert cost.attention_flops_per_key == fb * 2 * layers * n * (arch.head_dim + arch.v_head_dim)
    linear = fb * 2 * layers * (arch.latent_attention_parameters() + 3 * arch.hidden_size * arch.ffn_hidden_size)
    assert cost.linear_flops_per_token == pytest.approx(linear, abs=fb * 2 * layers * 3 * arch.hidden_size / 2)


def test_latent_cache_flag_resolves_and_refuses_sequence_parallelism():
    from megatron_psrl.engine.config import ActorConfig
    from megatron_psrl.training.arguments import build_parser

    assert build_parser().parse_args([]).latent_cache == "auto"
    assert ActorConfig().resolved_latent_cache == "latent"
    assert ActorConfig(latent_cache="per-head").resolved_latent_cache == "per-head"
    assert ActorConfig(tensor_model_parallel_size=2, sequence_parallel=True).resolved_latent_cache == "per-head"
    with pytest.raises(ConfigurationError, match="--latent-cache latent is not supported with --sequence-parallel"):
        ActorConfig(latent_cache="latent", tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ConfigurationError, match="latent_cache must be one of"):
        ActorConfig(latent_cache="compressed")
