"""The dynamic-block KV cache manager of mechanism 2 (see docs/architecture.md).

How many blocks a step needs and which graphs it keeps is planned with the step
(:mod:`megatron_psrl.schedule.memory`); this package holds the blocks.
"""

from megatron_psrl.kvcache.manager import (
    BLOCK_SIZE_CLASSES,
    BlockKVCache,
    CacheBudgetError,
    CacheMetrics,
    KVGeometry,
    choose_block_size,
)
from megatron_psrl.kvcache.prefix_state import (
    ALL_ROLES,
    GRADS,
    VALUES,
    CachePool,
    Combine,
    PrefixState,
    StateField,
    Storage,
    Tap,
)

__all__ = [
    "ALL_ROLES",
    "CachePool",
    "Combine",
    "GRADS",
    "PrefixState",
    "StateField",
    "Storage",
    "Tap",
    "VALUES",
    "BLOCK_SIZE_CLASSES",
    "BlockKVCache",
    "CacheBudgetError",
    "CacheMetrics",
    "KVGeometry",
    "choose_block_size",
]
