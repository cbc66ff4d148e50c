"""Device-side cache: layout arithmetic, sizing, and the pure page operations."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import (
    NULL_PAGE,
    CacheLayout,
    choose_cache_size,
    copy_pages,
    init_pool,
    read_pages,
    slot_mapping,
    write_pages,
)
from kvjax.config import KvCacheConfig


def layout(windows=(64, 64, 64), kv_heads=2, dtype="float32", pages=8) -> CacheLayout:
    groups = len(dict.fromkeys(windows))
    return CacheLayout(layer_windows=windows, num_pages=(pages,) * groups, tokens_per_block=4, num_kv_heads=kv_heads,
                       head_dim=8, max_seq_len=64, dtype=dtype)


@pytest.mark.parametrize("kv_heads", [1, 3, 9])
@pytest.mark.parametrize("dtype,size", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_bytes_per_token_counts_only_kv_heads(kv_heads, dtype, size):
    lay = layout(kv_heads=kv_heads, dtype=dtype)
    assert lay.bytes_per_token == 2 * 3 * kv_heads * 8 * size
    pool = init_pool(lay)
    allocated = sum(a.nbytes for a in pool.k + pool.v)
    assert allocated == lay.pool_bytes() == lay.bytes_per_token * lay.tokens_per_block * 8


def test_layer_groups_by_window():
    lay = layout(windows=(16, 64, 16, 64, 16), pages=5)
    assert lay.group_windows == (16, 64)
    assert lay.layer_group == (0, 1, 0, 1, 0)
    assert lay.group_layers == (3, 2)
    assert [lay.window_of(i) for i in range(5)] == [16, None, 16, None, 16]


def test_sizing_takes_the_smaller_of_fraction_and_max_tokens():
    free = 1_000_000
    by_fraction = choose_cache_size(KvCacheConfig(free_memory_bytes=free, free_gpu_memory_fraction=0.5), 100)
    assert (by_fraction.num_tokens, by_fraction.limited_by) == (5000, "free_gpu_memory_fraction")
    capped = choose_cache_size(KvCacheConfig(free_memory_bytes=free, max_tokens=1200), 100)
    assert (capped.num_tokens, capped.limited_by, capped.cache_bytes) == (1200, "max_tokens", 120_000)
    roomy = choose_cache_size(
        KvCacheConfig(free_memory_bytes=free, max_tokens=10**9, free_gpu_memory_fraction=0.1), 100
    )
    assert roomy.num_tokens == 1000


def test_slot_mapping_and_padding_go_to_the_null_page():
    tables = jnp.array([[5, 2, 7]], jnp.int32)
    pages, offsets = slot_mapping(tables, jnp.array([[0, 3, 4, 9, -1]], jnp.int32), tokens_per_block=4)
    np.testing.assert_array_equal(pages, [[5, 5, 2, 7, NULL_PAGE]])
    np.testing.assert_array_equal(offsets, [[0, 3, 0, 1, 0]])


def test_copy_read_write_pages_touch_only_their_group():
    lay = layout(windows=(16, 64, 16), pages=6)
    rng = np.random.default_rng(0)
    pool = init_pool(lay)
    pool = type(pool)(k=tuple(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in pool.k),
                      v=tuple(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in pool.v))
    before = [np.asarray(a) for a in pool.k]
    pool = copy_pages(pool, lay, 0, jnp.array([1, 2]), jnp.array([4, 5]))
    for layer in (0, 2):
        np.testing.assert_array_equal(pool.k[layer][4:6], before[layer][1:3])
        np.testing.assert_array_equal(pool.k[layer][:4], before[layer][:4])
    np.testing.assert_array_equal(pool.k[1], before[1])
    kv = np.asarray(read_pages(pool, lay, 1, jnp.array([3])))
    assert kv.shape == (2, 1, 1, 4, 2, 8)
    pool = write_pages(pool, lay, 1, jnp.array([2]), jnp.asarray(kv))
    np.testing.assert_array_equal(pool.k[1][2], pool.k[1][3])
    np.testing.assert_array_equal(pool.v[1][2], pool.v[1][3])


def test_layout_rejects_bad_page_counts():
    with pytest.raises(ValueError, match=r"num_pages has 1 entries but the windows \(16, 64\) define 2 layer groups"):
        CacheLayout(
            layer_windows=(16, 64), num_pages=(4,), tokens_per_block=4, num_kv_heads=1, head_dim=8, max_seq_len=64
        )
    with pytest.raises(ValueError, match="must be >= 2 per group"):
        CacheLayout(layer_windows=(64,), num_pages=(1,), tokens_per_block=4, num_kv_heads=1, head_dim=8, max_seq_len=64)
