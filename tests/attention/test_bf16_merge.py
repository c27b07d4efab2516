"""bf16 tree attention merges block outputs and accumulates dQ/dK/dV in fp32, rounding once:
a chain of 32 segments (every query merges up to 32 ancestor blocks) is as accurate as one
causal kernel over the same 256 tokens, against an fp64 reference."""

import torch
import torch.nn.functional as F

from megatron_psrl.attention.backends.blockwise import blockwise_tree_attention
from megatron_psrl.attention.plan import tree_plan


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def test_a_32_segment_bf16_chain_is_as_accurate_as_one_kernel():
    seg, n = 8, 32
    t = seg * n
    plan = tree_plan([i * seg for i in range(n)], [(i + 1) * seg for i in range(n)], [i - 1 for i in range(n)])
    gen = torch.Generator().manual_seed(0)
    q64, k64, v64 = (torch.randn(t, 4, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(t, 4, 32, generator=gen, dtype=torch.float64)

    def run(fn, dtype):
        q, k, v = (x.detach().to(dtype, copy=True).requires_grad_(True) for x in (q64, k64, v64))
        out = fn(q, k, v)
        out.backward(dout.to(dtype))
        return out.detach(), q.grad, k.grad, v.grad

    def causal(q, k, v):  # one kernel: [t, h, d] -> [1, h, t, d]
        o = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True)
        return o[0].transpose(0, 1)

    exact = run(causal, torch.float64)
    one_kernel = run(causal, torch.bfloat16)
    tree = run(lambda q, k, v: blockwise_tree_attention(q, k, v, plan), torch.bfloat16)
    for name, e, o, b in zip(("out", "dq", "dk", "dv"), exact, one_kernel, tree):
        assert b.dtype == torch.bfloat16
        # within 1.5x the single kernel's own bf16 error (measured: 1.0-1.1x)
        assert _rel(b, e) <= 1.5 * _rel(o, e) + 1e-4, (name, _rel(b, e), _rel(o, e))
