"""GPU backends over gathered keys: ``flash`` (flash-attn varlen) and ``te`` (Transformer Engine).

Every segment's queries attend to [its ancestors' keys, its own keys]; the plan lists these
key indices once per micro-batch (``AttentionPlan.gathered_keys``). A varlen kernel with a
causal mask aligned to the bottom right of every (queries, keys) pair is then exact: a query
sees every ancestor key and the earlier tokens of its own segment. Ancestor keys are
gathered (copied) per segment; autograd's index_select backward sums their gradients back
onto the single copy of every shared prefix token (and onto cached external K/V).

Both import their kernel lazily and fail with a clear message without CUDA or the package.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from megatron_psrl.attention.plan import AttentionPlan
from megatron_psrl.errors import MissingRequirementError

Tensor = torch.Tensor


def _gather_inputs(k: Tensor, v: Tensor, plan: AttentionPlan, external: Sequence[Tuple[Tensor, Tensor]]):
    key_index, cu_q, cu_k = plan.gathered_keys()
    device = k.device
    cache: Dict = plan.__dict__.setdefault("_device_cache", {})
    if device not in cache:
        cache[device] = (
            torch.from_numpy(key_index).to(device),
            torch.from_numpy(cu_q).to(device=device, dtype=torch.int32),
            torch.from_numpy(cu_k).to(device=device, dtype=torch.int32),
            int((cu_q[1:] - cu_q[:-1]).max()) if len(cu_q) > 1 else 0,
            int((cu_k[1:] - cu_k[:-1]).max()) if len(cu_k) > 1 else 0,
        )
    idx, cu_q_t, cu_k_t, max_q, max_k = cache[device]
    keys = torch.cat([k] + [e[0] for e in external], dim=0) if external else k
    values = torch.cat([v] + [e[1] for e in external], dim=0) if external else v
    return keys.index_select(0, idx), values.index_select(0, idx), cu_q_t, cu_k_t, max_q, max_k


def require_cuda(name: str, q: Tensor) -> None:
    """Refuse non-CUDA tensors for the CUDA-only attention backend ``name``."""
    if q.device.type != "cuda":
        raise MissingRequirementError(
            f"attention backend {name!r} needs CUDA tensors (got {q.device}); use "
            "--attention-backend torch on CPU"
        )


def flash_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, external: Sequence[Tuple[Tensor, Tensor]] = (),
    scale: float = None,
) -> Tensor:
    """flash-attn varlen over per-segment gathered keys, causal aligned bottom right."""
    require_cuda("flash", q)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:  # pragma: no cover - GPU extra
        raise MissingRequirementError("attention backend 'flash' needs flash-attn: pip install 'megatron_psrl[gpu]'") from exc
    kg, vg, cu_q, cu_k, max_q, max_k = _gather_inputs(k, v, plan, external)
    # flash-attn >= 2.1 aligns the causal mask to the bottom right when seqlen_q < seqlen_k.
    return flash_attn_varlen_func(
        q, kg, vg, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=True
    )


class TETreeAttention(torch.nn.Module):
    """Transformer Engine's DotProductAttention (thd, padding_causal_bottom_right)."""

    def __init__(self, num_heads: int, num_groups: int, head_dim: int, scale: float, layer_number: int):
        super().__init__()
        try:
            import transformer_engine.pytorch as te
        except ImportError as exc:  # pragma: no cover - GPU extra
            raise MissingRequirementError(
                "attention backend 'te' needs transformer-engine: pip install 'megatron_psrl[gpu]'"
            ) from exc
        # Heads here are already this tensor-parallel rank's heads: no TP inside TE.
        self.attention = te.DotProductAttention(
            num_attention_heads=num_heads,
            kv_channels=head_dim,
            num_gqa_groups=num_groups,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type="padding_causal_bottom_right",
            softmax_scale=scale,
            layer_number=layer_number,
        )

    def forward(self, q, k, v, plan: AttentionPlan, external=(), scale: float = None) -> Tensor:
        require_cuda("te", q)
        kg, vg, cu_q, cu_k, max_q, max_k = _gather_inputs(k, v, plan, external)
        out = self.attention(
            q, kg, vg, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k,
            attn_mask_type="padding_causal_bottom_right",
        )
        return out.view(q.shape)
