"""Loading controller decisions and metric helpers."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import metrics
from kvjax.blend.loading_controller import LoadingController, TierSpec


def controller(min_ratio=0.15):
    tiers = [TierSpec("hbm", 1e12, 0.0, 2, False), TierSpec("host", 1e10, 1e-5, 1, False), TierSpec("disk", 1e8, 1e-4, 0, False)]
    return LoadingController(tiers, seconds_per_token_layer=1e-6, bytes_per_token_layer=1536, min_ratio=min_ratio)


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
    mean, lo, hi = metrics.bootstrap_ci(np.arange(20.0), num=500)
    assert lo < mean < hi


def test_flop_fraction_of_full_and_half():
    from kvjax.testing.tiny import tiny_config

    cfg = tiny_config(num_layers=4)
    full = np.ones((4, 64), bool)
    assert metrics.recompute_flop_fraction(cfg, full, 64) == pytest.approx(1.0)
    half = np.zeros((4, 64), bool)
    half[:, ::2] = True
    assert 0.4 < metrics.recompute_flop_fraction(cfg, half, 64) < 0.6
