"""Loading controller decisions, its measurements (tiers read through their throttles, the
blended layer step's recompute cost, cached), and metric helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import statistics
from kvjax import metrics
from kvjax.blend.loading_controller import LoadingController, TierSpec, measure_recompute, measure_tier
from kvjax.cache import CacheLayout, TierThrottle
from kvjax.config import KvCacheConfig


def controller(min_ratio=0.15, fixed_s=0.0, headroom=1.0):
    tiers = [TierSpec("hbm", 1e12, 0.0, 2), TierSpec("host", 1e10, 1e-5, 1), TierSpec("disk", 1e8, 1e-4, 0)]
    return LoadingController(
        tiers,
        seconds_per_token_layer=1e-6,
        bytes_per_token_layer=1536,
        min_ratio=min_ratio,
        fixed_s=fixed_s,
        headroom=headroom,
    )


def layout_for(cfg, **kv) -> CacheLayout:
    config = KvCacheConfig(tokens_per_block=16, max_tokens=4096, **kv)
    return CacheLayout.for_model(
        config,
        model_windows=cfg.layer_windows,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_seq_len=512,
        model_dtype="float32",
    )[0]


def test_ratio_is_max_of_floor_and_break_even():
    c = controller()
    n = 2000
    assert c.choose_ratio("hbm", n) == pytest.approx(0.15)
    slow = c.break_even_ratio("disk", n)
    assert slow > 1 and c.choose_ratio("disk", n) == 1.0
    mid = c.break_even_ratio("host", n)
    assert c.choose_ratio("host", n) == pytest.approx(max(0.15, mid))
    assert c.recompute_time(mid, n) == pytest.approx(c.load_time("host", n))


def test_cheapest_hiding_tier():
    c = controller()
    n = 2000
    # at ratio 0.15 recompute is 0.3 ms per layer: host (0.32 ms) does not hide, hbm does.
    assert c.choose_tier(0.15, n) == "hbm"
    assert c.choose_tier(1.0, n) == "host"  # 2 ms hides host (0.32 ms) but not disk (30 ms)


def test_headroom_keeps_the_recompute_under_the_load_and_serial_hides_nothing():
    exact, spare = controller(min_ratio=0.0), controller(min_ratio=0.0, headroom=0.8)
    n = 200_000  # host load 30.7 ms a layer
    assert spare.choose_ratio("host", n) == pytest.approx(0.8 * exact.choose_ratio("host", n))
    assert spare.recompute_time(spare.choose_ratio("host", n), n) == pytest.approx(0.8 * spare.load_time("host", n))
    assert spare.decide(n, "host", overlapped=False).ratio == 0.0  # onboarded before the prefill: nothing hides
    assert spare.decide(n, "host").break_even == pytest.approx(exact.choose_ratio("host", n))
    ratio = 1.01 * exact.break_even_ratio("host", n)  # recompute just over the load: hides under the exact rule only
    assert exact.choose_tier(ratio, n) == "host" and spare.choose_tier(ratio, n) == "hbm"
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"headroom={bad} must lie in \(0, 1\]"):
            controller(headroom=bad)


def test_fixed_cost_moves_the_break_even():
    c, f = controller(), controller(fixed_s=1e-4)
    n = 2000
    assert f.break_even_ratio("host", n) == pytest.approx(c.break_even_ratio("host", n) - 1e-4 / (n * 1e-6))
    assert f.recompute_time(f.break_even_ratio("host", n), n) == pytest.approx(f.load_time("host", n))
    assert f.break_even_ratio("hbm", n) == 0.0  # a load shorter than the fixed cost is always hidden


def test_measured_tier_follows_its_throttle(tiny):
    cfg, _ = tiny
    layout = layout_for(cfg)
    for tier in ("host", "disk"):
        # 256 KiB a layer at 10 MB/s: 26 ms of transfer beside 2 ms of latency, so a millisecond of
        # scheduling noise on a loaded machine moves the fitted bandwidth by a few percent only.
        spec = measure_tier(layout, tier, TierThrottle(read_gbps=0.01, latency_ms=2.0), num_tokens=1024, repeats=3)
        assert spec.bandwidth <= 0.01e9 * 1.1  # a throttled read is never faster than its emulated bandwidth
        assert spec.bandwidth >= 0.01e9 * 0.5 and 1.5e-3 <= spec.latency <= 10e-3
    free = measure_tier(layout, "host", TierThrottle(), num_tokens=256)
    assert free.bandwidth > 0.05e9
    with pytest.raises(ValueError, match="tier='device' must be 'host' or 'disk'"):
        measure_tier(layout, "device", TierThrottle(), num_tokens=256)


def test_recompute_cost_is_measured_once_and_cached(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
    cfg, params = tiny
    layout = layout_for(cfg)
    cost = measure_recompute(params, cfg, layout, 256, rows=(16, 128), repeats=2)
    assert cost.seconds_per_token_layer > 0 and cost.fixed_s >= 0 and cost.num_tokens == 256
    [path] = (tmp_path / "controller").iterdir()
    assert json.loads(path.read_text())["num_tokens"] == 256
    assert measure_recompute(params, cfg, layout, 256, rows=(16, 128)) == cost  # read back, not re-measured
    with pytest.raises(ValueError, match="rows=.* must hold at least two row counts"):
        measure_recompute(params, cfg, layout, 256, rows=(512, 16))
    controller = LoadingController.measured(
        params, cfg, layout_for(cfg, host_cache_size=1 << 22), {"host": TierThrottle(0.01)}, 256
    )
    assert set(controller.tiers) == {"device", "host"}
    assert controller.decide(256, "device").ratio == controller.min_ratio  # nothing to hide on the device
    assert controller.decide(256, "host").ratio >= controller.min_ratio


def test_controller_rejects_bad_floor():
    with pytest.raises(ValueError, match="min_ratio"):
        controller(min_ratio=1.5)


def test_kl_and_agreement():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(8, 50))
    assert np.allclose(metrics.kl_divergence(ref, ref), 0.0)
    other = ref.copy()
    other[3] = -other[3]
    assert metrics.first_divergence(ref, other) == 3
    assert metrics.top1_agreement(ref, other).sum() == 7
    assert metrics.kl_divergence(ref, other)[3] > 0


def test_deviation_statistics():
    dev = np.tile(np.arange(100.0), (3, 1))
    assert np.allclose(metrics.adjacent_layer_spearman(dev), 1.0)
    share = metrics.top_share(dev, 0.15)
    assert np.allclose(share, np.arange(85, 100).sum() / np.arange(100).sum())
    assert metrics.recall([1, 2, 3], [2, 3, 4, 5]) == 0.5
    mean, lo, hi = statistics.bootstrap_ci(np.arange(20.0), num=500)
    assert lo < mean < hi


def test_flop_fraction_of_full_and_half():
    from kvjax.testing.tiny import tiny_config

    cfg = tiny_config(num_layers=4)
    full = np.ones((4, 64), bool)
    assert metrics.recompute_flop_fraction(cfg, full, 64) == pytest.approx(1.0)
    half = np.zeros((4, 64), bool)
    half[:, ::2] = True
    assert 0.4 < metrics.recompute_flop_fraction(cfg, half, 64) < 0.6
