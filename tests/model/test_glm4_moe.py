"""GLM-4.5 (``glm4_moe``): grouped sigmoid routing with an expert bias, dense first layers, an
ungated shared expert, q/k/v biases and partial RoPE (docs/moe.md "Grouped sigmoid routing").

What the joined suites do not: the published GLM-4.5-Air config, megatron's fields and the
per-layer MLPs it builds, the multi-token-prediction layer carried through a conversion, and
one training step over a GRPO group, a step-wise chain and a branching tree (the mixed
workload) at a KV budget that drops prefix graphs, with the expert bias updated from per-sample
token counts. Exactness at EP = 1 (mechanisms 1 and 2), the round trips and refusals:
tests/model/test_moe_families.py; router replay: test_router_replay.py; TP, EP, DP cross-rank:
test_sequence_parallel.py, test_router_replay.py, tests/training/test_cross_rank_exactness.py."""

import copy
import importlib
import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from helpers.batches import cross_rank_batch
from helpers.families import make_family_checkpoint
from helpers.hf_reference import load_hf_model, per_sample_loss_and_grads
from helpers.tolerance import rounding_tolerance

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import moe_config_fields
from megatron_psrl.model.logits import loss_head_peak_bytes
from megatron_psrl.model.tiny import tiny_config

NAME = "debug-glm4-moe"
LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")

# GLM-4.5-Air's published config.json (the fields that matter here)
GLM_4_5_AIR = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552, hidden_size=4096,
                   intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
                   num_key_value_heads=8, head_dim=128, n_routed_experts=128, num_experts_per_tok=8, n_group=1,
                   topk_group=1, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                   routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
                   rope_theta=1000000, rms_norm_eps=1e-05, max_position_embeddings=131072, hidden_act="silu",
                   num_nextn_predict_layers=1, tie_word_embeddings=False, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_family_checkpoint(tiny_config(NAME), str(tmp_path_factory.mktemp("hf-glm4-moe")), seed=4)


# ------------------------------------------------------------------------------- architecture
def test_glm_4_5_air_parses():
    """106B parameters, 12B active per token (embeddings aside); the dense first layer counted
    as such; its MTP layer read (carried through, not built)."""
    arch = ModelArchitecture.from_hf_config(copy.deepcopy(GLM_4_5_AIR))
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size) == (128, 8, 1408)
    assert (arch.moe_shared_expert_ffn_hidden_size, arch.moe_shared_expert_gate) == (1408, False)
    assert (arch.moe_router_score_function, arch.moe_router_expert_bias) == ("sigmoid", True)
    assert (arch.moe_router_num_groups, arch.moe_router_group_topk) == (None, None)  # one group: no limit
    assert arch.dense_mlp_layers == [0] and arch.moe_layers == tuple(range(1, 46)) and arch.mtp_layers == 1
    assert arch.qkv_bias and not arch.qk_norm and arch.rope.partial_rotary_factor == 0.5
    assert 106.8e9 < arch.num_parameters() < 106.9e9
    embeddings = 2 * arch.vocab_size * arch.hidden_size
    active = arch.num_parameters() - len(arch.moe_layers) * (arch.mlp_parameters() - arch.active_mlp_parameters())
    assert 12.1e9 < active - embeddings < 12.3e9
    # the cost model's MLP: the layers' average active width (45 MoE layers' top-8 + shared, 1 dense)
    per_layer = (45 * arch.active_mlp_parameters() + 3 * 4096 * 10944) / 46
    assert arch.active_ffn_hidden_size() == round(per_layer / (3 * 4096))
    fields = moe_config_fields(arch)
    assert fields["moe_layer_freq"] == [0] + [1] * 45
    assert fields["moe_router_topk_scaling_factor"] == 1.0 and fields["moe_router_dtype"] == "fp32"


def test_transformers_defaults_of_absent_fields():
    """As transformers' Glm4MoeConfig: partial RoPE 0.5 and RMSNorm epsilon 1e-5 where
    config.json has none, the MoE fields' defaults (one group, one shared expert, one dense
    layer, scaling 1)."""
    from transformers import AutoConfig

    cfg = {k: v for k, v in GLM_4_5_AIR.items()
           if k not in ("partial_rotary_factor", "rms_norm_eps", "n_group", "topk_group", "n_shared_experts",
                        "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob")}
    arch = ModelArchitecture.from_hf_config(cfg)
    hf = AutoConfig.for_model(**cfg)
    assert arch.rope.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5
    assert arch.rms_norm_eps == hf.rms_norm_eps == 1e-5
    assert arch.dense_mlp_layers == list(range(hf.first_k_dense_replace)) == [0]
    assert arch.moe_shared_expert_ffn_hidden_size == hf.n_shared_experts * hf.moe_intermediate_size
    assert arch.moe_router_topk_scaling_factor == hf.routed_scaling_factor and arch.moe_norm_topk_prob


def test_the_debug_model_builds_a_dense_first_layer():
    """megatron's fields of the debug config (two groups, the best one kept, weights scaled by
    2.5, the expert bias frozen unless the trainer updates it), and the model it builds: layer 1
    a dense SwiGLU MLP, layers 2 and 3 MoE layers with a sigmoid router and an ungated shared
    expert; routes, router losses and the expert load are per MoE layer."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_psrl.checkpoint import ModelSource, load_model
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model.moe import ExpertLoad, RouterReplayer, moe_layer_index

    arch = ModelArchitecture.from_hf_config(tiny_config(NAME))
    fields = moe_config_fields(arch)
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"]) == (2, 1)
    assert fields["moe_router_topk_scaling_factor"] == 2.5 and fields["moe_router_bias_update_rate"] == 0.0
    assert fields["moe_layer_freq"] == [0, 1, 1] and fields["moe_shared_expert_intermediate_size"] == 32
    initialize_parallel(1, 1, seed=0, device="cpu")
    _, model, _ = load_model(ModelSource(tiny=NAME))
    layers = model.decoder.layers
    assert type(layers[0].mlp) is MLP and all(isinstance(layer.mlp, MoELayer) for layer in layers[1:])
    router = layers[1].mlp.router
    assert router.score_function == "sigmoid" and router.expert_bias.dtype == torch.float32
    assert layers[1].mlp.shared_experts is not None and not layers[1].mlp.shared_experts.use_shared_expert_gate
    assert [moe_layer_index(router.config, layer.layer_number) for layer in layers[1:]] == [0, 1]
    assert [layer for layer, _, _ in RouterReplayer(model).replays] == [0, 1]
    assert ExpertLoad(model).layer_numbers == [2, 3]


# ------------------------------------------------------------------------------- MTP layer
def test_the_mtp_layer_is_carried_through_a_conversion(hf_dir, tmp_path, caplog):
    """GLM stores its multi-token-prediction layer as decoder layer ``num_hidden_layers``
    (``num_nextn_predict_layers`` 1): not built, carried through hf-to-mcore / mcore-to-hf
    bit for bit (a bf16 tensor stays bf16), with one logged line."""
    from safetensors.torch import load_file, save_file

    from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf
    from megatron_psrl.checkpoint.loading import hf_full_state_dict

    src = shutil.copytree(hf_dir, str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(64, 128, generator=gen),
           "model.layers.3.enorm.weight": torch.randn(64, generator=gen),
           "model.layers.3.mlp.experts.0.up_proj.weight": torch.randn(32, 64, generator=gen).to(torch.bfloat16),
           "model.layers.3.mlp.gate.e_score_correction_bias": torch.randn(8, generator=gen)}
    path = os.path.join(src, "model.safetensors")
    save_file(dict(load_file(path), **mtp), path, metadata={"format": "pt"})
    arch = ModelArchitecture.from_hf_dir(src)
    assert arch.mtp_layers == 1 and get_adapter(arch).hf_passthrough_prefixes == ("model.layers.3.",)
    assert not any(name.startswith("decoder.layers.3.") for name in hf_full_state_dict(src, arch, strict=True))
    with caplog.at_level(logging.INFO, logger="megatron_psrl"):
        hf_to_mcore(src, str(tmp_path / "ckpt"), progress=False)
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "not built or trained" in lines[0]
    mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = load_file(path)
    assert set(back) == set(original)
    assert all(back[k].dtype == original[k].dtype and torch.equal(back[k], original[k]) for k in original)


# ------------------------------------------------------------------------------- one training step
def _hf_logprobs_and_route_counts(hf, batch):
    """The per-sample run's log-probs (as ``per_sample_logprobs``) and fp32 ``[MoE layers, E]``
    counts of the experts transformers routes every token of every sample to."""
    moe = [layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "route_tokens_to_experts")]
    counts = torch.zeros(len(moe), moe[0].n_routed_experts)
    for row, mlp in enumerate(moe):
        route = mlp.route_tokens_to_experts

        def counted(logits, route=route, row=row):
            indices, weights = route(logits)
            counts[row] += torch.bincount(indices.flatten(), minlength=counts.shape[1]).float()
            return indices, weights

        mlp.route_tokens_to_experts = counted
    logprobs = []
    try:
        with torch.no_grad():
            for s in range(batch.num_samples):
                tokens = torch.from_numpy(batch.sample_tokens(s).astype(np.int64))
                logits = hf(tokens[None]).logits[0].float()
                lp = torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None])[:, 0]
                logprobs.append(np.concatenate([[0.0], lp.numpy()]))
    finally:
        for mlp in moe:
            del mlp.route_tokens_to_experts
    return logprobs, counts


def test_a_step_over_the_mixed_workload_with_dropped_graphs_and_the_expert_bias(hf_dir, monkeypatch):
    """A GRPO group, a step-wise chain and a branching tree in one batch, micro-batches of 16
    tokens and a KV budget that drops prefix graphs (recomputed): one SGD step (lr 1) moves
    every parameter by minus the per-sample reference gradient, the loss and log-probs are the
    reference's; and with ``moe_router_enable_expert_bias`` the bias moves by megatron's rule
    from the per-sample token counts (a shared token counted once per sample), bit for bit,
    which counting each tree token once would not give (nor counting the prefix sharing check's
    passes before the step)."""
    hf = load_hf_model(hf_dir)
    batch = cross_rank_batch("mixed", vocab_size=256)
    ref_loss, ref_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    ref_logprobs, counts = _hf_logprobs_and_route_counts(hf, batch)
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    head = loss_head_peak_bytes(arch.padded_vocab_size(1), 32)
    rate = 0.01
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    seen = []  # the token counts megatron updates the bias from ([MoE layers, E], summed over ranks)

    def update(tokens, bias, update_rate, update=finalize.get_updated_expert_bias):
        out = update(tokens, bias, update_rate)
        seen.append(tokens.clone())
        return out

    monkeypatch.setattr(finalize, "get_updated_expert_bias", update)
    actor = PolicyActor(hf_dir, ActorConfig(
        device="cpu", micro_batch_tokens=32, kv_cache_budget=150000 + head, loss=LOSS,
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate,
        check_sharing_every=1, check_sharing_samples=2,  # (its passes before the step count nothing)
        optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0)))
    try:
        before = actor.state_dict_hf()
        metrics = actor.train_step(batch)
        after = actor.state_dict_hf()
        assert metrics["tokens_recomputed"] > 0 and metrics["kv_hit_rate"] > 0  # mechanism 2, graphs dropped
        assert metrics["sharing_check"]["passed"]
        assert metrics["tokens_computed"] < batch.num_tokens
        assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for lp, ref in zip(metrics["logprobs"], ref_logprobs):
            computed = ~np.isnan(lp)
            np.testing.assert_allclose(lp[computed], ref[computed], atol=1e-5)
        for name, grad in get_adapter(arch).mcore_to_hf(_mcore_grads(arch, ref_grads)):
            if name.endswith("e_score_correction_bias"):
                continue  # a buffer, below
            atol = 1e-5 * float(grad.abs().max()) + rounding_tolerance(torch.float32, float(before[name].abs().max()))
            torch.testing.assert_close(after[name], before[name] - grad, rtol=0, atol=atol,
                                       msg=lambda m, name=name: f"{name}: {m}")
        # the expert bias: megatron's update (get_updated_expert_bias) of the per-sample counts
        assert len(seen) == 1 and torch.equal(seen[0], counts)
        offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts
        for row, layer in enumerate(arch.moe_layers):
            name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
            assert torch.equal(after[name], before[name] + torch.sign(offset[row]) * rate), name
        # every token of every sample counted, where the step computed fewer (megatron's own count)
        assert counts.sum() == batch.num_tokens * arch.moe_router_topk * len(arch.moe_layers)
        assert metrics["tokens_unique"] < batch.num_tokens
    finally:
        actor.close()


def _mcore_grads(arch, hf_grads):
    """The reference gradients as a megatron state dict (the expert bias, a buffer: zero)."""
    from helpers.hf_reference import hf_grads_to_mcore

    mcore = hf_grads_to_mcore(hf_grads, arch)
    for layer in arch.moe_layers:
        mcore[f"decoder.layers.{layer}.mlp.router.expert_bias"] = torch.zeros(arch.num_experts)
    return mcore
