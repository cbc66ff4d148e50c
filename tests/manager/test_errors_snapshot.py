"""Rejected input leaves state unchanged; snapshots round-trip and refuse mismatches (E4)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import KeyExtras, KVCacheManager, MultimodalItem, SnapshotError
from kvjax.manager.bookkeeping import FORMAT_VERSION


def _busy(make, run):
    mgr = make(num_device_pages=6, host=4, windows=(64, 8))
    keep = KvCacheRetentionConfig(
        (TokenRangeRetentionConfig(0, 4, 90, duration_ms=1000),), decode_retention_priority=50
    )
    run(mgr, "a", list(range(1, 14)), retention=keep)
    run(mgr, "b", [7] * 12, extras=KeyExtras(mm_items=[MultimodalItem("image", b"i", 4, 4, uuid="u")]))
    prompt = list(range(1, 10)) + [5, 5]
    reused = mgr.add_request("c", prompt, extras=KeyExtras(cache_salt="s"))
    mgr.allocate("c", 13)
    mgr.commit_tokens("c", prompt[reused:9])  # 9 of 11 prompt tokens written, 13 slots
    return mgr


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: m.add_request("c", [1, 2]), ValueError, r"request_id='c' is already active"),
        (lambda m: m.add_request("", [1, 2]), ValueError, r"request_id='' must be a non-empty string"),
        (lambda m: m.add_request("d", []), ValueError, r"len\(prompt_token_ids\)=0 must be in \[1, max_seq_len=64\]"),
        (lambda m: m.add_request("d", [1, -2]), ValueError, r"prompt_token_ids\[1\]=-2 must be an int token id"),
        (lambda m: m.add_request("d", [1] * 65), ValueError, r"max_seq_len=64"),
        (lambda m: m.add_request("d", [1], {"lora_id": 1}), ValueError, r"extras must be a kvjax.+KeyExtras, got dict"),
        (lambda m: m.allocate("zzz", 4), KeyError, r"unknown request_id='zzz'"),
        (lambda m: m.allocate("c", -1), ValueError, r"num_total_tokens=-1 must be an int in \[0, 64\]"),
        (lambda m: m.allocate("c", 65), ValueError, r"num_total_tokens=65"),
        (lambda m: m.commit_tokens("c", [5, 5, 5, 1, 2]), ValueError, r"would reach 14 tokens, but only 13 have slots"),
        (
            lambda m: m.commit_tokens("c", [4]),
            ValueError,
            r"token_ids\[0\]=4 differs from prompt token 5 at position 9",
        ),
        (lambda m: m.rollback("c", -1), ValueError, r"num_tokens=-1 must be an int in \[0, 4\]"),
        (lambda m: m.block_table("c", 2), ValueError, r"group=2 must be an int in \[0, 1\]"),
        (lambda m: m.free_request("nope"), KeyError, r"unknown request_id='nope'"),
        (lambda m: m.clear_cache(), RuntimeError, r"clear_cache\(\) needs no active requests"),
    ],
)
def test_bad_calls_raise_clear_errors_and_change_nothing(make, run, call, error, match):
    mgr = _busy(make, run)
    mgr.get_kv_cache_events()
    before = mgr.state_dict()
    with pytest.raises(error, match=match):
        call(mgr)
    assert mgr.state_dict() == before


def test_constructor_validates_layout(tiny_layout):
    config = KvCacheConfig(tokens_per_block=4)
    with pytest.raises(ValueError, match=r"num_pages=\(1,\) must be >= 2 per group"):
        tiny_layout(num_device_pages=1)
    with pytest.raises(ValueError, match=r"num_disk_pages=2 needs a host tier"):
        tiny_layout(disk=2)
    with pytest.raises(ValueError, match=r"layer_windows=\(\) must be a non-empty"):
        tiny_layout(windows=())
    with pytest.raises(ValueError, match=r"layout.tokens_per_block=8 must equal config.tokens_per_block=4"):
        KVCacheManager(config, tiny_layout(tokens_per_block=8))
    with pytest.raises(TypeError, match=r"layout must be a CacheLayout"):
        KVCacheManager(config, {"num_pages": (8,)})


def _restore(mgr, state, clock, config=None, **layout_changes):
    layout = dataclasses.replace(mgr.layout, **layout_changes)
    return KVCacheManager.from_state_dict(state, config or mgr.config, layout, clock=clock)


def test_snapshot_round_trips_through_json_and_behaves_identically(make, run, clock):
    mgr = _busy(make, run)
    state = json.loads(json.dumps(mgr.state_dict()))
    restored = _restore(mgr, state, clock)
    assert restored.state_dict() == mgr.state_dict()
    clock.now += 2.0  # past the retention duration: both expire the same blocks
    reused = []
    for m in (mgr, restored):
        m.commit_tokens("c", [5, 5])
        m.free_request("c")
        reused.append(m.add_request("d", list(range(1, 14)) + [0]))
        m.allocate("d", 20)
    assert reused[0] == reused[1] > 0
    assert restored.state_dict() == mgr.state_dict()
    assert restored.take_page_ops() == mgr.take_page_ops()
    assert restored.get_kv_cache_events() == mgr.get_kv_cache_events()
    restored.check_consistency()


def test_snapshot_refuses_other_version_config_layout_and_damage(make, run, clock):
    mgr = _busy(make, run)
    state = mgr.state_dict()
    with pytest.raises(SnapshotError, match=rf"format_version=99, this kvjax reads version {FORMAT_VERSION}"):
        _restore(mgr, {**state, "format_version": 99}, clock)
    other = KvCacheConfig(**{**state["config"], "max_attention_window": None, "copy_on_partial_reuse": False})
    with pytest.raises(SnapshotError, match=r"differing fields: copy_on_partial_reuse \(snapshot True, now False\)"):
        _restore(mgr, state, clock, config=other)
    with pytest.raises(SnapshotError, match=r"layout"):
        _restore(mgr, state, clock, num_pages=(7, 7))
    damaged = json.loads(json.dumps(state))
    damaged["pools"][0]["device_free"][2].append(damaged["pools"][0]["blocks"][0]["page"])
    with pytest.raises(SnapshotError, match=r"damaged: group 0: device pages leaked or double-owned"):
        _restore(mgr, damaged, clock)
    truncated = json.loads(json.dumps(state))
    del truncated["pools"][1]["blocks"][0]["key"]
    with pytest.raises(SnapshotError, match=r"damaged: KeyError"):
        _restore(mgr, truncated, clock)
    with pytest.raises(SnapshotError, match=r"not a KVCacheManager state dict"):
        _restore(mgr, {"pools": []}, clock)
