"""Partial attention with log-sum-exp: the building block of blockwise tree attention.

Attention over a key set that is the union of disjoint blocks can be computed block by block:
each block returns its softmax-normalised output ``o_b`` and log-sum-exp ``lse_b``; outputs
merge exactly with ``lse = logaddexp(lse_1, lse_2)`` and ``o = sum_b exp(lse_b - lse) o_b``.
The backward pass of each block needs only the *merged* output and lse (the same identity
ring attention uses): with ``P_b = exp(S_b - lse)`` and ``D = rowsum(dO * O)``,
``dV_b = P_b^T dO``, ``dS_b = P_b * (dO V_b^T - D)``, ``dQ += dS_b K_b``, ``dK_b = dS_b^T Q``.

Two implementations with one signature:
- ``aten``: PyTorch's CPU flash-attention kernels (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward), which return the lse, accept strided inputs and handle GQA natively;
- ``math``: the formulas above in plain torch (any device; the reference, O(nq * nk) memory).

Layouts (token-major, as megatron hands them to core attention, batch dimension removed):
q ``[nq, np, hn]``, k/v ``[nk, ng, hn]`` (np a multiple of ng: GQA groups are not expanded),
o ``[nq, np, hn]``, lse ``[nq, np]`` (float32; float64 for float64 inputs). ``causal`` is only used with nq == nk (a
segment attending to itself).
"""

from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor

_ATEN_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _use_aten(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _ATEN_DTYPES and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    )


def lse_dtype(q: Tensor) -> torch.dtype:
    """dtype of the log-sum-exp for inputs like q."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _bhld(x: Tensor) -> Tensor:
    """``[n, h, d]`` -> ``[1, h, n, d]`` view (no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


def partial_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, impl: str = "auto"
) -> Tuple[Tensor, Tensor]:
    """Attention of q over (k, v); returns ``(o [nq, np, hn], lse [nq, np])``."""
    if impl == "aten" or (impl == "auto" and _use_aten(q)):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhld(q), _bhld(k), _bhld(v), 0.0, causal, scale=scale
        )
        return o[0].transpose(0, 1), lse[0].transpose(0, 1)
    return _math_forward(q, k, v, causal, scale)


def partial_attention_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
    impl: str = "auto",
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged output ``o`` and log-sum-exp ``lse``."""
    if impl == "aten" or (impl == "auto" and _use_aten(q)):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhld(do), _bhld(q), _bhld(k), _bhld(v), _bhld(o),
            lse.to(lse_dtype(q)).transpose(0, 1).unsqueeze(0), 0.0, causal, scale=scale,
        )
        return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)
    return _math_backward(do, q, k, v, o, lse, causal, scale)


# ---------------------------------------------------------------------- reference math
def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """``[ng, rep, nq, nk]`` float32 scores, queries grouped by their K/V head."""
    nq, np_, hn = q.shape
    ng = k.shape[1]
    qg = q.to(lse_dtype(q)).reshape(nq, ng, np_ // ng, hn)
    s = torch.einsum("qgrd,kgd->grqk", qg, k.to(qg.dtype)) * scale
    if causal:
        nk = k.shape[0]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    nq, np_, hn = q.shape
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [ng, rep, nq]
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.einsum("grqk,kgd->qgrd", p, v.to(p.dtype)).reshape(nq, np_, hn)
    return o.to(q.dtype), lse.reshape(np_, nq).transpose(0, 1).contiguous()


def _math_backward(do, q, k, v, o, lse, causal, scale):
    nq, np_, hn = q.shape
    ng = k.shape[1]
    rep = np_ // ng
    s = _scores(q, k, causal, scale)
    f = s.dtype
    lse_g = lse.to(f).transpose(0, 1).reshape(ng, rep, nq)
    p = torch.exp(s - lse_g.unsqueeze(-1))  # [ng, rep, nq, nk]
    do_g = do.to(f).reshape(nq, ng, rep, hn)
    delta = (do.to(f) * o.to(f)).sum(-1).transpose(0, 1).reshape(ng, rep, nq)
    dv = torch.einsum("grqk,qgrd->kgd", p, do_g)
    dp = torch.einsum("qgrd,kgd->grqk", do_g, v.to(f))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("grqk,kgd->qgrd", ds, k.to(f)).reshape(nq, np_, hn) * scale
    dk = torch.einsum("grqk,qgrd->kgd", ds, q.to(f).reshape(nq, ng, rep, hn)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
