"""Host and disk offload and limited attention windows."""

from __future__ import annotations

import dataclasses

import pytest

from kvjax.cache import NULL_PAGE
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import KeyExtras, PageOp


def _prio(p: int) -> KvCacheRetentionConfig:
    return KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, p),))


@pytest.mark.parametrize("priority, offloaded", [(34, False), (35, True)])
def test_offload_threshold_is_inclusive_at_35(make, run, priority, offloaded):
    """TensorRT-LLM: blocks *below* secondary_offload_min_priority (35) are not offloaded."""
    mgr = make(num_device_pages=3, host=2, head_dim=3)  # 2 usable device pages of 2·4·3·4 = 96 bytes
    run(mgr, "a", [1] * 4 + [0], retention=_prio(priority))  # block on page 1
    mgr.take_page_ops()
    mgr.add_request("c", [7] * 8)
    mgr.allocate("c", 8)  # needs page 1 back
    ops = mgr.take_page_ops()
    if offloaded:
        assert ops == [PageOp("offload", 0, 1, 0)]
        assert mgr.num_cached_blocks(0, "host") == 1
        assert (mgr.stats.offloaded_pages, mgr.stats.offloaded_bytes) == (1, 96)
    else:
        assert ops == []
        assert mgr.num_cached_blocks(0, "host") == 0
    assert mgr.stats.device_evictions == 1


def test_reusing_a_host_block_onboards_it_to_a_fresh_page(make, run):
    mgr = make(num_device_pages=3, host=2, head_dim=3)  # pages of 96 bytes
    run(mgr, "a", [1] * 4 + [0])  # page 1
    run(mgr, "c", [7] * 8)  # evicts a's block to host page 0; c's blocks on pages 2, 1
    assert mgr.take_page_ops() == [PageOp("offload", 0, 1, 0)]
    mgr.get_kv_cache_events()
    assert mgr.add_request("b", [1] * 4 + [5]) == 4
    # a device page is needed: c's tail block (page 1) goes to host page 1, then onboard
    assert mgr.take_page_ops() == [PageOp("offload", 0, 1, 1), PageOp("onboard", 0, 0, 1)]
    assert mgr.block_table("b", 0) == [1]
    tiers = [(e.kind, e.tier) for e in mgr.get_kv_cache_events()]
    assert tiers == [("updated", "host"), ("updated", "device")]
    assert mgr.request_stats("b").onboarded_pages == 1
    assert (mgr.stats.onboarded_pages, mgr.stats.onboarded_bytes) == (1, 96)
    mgr.check_consistency()


def test_host_tier_evicts_its_own_lru_block(make, run):
    mgr = make(num_device_pages=2, host=1)  # 1 usable device page, 1 host page
    run(mgr, "a", [1] * 4)  # page 1 (block is full: 4 tokens, cap 3: nothing to reuse)
    run(mgr, "b", [2] * 4)  # a -> host 0; b on page 1
    run(mgr, "c", [3] * 4)  # b -> host: host full, a dropped
    assert mgr.stats.host_evictions == 1
    assert mgr.estimate_reusable_tokens([1] * 4 + [0]) == 0
    assert mgr.estimate_reusable_tokens([2] * 4 + [0]) == 4
    mgr.check_consistency()


def test_dropping_a_parent_drops_its_host_descendants(make, run):
    mgr = make(num_device_pages=4, host=1)  # 3 usable device pages, 1 host page
    low_parent = KvCacheRetentionConfig((TokenRangeRetentionConfig(0, 4, 10),))
    run(mgr, "a", [1] * 8 + [0], retention=low_parent)  # parent (10) page 1, child (35) page 2
    mgr.add_request("c", [7] * 12)
    mgr.allocate("c", 12)  # page 3, then the child (leaf) -> host, then the parent: dropped
    assert mgr.num_cached_blocks(0, "host") == 0
    assert mgr.num_cached_blocks(0, "device") == 0
    removed = [e.tier for e in mgr.get_kv_cache_events() if e.kind == "removed"]
    assert removed == ["host", "device"]
    mgr.check_consistency()


def test_host_victims_spill_to_disk_and_onboard_from_there(make, run):
    mgr = make(num_device_pages=2, host=1, disk=2, head_dim=3)  # 1 device, 1 host, 2 disk pages of 96 bytes
    run(mgr, "a", [1] * 4)  # page 1
    run(mgr, "b", [2] * 4)  # a -> host 0; b on page 1
    run(mgr, "c", [3] * 4)  # host full: a spills to disk 0; b -> host 0
    assert mgr.take_page_ops() == [
        PageOp("offload", 0, 1, 0), PageOp("spill", 0, 0, 0), PageOp("offload", 0, 1, 0),
    ]
    assert [mgr.num_cached_blocks(0, t) for t in ("device", "host", "disk")] == [1, 1, 1]
    spilled = [e for e in mgr.get_kv_cache_events() if e.tier == "disk"]
    assert [(e.kind, e.token_ids) for e in spilled] == [("updated", ())]
    assert (mgr.stats.host_evictions, mgr.stats.spilled_pages, mgr.stats.spilled_bytes) == (1, 1, 96)
    assert mgr.add_request("d", [1] * 4 + [0]) == 4  # a's block comes back from disk in one step
    # the device page comes from c: b spills to disk page 1 to make room on the host, c goes to host
    # page 0, then a is read from disk page 0 straight into device page 1
    assert mgr.take_page_ops() == [
        PageOp("spill", 0, 0, 1), PageOp("offload", 0, 1, 0), PageOp("onboard_disk", 0, 0, 1),
    ]
    assert mgr.block_table("d", 0) == [1]
    assert (mgr.stats.disk_onboarded_pages, mgr.stats.disk_onboarded_bytes) == (1, 96)
    assert mgr.request_stats("d").onboarded_pages == 1
    mgr.check_consistency()


def test_a_block_whose_spill_is_still_queued_is_not_lost(make, run):
    """The disk check vouches only for written pages; a lookup between a spill and the step that
    writes it (the engine runs the queued ops before the next forward) must still reuse the block."""
    mgr = make(num_device_pages=2, host=1, disk=2)
    written: set[int] = set()
    mgr.attach_disk_check(lambda group, page: page in written)
    run(mgr, "a", [1] * 4)  # page 1
    run(mgr, "b", [2] * 4)  # a -> host
    run(mgr, "c", [3] * 4)  # a spills to disk page 0: queued, not written
    assert mgr.reusable_tiers([1] * 4 + [0]) == ["disk"]
    assert mgr.add_request("d", [1] * 4 + [0]) == 4  # reused, ordered after the spill that writes it
    ops = mgr.take_page_ops()
    assert ops.index(PageOp("spill", 0, 0, 0)) < ops.index(PageOp("onboard_disk", 0, 0, 1))
    assert mgr.stats.lost_disk_pages == 0
    # b spilled to disk page 1 to make room for d, and that spill ran: its page now answers to the
    # check, which (never told of the write) fails it; the block is dropped at the lookup
    assert mgr.num_cached_blocks(0, "disk") == 1
    assert mgr.reusable_tiers([2] * 4 + [0]) == [] and mgr.stats.lost_disk_pages == 1
    assert mgr.num_cached_blocks(0, "disk") == 0
    mgr.check_consistency()


def test_reusable_tiers_names_each_reused_block_tier_without_side_effects(make, run):
    mgr = make(num_device_pages=2, host=1, disk=2)  # 1 device, 1 host, 2 disk pages of 4 tokens
    run(mgr, "a", [1] * 4)  # page 1
    run(mgr, "b", [2] * 4)  # a -> host; b on page 1
    run(mgr, "c", [3] * 4)  # a spills to disk; b -> host; c on page 1
    mgr.take_page_ops()
    stats = dataclasses.asdict(mgr.stats)
    assert mgr.reusable_tiers([1] * 4 + [0]) == ["disk"]
    assert mgr.reusable_tiers([2] * 4 + [0]) == ["host"]
    assert mgr.reusable_tiers([3] * 4 + [0]) == ["device"]
    assert mgr.reusable_tiers([4] * 4 + [0]) == []
    assert mgr.reusable_tiers([3] * 4 + [0], extras=KeyExtras(cache_salt="other")) == []  # another scope holds nothing
    assert dataclasses.asdict(mgr.stats) == stats and mgr.take_page_ops() == []  # nothing moved or counted
    assert mgr.add_request("d", [1] * 4 + [0]) == 4  # and add_request reuses exactly those blocks
    mgr.check_consistency()


def test_disk_tier_drops_its_own_lru_block_and_low_priority_blocks_skip_it(make, run):
    mgr = make(num_device_pages=2, host=1, disk=1)
    run(mgr, "a", [1] * 4)
    run(mgr, "b", [2] * 4, retention=_prio(34))  # below the threshold: dropped, never spilled
    run(mgr, "c", [3] * 4)  # a -> disk; b would spill but is dropped
    run(mgr, "d", [4] * 4)  # c -> host (b dropped from host: below threshold)
    run(mgr, "e", [5] * 4)  # c spills: disk full, a dropped
    assert mgr.stats.disk_evictions == 1
    assert mgr.estimate_reusable_tokens([1] * 4 + [0]) == 0
    assert mgr.estimate_reusable_tokens([2] * 4 + [0]) == 0
    assert mgr.estimate_reusable_tokens([3] * 4 + [0]) == 4
    mgr.check_consistency()


def test_disk_tier_needs_a_host_tier(tiny_layout):
    with pytest.raises(ValueError, match="disk_cache_size=1024 needs host_cache_size > 0"):
        KvCacheConfig(disk_cache_size=1024)
    with pytest.raises(ValueError, match=r"num_disk_pages=1 needs a host tier \(num_host_pages=0\)"):
        tiny_layout(disk=1)


def test_layer_groups_follow_distinct_windows(make):
    mgr = make(windows=(64, 8, 64, 8), max_seq_len=64)
    assert mgr.group_windows == (64, 8)
    assert mgr.layout.layer_group == (0, 1, 0, 1)


def test_windowed_group_memory_is_bounded_on_a_long_sequence(make):
    window, ps = 8, 4
    mgr = make(num_device_pages=40, windows=(128, window), max_seq_len=128)
    mgr.add_request("a", [1, 2])
    mgr.allocate("a", 2)
    mgr.commit_tokens("a", [1, 2])
    bound = -(-window // ps) + 1
    for n in range(2, 120):
        mgr.allocate("a", n + 1)
        held = [p for p in mgr.block_table("a", 1) if p != NULL_PAGE]
        assert len(held) <= bound, (n, mgr.block_table("a", 1))
        mgr.commit_tokens("a", [n % 50])
    table = mgr.block_table("a", 1)
    # 120 tokens: the next token (position 120) attends to 113..119 -> blocks 28 and 29
    assert [i for i, p in enumerate(table) if p != NULL_PAGE] == [28, 29]
    assert all(p != NULL_PAGE for p in mgr.block_table("a", 0))
    assert mgr.num_free_pages(1) == 39 - 2  # released blocks are cached but evictable
    mgr.check_consistency()


def test_windowed_group_releases_blocks_into_the_tree_for_reuse(make, run):
    mgr = make(num_device_pages=12, windows=(64, 4), max_seq_len=64)
    prompt = list(range(1, 21))  # 5 blocks
    run(mgr, "a", prompt, free=False)
    assert mgr.block_table("a", 1)[:4] == [NULL_PAGE] * 4
    assert mgr.num_cached_blocks(1) == 5  # released blocks stay cached
    mgr.free_request("a")
    assert mgr.add_request("b", prompt + [99]) == 20


def test_windowed_reuse_needs_only_blocks_inside_the_window(make, run):
    mgr = make(num_device_pages=12, windows=(64, 4), max_seq_len=64)
    prompt = list(range(1, 21))  # 5 blocks
    run(mgr, "a", prompt)
    stored = [e.block_key for e in mgr.get_kv_cache_events() if e.kind == "stored" and e.group == 1]
    windowed = mgr.pools[1]
    for key in stored[:2]:  # the windowed group loses the two oldest blocks
        windowed._drop(windowed.tree.blocks[key])
    mgr.check_consistency()
    # window 4: the first token to compute (position 20) attends to 17..20 -> block 4 only
    assert mgr.estimate_reusable_tokens(prompt + [99]) == 20
    # a prefix ending at 8 would need block 1 (positions 5..7): gone, and so is block 0
    assert mgr.estimate_reusable_tokens(prompt[:8] + [99]) == 0
    assert mgr.add_request("b", prompt + [99]) == 20
    table = mgr.block_table("b", 1)
    assert table[:4] == [NULL_PAGE] * 4 and table[4] != NULL_PAGE
    assert all(p != NULL_PAGE for p in mgr.block_table("b", 0))
    mgr.check_consistency()


def test_offloading_a_parent_whose_host_child_makes_room(make, run):
    """Regression: making host room for a victim may drop the victim's own host child."""
    mgr = make(num_device_pages=4, host=1)  # 3 usable device pages, 1 host page
    run(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])  # parent page 1, child page 2
    mgr.take_page_ops()
    mgr.add_request("c", [9] * 12)
    mgr.allocate("c", 12)  # child -> host 0; parent: host full, the child is dropped, parent -> host 0
    assert mgr.take_page_ops() == [PageOp("offload", 0, 2, 0), PageOp("offload", 0, 1, 0)]
    assert mgr.block_table("c", 0) == [3, 2, 1]
    assert (mgr.num_cached_blocks(0, "host"), mgr.num_cached_blocks(0, "device")) == (1, 0)
    mgr.check_consistency()
    mgr.free_request("c")
    assert mgr.add_request("b", [1, 2, 3, 4, 9]) == 4
    mgr.check_consistency()
