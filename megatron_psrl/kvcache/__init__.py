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

__all__ = [
    "BLOCK_SIZE_CLASSES",
    "BlockKVCache",
    "CacheBudgetError",
    "CacheMetrics",
    "KVGeometry",
    "choose_block_size",
]
