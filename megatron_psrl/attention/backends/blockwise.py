"""The ``torch`` backend: exact tree attention as a sum of dense blocks merged by log-sum-exp.

Each segment attends to itself causally (one kernel call; on the CPU kernel a square of
384-576 rows runs as pieces, ``partial.causal_chunks``), and each ancestor block (all the
descendants of a segment, or of a cached prefix, over that segment's keys) is one unmasked
kernel call whose output is merged into its queries' running output with log-sum-exp. Every
call runs on a fast path (causal-square or unmasked), no dense ``t x t`` mask is built, and
the work is exactly the tree's (query, key) pairs. The backward pass replays the blocks with
the merged output and lse (see ``partial.py``) and accumulates dQ, dK, dV, including the
gradients of external (cached) prefix K/V, which mechanism 2 collects. Cached prefixes given
as :class:`CachedPrefixKV` are gathered from the cache in the forward pass and again in the
backward pass rather than saved, so a graph kept between the two holds no copy of them.

A windowed plan (``AttentionPlan.windowed``: a sliding window) has segments of at most the
window and masked blocks whose queries see per-query suffixes of their keys; a learnable sink
per head (``sink``, gpt-oss) joins every query's softmax denominator once, after the last
merge: ``lse' = logaddexp(lse, sink)``, ``o' = exp(lse - lse') o``. The blocks' backward with
the final ``o'`` and ``lse'`` is then exact as it is, and ``dsink = -sum_q exp(sink - lse'_q)
rowsum(dO_q * o'_q)``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from megatron_psrl.attention.metadata import ArrivingPrefixKV, CachedPrefixKV
from megatron_psrl.attention.partial import lse_dtype, merge_, partial_attention_backward, partial_attention_forward
from megatron_psrl.attention.plan import AttentionPlan
from megatron_psrl.host_copy import host_to_device

Tensor = torch.Tensor


class _Arriving:
    """An :class:`ArrivingPrefixKV` source as the autograd function keeps it: its exchange and
    rows, the buffer itself being one of the function's tensor inputs (index ``buffer``)."""

    __slots__ = ("exchange", "buffer", "offset", "length")

    def __init__(self, exchange, buffer: int, offset: int, length: int):
        self.exchange, self.buffer, self.offset, self.length = exchange, buffer, offset, length


_LEADING_INPUTS = 9
"""Arguments of :meth:`BlockwiseTreeAttention.forward` before ``*tensors`` (plan, scale, impl,
readers, n_pairs, has_sink, q, k, v): where ``ctx.needs_input_grad`` starts counting the tensors."""


def _add_sink_(out: Tensor, lse: Tensor, sink: Tensor) -> None:
    """In place: the sink logit of every head joins the merged softmax's denominator, once."""
    with_sink = torch.logaddexp(lse, sink.to(lse.dtype)[None, :])
    out.mul_(torch.exp(lse - with_sink).unsqueeze(-1).to(out.dtype))
    lse.copy_(with_sink)


def _block_masks(plan: AttentionPlan, device: torch.device) -> List[Optional[Tensor]]:
    """Every block's window mask on ``device`` (None for a block seen whole), once per plan."""
    if plan.window is None:
        return [None] * plan.num_blocks
    cache = plan.__dict__.setdefault("_mask_cache", {})
    if device not in cache:
        cache[device] = [host_to_device(plan.block_mask(b), device) if plan.block_masked[b] else None
                         for b in range(plan.num_blocks)]
    return cache[device]


class BlockwiseTreeAttention(torch.autograd.Function):
    """Autograd function: ``(q, k, v, *external_kv, *buffers) -> out`` for one AttentionPlan.

    ``readers[j]`` is None when external source ``j`` comes as a ``(k, v)`` pair among the
    tensor inputs, or a :class:`CachedPrefixKV` that is read here, in the forward and again in
    the backward pass, and receives its gradients directly: a kept graph then holds no copy
    of that cached prefix (only one layer's copy exists at a time, while it runs); or an
    ``_Arriving`` source (:class:`ArrivingPrefixKV`, rows still in flight from another rank
    into one of the ``buffers``): its blocks run after every other block, once its exchange
    is waited for, and in the backward before every other block, so that their gradients
    travel back while the rest of the backward runs (``exchange.return_grad``). The order of
    the merges is the plan's whenever the arriving sources' blocks come last in it (the
    packing lists peers last), so the result is the same as with ``(k, v)`` pairs."""

    @staticmethod
    def forward(ctx, plan: AttentionPlan, scale: float, impl: str, readers: Tuple[object, ...], n_pairs: int,
                has_sink: bool, q: Tensor, k: Tensor, v: Tensor, *tensors: Tensor):
        sink = tensors[-1] if has_sink else None
        pairs, buffers = tensors[:n_pairs], tensors[n_pairs:len(tensors) - int(has_sink)]
        ext_k, ext_v = _external(readers, pairs, again=False)
        arriving = [j for j, r in enumerate(readers) if isinstance(r, _Arriving)]
        t, np_, hv = q.shape[0], q.shape[1], v.shape[-1]  # (values may be narrower than keys: MLA)
        # Merged in fp32 (fp64 for fp64 inputs) and rounded once at the end: a bf16 running
        # output would round at every merge, an error growing with the number of ancestors.
        acc = lse_dtype(q)
        out = torch.empty(t, np_, hv, dtype=acc, device=q.device)
        lse = torch.empty(t, np_, dtype=acc, device=q.device)
        for a, b, c in _segments(plan):
            o_s, lse_s = partial_attention_forward(q[a:b], k[c:c + b - a], v[c:c + b - a], True, scale, impl)
            out[a:b] = o_s
            lse[a:b] = lse_s
        blocks, masks = _blocks(plan), _block_masks(plan, q.device)

        def run(n, blk):
            qa, qb, ka, kb, src = blk
            kk, vv = (k, v) if src < 0 else (ext_k[src], ext_v[src])
            o_b, lse_b = partial_attention_forward(q[qa:qb], kk[ka:kb], vv[ka:kb], False, scale, impl, mask=masks[n])
            merge_(out[qa:qb], lse[qa:qb], o_b, lse_b)

        late = set(arriving)
        for n, blk in enumerate(blocks):  # while the arriving rows travel: every key this rank has
            if blk[4] not in late:
                run(n, blk)
        arrived = []
        for j in arriving:
            r = readers[j]
            r.exchange.wait()
            rows_k, rows_v = r.exchange.unpack(buffers[r.buffer][r.offset:r.offset + r.length])
            # Copies: saved for backward, where a view would keep the whole buffer alive.
            ext_k[j], ext_v[j] = rows_k.clone(), rows_v.clone()
            arrived += [ext_k[j], ext_v[j]]
        for n, blk in enumerate(blocks):
            if blk[4] in late:
                run(n, blk)
        if sink is not None:  # once, after every block (the cached prefixes' included) merged
            _add_sink_(out, lse, sink)
        out = out.to(q.dtype)
        ctx.plan, ctx.scale, ctx.impl, ctx.readers, ctx.n_pairs = plan, scale, impl, readers, n_pairs
        ctx.has_sink = sink is not None
        ctx.buffer_like = [(tuple(x.shape), x.dtype, x.device) for x in buffers]
        ctx.save_for_backward(q, k, v, out, lse, *pairs, *arrived, *([sink] if sink is not None else []))
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        readers, n_pairs = ctx.readers, ctx.n_pairs
        sink = rest.pop() if ctx.has_sink else None
        pairs, arrived = rest[:n_pairs], rest[n_pairs:]
        ext_k, ext_v = _external(readers, pairs, again=True)
        arriving = [j for j, r in enumerate(readers) if isinstance(r, _Arriving)]
        for n, j in enumerate(arriving):
            ext_k[j], ext_v[j] = arrived[2 * n], arrived[2 * n + 1]
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
        blocks, masks = _blocks(plan), _block_masks(plan, q.device)

        def block_grads(n, blk):
            qa, qb, ka, kb, src = blk
            kk, vv = (k, v) if src < 0 else (ext_k[src], ext_v[src])
            g = partial_attention_backward(
                dout[qa:qb], q[qa:qb], kk[ka:kb], vv[ka:kb], out[qa:qb], lse[qa:qb], False, scale, impl, mask=masks[n]
            )
            gk, gv = (dk, dv) if src < 0 else (d_ext_k[src], d_ext_v[src])
            gk[ka:kb] += g[1]
            gv[ka:kb] += g[2]
            return g[0]

        # The arriving rows' gradients first: they start their way back before the rest runs.
        late = set(arriving)
        early_dq = {n: block_grads(n, blk) for n, blk in enumerate(blocks) if blk[4] in late}
        d_buffers: List[Optional[Tensor]] = [None] * len(ctx.buffer_like)
        for b, (shape, dtype, device) in enumerate(ctx.buffer_like):
            if not ctx.needs_input_grad[_LEADING_INPUTS + n_pairs + b]:
                continue
            # The readers' gradients go back unrounded: their owner sums them in fp32 (kv_exchange).
            d = torch.zeros(shape, dtype=torch.float32, device=device)
            exchange = None
            for j in arriving:
                r = readers[j]
                if r.buffer == b:
                    rows_k, rows_v = r.exchange.unpack(d[r.offset:r.offset + r.length])
                    rows_k.copy_(d_ext_k[j])
                    rows_v.copy_(d_ext_v[j])
                    exchange = r.exchange
            exchange.return_grad(d)
            d_buffers[b] = d.to(dtype)  # (autograd's; the exchange already sent the fp32 one)
        for a, b, c in _segments(plan):
            e = c + b - a  # the segment's causal keys c:e (c == a unless the queries are a subset)
            g = partial_attention_backward(dout[a:b], q[a:b], k[c:e], v[c:e], out[a:b], lse[a:b], True, scale, impl)
            dq[a:b] = g[0]
            dk[c:e] = g[1]
            dv[c:e] = g[2]
        for n, blk in enumerate(blocks):  # dQ in the plan's order, whichever block ran first
            qa, qb = blk[0], blk[1]
            dq[qa:qb] += early_dq.pop(n) if n in early_dq else block_grads(n, blk)
        d_pairs = []
        for j, reader in enumerate(readers):
            if reader is None:
                d_pairs += [d_ext_k[j].to(ext_k[j].dtype), d_ext_v[j].to(ext_v[j].dtype)]
            elif not isinstance(reader, _Arriving):  # straight into the source's fp32 dK/dV: no rounding
                reader.add_grad(d_ext_k[j], d_ext_v[j])
        d_sink = [] if sink is None else [_sink_grad(dout, out, lse, sink)]
        return (None,) * 6 + (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *d_pairs, *d_buffers, *d_sink)


def _sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """``dsink[h] = -sum_q exp(sink[h] - lse[q, h]) rowsum(dO * O)[q, h]`` (``out`` and ``lse``
    with the sink joined), in the merge's precision."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [t, np]
    return -(torch.exp(sink.to(acc)[None, :] - lse) * delta).sum(0).to(sink.dtype)


def _external(readers: Sequence[object], pairs: Sequence[Tensor], again: bool):
    """External K and V lists in source order, from the tensor pairs and the readers (None for
    an arriving source: filled once it is here)."""
    ext_k, ext_v, it = [], [], iter(pairs)
    for reader in readers:
        if isinstance(reader, _Arriving):
            kk = vv = None
        elif reader is None:
            kk, vv = next(it), next(it)
        else:
            kk, vv = reader.read(again=again)
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
    external: Sequence[Union[Tuple[Tensor, Tensor], CachedPrefixKV, ArrivingPrefixKV]] = (), scale: float = None,
    impl: str = "auto", sink: Optional[Tensor] = None,
) -> Tensor:
    """Tree attention ``[t, np, hn] -> [t, np, hv]`` for ``plan`` (a windowed one too; ``hv``:
    the values' width); external = cached prefix K/V, as ``(k, v)`` pairs or
    :class:`CachedPrefixKV` readers (read here, again in backward), or K/V in flight from
    another rank (:class:`ArrivingPrefixKV`: attended to last, see
    :class:`BlockwiseTreeAttention`); ``sink`` ``[np]``: a learnable sink logit per head,
    joined once (see the module docstring)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    readers, pairs, buffers = [], [], []
    for e in external:
        if isinstance(e, tuple):
            readers.append(None)
            pairs += e
        elif isinstance(e, ArrivingPrefixKV):
            b = next((n for n, x in enumerate(buffers) if x is e.buffer), len(buffers))
            if b == len(buffers):
                buffers.append(e.buffer)
            readers.append(_Arriving(e.exchange, b, e.offset, e.length))
        else:
            readers.append(e)
    extra = [] if sink is None else [sink]
    return BlockwiseTreeAttention.apply(plan, scale, impl, tuple(readers), len(pairs), sink is not None, q, k, v,
                                        *pairs, *buffers, *extra)
