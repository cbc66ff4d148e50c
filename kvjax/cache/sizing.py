"""How many pages the cache gets.

``free_gpu_memory_fraction`` of the free device memory goes to the cache; with
``max_tokens`` also set, the smaller of the two sizes wins. On CPU the free memory is
``KvCacheConfig.free_memory_bytes`` when given, else the host's available memory.
"""

from __future__ import annotations

import dataclasses

import jax
import psutil

from kvjax.config import ConfigError, KvCacheConfig


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


def require_fits(config: KvCacheConfig, size: CacheSize, num_host_bytes: int) -> None:
    """Refuses, before anything is allocated, a device cache or host tier larger than the
    memory there is.

    The device cache must fit the device's free memory (measured, whatever
    ``free_memory_bytes`` claims); the host tier must fit the host's available memory, less the
    device cache when the device is the CPU (both then live in host memory).

    Raises:
      ConfigError: naming the field, the bytes needed and the bytes available.
    """
    device_free = free_device_memory()
    if size.cache_bytes > device_free:
        field = "max_tokens" if size.limited_by == "max_tokens" else "free_memory_bytes"
        raise ConfigError(
            f"kv_cache_config.{field}: the device cache needs {size.cache_bytes:,} bytes ({size.num_tokens:,} tokens "
            f"x {size.bytes_per_token:,} bytes/token) but {device_free:,} bytes are free; lower {field}"
        )
    host_free = int(psutil.virtual_memory().available)
    if jax.devices()[0].platform == "cpu":
        host_free -= size.cache_bytes
    if num_host_bytes > host_free:
        raise ConfigError(
            f"kv_cache_config.host_cache_size={config.host_cache_size:,} needs {num_host_bytes:,} bytes of host memory "
            f"but {max(host_free, 0):,} bytes are available; lower host_cache_size"
        )
