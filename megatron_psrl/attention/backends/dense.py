"""The ``dense`` backend: one SDPA call with the full boolean tree mask.

The plainest correct tree attention, used as the reference in tests and as the "dense tree
mask" comparison point of the benchmarks (it pays for every masked-out pair: O(t^2)). A
windowed plan's mask is the tree's and the window's (``AttentionPlan.dense_mask``); with a
learnable sink per head the softmax is written out, the sink one more logit of every row.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron_psrl.attention.plan import AttentionPlan
from megatron_psrl.host_copy import host_to_device

Tensor = torch.Tensor


def dense_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, external: Sequence[Tuple[Tensor, Tensor]] = (),
    scale: float = None, sink: Optional[Tensor] = None,
) -> Tensor:
    """``[t, np, hn] -> [t, np, hn]``; keys are [pack, external sources...] in plan order;
    ``sink`` ``[np]``: a learnable sink logit per head in every row's softmax."""
    keys = torch.cat([k] + [e[0] for e in external], dim=0)
    values = torch.cat([v] + [e[1] for e in external], dim=0)
    mask = host_to_device(plan.dense_mask(), q.device)
    if sink is not None:
        return _with_sink(q, keys, values, mask, scale if scale is not None else q.shape[-1] ** -0.5, sink)
    # [t, h, d] -> [h, t, d]; GQA via enable_gqa (no repeated K/V materialised by us).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)


def _with_sink(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, sink: Tensor) -> Tensor:
    """Softmax over ``[scores, sink]`` per head (fp32; fp64 inputs in fp64), the sink's column
    dropped after it."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // keys.shape[1]
    kk, vv = keys.repeat_interleave(rep, dim=1).to(acc), values.repeat_interleave(rep, dim=1).to(acc)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), kk) * scale  # [np, t, keys]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    column = sink.to(acc)[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
