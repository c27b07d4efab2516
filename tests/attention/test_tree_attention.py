"""Tree attention on random segment forests against an independent per-query reference.

The reference (``attn_reference``) derives every query's key set from the segment parents and
the external sources of its root, then takes a float64 softmax over exactly those keys. The
``torch`` (blockwise, both kernels) and ``dense`` backends and an emulation of the flash / TE
varlen semantics over ``AttentionPlan.gathered_keys`` must all match it, values and gradients
(q, k, v and the external K/V that mechanism 2 collects).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attn_reference import Forest, forests, make_qkv, per_query_attention, random_forest
from hypothesis import HealthCheck, given, settings

from megatron_psrl.attention.backends import blockwise_tree_attention, dense_tree_attention
from megatron_psrl.attention.plan import AttentionPlan, causal_plan, tree_plan

TOL = {torch.float32: dict(atol=3e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-9)}
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(backend: str, q, k, v, plan, external, scale):
    if backend == "dense":
        return dense_tree_attention(q, k, v, plan, external, scale)
    impl = backend.split("-")[1]
    return blockwise_tree_attention(q, k, v, plan, external, scale, impl=impl)


def gathered_varlen_attention(q, k, v, plan: AttentionPlan, external=(), scale=None):
    """What flash-attn varlen / TE thd do with gathered keys, emulated with SDPA on CPU:
    per segment, attention over its gathered keys with a causal mask aligned bottom right."""
    key_index, cu_q, cu_k = plan.gathered_keys()
    keys = torch.cat([k] + [e[0] for e in external], 0)
    values = torch.cat([v] + [e[1] for e in external], 0)
    idx = torch.from_numpy(key_index)
    kg, vg = keys.index_select(0, idx), values.index_select(0, idx)
    outs = []
    for g in range(len(cu_q) - 1):
        qs = q[cu_q[g]:cu_q[g + 1]]
        ks, vs = kg[cu_k[g]:cu_k[g + 1]], vg[cu_k[g]:cu_k[g + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)  # bottom-right aligned causal
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, scale=scale,
            enable_gqa=ks.shape[1] != qs.shape[1],
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


def _check_all_backends(forest: Forest, dtype, np_=4, ng=2, hn=8, seed=0, backends=None, hv=None):
    plan = forest.plan()
    scale = 0.9 / np.sqrt(hn)
    q, k, v, external = make_qkv(forest, np_, ng, hn, dtype, seed, hv)
    leaves = [q, k, v] + [x for pair in external for x in pair]
    out_shape = (q.shape[0], np_, v.shape[-1])
    dout = torch.randn(out_shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)

    ref = per_query_attention(q, k, v, forest.key_sets(), external, scale)
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), leaves)
    names = ["q", "k", "v"] + [f"ext{i}_{kv}" for i in range(len(external)) for kv in "kv"]
    for backend in backends or ("torch-aten", "torch-math", "dense", "gathered"):
        if backend == "gathered":
            out = gathered_varlen_attention(q, k, v, plan, external, scale)
        else:
            out = _run(backend, q, k, v, plan, external, scale)
        assert out.shape == out_shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), ref.detach(), **TOL[dtype], msg=lambda m: f"{backend} out: {m}")
        grads = torch.autograd.grad((out * dout).sum(), leaves)
        for name, got, want in zip(names, grads, ref_grads):
            torch.testing.assert_close(
                got.double(), want.double(), **TOL[dtype], msg=lambda m: f"{backend} d{name}: {m}"
            )


@HYP
@given(forest=forests())
def test_backends_match_per_query_reference_float64(forest):
    _check_all_backends(forest, torch.float64)


@HYP
@given(forest=forests(with_external=False, max_segments=9))
def test_backends_match_per_query_reference_without_external(forest):
    _check_all_backends(forest, torch.float64, np_=2, ng=2, hn=4)


@pytest.mark.parametrize("seed", range(6))
def test_backends_match_reference_float32(seed):
    forest = random_forest(np.random.default_rng(seed), max_segments=8, max_len=9)
    _check_all_backends(forest, torch.float32, np_=4, ng=2, hn=16, seed=seed)


@pytest.mark.parametrize("np_,ng", [(2, 2), (6, 3), (4, 1)])
def test_head_layouts(np_, ng):
    forest = random_forest(np.random.default_rng(42), max_segments=6)
    _check_all_backends(forest, torch.float64, np_=np_, ng=ng, hn=8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_values_narrower_than_keys(dtype):
    """Latent attention (DeepSeek-V3): keys of 24 (nope + rope), values of 12 per head, with a
    cached prefix; the CPU kernels take one width (values padded for them)."""
    forest = Forest(lengths=[5, 3, 2, 4, 1, 3], parents=[-1, 0, 1, 0, 0, 0], ext_lengths=[7, 2],
                    root_sources={0: [0, 1]})
    _check_all_backends(forest, dtype, np_=4, ng=4, hn=24, hv=12)


def test_flash_pads_narrow_values_for_its_one_width_kernel(monkeypatch, caplog):
    """flash-attn 2's varlen kernel takes one head width for q, k and v: narrower values are
    padded with zeros for it and the output cut back, exactly (values and every gradient equal
    the torch backend's), with one logged line. On CPU, with flash-attn's contract emulated by
    the reference varlen kernel (which refuses two widths, as flash-attn 2 does)."""
    import logging
    import sys
    import types

    from helpers.varlen_reference import ReferenceVarlen

    from megatron_psrl.attention.backends import varlen

    def flash_attn_varlen_func(q, kg, vg, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal,
                               deterministic):
        assert q.shape[-1] == kg.shape[-1] == vg.shape[-1], "flash-attn 2: one head width"
        return ReferenceVarlen.apply(q, kg, vg, cu_q, cu_k, softmax_scale)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    monkeypatch.setattr(varlen, "require_cuda", lambda name, q: None)
    monkeypatch.setattr(varlen, "_PADDED_LOGGED", set())
    forest = Forest(lengths=[5, 3, 2, 4], parents=[-1, 0, 1, 0], ext_lengths=[6], root_sources={0: [0]})
    q, k, v, external = make_qkv(forest, 4, 4, 24, torch.float64, seed=2, hv=12)
    leaves = [q, k, v, *external[0]]
    dout = torch.randn(forest.num_tokens, 4, 12, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger=varlen.__name__):
        got = [varlen.flash_tree_attention(q, k, v, forest.plan(), external, 0.3) for _ in range(2)][0]
    want = blockwise_tree_attention(q, k, v, forest.plan(), external, 0.3, impl="math")
    assert got.shape == want.shape == (forest.num_tokens, 4, 12)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # (the reference kernel keeps its log-sum-exp in fp32, as flash-attn does: the backward's tolerance)
    for a, b in zip(torch.autograd.grad((got * dout).sum(), leaves), torch.autograd.grad((want * dout).sum(), leaves)):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    padded = [r for r in caplog.records if "padded" in r.getMessage()]
    assert len(padded) == 1 and "12" in padded[0].getMessage() and "24" in padded[0].getMessage()


def test_prefix_with_many_children_and_a_cached_prefix():
    """The GRPO shape: a cached prompt (external), a shared in-pack prefix, 4 responses, one of
    which branches again; every query must see prompt + prefix + its own branch only."""
    forest = Forest(
        lengths=[5, 3, 2, 4, 1, 3],
        parents=[-1, 0, 1, 0, 0, 0],
        ext_lengths=[7],
        root_sources={0: [0]},
    )
    plan = forest.plan()
    assert plan.num_blocks == 3  # prefix -> its subtree, segment 1 -> segment 2, external -> all
    _check_all_backends(forest, torch.float64)


@HYP
@given(forest=forests(max_segments=9, max_len=8, max_sources=3))
def test_plan_masks_and_key_counts(forest):
    """dense_mask() is the reference mask; key_pairs() counts it; gathered_keys() lists, for
    every segment, exactly the ancestors of its queries followed by its own tokens."""
    plan = forest.plan()
    mask = plan.dense_mask()
    np.testing.assert_array_equal(mask, forest.reference_mask())
    assert plan.key_pairs() == int(mask.sum())

    key_index, cu_q, cu_k = plan.gathered_keys()
    np.testing.assert_array_equal(cu_q, np.array(forest.starts + [forest.num_tokens]))
    key_sets = forest.key_sets()
    for g in range(plan.num_segments):
        keys = key_index[cu_k[g]:cu_k[g + 1]].tolist()
        n_own = forest.lengths[g]
        own = list(range(forest.starts[g], forest.ends[g]))
        assert keys[len(keys) - n_own:] == own  # own tokens last: bottom-right causal is exact
        assert len(set(keys)) == len(keys)
        # the last query of the segment sees exactly every gathered key
        assert sorted(keys) == key_sets[forest.ends[g] - 1]
    assert plan.gathered_keys() is plan.gathered_keys()  # cached per micro-batch


def test_causal_plan_is_independent_sequences():
    plan = causal_plan([3, 1, 4])
    mask = plan.dense_mask()
    expected = np.zeros((8, 8), dtype=bool)
    for a, b in ((0, 3), (3, 4), (4, 8)):
        expected[a:b, a:b] = np.tril(np.ones((b - a, b - a), dtype=bool))
    np.testing.assert_array_equal(mask, expected)
    assert plan.key_pairs() == 6 + 1 + 10 and plan.num_blocks == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seg_start=[0, 2], seg_end=[2, 5], seg_parent=[1, -1]), "depth-first"),
        (dict(seg_start=[0, 3], seg_end=[2, 5], seg_parent=[-1, 0]), "contiguous"),
        (dict(seg_start=[0], seg_end=[3], seg_parent=[-1], external_blocks=[(0, 3, 1)], external_lengths=[2]),
         "unknown external source"),
    ],
)
def test_tree_plan_rejects_malformed_forests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tree_plan(**kwargs)


def test_plan_validation_errors():
    with pytest.raises(ValueError, match="cover"):
        AttentionPlan(num_tokens=5, seg_start=[0], seg_end=[4])
    with pytest.raises(ValueError, match="precede"):
        AttentionPlan(num_tokens=4, seg_start=[0, 2], seg_end=[2, 4], block_q_start=[0], block_q_end=[2],
                      block_k_start=[2], block_k_end=[4], block_source=[-1])
    with pytest.raises(ValueError, match="outside their external source"):
        AttentionPlan(num_tokens=2, seg_start=[0], seg_end=[2], block_q_start=[0], block_q_end=[2],
                      block_k_start=[0], block_k_end=[5], block_source=[0], external_lengths=[3])


@pytest.mark.parametrize("impl", ["aten", "math"])
def test_blockwise_gradients_accumulate_over_shared_prefix(impl):
    """A shared prefix read by many children gets the SUM of their K/V gradients: equal to
    running every root-to-leaf sample separately with plain causal attention."""
    prefix, children = 6, [3, 5, 2]
    forest = Forest(lengths=[prefix] + children, parents=[-1, 0, 0, 0])
    plan = forest.plan()
    q, k, v, _ = make_qkv(forest, 4, 2, 8, torch.float64, seed=9)
    out = blockwise_tree_attention(q, k, v, plan, impl=impl)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))

    # Separately: sample c = [prefix tokens, child c tokens]; prefix loss terms counted once
    # (the prefix outputs are identical in every sample, so weight them in one sample only).
    ref = [torch.zeros_like(x) for x in (q, k, v)]
    for c, (a, b) in enumerate(zip(forest.starts[1:], forest.ends[1:])):
        rows = torch.cat([torch.arange(prefix), torch.arange(a, b)])
        qs, ks, vs = (x.detach()[rows].requires_grad_(True) for x in (q, k, v))
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)
        w = dout[rows].clone()
        if c > 0:
            w[:prefix] = 0
        torch.testing.assert_close(o.detach(), out.detach()[rows], atol=1e-10, rtol=1e-10)
        for acc, gsep in zip(ref, torch.autograd.grad((o * w).sum(), (qs, ks, vs))):
            acc.index_add_(0, rows, gsep)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_tree_plan_rejects_non_depth_first_forests():
    """Segment 2 is a child of segment 0 but follows the unrelated root 1: the subtree of 0 is
    not contiguous, and a token-range block would let root 1 see segment 0."""
    with pytest.raises(ValueError, match="depth-first"):
        tree_plan([0, 2, 4], [2, 4, 6], [-1, -1, 0])
    with pytest.raises(ValueError, match="depth-first"):
        tree_plan([0, 1, 2, 3], [1, 2, 3, 4], [-1, 0, -1, 1])
    tree_plan([0, 1, 2, 3], [1, 2, 3, 4], [-1, 0, 1, 0])  # valid: 0 -> 1 -> 2, 0 -> 3


def test_gathered_keys_refuse_blocks_that_split_a_segment():
    """Queries 3:6 of one segment see an external source, queries 0:3 do not: the blockwise
    and dense backends are exact, but a varlen kernel gives a whole segment one key list, so
    gathered_keys must refuse instead of silently dropping the block."""
    plan = AttentionPlan(num_tokens=6, seg_start=[0], seg_end=[6], block_q_start=[3], block_q_end=[6],
                         block_k_start=[0], block_k_end=[2], block_source=[0], external_lengths=[2])
    q, k, v = (torch.randn(6, h, 4, dtype=torch.float64) for h in (2, 2, 2))
    ext = [(torch.randn(2, 2, 4, dtype=torch.float64), torch.randn(2, 2, 4, dtype=torch.float64))]
    key_sets = [list(range(i + 1)) + ([6, 7] if i >= 3 else []) for i in range(6)]
    ref = per_query_attention(q, k, v, key_sets, ext)
    for backend in ("torch-aten", "torch-math", "dense"):
        torch.testing.assert_close(_run(backend, q, k, v, plan, ext, None), ref, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="segment boundaries"):
        plan.gathered_keys()
