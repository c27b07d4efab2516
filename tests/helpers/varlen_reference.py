"""A reference for the flash / te varlen kernels on CPU: flash_attn_varlen_func's contract in
plain torch (causal aligned to the bottom right of every segment's (queries, keys); saves q,
the gathered K and V, the output and the fp32 log-sum-exp for backward; returns dK/dV of the
gathered copies in the input dtype, as flash-attn does)."""

import torch

from megatron_psrl.attention.partial import partial_attention_backward, partial_attention_forward


def _window_mask(nq: int, nk: int, window):
    """flash-attn's ``window_size=(window - 1, 0)`` aligned bottom right, as a bool mask (None:
    no window; the causal part is the kernel's ``causal``)."""
    if window is None:
        return None
    i = torch.arange(nq)[:, None] + (nk - nq)
    return torch.arange(nk)[None, :] >= i - (window - 1)


class ReferenceVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kg, vg, cu_q, cu_k, scale, window=None):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32 if q.dtype != torch.float64 else torch.float64)
        ctx.bounds = list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()))
        ctx.scale, ctx.window = scale, window
        for a, b, c, d in ctx.bounds:
            out[a:b], lse[a:b] = partial_attention_forward(q[a:b], kg[c:d], vg[c:d], True, scale, impl="math",
                                                           mask=_window_mask(b - a, d - c, window))
        ctx.save_for_backward(q, kg, vg, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kg, vg, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kg), torch.zeros_like(vg)
        for a, b, c, d in ctx.bounds:
            g = partial_attention_backward(dout[a:b], q[a:b], kg[c:d], vg[c:d], out[a:b], lse[a:b], True, ctx.scale,
                                           impl="math", mask=_window_mask(b - a, d - c, ctx.window))
            dq[a:b] += g[0]
            dk[c:d] += g[1]
            dv[c:d] += g[2]
        return dq, dk, dv, None, None, None, None


def reference_kernel(scale: float, window=None):
    """A ``VarlenKernel`` (``kernel(q, kg, vg, cu_q, cu_k, max_q, max_k)``) with softmax ``scale``
    (``window``: flash-attn's ``window_size=(window - 1, 0)``)."""
    def kernel(q, kg, vg, cu_q, cu_k, max_q, max_k):
        return ReferenceVarlen.apply(q, kg, vg, cu_q, cu_k, scale, window)

    return kernel
