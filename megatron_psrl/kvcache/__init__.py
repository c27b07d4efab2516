"""The dynamic-block KV cache manager of mechanism 2 (see docs/architecture.md)."""

from megatron_psrl.kvcache.manager import (
    BLOCK_SIZE_CLASSES,
    BlockKVCache,
    CacheBudgetError,
    CacheMetrics,
    KVGeometry,
    choose_block_size,
)
from megatron_psrl.kvcache.memory_plan import (
    ALLOCATOR_MARGIN,
    MemoryPlan,
    activation_bytes_per_token,
    attention_saved_bytes_per_token,
    plan_forward_memory,
    plan_memory,
    plan_memory_group,
    saved_activation_bytes_per_token,
    simulated_peak_bytes,
    step_peak_bytes,
)

__all__ = [
    "ALLOCATOR_MARGIN",
    "BLOCK_SIZE_CLASSES",
    "BlockKVCache",
    "CacheBudgetError",
    "CacheMetrics",
    "KVGeometry",
    "MemoryPlan",
    "activation_bytes_per_token",
    "attention_saved_bytes_per_token",
    "choose_block_size",
    "plan_forward_memory",
    "plan_memory",
    "plan_memory_group",
    "saved_activation_bytes_per_token",
    "simulated_peak_bytes",
    "step_peak_bytes",
]
