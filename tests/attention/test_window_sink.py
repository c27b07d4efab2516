"""Sliding windows and learnable sinks in tree attention, against an independent per-query
reference (``attn_reference``: every query's keys derived from the segment parents and the
chain of cached prefixes its root reads, kept when fewer than ``window`` tokens before it on its
own path; a sink logit per head one more softmax column, as transformers' gpt-oss).

Windows count depths along a token's path, never a sibling branch's tokens; the sink joins every
softmax's denominator once however the keys are split (the pack's own keys, cached prefixes,
rows in flight) and its gradient is exact; rows of a cached prefix no window reaches are not read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attn_reference import (
    chain_forest,
    make_qkv,
    per_query_attention,
    plan_with_depths,
    windowed_key_sets,
)
from helpers.varlen_reference import reference_kernel

from megatron_psrl.attention.backends import blockwise_tree_attention, dense_tree_attention
from megatron_psrl.attention.backends.varlen import varlen_tree_attention
from megatron_psrl.attention.plan import causal_plan, tree_plan

TOL = {torch.float32: dict(atol=3e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-9)}
SEEDS = range(6)
WINDOWS = (1, 3, 8)


def _attend(backend, q, k, v, plan, external, scale, sink):
    if backend == "dense":
        return dense_tree_attention(q, k, v, plan, external, scale, sink=sink)
    if backend == "varlen":  # flash-attn's contract (window_size=(W - 1, 0)) in torch
        assert sink is None
        return varlen_tree_attention(q, k, v, plan, external, reference_kernel(scale, window=plan.window))
    return blockwise_tree_attention(q, k, v, plan, external, scale, impl=backend.split("-")[1], sink=sink)


def _check(forest, window, backends, dtype=torch.float64, with_sink=True, seed=0):
    scale = 0.7
    plan = plan_with_depths(forest).windowed(window)
    q, k, v, external = make_qkv(forest, 4, 2, 8, dtype, seed)
    sink = (torch.randn(4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
            .requires_grad_(True) if with_sink else None)
    leaves = [q, k, v] + [x for pair in external for x in pair] + ([sink] if with_sink else [])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    ref = per_query_attention(q, k, v, windowed_key_sets(forest, window), external, scale, sink)
    want = torch.autograd.grad((ref * dout.double()).sum(), leaves)
    for backend in backends:
        trimmed = [(a[s:], b[s:]) for (a, b), s in zip(external, plan.external_starts)]
        out = _attend(backend, q, k, v, plan, trimmed, scale, sink)
        torch.testing.assert_close(out.double(), ref.detach(), **TOL[dtype], msg=lambda m: f"{backend} out: {m}")
        got = torch.autograd.grad((out * dout).sum(), leaves, allow_unused=True)
        # (the varlen path sums a gathered row's gradients in fp32 whatever the dtype: GatherRows)
        tol = TOL[torch.float32] if backend == "varlen" else TOL[dtype]
        for i, (g, w) in enumerate(zip(got, want)):
            g = torch.zeros_like(w) if g is None else g  # (a source no window reaches: no gradient)
            torch.testing.assert_close(g.double(), w.double(), **tol, msg=lambda m: f"{backend} grad {i}: {m}")


@pytest.mark.parametrize("seed", SEEDS)
def test_windowed_plan_mask_is_the_paths_window(seed):
    """The windowed plan (pieces, trimmed and masked blocks, skipped cached rows) sees exactly
    each query's ancestors within the window, counted along its own path."""
    rng = np.random.default_rng(seed)
    forest = chain_forest(rng)
    base = plan_with_depths(forest)
    for window in WINDOWS + (1000,):
        plan = base.windowed(window)
        assert base.windowed(window) is plan  # once per micro-batch
        mask = plan.dense_mask()
        ref = np.zeros((forest.num_tokens, base.key_source_offsets()[-1]), dtype=bool)
        for i, keys in enumerate(windowed_key_sets(forest, window)):
            ref[i, keys] = True
        # the windowed plan's columns: external sources from their first read row
        offsets = base.key_source_offsets()
        kept = np.concatenate([np.arange(forest.num_tokens)] + [
            np.arange(offsets[j + 1] + s, offsets[j + 2]) for j, s in enumerate(plan.external_starts)])
        assert np.array_equal(mask, ref[:, kept]), window
        assert not ref[:, np.setdiff1d(np.arange(ref.shape[1]), kept)].any()  # skipped rows: no query's
        assert np.all(plan.seg_end - plan.seg_start <= window)
        if window == 1000:  # every ancestor: nothing masked, a source is read whole (or not at all)
            assert not plan.block_masked.any()
            read = [j in base.block_source for j in range(len(forest.ext_lengths))]
            assert [0 if r else n for r, n in zip(read, forest.ext_lengths)] == plan.external_starts.tolist()


@pytest.mark.parametrize("seed", SEEDS)
def test_window_and_sink_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    forest = chain_forest(rng)
    window = WINDOWS[seed % len(WINDOWS)]
    _check(forest, window, ("torch-aten", "torch-math", "dense"), seed=seed)
    _check(forest, window, ("varlen",), with_sink=False, seed=seed)


def test_float32_backends_match_the_reference():
    forest = chain_forest(np.random.default_rng(3), max_len=12)
    _check(forest, 5, ("torch-aten", "torch-math", "dense"), dtype=torch.float32)


def test_branches_longer_than_the_window_never_see_their_siblings():
    """A prompt P with two long branches A and B (each longer than the window), B with a child C:
    every query sees the last `window` tokens of its own path and nothing of a sibling branch."""
    lengths, parents = [5, 11, 9, 4], [-1, 0, 0, 2]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    plan = tree_plan(starts, np.cumsum(lengths), parents,
                     positions=np.concatenate([np.arange(5), 5 + np.arange(11), 5 + np.arange(9), 14 + np.arange(4)]))
    mask = plan.windowed(4).dense_mask()
    A, B, C = range(5, 16), range(16, 25), range(25, 29)
    assert not mask[np.ix_(B, A)].any() and not mask[np.ix_(C, A)].any() and not mask[np.ix_(A, B)].any()
    assert mask[25].nonzero()[0].tolist() == [22, 23, 24, 25]  # C's first token: B's last three and itself
    assert mask[16].nonzero()[0].tolist() == [2, 3, 4, 16]  # B's first token: P's last three and itself


def test_off_by_one_matches_transformers_sliding_mask():
    """On a single sequence the window is transformers' sliding-window causal mask exactly
    (``kv_idx > q_idx - sliding_window``, and causal)."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    n = 13
    for window in (1, 2, 5, 12, 13, 20):
        ours = causal_plan([n]).windowed(window).dense_mask()
        hf_mask = and_masks(causal_mask_function, sliding_window_overlay(window))
        ref = np.array([[bool(hf_mask(0, 0, torch.tensor(i), torch.tensor(j))) for j in range(n)] for i in range(n)])
        assert np.array_equal(ours, ref), window


def test_the_sink_joins_the_denominator_once_across_cached_prefix_and_pack():
    """A query whose keys are a cached prefix (external) and the pack's own tokens: one merge of
    two partial attentions, one sink. Against the unsplit per-query softmax with one sink column,
    and a sink added per part would differ."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ek, ev = torch.randn(5, 2, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, 4, generator=g, dtype=torch.float64)
    sink = torch.tensor([0.5, 2.0], dtype=torch.float64)
    plan = tree_plan([0], [6], [-1], external_blocks=[(0, 6, 0)], external_lengths=[5])
    out = blockwise_tree_attention(q, k, v, plan, [(ek, ev)], 0.5, sink=sink)
    keys = [list(range(6, 11)) + list(range(i + 1)) for i in range(6)]
    ref = per_query_attention(q, k, v, keys, [(ek, ev)], 0.5, sink)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    # the sink counted twice (once per partial attention) is another result
    twice = per_query_attention(q, k, v, keys, [(ek, ev)], 0.5, sink + np.log(2.0))
    assert (out - twice).abs().max() > 1e-3


def test_sink_gradient_is_exact():
    """d(loss)/d(sink) against the float64 reference and a central difference."""
    forest = chain_forest(np.random.default_rng(5))
    plan = plan_with_depths(forest).windowed(3)
    q, k, v, external = make_qkv(forest, 4, 2, 8, torch.float64)
    ext = [(a[s:], b[s:]) for (a, b), s in zip(external, plan.external_starts)]
    sink = torch.tensor([0.1, -0.4, 1.3, 0.0], dtype=torch.float64, requires_grad=True)
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def loss(s):
        return (blockwise_tree_attention(q, k, v, plan, ext, 0.7, sink=s) * weights).sum()

    (grad,) = torch.autograd.grad(loss(sink), [sink])
    ref = per_query_attention(q, k, v, windowed_key_sets(forest, 3), external, 0.7, sink)
    (want,) = torch.autograd.grad((ref * weights).sum(), [sink])
    torch.testing.assert_close(grad, want, atol=1e-11, rtol=1e-9)
    eps = 1e-6
    for h in range(4):
        step = torch.zeros(4, dtype=torch.float64)
        step[h] = eps
        with torch.no_grad():
            numeric = (loss(sink.detach() + step) - loss(sink.detach() - step)) / (2 * eps)
        assert abs(float(numeric) - float(grad[h])) < 1e-6


class _Reader:
    """A cached prefix read by the attention itself (``CachedPrefixKV``), recording its reads."""

    def __init__(self, k, v):
        self.k, self.v, self.starts = k, v, []
        self.grad_k, self.grad_v = torch.zeros_like(k), torch.zeros_like(v)

    def read(self, again=False, start=0):
        self.starts.append(start)
        return self.k[start:].clone(), self.v[start:].clone()

    def add_grad(self, grad_key, grad_value, start=0):
        self.grad_k[start:] += grad_key
        self.grad_v[start:] += grad_value

    def materialize(self, start=0):
        raise AssertionError("the torch backend reads cached prefixes itself")


def test_cached_rows_no_window_reaches_are_not_read():
    """A 20-token cached prefix under a 4-token response with a window of 6: the response's first
    token (depth 20) reaches back to depth 15, so the attention reads the prefix's last 5 rows only
    (forward and backward), and its gradient lands on them."""
    from megatron_psrl.attention.window import rows_in_window

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ek, ev = torch.randn(20, 2, 4, generator=g, dtype=torch.float64), torch.randn(20, 2, 4, generator=g, dtype=torch.float64)
    plan = tree_plan([0], [4], [-1], external_blocks=[(0, 4, 0)], external_lengths=[20], positions=20 + np.arange(4),
                     external_positions=[0]).windowed(6)
    assert plan.external_starts.tolist() == [15] and plan.external_lengths == [5]
    reader = _Reader(ek, ev)
    out = blockwise_tree_attention(q, k, v, plan, rows_in_window([reader], plan.external_starts), 0.5)
    out.sum().backward()
    assert reader.starts == [15, 15]  # forward and backward, the window's rows only
    ek2, ev2 = ek.clone().requires_grad_(True), ev.clone().requires_grad_(True)
    keys = [[j for j in list(range(4, 24)) + list(range(i + 1)) if (20 + i) - (j - 4 if j >= 4 else 20 + j) < 6]
            for i in range(4)]
    ref = per_query_attention(q, k, v, keys, [(ek2, ev2)], 0.5)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    ref.sum().backward()
    torch.testing.assert_close(reader.grad_k, ek2.grad, atol=1e-12, rtol=1e-10)
    assert not reader.grad_k[:15].any() and reader.grad_k[15:].abs().min() > 0


def test_each_layer_reads_its_window_from_megatrons_config():
    """megatron's ``window_size`` is ``(W - 1, 0)`` and ``window_attn_skip_freq`` marks the
    windowed layers (1-based layer numbers); gpt-oss's alternate."""
    from types import SimpleNamespace

    from megatron_psrl.attention.window import layer_window
    from megatron_psrl.errors import ConfigurationError

    config = SimpleNamespace(window_size=(7, 0), window_attn_skip_freq=[1, 0, 1, 0])
    assert [layer_window(config, n) for n in (1, 2, 3, 4)] == [8, None, 8, None]
    assert layer_window(SimpleNamespace(window_size=None, window_attn_skip_freq=None), 1) is None
    assert layer_window(SimpleNamespace(window_size=(-1, -1), window_attn_skip_freq=None), 1) is None
    with pytest.raises(ConfigurationError, match="right"):
        layer_window(SimpleNamespace(window_size=(7, 3), window_attn_skip_freq=None), 1)


def test_kernels_without_a_window_or_a_sink_fall_back_to_torch(caplog):
    """flash-attn takes a window (2.3+) but no sink; Transformer Engine is asked for neither:
    those layers run on the torch backend, each reason logged once."""
    from megatron_psrl.attention import window

    window._LOGGED.clear()
    with caplog.at_level("WARNING", logger="megatron_psrl"):
        assert window.runnable_backend("flash", 8, False, flash_version=(2, 6, 3)) == "flash"
        assert window.runnable_backend("flash", None, True, flash_version=(2, 6, 3)) == "torch"
        assert window.runnable_backend("flash", 8, True, flash_version=(2, 6, 3)) == "torch"
        assert window.runnable_backend("flash", 8, False, flash_version=(2, 2)) == "torch"
        assert window.runnable_backend("te", 8, False) == "torch"
        assert window.runnable_backend("te", None, False) == "te"
        assert window.runnable_backend("dense", 8, True) == "dense"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and any("no attention sinks" in m for m in lines) and any("2.3" in m for m in lines)
