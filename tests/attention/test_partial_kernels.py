"""Partial attention with log-sum-exp: the aten CPU flash kernels against plain math, and both
against autograd through a float64 softmax written out here.

The backward of a block is checked the way the blockwise backend uses it: keys are split into
two blocks, the *merged* output and lse of the whole key set are handed to each block's
backward, and the per-block dK/dV plus the summed dQ must equal the gradients of attention over
the whole key set.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_psrl.attention import partial
from megatron_psrl.attention.partial import (
    causal_chunks,
    lse_dtype,
    partial_attention_backward,
    partial_attention_forward,
)

IMPLS = ("aten", "math")
DTYPES = (torch.float32, torch.float64)
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float64: dict(atol=1e-11, rtol=1e-10)}
SHAPES = [
    # (nq, nk, np, ng, hn, hv, causal)
    pytest.param(9, 9, 4, 2, 16, 16, True, id="causal-square-gqa"),
    pytest.param(1, 1, 2, 2, 8, 8, True, id="causal-single-token"),
    pytest.param(33, 33, 6, 3, 8, 8, True, id="causal-square-longer"),
    pytest.param(5, 11, 4, 2, 16, 16, False, id="rect-more-keys-gqa"),
    pytest.param(12, 3, 4, 4, 8, 8, False, id="rect-fewer-keys-mha"),
    pytest.param(7, 7, 4, 1, 32, 32, False, id="square-unmasked-mqa"),
    # latent attention: values narrower than queries and keys (DeepSeek-V3: 192 and 128)
    pytest.param(9, 9, 4, 4, 24, 16, True, id="causal-narrow-values"),
    pytest.param(5, 11, 4, 4, 24, 16, False, id="rect-narrow-values"),
    pytest.param(6, 6, 2, 1, 8, 12, True, id="causal-wide-values"),
    # causal squares the CPU kernel runs in pieces of 256 rows (partial.causal_chunks)
    pytest.param(400, 400, 4, 2, 16, 16, True, id="causal-two-pieces"),
    pytest.param(520, 520, 2, 1, 8, 8, True, id="causal-three-pieces"),
    pytest.param(390, 390, 2, 2, 24, 16, True, id="causal-pieces-narrow-values"),
]


def _inputs(nq, nk, np_, ng, hn, dtype, seed=0, hv=None):
    hv = hn if hv is None else hv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, np_, hn, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(nk, ng, hn, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(nk, ng, hv, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(nq, np_, hv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def _reference(q, k, v, causal, scale):
    """float64 ``(o, lse)`` by explicit softmax; GQA by repeating each K/V group."""
    rep = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(rep, dim=1)
    vv = v.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    lse = torch.logsumexp(s, -1)  # [h, q]
    o = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv)
    return o, lse.T


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nq,nk,np_,ng,hn,hv,causal", SHAPES)
def test_forward_matches_reference(nq, nk, np_, ng, hn, hv, causal, dtype):
    q, k, v, _ = _inputs(nq, nk, np_, ng, hn, dtype, hv=hv)
    scale = 0.7 / math.sqrt(hn)
    ref_o, ref_lse = _reference(q, k, v, causal, scale)
    results = {}
    for impl in IMPLS:
        o, lse = partial_attention_forward(q, k, v, causal, scale, impl)
        assert o.shape == (nq, np_, hv) and o.dtype == dtype
        assert lse.shape == (nq, np_) and lse.dtype == lse_dtype(q)
        torch.testing.assert_close(o.double(), ref_o, **TOL[dtype])
        torch.testing.assert_close(lse.double(), ref_lse, **TOL[dtype])
        results[impl] = (o, lse)
    torch.testing.assert_close(results["aten"][0], results["math"][0], **TOL[dtype])
    torch.testing.assert_close(results["aten"][1], results["math"][1], **TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_accepts_strided_views(impl, dtype):
    """Megatron hands q/k/v as views of a fused projection: non-contiguous inputs work."""
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(8, 2, 3 * 16, generator=g, dtype=torch.float64).to(dtype)  # [n, ng, 3*hn]
    q, k, v = fused[..., :16], fused[..., 16:32], fused[..., 32:]
    assert not q.is_contiguous()
    o, lse = partial_attention_forward(q, k, v, True, 0.25, impl)
    ref_o, ref_lse = _reference(q, k, v, True, 0.25)
    torch.testing.assert_close(o.double(), ref_o, **TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nq,nk,np_,ng,hn,hv,causal", SHAPES)
def test_backward_of_a_single_block(nq, nk, np_, ng, hn, hv, causal, dtype):
    """One block holding all keys: its backward equals autograd through the reference."""
    q, k, v, do = _inputs(nq, nk, np_, ng, hn, dtype, seed=3, hv=hv)
    scale = 1.0 / math.sqrt(hn)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref_o, _ = _reference(*leaves, causal, scale)
    ref = torch.autograd.grad((ref_o * do.double()).sum(), leaves)
    for impl in IMPLS:
        o, lse = partial_attention_forward(q, k, v, causal, scale, impl)
        grads = partial_attention_backward(do, q, k, v, o, lse, causal, scale, impl)
        for name, got, want, x in zip("qkv", grads, ref, (q, k, v)):
            assert got.shape == x.shape and got.dtype == dtype, name
            torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=lambda m: f"{impl} d{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("np_,ng", [(4, 2), (2, 2), (6, 1)])
@pytest.mark.parametrize("split", [1, 4, 9])
def test_backward_with_merged_out_and_lse(np_, ng, split, dtype):
    """Keys = [an unmasked ancestor block of `split` keys, a causal own block of nq keys].

    Each block's backward gets the merged (o, lse) of the whole key set; dQ summed over the
    blocks and each block's dK/dV equal autograd through attention over the whole key set
    (the mask: every query sees the ancestor block and its own earlier tokens).
    """
    nq, hn = 6, 8
    scale = 1.0 / math.sqrt(hn)
    q, k_own, v_own, do = _inputs(nq, nq, np_, ng, hn, dtype, seed=5)
    _, k_anc, v_anc, _ = _inputs(1, split, np_, ng, hn, dtype, seed=6)

    # Reference: explicit softmax over [ancestor keys, own keys] with the tree mask.
    leaves = [x.double().requires_grad_(True) for x in (q, k_anc, v_anc, k_own, v_own)]
    rq, rka, rva, rko, rvo = leaves
    rep = np_ // ng
    kk = torch.cat([rka, rko]).repeat_interleave(rep, dim=1)
    vv = torch.cat([rva, rvo]).repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", rq, kk) * scale
    mask = torch.cat([torch.ones(nq, split, dtype=torch.bool), torch.ones(nq, nq, dtype=torch.bool).tril()], 1)
    s = s.masked_fill(~mask, -math.inf)
    ref_lse = torch.logsumexp(s, -1).T
    ref_o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    ref_grads = torch.autograd.grad((ref_o * do.double()).sum(), leaves)

    for impl in IMPLS:
        o1, l1 = partial_attention_forward(q, k_anc, v_anc, False, scale, impl)
        o2, l2 = partial_attention_forward(q, k_own, v_own, True, scale, impl)
        lse = torch.logaddexp(l1, l2)
        o = (o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]).to(dtype)
        torch.testing.assert_close(o.double(), ref_o.detach(), **TOL[dtype])
        torch.testing.assert_close(lse.double(), ref_lse.detach(), **TOL[dtype])
        dq1, dka, dva = partial_attention_backward(do, q, k_anc, v_anc, o, lse, False, scale, impl)
        dq2, dko, dvo = partial_attention_backward(do, q, k_own, v_own, o, lse, True, scale, impl)
        got = (dq1 + dq2, dka, dva, dko, dvo)
        for name, a, b in zip(("dq", "dk_anc", "dv_anc", "dk_own", "dv_own"), got, ref_grads):
            torch.testing.assert_close(a.double(), b, **TOL[dtype], msg=lambda m: f"{impl} {name}: {m}")


def test_aten_and_math_backward_agree_on_random_blocks():
    """Both implementations agree on a merged (o, lse) that is *not* their own block's."""
    g = torch.Generator().manual_seed(11)
    for trial in range(5):
        nq, nk = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        q = torch.randn(nq, 4, 8, generator=g)
        k, v = torch.randn(nk, 2, 8, generator=g), torch.randn(nk, 2, 8, generator=g)
        do = torch.randn(nq, 4, 8, generator=g)
        o = torch.randn(nq, 4, 8, generator=g)
        lse = torch.randn(nq, 4, generator=g) + 3.0  # a merged lse is >= each block's; any value is valid
        a = partial_attention_backward(do, q, k, v, o, lse, False, 0.35, "aten")
        m = partial_attention_backward(do, q, k, v, o, lse, False, 0.35, "math")
        for x, y in zip(a, m):
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_math_path_in_query_chunks_equals_one_chunk(causal):
    """The math path bounds its score tensor by processing queries in chunks (how the torch
    backend runs on CUDA); chunk boundaries must not change anything, causal masks included."""
    from megatron_psrl.attention.partial import _math_backward, _math_forward

    torch.manual_seed(0)
    nq, nk = (13, 13) if causal else (13, 29)
    q, k, v = torch.randn(nq, 4, 8, dtype=torch.float64), torch.randn(nk, 2, 8, dtype=torch.float64), \
        torch.randn(nk, 2, 8, dtype=torch.float64)
    do = torch.randn(nq, 4, 8, dtype=torch.float64)
    o1, l1 = _math_forward(q, k, v, causal, 0.3)
    o2, l2 = _math_forward(q, k, v, causal, 0.3, max_elements=4 * nk * 3)  # chunks of 3 queries
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    g1 = _math_backward(do, q, k, v, o1, l1, causal, 0.3)
    g2 = _math_backward(do, q, k, v, o1, l1, causal, 0.3, max_elements=4 * nk * 3)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_causal_squares_split_only_where_the_cpu_kernel_computes_masked_pairs():
    assert causal_chunks(383) is None and causal_chunks(577) is None and causal_chunks(4096) is None
    assert causal_chunks(384) == [(0, 256), (256, 384)]
    assert causal_chunks(512) == [(0, 256), (256, 512)]
    assert causal_chunks(576) == [(0, 256), (256, 512), (512, 576)]


def test_a_split_causal_square_calls_the_kernel_per_piece(monkeypatch):
    """512 rows: the first piece causal, the second causal on itself and unmasked over the
    first; the backward replays the same three calls (and the result is the reference's)."""
    calls = []
    forward, backward = partial._aten_forward, partial._aten_backward
    monkeypatch.setattr(partial, "_aten_forward", lambda q, k, *a: calls.append(("f", q.shape[0], k.shape[0], a[1]))
                        or forward(q, k, *a))
    monkeypatch.setattr(partial, "_aten_backward", lambda do, q, k, *a: calls.append(("b", q.shape[0], k.shape[0],
                                                                                       a[3])) or backward(do, q, k, *a))
    q, k, v, do = _inputs(512, 512, 2, 1, 8, torch.float32)
    o, lse = partial_attention_forward(q, k, v, True, 0.3, "aten")
    partial_attention_backward(do, q, k, v, o, lse, True, 0.3, "aten")
    assert calls == [("f", 256, 256, True), ("f", 256, 256, True), ("f", 256, 256, False),
                     ("b", 256, 256, True), ("b", 256, 256, True), ("b", 256, 256, False)]
    ref_o, ref_lse = _reference(q, k, v, True, 0.3)
    torch.testing.assert_close(o.double(), ref_o, **TOL[torch.float32])
    torch.testing.assert_close(lse.double(), ref_lse, **TOL[torch.float32])
