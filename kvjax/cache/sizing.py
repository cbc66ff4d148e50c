"""How many pages the cache gets (SPEC A5).

``free_gpu_memory_fraction`` of the free device memory goes to the cache; with
``max_tokens`` also set, the smaller of the two sizes wins. On CPU the free memory is
``KvCacheConfig.free_memory_bytes`` when given, else the host's available memory.
"""

from __future__ import annotations

import dataclasses

import jax
import psutil

from kvjax.config import KvCacheConfig


@dataclasses.dataclass(frozen=True, slots=True)
class CacheSize:
    """The chosen size and how it was chosen (reported by experiments).

    Attributes:
      num_tokens: token capacity of a full-attention layer group.
      bytes_per_token: 2 · layers · kv_heads · head_dim · bytes(dtype).
      free_bytes: free memory the fraction applied to.
      limited_by: "free_gpu_memory_fraction" or "max_tokens".
    """

    num_tokens: int
    bytes_per_token: int
    free_bytes: int
    limited_by: str

    @property
    def cache_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


def free_device_memory(device: jax.Device | None = None) -> int:
    """Free bytes on ``device`` (accelerator memory stats), or available host memory on CPU."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(psutil.virtual_memory().available)


def choose_cache_size(config: KvCacheConfig, bytes_per_token: int) -> CacheSize:
    """Token capacity from the memory fraction and ``max_tokens`` (the smaller wins)."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token={bytes_per_token} must be positive")
    free = config.free_memory_bytes or free_device_memory()
    by_fraction = int(free * config.free_gpu_memory_fraction) // bytes_per_token
    if config.max_tokens is not None and config.max_tokens <= by_fraction:
        return CacheSize(config.max_tokens, bytes_per_token, free, "max_tokens")
    return CacheSize(by_fraction, bytes_per_token, free, "free_gpu_memory_fraction")
