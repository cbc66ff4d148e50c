"""Both managers implement ``CacheManager`` with the Protocol's own signatures, and V2 refuses
the V1-only features naming the switch."""

from __future__ import annotations

import inspect

import pytest

from kvjax.cache import CacheLayout
from kvjax.config import KvCacheConfig
from kvjax.manager import CacheManager, KVCacheManager
from kvjax.manager.manager_v2 import KVCacheManagerV2

MEMBERS = [name for name in dir(CacheManager) if not name.startswith("_")]


def _layout() -> CacheLayout:
    return CacheLayout(layer_windows=(64,), num_pages=(9,), tokens_per_block=4, num_kv_heads=1, head_dim=8,
                       max_seq_len=64)


@pytest.mark.parametrize("cls", [KVCacheManager, KVCacheManagerV2])
def test_each_manager_has_every_member_with_the_protocols_signature(cls):
    for name in MEMBERS:
        mine, theirs = getattr(cls, name), getattr(CacheManager, name)
        if isinstance(theirs, property):
            assert isinstance(mine, property), f"{cls.__name__}.{name} must be a property"
            continue
        want = list(inspect.signature(theirs).parameters)
        assert list(inspect.signature(mine).parameters) == want, f"{cls.__name__}.{name}"


def test_v2_refuses_v1_only_features_naming_the_switch():
    v2 = KVCacheManagerV2(KvCacheConfig(tokens_per_block=4), _layout(), 2)
    assert isinstance(v2, CacheManager) and isinstance(
        KVCacheManager(KvCacheConfig(tokens_per_block=4), _layout()), CacheManager
    )
    for call in (lambda: v2.rollback("r", 1), lambda: v2.allocate_drafts("r", 4), v2.get_kv_cache_events,
                 v2.state_dict, v2.clear_cache, lambda: v2.attach_disk_check(lambda g, p: True)):
        with pytest.raises(NotImplementedError, match=r"not supported by Manager V2 \(use_kv_cache_manager_v2"):
            call()
    assert v2.drop_lost_disk_blocks() == 0 and v2.num_cached_blocks(0, "disk") == 0
