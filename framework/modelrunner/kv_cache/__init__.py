"""The KV cache: its spec, sizing from a memory budget, and the block allocators."""

from .allocator import BlockAllocator, BlockCopy, KVCacheError, KVCacheStats
from .paged import PagedBlockAllocator
from .sizing import KVCacheBudgetError, allocate_kv_caches, copy_blocks, kv_cache_budget, num_blocks_for_budget
from .spec import KVCacheSpec

__all__ = [
    "BlockAllocator",
    "BlockCopy",
    "KVCacheBudgetError",
    "KVCacheError",
    "KVCacheSpec",
    "KVCacheStats",
    "PagedBlockAllocator",
    "allocate_kv_caches",
    "copy_blocks",
    "kv_cache_budget",
    "num_blocks_for_budget",
]
