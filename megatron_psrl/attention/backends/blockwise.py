"""The ``torch`` backend: exact tree attention as a sum of dense blocks merged by log-sum-exp.

Each segment attends to itself causally (one kernel call), and each ancestor block (all the
descendants of a segment, or of a cached prefix, over that segment's keys) is one unmasked
kernel call whose output is merged into its queries' running output with log-sum-exp. Every
call runs on a fast path (causal-square or unmasked), no dense ``t x t`` mask is built, and
the work is exactly the tree's (query, key) pairs. The backward pass replays the blocks with
the merged output and lse (see ``partial.py``) and accumulates dQ, dK, dV, including the
gradients of external (cached) prefix K/V, which mechanism 2 collects. Cached prefixes given
as :class:`CachedPrefixKV` are gathered from the cache in the forward pass and again in the
backward pass rather than saved, so a graph kept between the two holds no copy of them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from megatron_psrl.attention.metadata import CachedPrefixKV
from megatron_psrl.attention.partial import lse_dtype, partial_attention_backward, partial_attention_forward
from megatron_psrl.attention.plan import AttentionPlan

Tensor = torch.Tensor


def _merge_(out: Tensor, lse: Tensor, o_b: Tensor, lse_b: Tensor) -> None:
    """In place: merge a block's (o_b, lse_b) into the running (out, lse) of its queries
    (``out`` is the fp32 accumulator)."""
    new_lse = torch.logaddexp(lse, lse_b)
    w_old = torch.exp(lse - new_lse).unsqueeze(-1)
    w_new = torch.exp(lse_b - new_lse).unsqueeze(-1)
    out.mul_(w_old.to(out.dtype)).add_(o_b.to(out.dtype) * w_new.to(out.dtype))
    lse.copy_(new_lse)


class BlockwiseTreeAttention(torch.autograd.Function):
    """Autograd function: ``(q, k, v, *external_kv) -> out`` for one AttentionPlan.

    ``readers[j]`` is None when external source ``j`` comes as a ``(k, v)`` pair among the
    tensor inputs, or a :class:`CachedPrefixKV` that is read here, in the forward and again in
    the backward pass, and receives its gradients directly: a kept graph then holds no copy
    of that cached prefix (only one layer's copy exists at a time, while it runs)."""

    @staticmethod
    def forward(ctx, plan: AttentionPlan, scale: float, impl: str, readers: Tuple[Optional[CachedPrefixKV], ...],
                q: Tensor, k: Tensor, v: Tensor, *pairs: Tensor):
        ext_k, ext_v = _external(readers, pairs, again=False)
        t, np_, hn = q.shape
        # Merged in fp32 (fp64 for fp64 inputs) and rounded once at the end: a bf16 running
        # output would round at every merge, an error growing with the number of ancestors.
        acc = lse_dtype(q)
        out = torch.empty(t, np_, hn, dtype=acc, device=q.device)
        lse = torch.empty(t, np_, dtype=acc, device=q.device)
        for a, b, c in _segments(plan):
            o_s, lse_s = partial_attention_forward(q[a:b], k[c:c + b - a], v[c:c + b - a], True, scale, impl)
            out[a:b] = o_s
            lse[a:b] = lse_s
        for qa, qb, ka, kb, src in _blocks(plan):
            kk, vv = (k, v) if src < 0 else (ext_k[src], ext_v[src])
            o_b, lse_b = partial_attention_forward(q[qa:qb], kk[ka:kb], vv[ka:kb], False, scale, impl)
            _merge_(out[qa:qb], lse[qa:qb], o_b, lse_b)
        out = out.to(q.dtype)
        ctx.plan, ctx.scale, ctx.impl, ctx.readers = plan, scale, impl, readers
        ctx.save_for_backward(q, k, v, out, lse, *pairs)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse, *pairs = ctx.saved_tensors
        readers = ctx.readers
        ext_k, ext_v = _external(readers, pairs, again=True)
        plan, scale, impl = ctx.plan, ctx.scale, ctx.impl
        dout = dout.contiguous()
        # Every block adds into dQ (and into the keys' dK/dV): accumulate in fp32, round once.
        # The segments partition the pack (AttentionPlan checks it): their causal blocks write
        # every row first, so the accumulators start uninitialised, not zeroed. With a subset
        # of the queries (select_queries) some keys are no segment's: dK/dV start at zero.
        acc = lse_dtype(q)
        keys_new = torch.zeros if plan.is_query_subset else torch.empty
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dk = keys_new(k.shape, dtype=acc, device=k.device)
        dv = keys_new(v.shape, dtype=acc, device=v.device)
        d_ext_k = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in ext_k]
        d_ext_v = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in ext_v]
        for a, b, c in _segments(plan):
            e = c + b - a  # the segment's causal keys c:e (c == a unless the queries are a subset)
            g = partial_attention_backward(dout[a:b], q[a:b], k[c:e], v[c:e], out[a:b], lse[a:b], True, scale, impl)
            dq[a:b] = g[0]
            dk[c:e] = g[1]
            dv[c:e] = g[2]
        for qa, qb, ka, kb, src in _blocks(plan):
            kk, vv = (k, v) if src < 0 else (ext_k[src], ext_v[src])
            g = partial_attention_backward(
                dout[qa:qb], q[qa:qb], kk[ka:kb], vv[ka:kb], out[qa:qb], lse[qa:qb], False, scale, impl
            )
            dq[qa:qb] += g[0]
            gk, gv = (dk, dv) if src < 0 else (d_ext_k[src], d_ext_v[src])
            gk[ka:kb] += g[1]
            gv[ka:kb] += g[2]
        d_pairs = []
        for j, reader in enumerate(readers):
            if reader is None:
                d_pairs += [d_ext_k[j].to(ext_k[j].dtype), d_ext_v[j].to(ext_v[j].dtype)]
            else:  # straight into the source's fp32 dK/dV: no rounding to the model dtype
                reader.add_grad(d_ext_k[j], d_ext_v[j])
        return (None, None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *d_pairs)


def _external(readers: Sequence[Optional[CachedPrefixKV]], pairs: Sequence[Tensor], again: bool):
    """External K and V lists in source order, from the tensor pairs and the readers."""
    ext_k, ext_v, it = [], [], iter(pairs)
    for reader in readers:
        kk, vv = (next(it), next(it)) if reader is None else reader.read(again=again)
        ext_k.append(kk)
        ext_v.append(vv)
    return ext_k, ext_v


def _segments(plan: AttentionPlan) -> List[Tuple[int, int, int]]:
    """``(query start, query end, first causal key)`` of every segment."""
    return list(zip(plan.seg_start.tolist(), plan.seg_end.tolist(), plan.segment_key_start.tolist()))


def _blocks(plan: AttentionPlan) -> List[Tuple[int, int, int, int, int]]:
    return list(
        zip(
            plan.block_q_start.tolist(),
            plan.block_q_end.tolist(),
            plan.block_k_start.tolist(),
            plan.block_k_end.tolist(),
            plan.block_source.tolist(),
        )
    )


def blockwise_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan,
    external: Sequence[Union[Tuple[Tensor, Tensor], CachedPrefixKV]] = (), scale: float = None, impl: str = "auto",
) -> Tensor:
    """Tree attention ``[t, np, hn] -> [t, np, hn]`` for ``plan``; external = cached prefix K/V,
    as ``(k, v)`` pairs or :class:`CachedPrefixKV` readers (read here, again in backward)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    readers = tuple(None if isinstance(e, tuple) else e for e in external)
    pairs = [x for e in external if isinstance(e, tuple) for x in e]
    return BlockwiseTreeAttention.apply(plan, scale, impl, readers, q, k, v, *pairs)
