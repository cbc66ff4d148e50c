"""``KVCacheManager.demote_cached``: every unreferenced cached device block moves down to the
host tier (or on through it to the disk tier) as eviction would move it, with its page
operations queued; referenced blocks stay (two layer groups: full attention and a 16-token window)."""

from __future__ import annotations

import pytest

from kvjax.config import KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import KVCacheManager

A, B, C = [1] * 8 + [0], [2] * 4 + [0], [3] * 8 + [0]
"""Prompts of 2, 1 and 2 full 4-token blocks (the last token is never a full block)."""


def _stored(mgr: KVCacheManager, run) -> None:
    """A and B cached and unreferenced (3 blocks per group), C still running (2 blocks held)."""
    run(mgr, "a", A)
    run(mgr, "b", B)
    run(mgr, "c", C, free=False)
    assert [mgr.num_cached_blocks(g) for g in range(2)] == [5, 5]
    mgr.take_page_ops()
    mgr.get_kv_cache_events()


def _tiers(mgr: KVCacheManager, group: int) -> list[int]:
    return [mgr.num_cached_blocks(group, tier) for tier in ("device", "host", "disk")]


def test_demote_to_host_offloads_every_unreferenced_device_block(make, run):
    mgr = make(num_device_pages=8, windows=(64, 16), host=4)
    _stored(mgr, run)
    held = {g: set(mgr.block_table("c", g)) for g in range(2)}
    assert mgr.demote_cached("host") == 6
    assert [_tiers(mgr, g) for g in range(2)] == [[2, 3, 0], [2, 3, 0]]
    ops = mgr.take_page_ops()
    assert sorted((op.kind, op.group) for op in ops) == [("offload", 0)] * 3 + [("offload", 1)] * 3
    for g in range(2):
        mine = [op for op in ops if op.group == g]
        assert not {op.src for op in mine} & held[g]  # C's pages are not touched
        assert len({op.src for op in mine}) == len({op.dst for op in mine}) == 3
    events = mgr.get_kv_cache_events()
    assert sorted((e.kind, e.tier) for e in events) == [("updated", "host")] * 6
    assert mgr.stats.offloaded_pages == 6
    mgr.check_consistency()
    assert mgr.demote_cached("host") == 0  # nothing left to move
    assert mgr.take_page_ops() == []
    # the demoted blocks are still matched, and come back by onboards
    assert mgr.add_request("d", A) == 8
    assert sorted(op.kind for op in mgr.take_page_ops()) == ["onboard"] * 4
    mgr.check_consistency()


def test_demote_to_disk_goes_through_the_host_tier(make, run):
    mgr = make(num_device_pages=8, windows=(64, 16), host=2, disk=8)
    _stored(mgr, run)
    assert mgr.demote_cached("disk") >= 6
    assert [_tiers(mgr, g) for g in range(2)] == [[2, 0, 3], [2, 0, 3]]
    ops = mgr.take_page_ops()
    for g in range(2):
        mine = [op for op in ops if op.group == g]
        assert sorted(op.kind for op in mine) == ["offload"] * 3 + ["spill"] * 3
        for i, op in enumerate(mine):  # each spill reads a host page an earlier offload wrote
            if op.kind == "spill":
                assert op.src in {o.dst for o in mine[:i] if o.kind == "offload"}
    assert mgr.stats.spilled_pages == 6
    mgr.check_consistency()
    assert mgr.add_request("d", A) == 8
    assert sorted(op.kind for op in mgr.take_page_ops()) == ["onboard_disk"] * 4
    mgr.check_consistency()


def test_demote_drops_what_the_tier_cannot_take(make, run):
    low = KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, 34),))  # below the offload threshold
    mgr = make(num_device_pages=8, windows=(64, 16), host=4)
    run(mgr, "a", A, retention=low)
    run(mgr, "b", B)
    mgr.take_page_ops()
    assert mgr.demote_cached("host") == 6
    assert [_tiers(mgr, g) for g in range(2)] == [[0, 1, 0], [0, 1, 0]]  # only B's block moved
    assert mgr.estimate_reusable_tokens(A) == 0 and mgr.estimate_reusable_tokens(B) == 4
    mgr.check_consistency()


def test_demote_refuses_a_tier_this_cache_lacks(make, run):
    mgr = make(num_device_pages=8, windows=(64, 16))
    run(mgr, "a", A)
    with pytest.raises(
        ValueError, match=r"tier='host' must be 'host' or 'disk', a tier of this cache \(pages: host 0, disk 0"
    ):
        mgr.demote_cached("host")
    hosted = make(num_device_pages=8, host=4)
    run(hosted, "a", A)
    hosted.take_page_ops()
    with pytest.raises(ValueError, match=r"tier='disk' must be .*host 4, disk 0.*disk_cache_size"):
        hosted.demote_cached("disk")
    with pytest.raises(ValueError, match=r"tier='device' must be 'host' or 'disk'"):
        hosted.demote_cached("device")
    assert hosted.num_cached_blocks(0) == 2 and hosted.take_page_ops() == []  # nothing moved
    hosted.check_consistency()

