"""Host-side KV cache manager: block keys, radix tree, priority-LRU eviction, host offload,
windows, events, and the one interface (``CacheManager``) its two implementations share."""

from kvjax.manager.bookkeeping import ConsistencyError, SnapshotError
from kvjax.manager.events import KVCacheEvent
from kvjax.manager.hashing import NO_EXTRAS, InternalScope, KeyExtras, MultimodalItem, block_key, mm_hash, root_key
from kvjax.manager.interface import CacheManager, OutOfPagesError, TieredCacheManager, require_tiered
from kvjax.manager.manager import KVCacheManager
from kvjax.manager.stats import CacheStats, RequestStats
from kvjax.manager.tiers import PageOp

__all__ = [
    "NO_EXTRAS",
    "CacheManager",
    "CacheStats",
    "ConsistencyError",
    "InternalScope",
    "KVCacheEvent",
    "KVCacheManager",
    "KeyExtras",
    "MultimodalItem",
    "OutOfPagesError",
    "PageOp",
    "RequestStats",
    "SnapshotError",
    "TieredCacheManager",
    "block_key",
    "mm_hash",
    "require_tiered",
    "root_key",
]
