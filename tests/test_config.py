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
        ("free_gpu_memory_fraction", 1.5, r"free_gpu_memory_fraction=1.5 must be a float in the open interval \(0, 1\)"),
        ("free_gpu_memory_fraction", 0.0, r"free_gpu_memory_fraction=0.0"),
        ("tokens_per_block", 24, r"tokens_per_block=24 must be a power of two in \[1, 1024\]"),
        ("dtype", "int4", r"dtype='int4' must be one of"),
        ("max_tokens", 0, r"max_tokens=0 must be None or a positive int"),
        ("host_cache_size", -1, r"host_cache_size=-1 must be an int >= 0"),
        ("secondary_offload_min_priority", 101, r"secondary_offload_min_priority=101 must be an int in \[0, 100\]"),
        ("max_attention_window", [4096, 0], r"max_attention_window=\(4096, 0\) must be a non-empty list of positive ints"),
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
    cfg = KvCacheRetentionConfig([TokenRangeRetentionConfig(10, 62, 90, 1000.0), TokenRangeRetentionConfig(62, None, 5)])
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
