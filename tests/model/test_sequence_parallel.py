"""Sequence parallelism (``--sequence-parallel``): the row split and its padding, the norms that
run under it, the core attention's handling of padding rows, and exactness against the
per-sample Hugging Face reference under torchrun (dense TP = 2 and TP = 2 x CP = 2; MoE TP = 2
with EP = 1, 2 and 4, a shared expert included, GLM-4.5's dense first layer and grouped routing,
and TP = 2 x PP = 2 x EP = 2)."""

import os
import re

import numpy as np
import pytest
import torch
from helpers.families import make_family_checkpoint
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_psrl import ActorConfig
from megatron_psrl.attention import PrefixSharingAttention, TreeAttentionMetadata, tree_plan
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import build_layer_spec, build_transformer_config
from megatron_psrl.model.moe import check_moe_settings
from megatron_psrl.model.sequence_parallel import (
    SequenceParallelTorchNorm,
    local_row_range,
    padded_rows,
    padding_mask,
    shard_rows,
)
from megatron_psrl.model.tiny import tiny_config

SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "sequence_parallel_exactness.py")


# ----------------------------------------------------------------------------- the row split
@pytest.mark.parametrize("rows,tp", [(7, 2), (8, 2), (1, 4), (9, 4), (3, 1)])
def test_shards_cover_the_padded_rows_once_in_order(rows, tp):
    values = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3)
    fill = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    shards = [shard_rows(values, r, tp, fill=fill) for r in range(tp)]
    assert {s.shape[0] for s in shards} == {padded_rows(rows, tp) // tp}
    whole = torch.cat(shards)
    assert torch.equal(whole[:rows], values)  # the real rows, in order
    assert torch.equal(whole[rows:], fill.expand(padded_rows(rows, tp) - rows, 3))  # then the padding
    masks = [padding_mask(rows, r, tp, torch.device("cpu")) for r in range(tp)]
    if rows % tp == 0:
        assert all(m is None for m in masks)
    else:  # megatron's padding_mask ([1, rows of the rank], True on padding) marks exactly those rows
        flat = torch.cat([m[0] for m in masks])
        assert flat.tolist() == [False] * rows + [True] * (padded_rows(rows, tp) - rows)
        assert [local_row_range(rows, r, tp)[1] - local_row_range(rows, r, tp)[0] for r in range(tp)] == \
            [m.shape[1] for m in masks]


def test_norms_run_under_sequence_parallelism_and_mark_their_weights():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    config = build_transformer_config(arch)
    plain = SequenceParallelTorchNorm(config, arch.hidden_size, eps=arch.rms_norm_eps)
    assert not getattr(plain.weight, "sequence_parallel", False)  # megatron's own, as it is
    config.sequence_parallel = True
    with pytest.raises(AssertionError):  # megatron's local norm refuses sequence parallelism
        WrappedTorchNorm(config, arch.hidden_size, eps=arch.rms_norm_eps)
    norm = SequenceParallelTorchNorm(config, arch.hidden_size, eps=arch.rms_norm_eps)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel  # summed over TP by megatron
    assert config.sequence_parallel  # restored
    x = torch.randn(6, 1, arch.hidden_size)
    assert torch.equal(torch.cat([norm(x[:3]), norm(x[3:])]), norm(x))  # per row: a share of the rows alike
    # every norm of the local spec (input, pre-MLP, q/k) is the sequence-parallel one
    spec = build_layer_spec(arch, "local")
    assert spec.submodules.input_layernorm is SequenceParallelTorchNorm
    assert spec.submodules.pre_mlp_layernorm is SequenceParallelTorchNorm
    assert spec.submodules.self_attention.submodules.q_layernorm is SequenceParallelTorchNorm
    assert "WrappedTorchNorm" not in repr(spec)


def test_core_attention_ignores_padding_rows():
    """A pack of 7 rows padded to 8 (TP = 2): the real rows' outputs and gradients are the
    unpadded call's, bit for bit, the padding row's output is zero and gets no gradient."""
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-llama"))
    attention = PrefixSharingAttention(build_transformer_config(arch), layer_number=1,
                                       attn_mask_type=AttnMaskType.causal, attention_type="self")
    plan = tree_plan(np.array([0, 3, 5]), np.array([3, 5, 7]), np.array([-1, 0, 0]))
    torch.manual_seed(0)
    np_, ng, hn = arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    q, k, v = torch.randn(7, 1, np_, hn), torch.randn(7, 1, ng, hn), torch.randn(7, 1, ng, hn)
    grad = torch.randn(7, 1, np_ * hn)

    def run(pad):
        inputs = [torch.cat([t, torch.randn(pad, *t.shape[1:])]).requires_grad_() for t in (q, k, v)]
        out = attention(*inputs, None, packed_seq_params=TreeAttentionMetadata(plan=plan))
        out.backward(torch.cat([grad, torch.randn(pad, 1, np_ * hn)]))
        return out, [t.grad for t in inputs]

    (ref, ref_grads), (out, grads) = run(0), run(1)
    assert out.shape == (8, 1, np_ * hn) and torch.equal(out[:7], ref) and not out[7].any()
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g[:7], r) and not g[7].any()


def test_moe_under_tensor_parallelism_needs_sequence_parallelism():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    cpu = torch.device("cpu")
    with pytest.raises(ConfigurationError, match="--sequence-parallel"):
        check_moe_settings(arch, {}, cpu, tensor_parallel_size=2)
    check_moe_settings(arch, dict(sequence_parallel=True), cpu, tensor_parallel_size=2)
    assert ActorConfig(device="cpu", tensor_model_parallel_size=2, sequence_parallel=True,
                       expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall").parallel_overrides() == \
        dict(sequence_parallel=True)
    assert ActorConfig(device="cpu", sequence_parallel=True).parallel_overrides() == {}  # TP = 1: nothing to split


# ----------------------------------------------------------------------------- exactness
CASES = {  # name: (family, processes, EP, dispatcher, PP, CP[, placement, TP])
    "dense-tp2": ("debug-llama", 2, 1, "allgather", 1, 1),
    "dense-tp2xcp2": ("debug-llama", 4, 1, "allgather", 1, 2),  # the CP ranks exchange prefix K/V of padded packs
    "qwen3-moe-tp2": ("debug-qwen3-moe", 2, 1, "allgather", 1, 1),  # whole experts on both TP ranks
    "qwen3-moe-tp2xep4": ("debug-qwen3-moe", 4, 4, "alltoall", 1, 1),  # EP over TP x DP: the lockstep's empty passes
    "qwen2-moe-tp2xep2": ("debug-qwen2-moe", 2, 2, "alltoall", 1, 1),  # its shared expert split over TP
    # GLM-4.5: a dense first layer split over TP, then grouped sigmoid routing with the expert bias
    "glm4-moe-tp2xep2": ("debug-glm4-moe", 2, 2, "alltoall", 1, 1),
    # (4 layers: stage 0 holds the dense layer and an MoE one, stage 1 two MoE layers)
    "glm4-moe-tp2xpp2xep2": ("glm4-moe-4-layers", 4, 2, "alltoall", 2, 1),
    "qwen3-moe-tp2xpp2xep2": ("debug-qwen3-moe", 4, 2, "alltoall", 2, 1),  # stages pass their shares of the rows
    # EP x CP, trees split over the CP ranks (K/V exchanged inside passes that also exchange tokens):
    # one exchange group, one participant of the expert lockstep (no empty pass) ...
    "qwen3-moe-tp2xcp2xep4-cross-rank": ("debug-qwen3-moe", 4, 4, "alltoall", 1, 2, "cross-rank", 2),
    # ... and two exchange groups (CP = 2 x DP = 2, TP = 1) whose schedules differ: each runs
    # the other's passes as empty ones, both its ranks together
    "qwen3-moe-cp2xdp2xep4-cross-rank": ("debug-qwen3-moe", 4, 4, "alltoall", 1, 2, "cross-rank", 1),
    # without CP, trees split over the data-parallel ranks (DP = 4, TP = 1: one exchange group,
    # one participant, the start-up calibration run under EP)
    "qwen3-moe-dp4xep4-cross-rank": ("debug-qwen3-moe", 4, 4, "alltoall", 1, 1, "cross-rank", 1),
}


CHECKPOINTS = {"glm4-moe-4-layers": ("debug-glm4-moe", dict(num_hidden_layers=4), 1)}
"""Cases' checkpoints that are a debug config with other fields, and their seed (the rest: the
config itself, seed 0). (Seed 0's 4-layer GLM model gives this batch a near-cancelled loss, 9e-5,
whose rounding the script's relative check of 1e-5 sees, even at EP = 1 on one rank; seeds 1 and
2 give 0.06 and 0.07.)"""


def _case(case):
    """A case's fields, with placement ``auto`` and TP = 2 where it names neither."""
    family, nproc, ep, dispatcher, pp, cp, *rest = CASES[case]
    placement, tp = (list(rest) + ["auto", 2][len(rest):])[:2]
    return family, nproc, ep, dispatcher, pp, cp, placement, tp


@pytest.fixture(scope="module")
def launches(tmp_path_factory, request):
    """The cases of this module in one torchrun launch per world size (2 and 4 ranks)."""
    shared = SharedLaunches(selected_test_names(request))
    checkpoints = {}

    def args(case):
        family, _, ep, dispatcher, pp, cp, placement, tp = _case(case)
        if family not in checkpoints:
            name, fields, seed = CHECKPOINTS.get(family, (family, {}, 0))
            checkpoints[family] = make_family_checkpoint(dict(tiny_config(name), **fields),
                                                         str(tmp_path_factory.mktemp(f"hf-{family}")), seed=seed)
        return [checkpoints[family], str(ep), dispatcher, "16", str(pp), str(cp), placement, str(tp)]

    for case in CASES:
        shared.add(f"test_sequence_parallel_step_equals_per_sample_reference[{case}]", CASES[case][1], SCRIPT,
                   lambda case=case: args(case))
    return shared


@pytest.mark.slow  # two or four processes
@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_step_equals_per_sample_reference(case, launches, request):
    """TP = 2 with sequence parallelism over gloo, micro-batches of 16 tokens (cached prefixes,
    packs of odd length padded): log-probs, loss, every gradient of every rank and one SGD step
    match the per-sample reference (asserted in the script)."""
    _, nproc, ep, _, _, cp, placement, tp = _case(case)
    out = launches.check(request.node.name)
    reports = re.findall(r"rank (\d) tp_rank (\d) ep_rank \d: .*?padded packs (\d+) of \d+, .*?placement (\S+), "
                         r"exchanged (\d+), empty passes (\d+)", out)
    assert sorted(r[0] for r in reports) == [str(r) for r in range(nproc)], out[-3000:]
    if tp > 1:
        assert all(int(padded) > 0 for _, _, padded, *_ in reports)  # odd packs ran padded
    empty = {int(r): int(n) for r, *_, n in reports}
    if placement == "cross-rank":
        assert all(p == "cross-rank" and int(x) > 0 for *_, p, x, _ in reports), reports
        if tp > 1 or cp == 1:  # one exchange group (the CP ranks with their TP peers, or all DP ranks): one participant
            assert sum(empty.values()) == 0, empty
        else:  # two exchange groups of two CP ranks: each group's ranks run the same empty passes
            assert sum(empty.values()) > 0 and empty[0] == empty[1] and empty[2] == empty[3], empty
    elif ep == 4:  # the two data-parallel ranks' passes differ; each rank's TP peer runs the same
        assert sum(empty.values()) > 0 and empty[0] == empty[1] and empty[2] == empty[3], empty
