"""The paged KV cache's pages: layout (the geometry), device page pool pytree and its pure page ops,
the host and disk tiers (``HostPool``), quantized pages, sizing."""

from kvjax.cache.host_pool import HostPages, HostPool, TierThrottle, load_host_pages, store_host_pages
from kvjax.cache.layout import NULL_PAGE, CacheLayout
from kvjax.cache.pool import (
    PagePool,
    Pages,
    copy_pages,
    init_pool,
    read_pages,
    read_slots,
    slot_mapping,
    write_layer,
    write_pages,
)
from kvjax.cache.quant import QUANTIZED_DTYPES, SCALE_GRANULARITIES, QuantizedPages, dequantize_pages
from kvjax.cache.sizing import CacheSize, choose_cache_size, free_device_memory, require_fits

__all__ = [
    "NULL_PAGE",
    "QUANTIZED_DTYPES",
    "SCALE_GRANULARITIES",
    "CacheLayout",
    "CacheSize",
    "HostPages",
    "HostPool",
    "PagePool",
    "Pages",
    "QuantizedPages",
    "TierThrottle",
    "choose_cache_size",
    "copy_pages",
    "dequantize_pages",
    "free_device_memory",
    "init_pool",
    "load_host_pages",
    "read_pages",
    "read_slots",
    "require_fits",
    "slot_mapping",
    "store_host_pages",
    "write_layer",
    "write_pages",
]
