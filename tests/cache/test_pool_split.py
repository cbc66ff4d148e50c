"""Per-group pools: ``pool_ratio`` / ``avg_seq_len`` split the device cache's bytes between
the layer groups (``CacheLayout.for_model``), with the hybrid fallback and its warning."""

from __future__ import annotations

import logging

import pytest

from kvjax.cache import CacheLayout
from kvjax.config import ConfigError, KvCacheConfig
from kvjax.engine import Engine
from kvjax.sampling import SamplingParams


def _for_model(hybrid: bool = False, **config) -> CacheLayout:
    """Windows 32 and 128 (two groups of two layers), max_seq_len 128, 8-token pages."""
    kv = KvCacheConfig(tokens_per_block=8, free_memory_bytes=1 << 30, max_tokens=256, **config)
    layout, _ = CacheLayout.for_model(kv, model_windows=(32, 128, 32, 128), num_kv_heads=2, head_dim=16,
                                      max_seq_len=128, model_dtype="float32", hybrid=hybrid)
    return layout


def _split_bytes(layout: CacheLayout) -> list[int]:
    return [(pages - 1) * layout.bytes_per_page(g) for g, pages in enumerate(layout.num_pages)]


def test_without_either_field_every_group_gets_the_same_pages():
    assert _for_model().num_pages == (33, 33)


def test_pool_ratio_splits_the_bytes_by_weight():
    layout = _for_model(pool_ratio=[1, 3])
    equal = _for_model()
    budget = sum(_split_bytes(equal))
    shares = [b / budget for b in _split_bytes(layout)]
    assert layout.num_pages == (
        1 + budget // 4 // layout.bytes_per_page(0),
        1 + 3 * budget // 4 // layout.bytes_per_page(1),
    )
    assert shares == pytest.approx([0.25, 0.75])


def test_avg_seq_len_weighs_each_group_by_the_tokens_a_sequence_keeps_there():
    layout = _for_model(avg_seq_len=64)  # window 32 keeps 32 tokens of a 64-token sequence, full keeps 64
    assert layout.group_shares(KvCacheConfig(avg_seq_len=64)) == pytest.approx((1 / 3, 2 / 3))
    assert sum(_split_bytes(layout)) <= sum(_split_bytes(_for_model()))
    assert layout.num_pages[1] > 33 > layout.num_pages[0]


def test_hybrid_models_warn_and_use_half_of_max_seq_len(caplog):
    with caplog.at_level(logging.WARNING):
        layout = _for_model(hybrid=True)
    assert "avg_seq_len = max_seq_len // 2 = 64 tokens" in caplog.text
    assert layout.num_pages == _for_model(avg_seq_len=64).num_pages


@pytest.mark.parametrize(
    "config, error, message",
    [
        (
            dict(pool_ratio=[1, 2, 3]),
            ConfigError,
            r"pool_ratio=\[1, 2, 3\] must have one weight per layer group: this model has 2 \(windows \[32, 128\]\)",
        ),
        (
            dict(pool_ratio=[50, 1]),
            ValueError,
            r"kv_cache_config.pool_ratio: layer group 1 \(window 128\) gets \d+ pages",
        ),
        (
            dict(pool_ratio=[1, 50]),
            ValueError,
            r"kv_cache_config.pool_ratio: layer group 0 \(window 32\) gets \d+ pages",
        ),
    ],
)
def test_a_split_the_model_cannot_use_is_refused(config, error, message):
    with pytest.raises(error, match=message):
        _for_model(**config)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("pool_ratio", [1, 0], r"pool_ratio=\(1, 0\) must be a non-empty list of positive numbers"),
        ("pool_ratio", 2, r"pool_ratio=2 must be a list of positive numbers"),
        ("avg_seq_len", 0, r"avg_seq_len=0 must be None or a positive int \(tokens\)"),
    ],
)
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        KvCacheConfig(**{field: value})


@pytest.mark.real_model
def test_smollm2_with_split_pools_generates_the_same_tokens(smollm2):
    """Two groups (windows 1024 and 128 on SmolLM2); a 600-token prompt runs past the short
    window. The split changes only how many pages each group has, never the outputs."""
    prompt = list(range(1000, 1600))
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outputs = []
    for extra in ({}, {"avg_seq_len": 640}):
        kv = KvCacheConfig(tokens_per_block=32, max_tokens=4096, max_attention_window=[1024, 128], **extra)
        engine = Engine(smollm2, kv, max_seq_len=1024)
        outputs.append(engine.generate([prompt], sampling)[0].output)
        pages = engine.layout.num_pages
    assert pages[1] < pages[0]  # the 128-token window group gets fewer pages than the full one
    assert outputs[0] == outputs[1]
