"""The flash / te path sums a shared prefix's dK/dV over its readers in fp32, deterministically.

Every segment reads its own gathered copy of its ancestors' K/V; a prompt read by n responses
has n copies, and its dK/dV is the sum of their n gradients. Added in bf16 (``index_select``'s
own backward), every addition rounds the running sum: the error grows with n. Added in fp32
(``GatherRows``) and rounded once, it stays where one rounding puts it, as the ``torch``
backend's does. On CPU, around the reference varlen kernel (flash-attn's contract, dK/dV of the
copies in bf16 as flash-attn returns them), against an fp64 reference on the same bf16 inputs.
"""

import numpy as np
import pytest
import torch
from helpers.varlen_reference import reference_kernel

from megatron_psrl.attention.backends import blockwise_tree_attention
from megatron_psrl.attention.backends.varlen import GatherRows, gather_index, varlen_tree_attention
from megatron_psrl.attention.plan import tree_plan

NP, NG, HN = 2, 1, 16
SCALE = HN ** -0.5
PROMPT, RESPONSE, SYSTEM = 32, 2, 8
READERS = (16, 512)

FLAT = 2.0
"""Error at 512 readers over error at 16 allowed: one bf16 rounding of the sum has a relative
error of at most 2^-9 at both sizes, and the per-copy roundings inside the kernel (random
signs, a sum that grows like sqrt(n) as the sum itself) keep a relative error independent of n;
what varies is which rows happen to round up, a factor well under 2 (measured 0.95 and 1.00 on
two seeds: 2.41e-3 -> 2.29e-3, 2.35e-3 -> 2.35e-3). Summed in bf16 the ratio grows like
sqrt(512 / 16) = 5.7 at most (a random walk of n roundings of a sum of size sqrt(n)); measured
4.4 and 4.0 (5.9e-3 -> 2.6e-2, 6.7e-3 -> 2.7e-2)."""


def _plan(readers: int):
    """A prompt read by ``readers`` responses, all under a cached system prompt (an external source)."""
    starts = [0] + [PROMPT + i * RESPONSE for i in range(readers)]
    ends = [PROMPT] + [PROMPT + (i + 1) * RESPONSE for i in range(readers)]
    return tree_plan(starts, ends, [-1] + [0] * readers, external_blocks=[(0, ends[-1], 0)],
                     external_lengths=[SYSTEM])


def _inputs(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(t, NP, HN), (t, NG, HN), (t, NG, HN), (SYSTEM, NG, HN), (SYSTEM, NG, HN), (t, NP, HN)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(torch.bfloat16) for s in shapes]


class Bf16AtomicGather(torch.autograd.Function):
    """``index_select`` with the backward it has on CUDA: ``index_add_`` of the copies' gradients
    into a bf16 buffer by atomics, every addition rounded to bf16 (here in index order, one
    round per copy; on the GPU in whatever order the atomics land). CPU's own ``index_select``
    backward adds in fp32, so the CUDA behaviour is emulated to show what the fix changes."""

    @staticmethod
    def forward(ctx, source, idx):
        ctx.save_for_backward(idx)
        ctx.rows = source.shape[0]
        return source.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        total = torch.zeros((ctx.rows,) + tuple(grad.shape[1:]), dtype=grad.dtype)
        order = torch.argsort(idx, stable=True)
        sorted_idx = idx[order]
        first = torch.searchsorted(sorted_idx, sorted_idx)  # where each destination's run starts
        copy = torch.empty_like(idx)
        copy[order] = torch.arange(len(idx)) - first  # which copy of its row each gathered row is
        for r in range(int(copy.max()) + 1 if len(idx) else 0):
            pick = copy == r  # at most one copy per destination: one rounded addition each
            total[idx[pick]] = total[idx[pick]] + grad[pick]
        return total, None


def _bf16_sum_path(q, k, v, plan, external, kernel):
    """The varlen path as it was, with the bf16 accumulation CUDA's ``index_select`` backward does."""
    idx, cu_q, cu_k, max_q, max_k = gather_index(plan, k.device)
    kg = Bf16AtomicGather.apply(torch.cat([k] + [e[0] for e in external]), idx)
    vg = Bf16AtomicGather.apply(torch.cat([v] + [e[1] for e in external]), idx)
    return kernel(q, kg, vg, cu_q, cu_k, max_q, max_k)


def _torch_path(q, k, v, plan, external, kernel):
    """The ``torch`` backend (blockwise, dK/dV in fp32 over every reader), for comparison."""
    return blockwise_tree_attention(q, k, v, plan, external, SCALE)


def _prefix_grad_error(readers: int, seed: int, path) -> float:
    """Relative L2 error of the prompt's and the system prompt's dK/dV (bf16 varlen path vs an
    fp64 blockwise reference on the same bf16 inputs)."""
    plan = _plan(readers)
    q, k, v, ek, ev, dout = _inputs(plan.num_tokens, seed)
    grads = []
    for dtype, run in ((torch.bfloat16, path), (torch.float64, None)):
        leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v, ek, ev)]
        lq, lk, lv, lek, lev = leaves
        if run is None:
            out = blockwise_tree_attention(lq, lk, lv, plan, [(lek, lev)], SCALE)
        else:
            out = run(lq, lk, lv, plan, [(lek, lev)], reference_kernel(SCALE))
        grads.append(torch.autograd.grad((out * dout.to(dtype)).sum(), (lk, lv, lek, lev)))
    got = torch.cat([torch.cat([g[:PROMPT] if g.shape[0] > SYSTEM else g for g in grads[0]]).double().flatten()])
    want = torch.cat([torch.cat([g[:PROMPT] if g.shape[0] > SYSTEM else g for g in grads[1]]).flatten()])
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def errors():
    """Per path and number of readers: the relative error (one thread: the reference kernel's
    many small products run 7x faster than with a contended thread pool)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {(name, n): _prefix_grad_error(n, 0, path) for n in READERS
                for name, path in (("fp32", varlen_tree_attention), ("bf16", _bf16_sum_path), ("torch", _torch_path))}
    finally:
        torch.set_num_threads(threads)


def test_prefix_grads_stay_flat_from_16_to_512_readers(errors):
    small, large = errors["fp32", READERS[0]], errors["fp32", READERS[1]]
    assert large <= FLAT * small, errors
    assert large < 2 ** -7, errors  # a few bf16 roundings, not hundreds
    assert large <= FLAT * errors["torch", READERS[1]], errors  # as good as the torch backend


def test_bf16_accumulation_would_not_pass(errors):
    """The check has teeth: summing the copies in bf16 (the path before) grows past the bound."""
    small, large = errors["bf16", READERS[0]], errors["bf16", READERS[1]]
    assert large > FLAT * small and large > 2 * errors["fp32", READERS[1]], errors


def test_gather_backward_is_fp32_and_deterministic():
    """The copies' gradients are summed in fp32 (what autograd hands the bf16 source is that
    sum rounded once) and the same bits come out every time."""
    g = torch.Generator().manual_seed(0)
    source = torch.randn(6, 2, 4, generator=g).to(torch.bfloat16).requires_grad_(True)
    idx = torch.from_numpy(np.array([0, 1, 1, 2, 1, 0, 5] * 40))
    grad = torch.randn(len(idx), 2, 4, generator=g).to(torch.bfloat16)
    (first,) = torch.autograd.grad(GatherRows.apply(source, idx), source, grad)
    (again,) = torch.autograd.grad(GatherRows.apply(source, idx), source, grad)
    want = torch.zeros(6, 2, 4, dtype=torch.float32).index_add_(0, idx, grad.float())  # serial fp32 sum
    assert first.dtype == torch.bfloat16 and torch.equal(first, again)
    assert torch.equal(first, want.to(torch.bfloat16))
