"""A reference for the flash / te varlen kernels on CPU: flash_attn_varlen_func's contract in
plain torch (causal aligned to the bottom right of every segment's (queries, keys); saves q,
the gathered K and V, the output and the fp32 log-sum-exp for backward; returns dK/dV of the
gathered copies in the input dtype, as flash-attn does)."""

import torch

from megatron_psrl.attention.partial import partial_attention_backward, partial_attention_forward


class ReferenceVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kg, vg, cu_q, cu_k, scale):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)
        ctx.bounds = list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()))
        ctx.scale = scale
        for a, b, c, d in ctx.bounds:
            out[a:b], lse[a:b] = partial_attention_forward(q[a:b], kg[c:d], vg[c:d], True, scale, impl="math")
        ctx.save_for_backward(q, kg, vg, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kg, vg, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kg), torch.zeros_like(vg)
        for a, b, c, d in ctx.bounds:
            g = partial_attention_backward(dout[a:b], q[a:b], kg[c:d], vg[c:d], out[a:b], lse[a:b], True, ctx.scale,
                                           impl="math")
            dq[a:b] += g[0]
            dk[c:d] += g[1]
            dv[c:d] += g[2]
        return dq, dk, dv, None, None, None


def reference_kernel(scale: float):
    """A ``VarlenKernel`` (``kernel(q, kg, vg, cu_q, cu_k, max_q, max_k)``) with softmax ``scale``."""
    def kernel(q, kg, vg, cu_q, cu_k, max_q, max_k):
        return ReferenceVarlen.apply(q, kg, vg, cu_q, cu_k, scale)

    return kernel
