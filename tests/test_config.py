"""Configs validate at construction with errors that name the field, value and range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.config import (
    ConfigError,
    KvCacheConfig,
    KvCacheRetentionConfig,
    SchedulerConfig,
    TokenRangeRetentionConfig,
    load_llm_config,
)


@pytest.mark.parametrize(
    "field,value,message",
    [
        (
            "free_gpu_memory_fraction",
            1.5,
            r"free_gpu_memory_fraction=1.5 must be a float in the open interval \(0, 1\)",
        ),
        ("free_gpu_memory_fraction", 0.0, r"free_gpu_memory_fraction=0.0"),
        ("tokens_per_block", 24, r"tokens_per_block=24 must be a power of two in \[1, 1024\]"),
        ("dtype", "int4", r"dtype='int4' must be one of"),
        ("max_tokens", 0, r"max_tokens=0 must be None or a positive int"),
        ("host_cache_size", -1, r"host_cache_size=-1 must be an int >= 0"),
        ("disk_cache_size", -1, r"disk_cache_size=-1 must be an int >= 0 \(bytes\)"),
        ("disk_cache_size", 4096, r"disk_cache_size=4096 needs host_cache_size > 0"),
        ("disk_cache_dir", "", r"disk_cache_dir='' must be None or a non-empty path string"),
        ("secondary_offload_min_priority", 101, r"secondary_offload_min_priority=101 must be an int in \[0, 100\]"),
        (
            "max_attention_window",
            [4096, 0],
            r"max_attention_window=\(4096, 0\) must be a non-empty list of positive ints",
        ),
        ("event_buffer_max_size", -5, r"event_buffer_max_size=-5 must be an int >= 0"),
        ("use_kv_cache_manager_v2", "maybe", r"use_kv_cache_manager_v2='maybe' must be 'auto', 'true' or 'false'"),
        ("enable_block_reuse", "yes", r"enable_block_reuse='yes' must be a bool"),
    ],
)
def test_kv_cache_config_rejects(field, value, message):
    with pytest.raises(ConfigError, match=message):
        KvCacheConfig(**{field: value})


def test_retention_rejects_bad_priority_and_overlap():
    with pytest.raises(ConfigError, match=r"priority=101 must be an int in \[0, 100\]"):
        TokenRangeRetentionConfig(0, 10, 101)
    with pytest.raises(ConfigError, match=r"token_start=-1 must be an int >= 0"):
        TokenRangeRetentionConfig(-1, 10, 50)
    with pytest.raises(ConfigError, match=r"token_end=5 must be None \(to the end\) or an int > token_start=5"):
        TokenRangeRetentionConfig(5, 5, 50)
    with pytest.raises(ConfigError, match=r"overlap: \[0, 10\) and \[5, 20\)"):
        KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 10, 80), TokenRangeRetentionConfig(5, 20, 10)])
    with pytest.raises(ConfigError, match=r"overlap: \[0, None\) and \[64, 70\)"):
        KvCacheRetentionConfig([TokenRangeRetentionConfig(64, 70, 80), TokenRangeRetentionConfig(0, None, 10)])
    with pytest.raises(ConfigError, match="duration_ms=0 must be None"):
        TokenRangeRetentionConfig(0, 4, 50, duration_ms=0)


def test_retention_priority_lookup():
    cfg = KvCacheRetentionConfig(
        [TokenRangeRetentionConfig(10, 62, 90, 1000.0), TokenRangeRetentionConfig(62, None, 5)]
    )
    assert cfg.priority_at(0) == (35, None)
    assert cfg.priority_at(10) == (90, 1000.0)
    assert cfg.priority_at(61) == (90, 1000.0)
    assert cfg.priority_at(10_000) == (5, None)


def test_yaml_in_the_seed_shape():
    kv, sched = load_llm_config(
        "kv_cache_config:\n  enable_block_reuse: true\n  max_attention_window: [4096, 256]\n"
        "scheduler_config:\n  enable_prefix_aware_scheduling: false\n"
    )
    assert kv.enable_block_reuse and not sched.enable_prefix_aware_scheduling
    assert kv.windows_for(5, 8192) == (4096, 256, 4096, 256, 4096)
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['enable_reuse'\]"):
        load_llm_config({"kv_cache_config": {"enable_reuse": True}})
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['kv_cache'\]"):
        load_llm_config({"kv_cache": {}})
    with pytest.raises(ConfigError, match=r"duplicate key 'enable_block_reuse' at line 3 of the config"):
        load_llm_config("kv_cache_config:\n  enable_block_reuse: true\n  enable_block_reuse: false\n")


def test_scheduler_config_rejects():
    with pytest.raises(ConfigError, match="max_num_tokens=0 must be a positive int"):
        SchedulerConfig(max_num_tokens=0)
    with pytest.raises(ConfigError, match="prefill_chunk_size=4096 must be <= max_num_tokens=2048"):
        SchedulerConfig(prefill_chunk_size=4096)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_fraction_accepts_exactly_the_open_unit_interval(f):
    if 0.0 < f < 1.0:
        assert KvCacheConfig(free_gpu_memory_fraction=f).free_gpu_memory_fraction == f
    else:
        with pytest.raises(ConfigError, match="free_gpu_memory_fraction"):
            KvCacheConfig(free_gpu_memory_fraction=f)


@pytest.mark.parametrize(
    "field", ["tokens_per_block", "max_tokens", "host_cache_size", "free_memory_bytes", "event_buffer_max_size"]
)
def test_booleans_are_not_sizes(field):
    with pytest.raises(ConfigError, match=rf"{field}=True must be"):
        KvCacheConfig(**{field: True})


@pytest.mark.parametrize("field", ["max_num_tokens", "max_batch_size", "prefill_chunk_size"])
def test_booleans_are_not_scheduler_sizes(field):
    with pytest.raises(ConfigError, match=rf"{field}=True must be a positive int"):
        SchedulerConfig(**{field: True})


@pytest.mark.parametrize(
    "source,message",
    [
        ("kv_cache_config: false\n", r"kv_cache_config=False must be a mapping of field names to values"),
        ("kv_cache_config: 5\n", r"kv_cache_config=5 must be a mapping"),
        ("scheduler_config: [1, 2]\n", r"scheduler_config=\[1, 2\] must be a mapping"),
        (
            "kv_cache_config:\n  max_attention_window: 4096\n",
            r"max_attention_window=4096 must be a list of positive ints",
        ),
        ("- 1\n", r"config source must be a mapping, got list"),
    ],
)
def test_yaml_sections_of_the_wrong_type(source, message):
    with pytest.raises(ConfigError, match=message):
        load_llm_config(source)


def test_empty_yaml_sections_mean_defaults():
    kv, sched = load_llm_config("kv_cache_config:\nscheduler_config:\n")
    assert kv == KvCacheConfig() and sched == SchedulerConfig()


def test_retention_shapes_are_checked():
    with pytest.raises(
        ConfigError,
        match=r"token_range_retention_configs=TokenRangeRetentionConfig\(.*\) must be a list of token ranges",
    ):
        KvCacheRetentionConfig(TokenRangeRetentionConfig(0, 4, 50))
    with pytest.raises(ConfigError, match=r"token range=5 must be a mapping"):
        KvCacheRetentionConfig([5])
    with pytest.raises(ConfigError, match=r"token_start=True must be an int >= 0"):
        TokenRangeRetentionConfig(True, 4, 50)
    with pytest.raises(ConfigError, match=r"duration_ms=inf must be None"):
        TokenRangeRetentionConfig(0, 4, 50, duration_ms=float("inf"))
    assert KvCacheRetentionConfig([{"token_start": 0, "token_end": 4, "priority": 90}]).priority_at(1) == (90, None)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("recompute_ratio", "0.5", r"recompute_ratio='0.5' must be a number in \[0, 1\]"),
        ("recompute_ratio", True, r"recompute_ratio=True must be a number in \[0, 1\]"),
        ("recompute_ratio", 1.5, r"recompute_ratio=1.5 must be a number in \[0, 1\]"),
        ("check_layers", 3, r"check_layers=3 must be a list or tuple"),
        ("check_layers", (0, 1, 2), r"check_layers=\(0, 1, 2\) must be strictly increasing layer indices >= 1"),
        ("budgets", (2.0, "1.5", 1.0), r"budgets=\(2.0, '1.5', 1.0\) must be numbers, one per check layer \(3\)"),
        ("row_bucket", True, r"row_bucket=True must be an int >= 1"),
        ("selector", "best", r"selector='best' must be one of"),
    ],
)
def test_selection_config_rejects(field, value, message):
    from kvjax.blend.selection import SelectionConfig

    with pytest.raises(ConfigError, match=message):
        SelectionConfig(**{field: value})


@pytest.mark.parametrize("field", ["host_read_gbps", "host_latency_ms", "disk_read_gbps", "disk_latency_ms"])
@pytest.mark.parametrize("value", [-0.5, float("inf"), float("nan"), True, "1"])
def test_tier_throttles_must_be_finite_numbers_at_least_zero(field, value):
    with pytest.raises(ConfigError, match=rf"{field}=.* must be a finite number >= 0"):
        KvCacheConfig(**{field: value})


def test_tier_throttles_are_config_fields():
    kv = KvCacheConfig(host_read_gbps=12.5, host_latency_ms=0, disk_read_gbps=2, disk_latency_ms=0.1)
    assert (kv.host_read_gbps, kv.host_latency_ms, kv.disk_read_gbps, kv.disk_latency_ms) == (12.5, 0, 2, 0.1)
    assert load_llm_config({"kv_cache_config": {"disk_read_gbps": 3.0}})[0].disk_read_gbps == 3.0
