"""Prefix-sharing core attention for megatron-core (see docs/architecture.md)."""

from megatron_psrl.attention.core_attention import PrefixSharingAttention
from megatron_psrl.attention.metadata import PrefixKVHook, TreeAttentionMetadata
from megatron_psrl.attention.plan import AttentionPlan, causal_plan, tree_plan

__all__ = [
    "AttentionPlan",
    "PrefixKVHook",
    "PrefixSharingAttention",
    "TreeAttentionMetadata",
    "causal_plan",
    "tree_plan",
]
