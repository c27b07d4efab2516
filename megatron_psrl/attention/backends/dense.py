"""The ``dense`` backend: one SDPA call with the full boolean tree mask.

The plainest correct tree attention, used as the reference in tests and as the "dense tree
mask" comparison point of the benchmarks (it pays for every masked-out pair: O(t^2)).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron_psrl.attention.plan import AttentionPlan
from megatron_psrl.host_copy import host_to_device

Tensor = torch.Tensor


def dense_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, external: Sequence[Tuple[Tensor, Tensor]] = (),
    scale: float = None,
) -> Tensor:
    """``[t, np, hn] -> [t, np, hn]``; keys are [pack, external sources...] in plan order."""
    keys = torch.cat([k] + [e[0] for e in external], dim=0)
    values = torch.cat([v] + [e[1] for e in external], dim=0)
    mask = host_to_device(plan.dense_mask(), q.device)
    # [t, h, d] -> [h, t, d]; GQA via enable_gqa (no repeated K/V materialised by us).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)
