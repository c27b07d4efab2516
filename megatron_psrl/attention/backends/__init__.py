"""Attention backends: one contract, several kernels.

Every backend computes ``out [t, np, hn]`` from ``q [t, np, hn]``, ``k, v [t, ng, hn]``, an
:class:`~megatron_psrl.attention.plan.AttentionPlan` and optional external (cached prefix)
K/V pairs, exactly (each query sees its ancestors and the earlier tokens of its segment).

- ``torch``: blockwise tree attention with log-sum-exp merging; CPU flash kernels on CPU,
  plain math elsewhere. The default on CPU and the reference for the GPU kernels.
- ``dense``: one SDPA call with the full boolean tree mask (O(t^2)); a plain reference and
  the benchmarks' "dense tree mask" comparison.
- ``flash``: flash-attn varlen over gathered ancestor keys (CUDA).
- ``te``: Transformer Engine DotProductAttention, thd + padding_causal_bottom_right (CUDA).
"""

from megatron_psrl.attention.backends.blockwise import blockwise_tree_attention
from megatron_psrl.attention.backends.dense import dense_tree_attention
from megatron_psrl.attention.backends.varlen import TETreeAttention, flash_tree_attention
from megatron_psrl.options import ATTENTION_BACKENDS

BACKENDS = ATTENTION_BACKENDS


def default_backend(device_type: str, dtype=None) -> str:
    """``flash`` on CUDA for fp16/bf16 when flash-attn is installed, else ``torch``."""
    import torch

    if device_type == "cuda" and dtype in (None, torch.float16, torch.bfloat16):
        try:
            import flash_attn  # noqa: F401

            return "flash"
        except ImportError:
            return "torch"
    return "torch"


__all__ = [
    "BACKENDS",
    "TETreeAttention",
    "blockwise_tree_attention",
    "default_backend",
    "dense_tree_attention",
    "flash_tree_attention",
]
