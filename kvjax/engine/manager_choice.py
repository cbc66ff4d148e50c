"""Which cache manager an engine runs: Manager V2 or V1 (``use_kv_cache_manager_v2``).

The one place that asks: everything else sees the ``kvjax.manager.CacheManager`` interface
(and asks for an extension of it by what it offers, ``kvjax.manager.require_tiered``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvjax.cache.layout import CacheLayout
from kvjax.config import ConfigError, KvCacheConfig, SpeculativeConfig
from kvjax.engine.manager_v2 import KVCacheManagerV2
from kvjax.manager import CacheManager, KVCacheManager
from kvjax.model.config import ModelConfig

log = logging.getLogger(__name__)


def choose_manager_v2(
    config: KvCacheConfig, cfg: ModelConfig, speculative: SpeculativeConfig | None, sharded: bool = False
) -> bool:
    """Whether an engine runs Manager V2: ``use_kv_cache_manager_v2`` "true" / "false", or for
    "auto" the model family's ``prefers_kv_cache_manager_v2`` (V1 when it declares none, or
    when it prefers V2 but the configuration needs a V1 feature).

    Raises:
      ConfigError: "true" together with a feature only V1 has, naming the field and why.
    """
    choice = config.use_kv_cache_manager_v2
    if choice == "false" or (choice == "auto" and not cfg.prefers_kv_cache_manager_v2):
        return False
    needs_v1 = [
        reason
        for reason, present in (
            (
                f"kv_cache_config.host_cache_size={config.host_cache_size} (host offload tier)",
                config.host_cache_size > 0,
            ),
            (f"kv_cache_config.disk_cache_size={config.disk_cache_size} (disk tier)", config.disk_cache_size > 0),
            (
                f"kv_cache_config.event_buffer_max_size={config.event_buffer_max_size} (KV cache events)",
                config.event_buffer_max_size > 0,
            ),
            ("speculative (speculative decoding rolls back slots the host manager owns)", speculative is not None),
            (f"model {cfg.name!r} with recurrent layers (recurrent-state pool and snapshots)", cfg.is_hybrid),
            ("a device mesh (the on-device decode loop runs on one device)", sharded),
        )
        if present
    ]
    if not needs_v1:
        return True
    if choice == "true":
        raise ConfigError(
            "use_kv_cache_manager_v2='true' is not supported with " + "; ".join(needs_v1)
            + ": Manager V2 implements none of these; use 'false' or 'auto'"
        )
    log.info("use_kv_cache_manager_v2='auto': model prefers V2 but %s needs V1", "; ".join(needs_v1))
    return False


def manager_builder(
    config: KvCacheConfig,
    cfg: ModelConfig,
    speculative: SpeculativeConfig | None,
    sharded: bool,
    max_batch_size: int,
) -> Callable[[CacheLayout], CacheManager]:
    """What builds the engine's cache manager once its layout is known: Manager V2
    (``max_batch_size`` block-table rows) when ``choose_manager_v2`` says so, else V1. The
    choice is checked now, before the engine builds anything.

    Raises:
      ConfigError: as ``choose_manager_v2``.
    """
    if choose_manager_v2(config, cfg, speculative, sharded):
        return lambda layout: KVCacheManagerV2(config, layout, max_batch_size)
    return lambda layout: KVCacheManager(config, layout)
