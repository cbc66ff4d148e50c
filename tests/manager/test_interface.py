"""Both managers implement ``CacheManager`` with the Protocol's own signatures, each implements
its extension in full, and no member of any Protocol is left to raise: a feature V2 does not
offer is refused by ``require_tiered`` naming the feature and the switch."""

from __future__ import annotations

import inspect

import pytest

from kvjax.cache import CacheLayout
from kvjax.config import KvCacheConfig
from kvjax.engine.manager_v2 import DeviceBlockPoolManager, KVCacheManagerV2
from kvjax.manager import CacheManager, KVCacheManager, TieredCacheManager, require_tiered


def _layout() -> CacheLayout:
    return CacheLayout(layer_windows=(64,), num_pages=(9,), tokens_per_block=4, num_kv_heads=1, head_dim=8,
                       max_seq_len=64)


def _members(protocol: type) -> list[str]:
    return [name for name in dir(protocol) if not name.startswith("_")]


def _managers() -> tuple[KVCacheManager, KVCacheManagerV2]:
    config = KvCacheConfig(tokens_per_block=4)
    return KVCacheManager(config, _layout()), KVCacheManagerV2(config, _layout(), 2)


@pytest.mark.parametrize(
    ("cls", "protocol"),
    [
        (KVCacheManager, CacheManager),
        (KVCacheManager, TieredCacheManager),
        (KVCacheManagerV2, CacheManager),
        (KVCacheManagerV2, DeviceBlockPoolManager),
    ],
)
def test_each_manager_has_every_member_with_the_protocols_signature(cls, protocol):
    for name in _members(protocol):
        mine, theirs = getattr(cls, name), getattr(protocol, name)
        if isinstance(theirs, property):
            assert isinstance(mine, property), f"{cls.__name__}.{name} must be a property"
            continue
        want = list(inspect.signature(theirs).parameters)
        assert list(inspect.signature(mine).parameters) == want, f"{cls.__name__}.{name}"


def test_each_manager_offers_exactly_its_extension():
    v1, v2 = _managers()
    assert isinstance(v1, CacheManager) and isinstance(v2, CacheManager)
    assert isinstance(v1, TieredCacheManager) and not isinstance(v1, DeviceBlockPoolManager)
    assert isinstance(v2, DeviceBlockPoolManager) and not isinstance(v2, TieredCacheManager)
    assert v2.row_of is not None and len(v2.block_pools) == v2.layout.num_groups


def test_no_manager_member_raises_not_implemented():
    for cls in (KVCacheManager, KVCacheManagerV2):
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            assert "NotImplementedError" not in inspect.getsource(member), f"{cls.__name__}.{name}"


def test_a_tiered_feature_on_v2_is_refused_naming_the_feature_and_the_switch():
    v1, v2 = _managers()
    assert require_tiered(v1, "speculative decoding") is v1
    with pytest.raises(ValueError, match=r"^speculative decoding needs the V1 manager .*KVCacheManagerV2 .*"
                                         r"use_kv_cache_manager_v2='false'$"):
        require_tiered(v2, "speculative decoding")
