"""The cache geometry built once from the config (``CacheLayout.for_model``), the host and disk
tiers' owner (``HostPool``) and the sequence reads/writes of the device pool."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import NULL_PAGE, CacheLayout, HostPool, QuantizedPages, init_pool, read_pages
from kvjax.cache.pool import read_slots, sequence_slots, slot_mapping, write_layer
from kvjax.config import KvCacheConfig


def _layout(windows=(16, 64, 16), pages=6, dtype="float32", host=0, disk=0) -> CacheLayout:
    return CacheLayout(
        layer_windows=windows,
        num_pages=(pages,) * len(dict.fromkeys(windows)),
        tokens_per_block=4,
        num_kv_heads=2,
        head_dim=8,
        max_seq_len=64,
        dtype=dtype,
        num_host_pages=host,
        num_disk_pages=disk,
    )


def _for_model(**config) -> CacheLayout:
    kv = KvCacheConfig(tokens_per_block=8, free_memory_bytes=1 << 30, **config)
    layout, _ = CacheLayout.for_model(kv, model_windows=(32, 128, 32, 128), num_kv_heads=2, head_dim=16,
                                      max_seq_len=128, model_dtype="float32")
    return layout


def test_for_model_turns_the_config_into_pages_once():
    base = _for_model(max_tokens=256)
    assert (base.tokens_per_block, base.layer_windows, base.num_pages) == (8, (32, 128, 32, 128), (33, 33))
    block = base.bytes_per_block
    assert block == 2 * 4 * 2 * 8 * 16 * 4 == sum(base.bytes_per_page(g) for g in range(2))
    tiers = _for_model(max_tokens=256, host_cache_size=5 * block + block // 2, disk_cache_size=3 * block)
    assert (tiers.num_host_pages, tiers.num_disk_pages) == (5, 3)  # whole blocks of every group
    assert dataclasses.replace(tiers, num_host_pages=0, num_disk_pages=0) == base
    windows = _for_model(max_tokens=256, max_attention_window=[64, 16])
    assert windows.layer_windows == (64, 16, 64, 16)
    with pytest.raises(ValueError, match=r"fewer than max_seq_len=128"):
        _for_model(max_tokens=64)


def test_layout_refuses_bad_tiers_and_windows():
    with pytest.raises(ValueError, match=r"num_host_pages=-1 must be an int >= 0"):
        _layout(host=-1)
    with pytest.raises(ValueError, match=r"num_disk_pages=2 needs a host tier"):
        _layout(disk=2)
    with pytest.raises(
        ValueError, match=r"layer_windows=\(128,\) must be a non-empty tuple of ints in \[1, max_seq_len=64\]"
    ):
        _layout(windows=(128,))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_host_pool_stores_loads_and_restores_every_tier(dtype, tmp_path):
    lay = _layout(dtype=dtype, host=3, disk=2)
    tiers = HostPool(lay, tmp_path)
    assert [(t, g) for t, g, _ in tiers.pools()] == [("host", 0), ("host", 1), ("disk", 0), ("disk", 1)]
    rng = np.random.default_rng(0)
    pool = init_pool(lay)
    pool = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 3, a.dtype), pool)
    kv = jax.device_get(read_pages(pool, lay, 0, jnp.array([4, 2, NULL_PAGE, NULL_PAGE], jnp.int32)))
    tiers.store("host", 0, np.array([2, 0]), kv)
    back = tiers.load("host", 0, np.array([2, 0]), 4)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(kv)):
        np.testing.assert_array_equal(a[:, :, :2], b[:, :, :2])
        assert not a[:, :, 2:].any()
    tiers.store("disk", 0, np.array([1, 0]), tiers.load("host", 0, np.array([0, 2]), 2))
    spilled = tiers.load("disk", 0, np.array([1, 0]), 2)
    for a, b in zip(jax.tree.leaves(spilled), jax.tree.leaves(kv)):
        np.testing.assert_array_equal(a[:, :, 0], b[:, :, 1])
        np.testing.assert_array_equal(a[:, :, 1], b[:, :, 0])
    assert isinstance(tiers.host[0], QuantizedPages) == (dtype == "int8")
    other = HostPool(lay, tmp_path)
    for tier, g, pages in tiers.pools():
        other.restore(tier, g, jax.tree.map(np.array, pages))
    for (_, _, a), (_, _, b) in zip(tiers.pools(), other.pools()):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match=r"saved host pages of group 1 have shape"):
        other.restore("host", 1, jax.tree.map(lambda a: a[:, :, :1], tiers.host[1]))
    with pytest.raises(ValueError, match=r"tier='gpu' must be 'host' or 'disk'"):
        tiers.load("gpu", 0, np.array([0]), 1)


def test_host_pool_without_tiers_is_empty():
    tiers = HostPool(_layout())
    assert (tiers.host, tiers.disk, list(tiers.pools())) == ((), (), [])


def test_sequence_slots_read_and_write_round_trip():
    lay = _layout()
    tables = [[3, 5, 1], [2, 4, 5]]  # per group (pages 1..5 of 6)
    positions = np.array([1, 4, 9])
    page_ids, offsets, valid = sequence_slots(tables, positions, np.array([0, 2, 3]), 5, lay.tokens_per_block)
    np.testing.assert_array_equal(page_ids, [[3, NULL_PAGE, 5, 1, NULL_PAGE], [2, NULL_PAGE, 4, 5, NULL_PAGE]])
    np.testing.assert_array_equal(offsets, [1, 0, 0, 1, 0])
    np.testing.assert_array_equal(valid, [True, False, True, True, False])
    rng = np.random.default_rng(1)
    k = [jnp.asarray(rng.normal(size=(12, 2, 8)), jnp.float32) for _ in range(lay.num_layers)]
    v = [jnp.asarray(rng.normal(size=(12, 2, 8)), jnp.float32) for _ in range(lay.num_layers)]
    written = jnp.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, -1], jnp.int32)
    pool = init_pool(lay)
    for layer in range(lay.num_layers):  # each layer's sequence written through its group's block table
        table = jnp.asarray(tables[lay.layer_group[layer]], jnp.int32)[None]
        ids, offs = slot_mapping(table, written[None], lay.tokens_per_block)
        for pages, values in ((pool.k[layer], k[layer]), (pool.v[layer], v[layer])):
            got = np.asarray(
                read_slots(write_layer(pages, ids, offs, values[None]), page_ids[lay.layer_group[layer]], offsets)
            )
            np.testing.assert_array_equal(got[[0, 2, 3]], np.asarray(values)[positions])
