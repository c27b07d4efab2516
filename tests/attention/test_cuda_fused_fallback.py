"""Without flash-attn, tree attention on CUDA runs PyTorch's own fused memory-efficient attention
(megatron_psrl/attention/partial.py, ``cuda``), which returns the log-sum-exp and takes the
merged output and lse in its backward, instead of fp32 score chunks outside the memory plan. It
is checked against the reference math once per dtype and head width before use, and a kernel
that disagrees (or fails) leaves the reference in place. Here without a GPU: the check's logic,
with stand-ins for the kernel; on a GPU (the acceptance script's kernels part, ``-m gpu``): the
kernel against the math, causal and not, GQA, lengths off the kernel's 32-row alignment."""

import logging

import pytest
import torch

from megatron_psrl.attention import partial


def test_the_cpu_never_takes_the_cuda_kernel():
    assert not partial._use_cuda(torch.zeros(3, 2, 8))


def test_a_kernel_that_agrees_is_used_and_one_that_does_not_is_not(monkeypatch, caplog):
    monkeypatch.setattr(partial, "_cuda_forward", partial._math_forward)
    monkeypatch.setattr(partial, "_cuda_backward", partial._math_backward)
    assert partial._cuda_kernel_agrees(torch.float32, 8, "cpu")

    def off_by_a_little(q, k, v, causal, scale):
        o, lse = partial._math_forward(q, k, v, causal, scale)
        return o * 1.01, lse

    monkeypatch.setattr(partial, "_cuda_forward", off_by_a_little)
    with caplog.at_level(logging.WARNING):
        assert not partial._cuda_kernel_agrees(torch.float32, 8, "cpu")
    assert "uses the reference math" in caplog.text

    def fails(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(partial, "_cuda_forward", fails)
    assert not partial._cuda_kernel_agrees(torch.bfloat16, 8, "cpu")


class _KernelStandIns:
    """The two CUDA ops' interfaces (``[1, heads, rows, hn]`` tensors, the lse padded to 32 rows,
    the backward taking the merged output and lse) computed by the reference math, so that the
    wrappers' head bookkeeping (one call per query head within a group, lse padding, K/V
    gradients summed over the heads) is checked on the CPU."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    @staticmethod
    def _scaled_dot_product_efficient_attention(q, k, v, bias, with_lse, dropout, causal, scale=None):
        o, lse = partial._math_forward(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), causal, scale)
        padded = torch.full((1, lse.shape[1], -(-lse.shape[0] // 32) * 32), float("nan"))
        padded[0, :, :lse.shape[0]] = lse.transpose(0, 1)
        return partial._bhld(o), padded, None, None

    @staticmethod
    def _scaled_dot_product_efficient_attention_backward(do, q, k, v, bias, o, lse, seed, offset, dropout, mask,
                                                         causal, scale=None):
        t = lambda x: x[0].transpose(0, 1)  # noqa: E731
        g = partial._math_backward(t(do), t(q), t(k), t(v), t(o), lse[0, :, :q.shape[2]].transpose(0, 1), causal, scale)
        return partial._bhld(g[0]), partial._bhld(g[1]), partial._bhld(g[2]), None


@pytest.mark.parametrize("causal, nq, nk", [(True, 45, 45), (False, 45, 77)])
def test_the_wrappers_bookkeeping_with_gqa(monkeypatch, causal, nq, nk):
    monkeypatch.setattr(torch.ops, "aten", _KernelStandIns(torch.ops.aten))
    gen = torch.Generator().manual_seed(2)
    q, do = (torch.randn(nq, 6, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(nk, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    o, lse = partial._cuda_forward(q, k, v, causal, 0.3)
    o_ref, lse_ref = partial._math_forward(q, k, v, causal, 0.3)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref.float())
    for a, b in zip(partial._cuda_backward(do, q, k, v, o_ref, lse_ref, causal, 0.3),
                    partial._math_backward(do, q, k, v, o_ref, lse_ref, causal, 0.3)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # (lse through fp32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_the_cuda_kernel_equals_the_math(dtype, causal):
    gen = torch.Generator().manual_seed(1)
    nq, nk = (45, 45) if causal else (45, 77)
    q = torch.randn(nq, 4, 64, generator=gen).cuda().to(dtype)
    k, v = (torch.randn(nk, 2, 64, generator=gen).cuda().to(dtype) for _ in range(2))
    do = torch.randn(nq, 4, 64, generator=gen).cuda().to(dtype)
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    o, lse = partial.partial_attention_forward(q, k, v, causal, 0.125, impl="cuda")
    o_ref, lse_ref = partial.partial_attention_forward(q, k, v, causal, 0.125, impl="math")
    torch.testing.assert_close(o.float(), o_ref.float(), **tol)
    torch.testing.assert_close(lse.float(), lse_ref.float(), **tol)
    got = partial.partial_attention_backward(do, q, k, v, o_ref, lse_ref, causal, 0.125, impl="cuda")
    want = partial.partial_attention_backward(do, q, k, v, o_ref, lse_ref, causal, 0.125, impl="math")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert partial._use_cuda(q)  # the start-up check passed on this device
