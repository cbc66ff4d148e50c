"""Scenario tests for allocation, reuse, eviction order and partial reuse (B2-B4, B6).

Tiny pools (4 tokens per page, a handful of pages) and exact page ids, in vLLM's style.
"""

from __future__ import annotations

import pytest

from kvjax.cache import NULL_PAGE
from kvjax.config import KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import OutOfPagesError, PageOp

P = list(range(100, 112))  # 12 tokens = 3 full blocks of 4


def test_fresh_allocation_hands_out_pages_in_order(make):
    mgr = make(num_device_pages=8)
    assert mgr.add_request("a", P) == 0
    mgr.allocate("a", 6)
    assert mgr.block_table("a", 0) == [1, 2]
    mgr.allocate("a", 12)
    assert mgr.block_table("a", 0) == [1, 2, 3]
    assert mgr.num_free_pages(0) == 4
    assert NULL_PAGE == 0


def test_second_request_reuses_blocks_and_copies_partial_last_block(make, run):
    mgr = make(num_device_pages=8)
    run(mgr, "a", P)
    # same 12-token prompt: capped at 11 tokens -> 2 shared blocks + 3 tokens of block 3 copied
    assert mgr.add_request("b", P) == 11
    assert mgr.block_table("b", 0) == [1, 2, 4]
    assert mgr.take_page_ops() == [PageOp("copy", 0, 3, 4)]
    stats = mgr.request_stats("b")
    assert (stats.reused_tokens, stats.reused_blocks, stats.copied_pages) == (11, 2, 1)
    mgr.allocate("b", 12)
    mgr.commit_tokens("b", P[11:])
    # block 3 filled identically: b switches to the cached page 3 and page 4 is freed
    assert mgr.block_table("b", 0) == [1, 2, 3]
    mgr.check_consistency()


def test_longer_prompt_reuses_whole_cached_prefix(make, run):
    mgr = make(num_device_pages=8)
    run(mgr, "a", P)
    assert mgr.add_request("b", P + [7, 8]) == 12
    assert mgr.block_table("b", 0) == [1, 2, 3]
    assert mgr.take_page_ops() == []


def test_reuse_disabled_frees_pages_and_matches_nothing(make, run):
    mgr = make(num_device_pages=8, enable_block_reuse=False)
    run(mgr, "a", P)
    assert mgr.num_free_pages(0) == 7
    assert mgr.num_cached_blocks(0) == 0
    assert mgr.estimate_reusable_tokens(P) == 0
    assert run(mgr, "b", P) == 0
    assert mgr.get_kv_cache_events() == []


def test_estimate_has_no_side_effects(make, run):
    mgr = make(num_device_pages=8)
    run(mgr, "a", P)
    mgr.get_kv_cache_events()
    before = mgr.state_dict()
    assert mgr.estimate_reusable_tokens(P) == 11
    assert mgr.estimate_reusable_tokens(P[:5]) == 4
    assert mgr.state_dict() == before


def test_lru_eviction_order_is_tail_first_then_oldest_request(make, run):
    mgr = make(num_device_pages=7)  # 6 usable pages
    run(mgr, "a", [1, 1, 1, 1, 2, 2, 2, 2])  # pages 1, 2
    run(mgr, "b", [3, 3, 3, 3, 4, 4, 4, 4])  # pages 3, 4
    mgr.get_kv_cache_events()
    mgr.add_request("c", [9] * 16)
    mgr.allocate("c", 16)  # pages 5, 6 free, then evict a's tail (2), a's head (1)
    assert mgr.block_table("c", 0) == [5, 6, 2, 1]
    removed = [e for e in mgr.get_kv_cache_events() if e.kind == "removed"]
    assert [e.token_ids for e in removed] == [(), ()]
    assert mgr.estimate_reusable_tokens([1, 1, 1, 1, 2, 2, 2, 2, 0]) == 0
    assert mgr.estimate_reusable_tokens([3, 3, 3, 3, 4, 4, 4, 4, 0]) == 8


def test_reuse_refreshes_lru_position(make, run):
    mgr = make(num_device_pages=5)  # 4 usable pages
    run(mgr, "a", [1] * 4 + [0])  # block on page 1 cached (page 2 private, freed)
    run(mgr, "b", [2] * 4 + [0])  # block on page 3 cached (page 4 private, freed)
    assert run(mgr, "a2", [1] * 4 + [5]) == 4  # touches a's block: now more recent than b's
    mgr.add_request("c", [7] * 12)
    mgr.allocate("c", 12)
    assert mgr.estimate_reusable_tokens([1] * 4 + [0]) == 4
    assert mgr.estimate_reusable_tokens([2] * 4 + [0]) == 0


def test_lowest_priority_is_evicted_first_even_if_more_recent(make, run):
    mgr = make(num_device_pages=5)
    low = KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, 10),))
    run(mgr, "old", [1] * 4 + [0])  # priority 35, page 1
    run(mgr, "new", [2] * 4 + [0], retention=low)  # priority 10, page 2
    mgr.add_request("c", [7] * 12)
    mgr.allocate("c", 12)  # 2 free pages (2, 4), then one eviction: the priority-10 block
    assert mgr.block_table("c", 0) == [2, 4, 3]
    assert mgr.estimate_reusable_tokens([1] * 4 + [0]) == 4


def test_leaves_are_evicted_before_their_parents(make, run):
    mgr = make(num_device_pages=6)  # 5 usable pages
    ranges = KvCacheRetentionConfig(
        (TokenRangeRetentionConfig(0, 4, 5), TokenRangeRetentionConfig(4, None, 90))
    )
    run(mgr, "chain", [1] * 8 + [0], retention=ranges)  # parent page 1 (prio 5), child page 2 (prio 90)
    run(mgr, "other", [3] * 4 + [0])  # page 3, prio 35
    mgr.add_request("c", [7] * 16)
    # free pages 3 and 5, then evict the evictable leaves: "other" (35) before the child (90);
    # the parent (5) is not a candidate while its child is cached
    mgr.allocate("c", 16)
    assert mgr.block_table("c", 0) == [3, 5, 4, 2]
    mgr.check_consistency()
    assert mgr.num_cached_blocks(0) == 1
    assert mgr.estimate_reusable_tokens([1] * 4 + [0]) == 4


def test_retention_duration_expires_back_to_default(make, run, clock):
    mgr = make(num_device_pages=5)
    keep = KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, 90, duration_ms=500),))
    run(mgr, "kept", [1] * 4 + [0], retention=keep)  # page 1, priority 90 for 0.5 s
    run(mgr, "plain", [2] * 4 + [0])  # page 2, priority 35 (more recent)
    mgr.get_kv_cache_events()
    clock.now += 0.6
    mgr.add_request("c", [7] * 12)
    events = mgr.get_kv_cache_events()
    assert [(e.kind, e.priority) for e in events if e.kind == "updated"] == [("updated", 35)]
    mgr.allocate("c", 12)  # both at 35 now: LRU evicts "kept" (released first)
    assert mgr.block_table("c", 0) == [2, 4, 1]


def test_decode_blocks_get_decode_priority(make):
    mgr = make(num_device_pages=8)
    retention = KvCacheRetentionConfig(decode_retention_priority=80)
    mgr.add_request("a", [1, 2, 3, 4, 5], retention=retention)
    mgr.allocate("a", 8)
    mgr.commit_tokens("a", [1, 2, 3, 4, 5, 6, 7, 8])
    stored = [e for e in mgr.get_kv_cache_events() if e.kind == "stored"]
    assert [e.priority for e in stored] == [35, 80]


def test_partial_reuse_copies_matching_tokens(make, run):
    mgr = make(num_device_pages=8)
    run(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])  # pages 1, 2 cached
    assert mgr.add_request("b", [1, 2, 3, 4, 5, 6, 9, 9, 9]) == 6
    assert mgr.block_table("b", 0) == [1, 4]
    assert mgr.take_page_ops() == [PageOp("copy", 0, 2, 4)]


def test_partial_reuse_without_copy_takes_free_leaf_in_place(make, run):
    mgr = make(num_device_pages=8, copy_on_partial_reuse=False)
    run(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    mgr.get_kv_cache_events()
    assert mgr.add_request("b", [1, 2, 3, 4, 5, 6, 9, 9, 9]) == 6
    assert mgr.block_table("b", 0) == [1, 2]  # page 2 taken over, no copy
    assert mgr.take_page_ops() == []
    assert [e.kind for e in mgr.get_kv_cache_events()] == ["removed"]
    assert mgr.estimate_reusable_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4  # a's second block is gone


def test_partial_reuse_without_copy_refuses_a_block_in_use(make, run):
    mgr = make(num_device_pages=8, copy_on_partial_reuse=False)
    run(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0], free=False)  # a still holds block 2
    assert mgr.add_request("b", [1, 2, 3, 4, 5, 6, 9, 9, 9]) == 4
    assert mgr.block_table("b", 0) == [1]


def test_partial_reuse_disabled_rounds_down_to_blocks(make, run):
    mgr = make(num_device_pages=8, enable_partial_reuse=False)
    run(mgr, "a", P)
    assert mgr.add_request("b", P) == 8
    assert mgr.take_page_ops() == []


def test_out_of_pages_leaves_state_unchanged(make):
    mgr = make(num_device_pages=4)  # 3 usable
    mgr.add_request("a", [1] * 8)
    mgr.allocate("a", 8)
    before = mgr.state_dict()
    with pytest.raises(OutOfPagesError, match=r"needs 2 more page\(s\) in layer group 0.*only 1"):
        mgr.allocate("a", 16)
    assert mgr.state_dict() == before


def test_concurrent_identical_prompts_share_pages_after_commit(make):
    mgr = make(num_device_pages=8)
    for rid in ("a", "b"):
        assert mgr.add_request(rid, P) == 0
        mgr.allocate(rid, 12)
    assert mgr.block_table("a", 0) == [1, 2, 3]
    assert mgr.block_table("b", 0) == [4, 5, 6]
    mgr.commit_tokens("a", P)
    mgr.commit_tokens("b", P)
    assert mgr.block_table("b", 0) == [1, 2, 3]
    assert mgr.num_free_pages(0) == 4
    mgr.check_consistency()


def test_rollback_frees_rejected_draft_slots_and_keys_only_accepted_tokens(make):
    mgr = make(num_device_pages=8)
    mgr.add_request("a", [1, 2, 3])
    mgr.allocate("a", 3)
    mgr.commit_tokens("a", [1, 2, 3])
    mgr.allocate("a", 3 + 1 + 4)  # next token + 4 drafts: slots 3..7, pages [1, 2]
    mgr.allocate("a", 9)  # one more draft: page 3
    assert mgr.block_table("a", 0) == [1, 2, 3]
    mgr.commit_tokens("a", [4, 5])  # 2 accepted
    mgr.rollback("a", 4)  # 4 rejected: 5 slots left -> 2 pages
    assert mgr.block_table("a", 0) == [1, 2]
    stored = [e.token_ids for e in mgr.get_kv_cache_events() if e.kind == "stored"]
    assert stored == [(1, 2, 3, 4)]
    with pytest.raises(ValueError, match=r"num_tokens=1 must be an int in \[0, 0\]"):
        mgr.rollback("a", 1)
    mgr.check_consistency()


def test_stats_hit_rates(make, run):
    mgr = make(num_device_pages=8)
    run(mgr, "a", P)
    run(mgr, "b", P)
    s = mgr.stats
    assert (s.num_requests, s.prompt_tokens, s.reused_tokens) == (2, 24, 11)
    assert s.token_hit_rate == pytest.approx(11 / 24)
    assert s.block_hit_rate == pytest.approx(2 / 6)
    assert s.copied_pages == 1
