"""Qwen3-MoE on megatron-core's MoELayer: config parsing, refusals, the HF <-> megatron
conversion, the expert-parallel lockstep schedule, and exactness with prefix sharing against
the per-sample Hugging Face reference (one process; EP = 2, and EP = 2 with PP = 2, under torchrun)."""

import copy
import os
import re

import numpy as np
import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import make_family_checkpoint
from helpers.hf_reference import assert_grads_close, load_hf_model, per_sample_logprobs, per_sample_loss_and_grads
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.adapters import get_adapter, unfuse_experts
from megatron_psrl.model.architecture import ModelArchitecture, UnsupportedModelError
from megatron_psrl.model.moe import check_moe_settings, global_experts, local_experts, lockstep_ticks
from megatron_psrl.model.tiny import tiny_config

MICRO_BATCH = 32  # below the longest trees: cached prefixes (mechanism 2) in every step
LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_expert_parallel.py")
PP_SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_expert_pipeline.py")
RECOMPUTE_SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_expert_recompute.py")

# Qwen3-30B-A3B's published config.json (the fields that matter here).
QWEN3_30B_A3B = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     attention_bias=False, use_sliding_window=False, tie_word_embeddings=False,
                     torch_dtype="bfloat16", router_aux_loss_coef=0.001)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_family_checkpoint(tiny_config("debug-qwen3-moe"), str(tmp_path_factory.mktemp("hf-qwen3-moe")))


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return load_hf_model(hf_dir)


@pytest.fixture(scope="module")
def records():
    return random_tree_records(seed=5, num_roots=3)


# ------------------------------------------------------------------------------- architecture
def test_qwen3_30b_a3b_config_parses():
    arch = ModelArchitecture.from_hf_config(copy.deepcopy(QWEN3_30B_A3B))
    assert (arch.num_experts, arch.moe_ffn_hidden_size, arch.moe_router_topk, arch.moe_norm_topk_prob) == (
        128, 768, 8, True)
    assert arch.is_moe and arch.qk_norm and not arch.qkv_bias
    assert arch.num_parameters() == 30_532_122_624  # the published size (30.5B total)
    active = arch.num_parameters() - arch.num_layers * (arch.mlp_parameters() - arch.active_mlp_parameters())
    assert 3.2e9 < active < 3.4e9  # "A3B": about 3.3B parameters active per token
    # transformers >= 5 writes num_experts as num_local_experts
    renamed = dict(QWEN3_30B_A3B, num_local_experts=128)
    del renamed["num_experts"]
    assert ModelArchitecture.from_hf_config(renamed).num_experts == 128


def test_the_debug_config_matches_the_hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config("debug-qwen3-moe")
    arch = ModelArchitecture.from_hf_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**copy.deepcopy(cfg)))
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert (arch.num_experts, arch.moe_router_topk) == (model.config.num_experts, model.config.num_experts_per_tok)


@pytest.mark.parametrize("override,words", [
    (dict(mlp_only_layers=[1]), ["dense MLP layers", "[1]"]),
    (dict(decoder_sparse_step=2), ["dense MLP layers", "[0]"]),
    (dict(shared_expert_intermediate_size=64), ["shared experts"]),
    (dict(num_experts_per_tok=9), ["num_experts_per_tok"]),
    (dict(model_type="deepseek_v2", n_routed_experts=8), ["mixture-of-experts", "deepseek_v2"]),
], ids=["mlp-only-layers", "sparse-step", "shared-expert", "topk", "deepseek-v2"])
def test_unsupported_moe_variants_are_refused(override, words):
    with pytest.raises(UnsupportedModelError) as err:
        ModelArchitecture.from_hf_config(dict(tiny_config("debug-qwen3-moe"), **override))
    for word in words:
        assert word in str(err.value)


def test_moe_settings_that_cannot_run_are_refused():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    cpu = torch.device("cpu")
    with pytest.raises(ConfigurationError, match="needs CUDA"):
        check_moe_settings(arch, dict(moe_grouped_gemm=True), cpu)
    with pytest.raises(ConfigurationError, match="depends on the other tokens"):
        check_moe_settings(arch, dict(moe_expert_capacity_factor=1.0), cpu)
    with pytest.raises(ConfigurationError, match="must divide the model's 8 experts"):
        check_moe_settings(arch, dict(expert_model_parallel_size=3), cpu)
    with pytest.raises(ConfigurationError, match="tensor parallelism"):
        check_moe_settings(arch, {}, cpu, tensor_parallel_size=2)
    ActorConfig(device="cpu", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)  # exact (test_moe_router_losses.py)
    with pytest.raises(ConfigurationError, match="seq_aux_loss"):
        ActorConfig(device="cpu", moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss")
    with pytest.raises(ConfigurationError, match="needs CUDA"):
        ActorConfig(device="cpu", moe_grouped_gemm=True)
    with pytest.raises(ConfigurationError, match="alltoall"):
        ActorConfig(device="cpu", expert_model_parallel_size=2)
    ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                pipeline_model_parallel_size=2)  # exact (test_expert_and_pipeline_parallel_under_torchrun)
    ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=1)  # exact (test_expert_parallel_with_activation_recomputation_under_torchrun)
    with pytest.raises(ConfigurationError, match="context-parallel"):
        ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                    pipeline_model_parallel_size=2, context_parallel_size=2)
    ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall", context_parallel_size=2,
                placement="cross-rank")  # exact (test_sequence_parallel.py, the cross-rank cases)
    ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                placement="cross-rank")  # exact (test_sequence_parallel.py, trees over data-parallel ranks)
    with pytest.raises(ConfigurationError, match="cross-rank and pipeline stages"):
        ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                    placement="cross-rank", pipeline_model_parallel_size=2)
    with pytest.raises(ConfigurationError, match="virtual pipeline stages"):
        ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                    pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    with pytest.raises(ConfigurationError, match="moe_token_dispatcher_type"):
        ActorConfig(device="cpu", moe_token_dispatcher_type="flex")


def test_moe_flags_on_a_dense_model_are_refused():
    from megatron_psrl.engine.builder import moe_overrides

    config = ActorConfig(device="cpu", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")
    with pytest.raises(ConfigurationError, match="dense llama model"):
        moe_overrides(config, ModelArchitecture.from_hf_config(tiny_config("debug-llama")))
    assert moe_overrides(config, ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe")))[
        "moe_token_dispatcher_type"] == "alltoall"


# ------------------------------------------------------------------------------- conversion
def test_hf_megatron_round_trip_is_bit_exact(hf_dir, hf_model):
    """What save_pretrained wrote (per-expert names) -> megatron -> HF names again, bit for bit;
    and transformers' in-memory fused experts name the same tensors."""
    from safetensors.torch import load_file

    from megatron_psrl.checkpoint.loading import hf_full_state_dict

    arch = ModelArchitecture.from_hf_dir(hf_dir)
    on_disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in on_disk  # the Hub's per-expert names
    assert set(on_disk) == set(get_adapter(arch).hf_keys())
    mcore = hf_full_state_dict(hf_dir, arch, strict=True)
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in mcore
    assert "decoder.layers.1.mlp.router.weight" in mcore
    back = dict(get_adapter(arch).mcore_to_hf(mcore))
    assert set(back) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(back[name], tensor), name
    in_memory = unfuse_experts(hf_model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_model.state_dict()
    for name, tensor in on_disk.items():
        assert torch.equal(in_memory[name], tensor), name


def test_expert_parallel_shards_merge_back():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    shapes = get_adapter(arch).hf_shapes()
    full = dict(get_adapter(arch).hf_to_mcore(lambda n: torch.randn(shapes[n])))
    shards = {r: local_experts(full, arch, r, 4) for r in range(4)}
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in shards[3]
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in shards[3]
    assert torch.equal(shards[3]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
                       full["decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight"])
    merged = global_experts(shards, arch)
    assert set(merged) == set(full) and all(torch.equal(merged[k], full[k]) for k in full)


# ------------------------------------------------------------------------------- lockstep
def _simulate(sequences):
    """Replay the ticks: every rank runs its own passes in its order; every B undoes a K tick
    whose forward every rank ran (own or empty) and which is undone once."""
    ticks = lockstep_ticks(sequences)
    pos = [0] * len(sequences)
    k_ticks, undone = {}, set()
    for t, (kind, own, ref) in enumerate(ticks):
        for r, mine in enumerate(own):
            if mine:
                assert sequences[r][pos[r]][0] == kind
                if kind == "K":
                    k_ticks[(r, sequences[r][pos[r]][1])] = t
                if kind == "B":
                    assert k_ticks[(r, sequences[r][pos[r]][1])] == ref
                pos[r] += 1
        if kind == "B":
            assert ticks[ref][0] == "K" and ref not in undone and ref < t
            undone.add(ref)
        if kind in ("K", "B"):
            assert sum(own) == 1
    assert pos == [len(s) for s in sequences]
    assert undone == {t for t, (kind, _, _) in enumerate(ticks) if kind == "K"}
    return ticks


def test_lockstep_ticks():
    # equal schedules of P and N passes: every pass shared, no empty one
    same = [("P", 0), ("N", 1), ("P", 1), ("P", 2)]
    ticks = _simulate([same, same])
    assert len(ticks) == 4 and all(all(own) for _, own, _ in ticks)
    # kept graphs: a tick of their own for every K and its B
    ticks = _simulate([[("K", 0), ("B", 0)], [("K", 0), ("B", 0)]])
    assert [(kind, own, ref) for kind, own, ref in ticks] == [
        ("K", [True, False], -1), ("B", [True, False], 0), ("K", [False, True], -1), ("B", [False, True], 2)]
    # producers backed-propagated in different orders on the two ranks, and a rank with no work
    a = [("K", 0), ("K", 1), ("P", 2), ("B", 1), ("B", 0), ("N", 3), ("P", 3)]
    b = [("K", 5), ("P", 6), ("P", 7), ("K", 8), ("B", 5), ("B", 8)]
    _simulate([a, b, []])
    rng = np.random.default_rng(0)
    for _ in range(50):  # random valid schedules
        seqs = []
        for _ in range(int(rng.integers(1, 4))):
            seq, open_k = [], []
            for i in range(int(rng.integers(0, 8))):
                kind = "NPK"[int(rng.integers(3))]
                seq.append((kind, i))
                open_k += [i] if kind == "K" else []
                if open_k and rng.random() < 0.4:
                    seq.append(("B", open_k.pop(int(rng.integers(len(open_k))))))
            seq += [("B", i) for i in reversed(open_k)]
            seqs.append(seq)
        _simulate(seqs)


# ------------------------------------------------------------------------------- exactness
def _actor(hf_dir, **overrides):
    return PolicyActor(hf_dir, ActorConfig(device="cpu", micro_batch_tokens=MICRO_BATCH, loss=LOSS,
                                           optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0),
                                           **overrides))


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_logprobs_loss_and_gradients_equal_the_per_sample_reference(hf_dir, hf_model, records, dispatcher):
    """Prefix sharing (mechanisms 1 and 2: micro-batches of 32 tokens, cached prefixes) with
    dropless top-k routing at EP = 1: log-probs, the loss and every gradient, the router's
    and every expert's included, equal the per-sample HF computation (fp32)."""
    batch = samples_from_dicts(records, source="records")
    actor = _actor(hf_dir, moe_token_dispatcher_type=dispatcher)
    ours = actor.compute_logprobs(records)
    for a, b in zip(ours, per_sample_logprobs(hf_model, batch)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    result = actor.forward_backward(records)
    actor.engine.optimizer.reduce_gradients()
    grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}
    ref_loss, ref_grads = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    assert result.metrics["micro_batches"] > 1 and result.metrics["tokens_computed"] < batch.num_tokens
    ref = dict(get_adapter(actor.arch).hf_to_mcore(lambda n: unfuse_experts(ref_grads)[n]))
    assert any(".mlp.router." in n for n in ref) and any(".local_experts.7." in n for n in ref)
    assert_grads_close(grads, ref, rtol=1e-5)
    actor.close()


@pytest.fixture(scope="module")
def launches(hf_dir, request):
    """The torchrun cases of this module: the two 2-rank ones in one launch."""
    shared = SharedLaunches(selected_test_names(request))
    shared.add("test_expert_parallel_under_torchrun", 2, SCRIPT, lambda: [hf_dir, "16", "tree", "3"])
    shared.add("test_expert_parallel_with_activation_recomputation_under_torchrun", 2, RECOMPUTE_SCRIPT,
               lambda: [hf_dir, "16", "450000", "full", "uniform", "1"])
    shared.add("test_expert_and_pipeline_parallel_under_torchrun", 4, PP_SCRIPT, lambda: [hf_dir, "16", "3"])
    return shared


@pytest.mark.slow  # two processes
def test_expert_parallel_under_torchrun(launches, request):
    """EP = DP = 2 over gloo, alltoall dispatcher, micro-batches of 16 tokens: the ranks get
    different numbers and orders of passes, so the lockstep's empty passes run; every rank
    matches the per-sample reference (asserted inside the script)."""
    out = launches.check(request.node.name)
    # the ranks share stdout: their lines may interleave, so find each rank's report anywhere
    reports = re.findall(r"rank (\d) ep_rank \d: .*?empty passes (\d+)", out)
    assert sorted(rank for rank, _ in reports) == ["0", "1"], out[-3000:]
    assert sum(int(empty) for _, empty in reports) > 0, reports


@pytest.mark.slow  # two processes
def test_expert_parallel_with_activation_recomputation_under_torchrun(launches, request):
    """EP = DP = 2 over gloo with full activation recomputation (one checkpointed unit per
    layer), micro-batches of 16 tokens and a KV budget that keeps some prefix graphs and drops
    others: a recomputing backward repeats its layers' all-to-alls, and the empty passes
    (forward + backward, kept forward and its later backward, graph-less forward) recompute
    theirs the same way; every rank matches the per-sample reference, without and with router
    replay (asserted inside the script)."""
    out = launches.check(request.node.name)
    reports = re.findall(r"rank (\d) ep_rank \d: .*?tokens recomputed (\d+), empty passes (\d+), empty ticks (\w*)", out)
    assert sorted(rank for rank, *_ in reports) == ["0", "1"], out[-3000:]
    assert all(int(recomputed) > 0 for _, recomputed, _, _ in reports)  # dropped graphs (mechanism 2)
    ticks = "".join(kinds for *_, kinds in reports)
    assert {"P", "K", "B", "N"} <= set(ticks), reports  # every kind of empty pass ran


@pytest.mark.slow  # four processes
def test_expert_and_pipeline_parallel_under_torchrun(launches, request):
    """PP = 2 x DP = 2 x EP = 2 over gloo (each stage's expert group: its two data-parallel
    ranks), micro-batches of 16 tokens: cached prefixes on both pipelines, which get different
    numbers of micro-batches, so each stage's lockstep runs empty passes on the pipeline with
    fewer; every rank matches the per-sample reference (asserted inside the script)."""
    out = launches.check(request.node.name)
    reports = re.findall(r"rank (\d) pp_rank (\d) dp_rank (\d) ep_rank \d: .*?schedule (\S+), own micro-batches "
                         r"(\d+), cached prefixes (\d+), .*?empty passes (\d+)", out)
    assert sorted(r[0] for r in reports) == ["0", "1", "2", "3"], out[-3000:]
    own = {(pp, dp): int(n) for _, pp, dp, _, n, _, _ in reports}
    assert own[("0", "0")] == own[("1", "0")] and own[("0", "1")] == own[("1", "1")]  # a pipeline's stages
    assert own[("0", "0")] != own[("0", "1")], own  # the two pipelines: uneven
    assert all(schedule == "plan-order" for _, _, _, schedule, _, _, _ in reports)
    assert all(int(cached) > 0 for *_, cached, _ in reports)  # mechanism 2 on both pipelines
    fewer = min(("0", "1"), key=lambda dp: own[("0", dp)])
    assert all(int(empty) > 0 for _, _, dp, *_, empty in reports if dp == fewer), reports


def test_checkpoint_and_hf_export_round_trip(hf_dir, records, tmp_path):
    """EP = 1: a trained step's weights survive a torch_dist checkpoint and an HF export (the
    exported folder loads into transformers and names every expert on its own)."""
    from safetensors.torch import load_file

    config = ActorConfig(device="cpu", micro_batch_tokens=MICRO_BATCH, optimizer=OptimizerSettings(lr=1e-3))
    actor = PolicyActor(hf_dir, config)
    actor.train_step(records)
    actor.save(str(tmp_path / "ckpt"))
    again = PolicyActor(str(tmp_path / "ckpt"), config)  # (Adam: its state is loaded too)
    for (name, a), b in zip(actor.model.named_parameters(), again.model.parameters()):
        assert torch.equal(a, b), name
    out = actor.export_hf(str(tmp_path / "hf"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    hf = actor.state_dict_hf()
    assert set(exported) == set(hf) and "model.layers.1.mlp.experts.7.down_proj.weight" in exported
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
    reloaded = unfuse_experts(load_hf_model(out).state_dict())
    assert all(torch.equal(reloaded[k], hf[k]) for k in hf)
    again.close()
    actor.close()
