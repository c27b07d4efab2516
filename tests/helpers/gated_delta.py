"""Inputs and a plain reference for the Gated DeltaNet kernel tests: random pre-conv rows and
gates, and one root-to-leaf path run alone, token by token."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_psrl.model import linear_attention as la
from megatron_psrl.model.linear_attention import GdnHeads


def random_inputs(t, heads: GdnHeads, kernel=4, seed=3):
    """``tree_gated_delta_rule``'s inputs for a pack of ``t`` tokens (decays in (-0.5, 0])."""
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * heads.qk_dim + heads.v_dim
    return dict(mixed_qkv=torch.randn(t, conv_dim, generator=g),
                g=-torch.rand(t, heads.num_value_heads, generator=g) * 0.5,
                beta=torch.rand(t, heads.num_value_heads, generator=g),
                conv_weight=torch.randn(conv_dim, 1, kernel, generator=g) * 0.5,
                conv_bias=torch.randn(conv_dim, generator=g) * 0.1)


def naive_path(inputs, rows, heads: GdnHeads, state=None):
    """One path alone: megatron's conv1d, then the delta rule token by token,
    ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q / sqrt(d_k)`` (S ``[d_k, d_v]``).
    Returns the outputs ``[len(rows), h_v, d_v]`` and the final state."""
    x = inputs["mixed_qkv"][rows]
    k_size = inputs["conv_weight"].shape[-1]
    mixed = F.silu(F.conv1d(x.t()[None], inputs["conv_weight"], inputs["conv_bias"], padding=k_size - 1,
                            groups=x.shape[1])[0, :, :len(rows)].t())
    q, k, v = la._heads(mixed, heads)
    s = torch.zeros(heads.num_value_heads, heads.key_head_dim, heads.value_head_dim) if state is None else state
    outs = []
    for i, r in enumerate(rows):
        s = s * inputs["g"][r].exp()[:, None, None]
        err = v[i] - torch.einsum("hkv,hk->hv", s, k[i])
        s = s + torch.einsum("hk,hv->hkv", k[i], inputs["beta"][r][:, None] * err)
        outs.append(torch.einsum("hkv,hk->hv", s, q[i]) / math.sqrt(heads.key_head_dim))
    return torch.stack(outs), s
