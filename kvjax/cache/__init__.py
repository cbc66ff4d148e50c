"""Device side of the paged KV cache: layout, page pool pytree, pure page ops, sizing."""

from kvjax.cache.layout import NULL_PAGE, CacheLayout
from kvjax.cache.pool import PagePool, copy_pages, init_pool, read_pages, slot_mapping, write_layer, write_pages
from kvjax.cache.sizing import CacheSize, choose_cache_size, free_device_memory, require_fits

__all__ = [
    "NULL_PAGE",
    "CacheLayout",
    "CacheSize",
    "PagePool",
    "choose_cache_size",
    "copy_pages",
    "free_device_memory",
    "init_pool",
    "read_pages",
    "require_fits",
    "slot_mapping",
    "write_layer",
    "write_pages",
]
