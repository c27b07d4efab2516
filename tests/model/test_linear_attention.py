"""TreeGatedDeltaNet on tree-packed micro-batches against Hugging Face's Gated DeltaNet per sample.

Every sample of a tree run alone through transformers' ``Qwen3NextGatedDeltaNet`` (and
Qwen3.5's) must give what the packed tree gives on its path: outputs, input gradients (a shared
row's gradient is the sum over the samples through it) and every parameter gradient. The trees:
a GRPO group (one prompt, several responses), a step-wise chain, and a branching tree whose
segments are shorter than the conv's ``K - 1`` (the conv then reaches several ancestors up).
Also: the delta rule against a naive per-token recurrence, end padding leaves a state unchanged,
a branch started from a zero state is far off (so the tests would see it), the mechanism-2 API
(a prefix's returned state continues it exactly; an external state's gradient is the sum over
the roots continuing it), a plain batch without metadata, and fla against the torch kernel.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.gated_delta import naive_path, random_inputs
from helpers.tolerance import assert_equal_up_to_rounding
from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

from megatron_psrl.attention.metadata import TreeAttentionMetadata
from megatron_psrl.attention.plan import tree_plan
from megatron_psrl.model import linear_attention as la
from megatron_psrl.model.linear_attention import (
    GdnHeads,
    LinearState,
    SegmentForest,
    build_tree_linear_index,
    tree_gated_delta_rule,
)

HIDDEN = 32
ULPS = 32
"""Units of fp32 rounding allowed: the chunked kernel's chunks start at other tokens in a pack
than in a sample run alone (another order of the same sums), its triangular solve amplifies that."""

# Trees: (segment lengths, parents) in depth-first order.
TREES = {
    "grpo-group": ([7, 5, 3, 6, 1], [-1, 0, 0, 0, 0]),
    "step-chain": ([4, 3, 3, 2, 3], [-1, 0, 1, 2, 3]),
    "short-branches": ([3, 1, 2, 1, 1, 2, 1, 2], [-1, 0, 1, 1, 0, 4, 4, -1]),
}


# ------------------------------------------------------------------------------- tree helpers
def _plan(lengths, parents):
    ends = np.cumsum(lengths)
    return tree_plan(ends - np.asarray(lengths), ends, parents)


def _paths(lengths, parents):
    """Pack rows of every leaf's root-to-leaf path."""
    ends = np.cumsum(lengths)
    starts = ends - np.asarray(lengths)
    children = {p for p in parents if p >= 0}
    paths = []
    for leaf in range(len(lengths)):
        if leaf in children:
            continue
        chain, s = [], leaf
        while s >= 0:
            chain.append(s)
            s = parents[s]
        paths.append(np.concatenate([np.arange(starts[s], ends[s]) for s in reversed(chain)]))
    return paths


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def parallel():
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_psrl.distributed.setup import initialize_parallel

    initialize_parallel(device="cpu")
    return ProcessGroupCollection.use_mpu_process_groups()


def _hf_layer(family: str):
    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        layer = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**common), layer_idx=0)
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        layer = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**common), layer_idx=0)
    with torch.no_grad():
        for name, p in layer.named_parameters():  # away from any symmetric init
            p.add_(0.3 * torch.randn_like(p)) if name.endswith("norm.weight") else p.copy_(0.3 * torch.randn_like(p))
    return layer.float()


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
                  layernorm_epsilon=1e-6, activation_func=F.silu, use_cpu_initialization=True,
                  params_dtype=torch.float32, layernorm_zero_centered_gamma=True,  # as Qwen3-Next's other norms
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                  linear_conv_kernel_dim=4, bias_activation_fusion=False, gradient_accumulation_fusion=False)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _arch(family: str):
    """The tiny model of ``family`` with this file's linear-layer shape (for its adapter and the
    sharding rules: the one place that maps Hugging Face's projections onto megatron's ``in_proj``)."""
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.model.tiny import tiny_config

    name = "debug-qwen3-next" if family == "qwen3_next" else "debug-qwen3.5-text"
    return ModelArchitecture.from_hf_config(dict(
        tiny_config(name), hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4))


def _in_proj_of(hf, tensors) -> torch.Tensor:
    """megatron's ``in_proj`` from the HF layer's projections ``tensors`` (name -> weight or its
    gradient: the mapping is a permutation of rows, so it maps gradients too), by the adapter."""
    from megatron_psrl.model.adapters import get_adapter

    family = "qwen3_next" if hasattr(hf, "in_proj_qkvz") else "qwen3_5"
    adapter = get_adapter(_arch(family))
    names = {f"model.layers.0.linear_attn.{k}": v for k, v in tensors.items()}
    return torch.cat(adapter._in_proj_parts(names.__getitem__, "model.layers.0."), 0)


def _hf_in_proj(hf) -> torch.Tensor:
    return _in_proj_of(hf, {n: p for n, p in hf.named_parameters() if n.startswith("in_proj")})


def _full_heads() -> GdnHeads:
    return GdnHeads(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)


def _ours(hf, pg):
    from megatron.core.transformer.spec_utils import build_module

    config = _config()
    layer = build_module(la.tree_gated_delta_net_spec(config), config=config, layer_number=1, pg_collection=pg)
    with torch.no_grad():
        layer.in_proj.weight.copy_(_hf_in_proj(hf))
        layer.conv1d.weight.copy_(hf.conv1d.weight)
        for name in ("dt_bias", "A_log"):
            getattr(layer, name).copy_(getattr(hf, name))
        layer.out_norm.weight.copy_(hf.norm.weight)
        layer.out_proj.weight.copy_(hf.out_proj.weight)
    return layer


def _hf_grads(hf):
    return {"in_proj.weight": _hf_in_proj_grad(hf), "conv1d.weight": hf.conv1d.weight.grad,
            "dt_bias": hf.dt_bias.grad, "A_log": hf.A_log.grad, "out_norm.weight": hf.norm.weight.grad,
            "out_proj.weight": hf.out_proj.weight.grad}


def _hf_in_proj_grad(hf):
    return _in_proj_of(hf, {n: p.grad for n, p in hf.named_parameters() if n.startswith("in_proj")})


def _close(actual, expected):
    assert_equal_up_to_rounding(actual, expected, scale=float(expected.abs().max()), ulps=ULPS)


# ---------------------------------------------------------------------- against Hugging Face
@pytest.mark.parametrize("family,tree", [("qwen3_next", t) for t in sorted(TREES)] + [("qwen3_5", "short-branches")])
def test_tree_pack_matches_hf_per_sample(parallel, family, tree):
    lengths, parents = TREES[tree]
    hf = _hf_layer(family)
    ours = _ours(hf, parallel)
    t = int(sum(lengths))
    torch.manual_seed(1)
    x = torch.randn(t, 1, HIDDEN)
    paths = _paths(lengths, parents)
    weights = [torch.randn(len(p), HIDDEN) for p in paths]

    x_ours = x.clone().requires_grad_()
    meta = TreeAttentionMetadata(plan=_plan(lengths, parents))
    out, bias = ours(x_ours, attention_mask=None, packed_seq_params=meta)
    assert out.shape == (t, 1, HIDDEN) and bias is None
    sum((out[p, 0] * w).sum() for p, w in zip(paths, weights)).backward()

    x_hf = x[:, 0].clone().requires_grad_()
    hf_loss = 0
    for p, w in zip(paths, weights):
        y = hf(x_hf[p][None])[0]  # the sample alone, [len, h]
        _close(out[p, 0].detach(), y.detach())
        hf_loss = hf_loss + (y * w).sum()
    hf_loss.backward()
    _close(x_ours.grad[:, 0], x_hf.grad)
    grads = dict(ours.named_parameters())
    for name, expected in _hf_grads(hf).items():
        _close(grads[name].grad, expected)


def test_plain_batch_without_metadata_matches_hf(parallel):
    hf = _hf_layer("qwen3_next")
    ours = _ours(hf, parallel)
    torch.manual_seed(2)
    x = torch.randn(9, 3, HIDDEN)  # [s, b, h]
    out, _ = ours(x, attention_mask=None)
    with torch.no_grad():
        expected = hf(x.transpose(0, 1)).transpose(0, 1)
    _close(out.detach(), expected)


def test_sequence_parallel_padding_rows_past_the_plan(parallel):
    """Rows past the plan's tokens (sequence-parallel padding to a multiple of TP) leave the
    pack's rows as they are and come out zero."""
    lengths, parents = TREES["grpo-group"]
    ours = _ours(_hf_layer("qwen3_next"), parallel)
    t = int(sum(lengths))
    x = torch.randn(t + 2, 1, HIDDEN)
    meta = TreeAttentionMetadata(plan=_plan(lengths, parents))
    with torch.no_grad():
        padded, _ = ours(x, attention_mask=None, packed_seq_params=meta)
        exact, _ = ours(x[:t], attention_mask=None, packed_seq_params=TreeAttentionMetadata(plan=meta.plan))
    # (the projections run over t + 2 rows against t: another GEMM shape, equal up to rounding)
    _close(padded[:t], exact)
    assert torch.equal(padded[t:], torch.zeros(2, 1, HIDDEN))


def test_as_the_last_layer_every_row_is_computed(parallel):
    """In megatron's TransformerLayer (the project's, which skips rows in the model's last layer
    when the loss reads only some), a linear-attention mixer runs every row: each feeds the states
    of its descendants."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from megatron_psrl.model.gpt import PsrlTransformerLayer

    config = _config(hidden_dropout=0.0, attention_dropout=0.0)
    spec = ModuleSpec(module=PsrlTransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=la.tree_gated_delta_net_spec(config), self_attn_bda=get_bias_dropout_add))
    layer = build_module(spec, config=config, layer_number=1, pg_collection=parallel).eval()
    lengths, parents = TREES["short-branches"]
    t = int(sum(lengths))
    x = torch.randn(t, 1, HIDDEN)
    meta = TreeAttentionMetadata(plan=_plan(lengths, parents), output_rows=np.array([2, 5, t - 1]))
    with torch.no_grad():
        out, _ = layer(x, attention_mask=None, packed_seq_params=meta)
        mixed, _ = layer.self_attention(x, attention_mask=None, packed_seq_params=TreeAttentionMetadata(plan=meta.plan))
    assert out.shape == (t, 1, HIDDEN)
    assert_equal_up_to_rounding(out, x + mixed, scale=float(out.abs().max()))


def test_output_norm_is_not_zero_centred(parallel):
    """``layernorm_zero_centered_gamma`` (Qwen3-Next's other norms) must not reach the gated norm."""
    ours = _ours(_hf_layer("qwen3_next"), parallel)
    assert isinstance(ours.out_norm, la.GatedRMSNorm)
    fresh = la.GatedRMSNorm(_config(), 6)
    assert torch.equal(fresh.weight, torch.ones(6))
    x = torch.randn(5, 6)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + fresh.eps)
    assert_equal_up_to_rounding(fresh(x), expected, scale=float(expected.abs().max()))


# ------------------------------------------------------------------- the math on its own
@pytest.mark.parametrize("tree", sorted(TREES))
def test_delta_rule_matches_naive_recurrence_per_path(tree):
    lengths, parents = TREES[tree]
    heads = _full_heads()
    inputs = random_inputs(int(sum(lengths)), heads)
    index = build_tree_linear_index(SegmentForest.from_plan(_plan(lengths, parents)), 4, "cpu")
    result = tree_gated_delta_rule(**inputs, heads=heads, index=index, return_states=True)
    ends = np.cumsum(lengths)
    for rows in _paths(lengths, parents):
        expected, final = naive_path(inputs, rows, heads)
        _close(result.core[rows], expected)
        leaf = int(np.searchsorted(ends, rows[-1], side="right"))
        _close(result.states.recurrent[leaf], final)
        tail = torch.cat([torch.zeros(3, inputs["mixed_qkv"].shape[1]), inputs["mixed_qkv"][rows]])[-3:]
        assert torch.equal(result.states.conv_tail[leaf], tail)


def test_path_conv_gradients_by_gradcheck():
    """The conv's own backward (it saves its input rows only and gathers again) in fp64."""
    lengths, parents = TREES["short-branches"]
    index = build_tree_linear_index(SegmentForest.from_plan(_plan(lengths, parents)), 4, "cpu")
    t = int(sum(lengths))
    rows = torch.randn(t + 1, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, w: la.conv_along_paths(r, index.conv_rows, w, None), (rows, weight))


def test_a_branch_from_a_zero_state_is_far_off():
    """The same pack with every non-root segment cut from its parent (a zero state and zero conv
    context) must differ clearly from the per-path reference the real run matches."""
    lengths, parents = TREES["grpo-group"]
    heads = _full_heads()
    inputs = random_inputs(int(sum(lengths)), heads)
    forest = SegmentForest.from_plan(_plan(lengths, parents))
    real = tree_gated_delta_rule(**inputs, heads=heads, index=build_tree_linear_index(forest, 4, "cpu")).core
    cut = SegmentForest(forest.seg_start, forest.seg_end, np.full(len(lengths), -1), forest.source)
    zero = tree_gated_delta_rule(**inputs, heads=heads, index=build_tree_linear_index(cut, 4, "cpu")).core
    branch = _paths(lengths, parents)[0][lengths[0]:]  # the first response's rows
    expected = torch.cat([naive_path(inputs, rows, heads)[0][lengths[0]:] for rows in _paths(lengths, parents)])
    responses = np.concatenate([p[lengths[0]:] for p in _paths(lengths, parents)])
    _close(real[responses], expected)
    assert (zero[branch] - real[branch]).abs().max() > 1e-2 * real[branch].abs().max()


def test_end_padding_leaves_the_final_state_unchanged():
    torch.manual_seed(4)
    b, length, pad, h, dk, dv = 2, 11, 70, 3, 8, 6  # the padding crosses a 64-token chunk boundary
    q, k = F.normalize(torch.randn(b, length, h, dk), dim=-1), F.normalize(torch.randn(b, length, h, dk), dim=-1)
    v, g, beta = torch.randn(b, length, h, dv), -torch.rand(b, length, h), torch.rand(b, length, h)
    s0 = torch.randn(b, h, dk, dv)
    out, final = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)

    def padded(x):
        return torch.cat([x, x.new_zeros((b, pad) + tuple(x.shape[2:]))], dim=1)

    out_p, final_p = torch_chunk_gated_delta_rule(*(padded(x) for x in (q, k, v, g, beta)), initial_state=s0,
                                                  output_final_state=True)
    _close(final_p, final)
    _close(out_p[:, :length], out)


# ---------------------------------------------------------------- mechanism 2's function API
def test_a_returned_state_continues_its_prefix_exactly():
    """Prefix P alone (its final LinearState returned), then its continuations from that state as
    an external source, equal the whole tree in one pack."""
    lengths, parents = [6, 4, 2, 5], [-1, 0, 1, 0]
    heads = _full_heads()
    inputs = random_inputs(sum(lengths), heads)
    whole = tree_gated_delta_rule(**inputs, heads=heads,
                                  index=build_tree_linear_index(SegmentForest.from_plan(_plan(lengths, parents)),
                                                                4, "cpu"))
    p = lengths[0]
    first = {k: (v[:p] if k in ("mixed_qkv", "g", "beta") else v) for k, v in inputs.items()}
    prefix = tree_gated_delta_rule(**first, heads=heads, index=build_tree_linear_index(
        SegmentForest.from_plan(_plan([p], [-1])), 4, "cpu"), return_states=True)
    rest = {k: (v[p:] if k in ("mixed_qkv", "g", "beta") else v) for k, v in inputs.items()}
    plan = tree_plan([0, 4, 6], [4, 6, 11], [-1, 0, -1], external_blocks=[(0, 11, 0)], external_lengths=[p])
    forest = SegmentForest.from_plan(plan)
    assert list(forest.source) == [0, -1, 0] and list(forest.parent) == [-1, 0, -1]
    cont = tree_gated_delta_rule(**rest, heads=heads, index=build_tree_linear_index(forest, 4, "cpu"),
                                 initial=prefix.states)
    _close(cont.core, whole.core[p:])


def test_an_external_state_gradient_is_the_sum_over_its_continuations():
    heads = _full_heads()
    inputs = random_inputs(9, heads)
    torch.manual_seed(5)
    state = LinearState(recurrent=torch.randn(1, 4, 8, 6).requires_grad_(),
                        conv_tail=torch.randn(1, 3, inputs["mixed_qkv"].shape[1]).requires_grad_())
    plan = tree_plan([0, 5], [5, 9], [-1, -1], external_blocks=[(0, 9, 0)], external_lengths=[7])
    index = build_tree_linear_index(SegmentForest.from_plan(plan), 4, "cpu")
    weight = torch.randn(9, 4, 6)
    (tree_gated_delta_rule(**inputs, heads=heads, index=index, initial=state).core * weight).sum().backward()
    together = (state.recurrent.grad.clone(), state.conv_tail.grad.clone())
    alone = [torch.zeros_like(together[0]), torch.zeros_like(together[1])]
    for rows in (slice(0, 5), slice(5, 9)):
        single = LinearState(state.recurrent.detach().requires_grad_(), state.conv_tail.detach().requires_grad_())
        part = {k: (v[rows] if k in ("mixed_qkv", "g", "beta") else v) for k, v in inputs.items()}
        n = rows.stop - rows.start
        plan1 = tree_plan([0], [n], [-1], external_blocks=[(0, n, 0)], external_lengths=[7])
        out = tree_gated_delta_rule(**part, heads=heads, initial=single,
                                    index=build_tree_linear_index(SegmentForest.from_plan(plan1), 4, "cpu")).core
        (out * weight[rows]).sum().backward()
        alone[0] += single.recurrent.grad
        alone[1] += single.conv_tail.grad
    _close(together[0], alone[0])
    _close(together[1], alone[1])


# ----------------------------------------------------------------- layouts: HF and TP shares
def test_qwen3_next_in_proj_mapping_round_trips():
    from megatron_psrl.model.adapters import get_adapter

    hf = _hf_layer("qwen3_next")
    arch = _arch("qwen3_next")
    parts = torch.split(_hf_in_proj(hf), [16, 16, 24, 24, 4, 4], 0)  # q k v z beta alpha of 2 x 8, 4 x 6, 4
    back = dict(get_adapter(arch)._in_proj_to_hf(list(parts), "model.layers.0."))
    assert torch.equal(back["model.layers.0.linear_attn.in_proj_qkvz.weight"], hf.in_proj_qkvz.weight)
    assert torch.equal(back["model.layers.0.linear_attn.in_proj_ba.weight"], hf.in_proj_ba.weight)


def test_tensor_parallel_shares_compute_their_heads():
    """A TP rank's share (megatron's layout: every in_proj part and the conv's q|k|v channels
    split separately, key heads with their value-head groups) gives exactly its heads' outputs."""
    lengths, parents = TREES["short-branches"]
    heads = _full_heads()
    inputs = random_inputs(int(sum(lengths)), heads)
    index = build_tree_linear_index(SegmentForest.from_plan(_plan(lengths, parents)), 4, "cpu")
    full = tree_gated_delta_rule(**inputs, heads=heads, index=index, return_states=True)
    from megatron_psrl.checkpoint.sharding import tp_shard

    arch = _arch("qwen3_5")
    conv = "decoder.layers.0.self_attention.conv1d.weight"  # the sharding rules' split of the conv channels
    share = dataclasses.replace(heads, num_key_heads=1, num_value_heads=2)
    for rank in range(2):
        mine = dict(mixed_qkv=tp_shard(conv, inputs["mixed_qkv"].t(), arch, 2, rank).t(),
                    g=inputs["g"].chunk(2, dim=1)[rank], beta=inputs["beta"].chunk(2, dim=1)[rank],
                    conv_weight=tp_shard(conv, inputs["conv_weight"], arch, 2, rank),
                    conv_bias=tp_shard(conv, inputs["conv_bias"], arch, 2, rank))
        out = tree_gated_delta_rule(**mine, heads=share, index=index, return_states=True)
        _close(out.core, full.core.chunk(2, dim=1)[rank])
        _close(out.states.recurrent, full.states.recurrent.chunk(2, dim=1)[rank])


# ------------------------------------------------------------------------------ fla kernel
@pytest.mark.skipif(la.fla_chunk_gated_delta_rule is None or not torch.cuda.is_available(),
                    reason="needs fla and CUDA")
def test_fla_kernel_matches_the_torch_kernel():
    lengths, parents = TREES["short-branches"]
    heads = _full_heads()
    inputs = {k: v.cuda() for k, v in random_inputs(int(sum(lengths)), heads).items()}
    index = build_tree_linear_index(SegmentForest.from_plan(_plan(lengths, parents)), 4, "cuda")
    fla = tree_gated_delta_rule(**inputs, heads=heads, index=index, return_states=True)
    torch_heads = dataclasses.replace(heads, deterministic=True)
    ref = tree_gated_delta_rule(**inputs, heads=torch_heads, index=index, return_states=True)
    torch.testing.assert_close(fla.core, ref.core, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fla.states.recurrent, ref.states.recurrent, rtol=1e-3, atol=1e-3)


def test_a_depth_of_unequal_segments_is_cut_into_length_buckets():
    """Padding to the longest segment of a depth is bounded (PADDING_LIMIT): the GRPO group's
    responses (5, 3, 6, 1 tokens) go into three calls, each within the limit, every segment
    once; the results above (naive recurrence, HF per sample) hold with the buckets."""
    from megatron_psrl.model.linear_attention import PADDING_LIMIT, _length_buckets

    lengths = np.array([5, 3, 6, 1])
    buckets = _length_buckets(lengths)
    assert sorted(np.concatenate(buckets).tolist()) == [0, 1, 2, 3]
    for b in buckets:
        assert lengths[b].max() * len(b) <= PADDING_LIMIT * lengths[b].sum()
    assert [lengths[b].tolist() for b in buckets] == [[6, 5], [3], [1]]
    index = build_tree_linear_index(SegmentForest.from_plan(_plan(*TREES["grpo-group"])), 4, "cpu")
    assert [level.depth for level in index.levels] == [0, 1, 1, 1]
