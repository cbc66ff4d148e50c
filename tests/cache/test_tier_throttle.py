"""The emulated read speed of the host and disk tiers (``TierThrottle``) and one-layer reads of
a tier (``HostPool.load(layer=...)``, ``PageFile.read(layer=...)``)."""

from __future__ import annotations

import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import NULL_PAGE, CacheLayout, HostPool, QuantizedPages, TierThrottle, init_pool, read_pages
from kvjax.cache import host_pool as host_pool_module
from kvjax.config import KvCacheConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model
from kvjax.testing.tiny import tiny_model


def _layout(dtype: str = "float32") -> CacheLayout:
    """Two layer groups: window 16 (layers 0, 2, 4) and the full window (layers 1, 3); 4-token
    pages of 2 KV heads x 8, 4 host and 3 disk pages per group."""
    return CacheLayout(layer_windows=(16, 64, 16, 64, 16), num_pages=(6, 6), tokens_per_block=4, num_kv_heads=2,
                       head_dim=8, max_seq_len=64, dtype=dtype, num_host_pages=4, num_disk_pages=3)


def _filled(layout: CacheLayout, tmp_path, throttles=None) -> HostPool:
    """A HostPool whose host pages 0..3 and disk pages 0..2 of every group hold distinct random
    values (device pages read back through ``read_pages``, so quantized pages are valid)."""
    tiers = HostPool(layout, tmp_path, throttles=throttles)
    rng = np.random.default_rng(0)
    pool = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 3, a.dtype), init_pool(layout))
    for g in range(layout.num_groups):
        tiers.store(
            "host", g, np.arange(4), jax.device_get(read_pages(pool, layout, g, jnp.array([1, 2, 3, 4], jnp.int32)))
        )
        tiers.store(
            "disk",
            g,
            np.arange(3),
            jax.device_get(read_pages(pool, layout, g, jnp.array([5, 4, 3, NULL_PAGE], jnp.int32))),
        )
    return tiers


@pytest.mark.parametrize("field", ["read_gbps", "latency_ms"])
@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), True, "1"])
def test_throttle_rejects_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"TierThrottle\.{field}=.* must be a finite number >= 0"):
        TierThrottle(**{field: value})


def test_throttle_seconds_are_latency_plus_bytes_over_bandwidth():
    assert TierThrottle().seconds(10**9) == 0.0
    assert not TierThrottle().active
    assert TierThrottle(latency_ms=20).seconds(10**9) == pytest.approx(0.02)
    assert TierThrottle(read_gbps=2.0).seconds(10**9) == pytest.approx(0.5)
    assert TierThrottle(read_gbps=0.5, latency_ms=3).seconds(2 * 10**8) == pytest.approx(0.403)
    assert TierThrottle(read_gbps=1, latency_ms=0).active and TierThrottle(latency_ms=1).active


def test_throttle_sleeps_only_for_the_time_left(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(host_pool_module.time, "sleep", slept.append)
    TierThrottle().wait(time.perf_counter(), 10**9)  # unthrottled: never sleeps
    TierThrottle(latency_ms=50).wait(time.perf_counter() - 1.0, 0)  # the read already took longer
    assert slept == []
    start = time.perf_counter()
    TierThrottle(read_gbps=1.0, latency_ms=100).wait(start, 10**8)
    assert len(slept) == 1 and 0.0 < slept[0] <= 0.2


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_throttled_load_lasts_at_least_the_emulated_time(tier, tmp_path):
    layout = _layout()
    throttle = TierThrottle(read_gbps=1e-4, latency_ms=20)  # 100 kB/s: two 1,536-byte pages take 20 + 30.7 ms
    tiers = _filled(layout, tmp_path, throttles={tier: throttle})
    plain = _filled(layout, tmp_path / "plain")
    slots = np.array([2, 0])
    for layer in (None, 1):
        if tier == "disk":
            assert all(tiers.check_disk(0, int(s)) for s in slots)
        num_bytes = len(slots) * (layout.bytes_per_page(0) if layer is None else layout.bytes_per_page_layer)
        start = time.perf_counter()
        got = tiers.load(tier, 0, slots, 4, layer=layer)
        assert time.perf_counter() - start >= throttle.seconds(num_bytes) >= 0.02
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain.load(tier, 0, slots, 4, layer=layer))):
            np.testing.assert_array_equal(a, b)  # the throttle only slows the read down
        tiers.end_step()


def test_throttles_are_per_tier(tmp_path):
    tiers = HostPool(_layout(), tmp_path, throttles={"disk": TierThrottle(latency_ms=5)})
    assert tiers.throttles["disk"] == TierThrottle(latency_ms=5)
    assert not tiers.throttles["host"].active


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_one_layer_load_is_that_layer_of_the_whole_load(dtype, tier, tmp_path):
    layout = _layout(dtype)
    tiers = _filled(layout, tmp_path)
    slots = np.array([2, 0, 1])
    for g in range(layout.num_groups):
        whole = tiers.load(tier, g, slots, 4)
        assert isinstance(whole, QuantizedPages) == (dtype == "int8")
        assert any(leaf[:, :, :3].any() for leaf in jax.tree.leaves(whole))
        for i in range(layout.group_layers[g]):
            one = tiers.load(tier, g, slots, 4, layer=i)
            assert jax.tree.structure(one) == jax.tree.structure(whole)
            for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(whole)):
                assert a.shape == (2, 1, *b.shape[2:]) and a.dtype == b.dtype
                np.testing.assert_array_equal(a, b[:, i : i + 1])
                assert not a[:, :, 3:].any()  # the padding page
        tiers.end_step()


def test_the_engine_throttles_its_tiers_from_the_config(tmp_path):
    cfg, params = tiny_model(0)
    model = Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=160, host_cache_size=4 * 8192, disk_cache_size=4 * 8192,
                       disk_cache_dir=str(tmp_path), host_read_gbps=8.0, host_latency_ms=0.5, disk_read_gbps=0.25,
                       disk_latency_ms=4.0)
    engine = Engine(model, kv, max_seq_len=128)
    assert engine.host_pool.throttles == {"host": TierThrottle(8.0, 0.5), "disk": TierThrottle(0.25, 4.0)}
