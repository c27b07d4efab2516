"""Partial attention with log-sum-exp: the building block of blockwise tree attention.

Attention over a key set that is the union of disjoint blocks can be computed block by block:
each block returns its softmax-normalised output ``o_b`` and log-sum-exp ``lse_b``; outputs
merge exactly with ``lse = logaddexp(lse_1, lse_2)`` and ``o = sum_b exp(lse_b - lse) o_b``.
The backward pass of each block needs only the *merged* output and lse (the same identity
ring attention uses): with ``P_b = exp(S_b - lse)`` and ``D = rowsum(dO * O)``,
``dV_b = P_b^T dO``, ``dS_b = P_b * (dO V_b^T - D)``, ``dQ += dS_b K_b``, ``dK_b = dS_b^T Q``.

Three implementations with one signature:
- ``aten``: PyTorch's CPU flash-attention kernels (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward), which return the lse, accept strided inputs and handle GQA natively; a
  causal square of 384-576 rows runs as pieces of 256 (:func:`causal_chunks`), which skip most
  of the masked pairs the kernel computes at those lengths;
- ``cuda``: PyTorch's own fused memory-efficient attention on CUDA
  (``_scaled_dot_product_efficient_attention`` and its backward, which take the merged output
  and lse as this backward needs), the fallback where flash-attn is not installed; one call per
  query head within a K/V group, so GQA needs no copies of K and V. It is checked against ``math`` once per process, dtype and head width
  on a small problem before it is used (:func:`_cuda_kernel_agrees`): a build whose kernel
  disagrees falls back to ``math`` with one logged line;
- ``math``: the formulas above in plain torch (any device; the reference), over chunks of
  queries so that the score tensor stays bounded (``MATH_SCORE_ELEMENTS``).

Layouts (token-major, as megatron hands them to core attention, batch dimension removed):
q ``[nq, np, hn]``, k ``[nk, ng, hn]``, v ``[nk, ng, hv]`` (np a multiple of ng: GQA groups are
not expanded; latent attention's values are narrower than its queries and keys, ``hv < hn``),
o ``[nq, np, hv]``, lse ``[nq, np]`` (float32; float64 for float64 inputs). The CPU kernels
take one head width for all three: there the narrower side is padded with zeros for the call
(:func:`_one_width`), which changes no score, no output column and no gradient. ``causal`` is only used with nq == nk (a
segment attending to itself). ``mask`` (bool ``[nq, nk]``, True where the query sees the key; a
sliding window's block) restricts an unmasked block: a query that sees none of the block's keys
gets ``o = 0``, ``lse = -inf`` (nothing to merge). The CUDA kernel takes no mask here: masked
blocks run on the math path (a window's masked blocks are at most ``window - 1`` keys wide).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

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


_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_CHECKED: Dict[Tuple[torch.dtype, int, int], bool] = {}
"""(dtype, query/key head width, value head width) -> the CUDA kernel agreed with the math path
(once per process)."""
_LSE_ALIGN = 32
"""The memory-efficient kernel's log-sum-exp rows come padded to a multiple of this."""


def _use_cuda(q: Tensor, v: Optional[Tensor] = None) -> bool:
    if q.device.type != "cuda" or q.dtype not in _CUDA_DTYPES \
            or not hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention"):
        return False
    v = q if v is None else v
    key = (q.dtype, q.shape[-1], v.shape[-1])
    if key not in _CUDA_CHECKED:
        _CUDA_CHECKED[key] = _cuda_kernel_agrees(q.dtype, q.shape[-1], q.device, v.shape[-1])
    return _CUDA_CHECKED[key]


def _heads_of(x: Tensor, ng: int, r: int) -> Tensor:
    """``[n, ng, hn]``: the ``r``-th query head of every K/V group of ``x [n, ng * rep, hn]``."""
    n, np_, hn = x.shape
    return x.view(n, ng, np_ // ng, hn)[:, :, r].contiguous()


def _cuda_forward(q, k, v, causal, scale):
    """One kernel call per query head within a group (``rep`` of them), each over every group
    at once: GQA without copies of K and V."""
    nq, np_, _ = q.shape
    ng, hv = k.shape[1], v.shape[-1]
    rep = np_ // ng
    o = torch.empty((nq, ng, rep, hv), dtype=q.dtype, device=q.device)
    lse = torch.empty((nq, ng, rep), dtype=torch.float32, device=q.device)
    for r in range(rep):
        o_r, lse_r, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bhld(_heads_of(q, ng, r)), _bhld(k), _bhld(v), None, True, 0.0, causal, scale=scale)
        o[:, :, r] = o_r[0].transpose(0, 1)
        lse[:, :, r] = lse_r[0, :, :nq].transpose(0, 1)
    return o.view(nq, np_, hv), lse.view(nq, np_)


def _cuda_backward(do, q, k, v, o, lse, causal, scale):
    """The kernel's backward per query head within a group, from the *merged* output and lse
    (the lse padded to the kernel's alignment); K/V gradients summed over the heads in fp32."""
    nq, np_, hn = q.shape
    ng = k.shape[1]
    rep = np_ // ng
    dq = torch.empty((nq, ng, rep, hn), dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    lse_g = lse.float().reshape(nq, ng, rep)
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # (philox seed / offset: no dropout)
    for r in range(rep):
        padded = torch.zeros((1, ng, -(-nq // _LSE_ALIGN) * _LSE_ALIGN), dtype=torch.float32, device=q.device)
        padded[0, :, :nq] = lse_g[:, :, r].transpose(0, 1)
        g = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhld(_heads_of(do, ng, r)), _bhld(_heads_of(q, ng, r)), _bhld(k), _bhld(v), None,
            _bhld(_heads_of(o, ng, r)), padded, unused, unused, 0.0, [True, True, True, False], causal, scale=scale)
        dq[:, :, r] = g[0][0].transpose(0, 1)
        dk += g[1][0].transpose(0, 1).float()
        dv += g[2][0].transpose(0, 1).float()
    return dq.view(nq, np_, hn), dk.to(k.dtype), dv.to(v.dtype)


def _cuda_kernel_agrees(dtype: torch.dtype, head_dim: int, device, value_dim: Optional[int] = None) -> bool:
    """The CUDA kernel against the math path on a small GQA problem (outputs, lse and every
    gradient, causal and not), within the dtype's rounding; False (and one logged line) if not
    (a kernel that refuses values narrower than the keys included)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    value_dim = head_dim if value_dim is None else value_dim
    q, k, v, do = (torch.randn(n, h, d, generator=gen).to(device=device, dtype=dtype)
                   for n, h, d in ((37, 4, head_dim), (37, 2, head_dim), (37, 2, value_dim), (37, 4, value_dim)))
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    try:
        for causal in (True, False):
            o_ref, lse_ref = _math_forward(q, k, v, causal, 0.3)
            o, lse = _cuda_forward(q, k, v, causal, 0.3)
            got = _cuda_backward(do, q, k, v, o_ref, lse_ref, causal, 0.3)
            want = _math_backward(do, q, k, v, o_ref, lse_ref, causal, 0.3)
            pairs = [(o, o_ref), (lse, lse_ref), *zip(got, want)]
            if not all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol) for a, b in pairs):
                raise ValueError("results differ from the reference")
    except (RuntimeError, ValueError, TypeError) as exc:
        import logging

        logging.getLogger(__name__).warning(
            "torch's fused CUDA attention disagrees with the reference for %s, head width %d, value width %d "
            "(%s): tree attention uses the reference math on this device", dtype, head_dim, value_dim, exc)
        return False
    return True


def _additive(mask: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """A bool mask as the aten kernel's additive one, ``[1, 1, nq, nk]`` (0 or -inf, q's dtype)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))[None, None]


def _one_width(x: Tensor, width: int) -> Tensor:
    """``x`` padded with zero columns to ``width`` (itself when it has that width): a kernel that
    takes one head width for q, k and v then computes the same scores (the zeros add nothing to
    q . k) and the same output and gradients in the real columns (a zero value column gives a
    zero output column; a zero output-gradient column adds nothing to dP)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def merge_(out: Tensor, lse: Tensor, o_b: Tensor, lse_b: Tensor) -> None:
    """In place: merge a block's ``(o_b, lse_b)`` into the running ``(out, lse)`` of its queries
    (``out`` is the accumulator: fp32, fp64 for fp64 inputs)."""
    new_lse = torch.logaddexp(lse, lse_b)
    w_old = torch.exp(lse - new_lse).unsqueeze(-1)
    w_new = torch.exp(lse_b - new_lse).unsqueeze(-1)
    out.mul_(w_old.to(out.dtype)).add_(o_b.to(out.dtype) * w_new.to(out.dtype))
    lse.copy_(new_lse)


CAUSAL_CHUNK = 256
"""Query rows per piece of a split causal square on the CPU kernel (:func:`causal_chunks`)."""
CAUSAL_SPLIT_ROWS = (384, 576)
"""Causal squares of this many rows (inclusive) are split on the CPU kernel. Below 768 query
rows torch's CPU flash kernel scores each 64-row query tile against a whole 512-key block and
masks it, so a causal square of up to 512 rows costs its full square (measured: a 512-row
causal call as long as an unmasked one, forward and backward). As pieces of
:data:`CAUSAL_CHUNK` rows (each a causal square of its own beside one unmasked call over the
rows before it, merged by log-sum-exp) the kernel scores 0.75-0.78 of the pairs it scores in
one call at 384-576 rows, and more outside: 0.84 at 320, 0.81 at 640, 0.86 at 767 (at 768 and
above its own tiles skip the masked half). Measured (``benchmarks/bench_causal_split.py``,
forward and backward, 2 threads, fp32, head widths 32-128): 0.75-0.87x of one call at 512 rows
for every head shape but one (4 heads of 128: 0.97-1.02x), 0.85-1.03x at 384; at 320 and
640-767 the extra calls eat most of the saving (0.84-1.12x). Lengths outside stay one call."""


def causal_chunks(n: int) -> Optional[List[Tuple[int, int]]]:
    """The pieces ``[(a, b)]`` a causal square of ``n`` rows runs as on the CPU kernel (see
    :data:`CAUSAL_SPLIT_ROWS`); None: one call."""
    low, high = CAUSAL_SPLIT_ROWS
    if not low <= n <= high:
        return None
    return [(a, min(n, a + CAUSAL_CHUNK)) for a in range(0, n, CAUSAL_CHUNK)]


def _aten_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Optional[Tensor]):
    """One call of torch's CPU flash kernel: ``(o [nq, np, hv], lse [nq, np])``."""
    width = max(q.shape[-1], v.shape[-1])
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhld(_one_width(q, width)), _bhld(_one_width(k, width)), _bhld(_one_width(v, width)), 0.0, causal,
        attn_mask=_additive(mask, q), scale=scale,
    )[:2]
    o, lse = o[0, ..., :v.shape[-1]].transpose(0, 1), lse[0].transpose(0, 1)
    if mask is not None:  # the kernel answers a query that sees no key with lse 0
        lse = lse.masked_fill(~mask.any(1)[:, None], float("-inf"))
    return o, lse


def _aten_backward(do, q, k, v, o, lse, causal: bool, scale: float, mask: Optional[Tensor]):
    """The CPU flash kernel's backward from the merged ``o`` and ``lse``: ``(dq, dk, dv)``."""
    hn, hv = q.shape[-1], v.shape[-1]
    width = max(hn, hv)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(_bhld(_one_width(x, width)) for x in (do, q, k, v, o)),
        lse.to(lse_dtype(q)).transpose(0, 1).unsqueeze(0), 0.0, causal, attn_mask=_additive(mask, q), scale=scale,
    )
    return dq[0, ..., :hn].transpose(0, 1), dk[0, ..., :hn].transpose(0, 1), dv[0, ..., :hv].transpose(0, 1)


def _split_causal_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, chunks) -> Tuple[Tensor, Tensor]:
    """A causal square as ``chunks``: each piece causal on itself, then merged with one unmasked
    call over the rows before it (in fp32, rounded once)."""
    acc = lse_dtype(q)
    out = torch.empty(q.shape[:2] + v.shape[-1:], dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=acc, device=q.device)
    for a, b in chunks:
        out[a:b], lse[a:b] = _aten_forward(q[a:b], k[a:b], v[a:b], True, scale, None)
        if a:
            merge_(out[a:b], lse[a:b], *_aten_forward(q[a:b], k[:a], v[:a], False, scale, None))
    return out.to(q.dtype), lse


def _split_causal_backward(do, q, k, v, o, lse, scale: float, chunks) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`_split_causal_forward`'s gradients: every piece's calls replayed with the merged
    ``o`` and ``lse``, accumulated in fp32 and rounded once. A piece's causal call writes its
    rows of dQ, dK and dV first (the later pieces' unmasked calls add to earlier rows only), so
    the accumulators start uninitialised, as the blockwise backend's segments do."""
    acc = lse_dtype(q)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=k.device)
    dv = torch.empty(v.shape, dtype=acc, device=v.device)
    for a, b in chunks:
        dq[a:b], dk[a:b], dv[a:b] = _aten_backward(do[a:b], q[a:b], k[a:b], v[a:b], o[a:b], lse[a:b], True, scale,
                                                   None)
        if a:
            g_q, g_k, g_v = _aten_backward(do[a:b], q[a:b], k[:a], v[:a], o[a:b], lse[a:b], False, scale, None)
            dq[a:b] += g_q
            dk[:a] += g_k
            dv[:a] += g_v
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def partial_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, impl: str = "auto", mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention of q over (k, v); returns ``(o [nq, np, hv], lse [nq, np])``."""
    if mask is None and (impl == "cuda" or (impl == "auto" and _use_cuda(q, v))):
        return _cuda_forward(q, k, v, causal, scale)
    if impl == "aten" or (impl == "auto" and _use_aten(q)):
        chunks = causal_chunks(q.shape[0]) if causal and mask is None else None
        if chunks is not None:
            return _split_causal_forward(q, k, v, scale, chunks)
        return _aten_forward(q, k, v, causal, scale, mask)
    return _math_forward(q, k, v, causal, scale, mask=mask)


def partial_attention_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
    impl: str = "auto", mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged output ``o`` and log-sum-exp ``lse``."""
    if mask is None and (impl == "cuda" or (impl == "auto" and _use_cuda(q, v))):
        return _cuda_backward(do, q, k, v, o, lse, causal, scale)
    if impl == "aten" or (impl == "auto" and _use_aten(q)):
        chunks = causal_chunks(q.shape[0]) if causal and mask is None else None
        if chunks is not None:
            return _split_causal_backward(do, q, k, v, o, lse, scale, chunks)
        return _aten_backward(do, q, k, v, o, lse, causal, scale, mask)
    return _math_backward(do, q, k, v, o, lse, causal, scale, mask=mask)


# ---------------------------------------------------------------------- reference math
MATH_SCORE_ELEMENTS = 1 << 25
"""The math path materialises scores for at most this many (head, query, key) triples at once
(128 MiB in fp32): queries are processed in chunks, so memory stays linear in the keys."""


def _query_chunks(nq: int, np_: int, nk: int, max_elements: int):
    step = max(1, max_elements // max(1, np_ * nk))
    return [(a, min(nq, a + step)) for a in range(0, nq, step)]


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, q_offset: int, nq_total: int,
            mask: Optional[Tensor] = None) -> Tensor:
    """``[ng, rep, nq, nk]`` scores of queries ``q_offset:q_offset+nq`` of ``nq_total``, grouped
    by their K/V head (float32; float64 for float64 inputs); ``mask`` is the whole block's."""
    nq, np_, hn = q.shape
    ng = k.shape[1]
    qg = q.to(lse_dtype(q)).reshape(nq, ng, np_ // ng, hn)
    s = torch.einsum("qgrd,kgd->grqk", qg, k.to(qg.dtype)) * scale
    if causal:
        nk = k.shape[0]
        rows = torch.arange(q_offset, q_offset + nq, device=q.device)[:, None]
        keep = torch.arange(nk, device=q.device)[None, :] <= rows + (nk - nq_total)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[q_offset:q_offset + nq], float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale, max_elements: int = MATH_SCORE_ELEMENTS, mask=None):
    nq, np_, _ = q.shape
    hv = v.shape[-1]
    outs, lses = [], []
    for a, b in _query_chunks(nq, np_, k.shape[0], max_elements):
        s = _scores(q[a:b], k, causal, scale, a, nq, mask)
        lse = torch.logsumexp(s, dim=-1)  # [ng, rep, n]
        # (a query that sees no key: lse -inf, and nothing to weigh)
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
        outs.append(torch.einsum("grqk,kgd->qgrd", p, v.to(p.dtype)).reshape(b - a, np_, hv).to(q.dtype))
        lses.append(lse.reshape(np_, b - a).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses).contiguous()


def _math_backward(do, q, k, v, o, lse, causal, scale, max_elements: int = MATH_SCORE_ELEMENTS, mask=None):
    nq, np_, hn = q.shape
    ng = k.shape[1]
    rep = np_ // ng
    f = lse_dtype(q)
    dqs = []
    dk = torch.zeros(k.shape, dtype=f, device=k.device)
    dv = torch.zeros(v.shape, dtype=f, device=v.device)
    for a, b in _query_chunks(nq, np_, k.shape[0], max_elements):
        n = b - a
        s = _scores(q[a:b], k, causal, scale, a, nq, mask)
        lse_g = lse[a:b].to(f).transpose(0, 1).reshape(ng, rep, n)
        p = torch.exp(s - lse_g.unsqueeze(-1))  # [ng, rep, n, nk]
        do_g = do[a:b].to(f).reshape(n, ng, rep, v.shape[-1])
        delta = (do[a:b].to(f) * o[a:b].to(f)).sum(-1).transpose(0, 1).reshape(ng, rep, n)
        dv += torch.einsum("grqk,qgrd->kgd", p, do_g)
        ds = p * (torch.einsum("qgrd,kgd->grqk", do_g, v.to(f)) - delta.unsqueeze(-1))
        dqs.append((torch.einsum("grqk,kgd->qgrd", ds, k.to(f)).reshape(n, np_, hn) * scale).to(q.dtype))
        dk += torch.einsum("grqk,qgrd->kgd", ds, q[a:b].to(f).reshape(n, ng, rep, hn)) * scale
    return torch.cat(dqs), dk.to(k.dtype), dv.to(v.dtype)
