"""Block keys, tenant/adapter isolation, multimodal identifiers (B1, B9) and events (B8)."""

from __future__ import annotations

import blake3
import numpy as np
import pytest

from kvjax.config import KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import KeyExtras, MultimodalItem, block_key, mm_hash, root_key
from kvjax.manager.hashing import hash_items, items_in
from kvjax.manager.retention import block_priority

P = list(range(100, 112))


def test_block_keys_are_full_digests_chained_over_parent_tokens_and_extras():
    root = root_key(None, None)
    k = block_key(root, [1, 2, 3, 4], ())
    assert len(k) == 32
    assert k == block_key(root, [1, 2, 3, 4], ())
    assert k != block_key(root, [1, 2, 3, 5], ())
    assert k != block_key(block_key(root, [0] * 4, ()), [1, 2, 3, 4], ())
    item = hash_items([MultimodalItem("image", b"px", 1, 2)], 4)
    assert k != block_key(root, [1, 2, 3, 4], item)


def test_roots_separate_salts_and_adapters():
    roots = {root_key(s, lora) for s in (None, "", "tenant-a", "tenant-b") for lora in (None, 0, 1)}
    assert len(roots) == 12


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(cache_salt=""), r"cache_salt='' must be None or a non-empty str"),
        (dict(cache_salt=b"x"), r"cache_salt=b'x' must be None or a non-empty str"),
        (dict(lora_id=-1), r"lora_id=-1 must be None or an int >= 0"),
        (dict(lora_id=True), r"lora_id=True must be None or an int >= 0"),
        (dict(mm_items="image"), r"mm_items must be a sequence of MultimodalItem, got str"),
        (dict(mm_items=[b"x"]), r"mm_items\[0\] must be a MultimodalItem, got bytes"),
    ],
)
def test_key_extras_name_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        KeyExtras(**fields)


def test_key_extras_normalize_their_fields():
    extras = KeyExtras(lora_id=np.int64(3), mm_items=[MultimodalItem("image", b"x", 0, 1)])
    assert type(extras.lora_id) is int and isinstance(extras.mm_items, tuple)
    assert extras == KeyExtras(lora_id=3, mm_items=(MultimodalItem("image", b"x", 0, 1),))


def test_different_cache_salts_never_share_a_block(make, run):
    mgr = make(num_device_pages=16)
    run(mgr, "a", P, extras=KeyExtras(cache_salt="tenant-a"))
    assert mgr.estimate_reusable_tokens(P, extras=KeyExtras(cache_salt="tenant-b")) == 0
    assert mgr.estimate_reusable_tokens(P) == 0
    assert mgr.estimate_reusable_tokens(P, extras=KeyExtras(cache_salt="tenant-a")) == 11
    assert run(mgr, "b", P, extras=KeyExtras(cache_salt="tenant-b")) == 0
    assert mgr.num_cached_blocks(0) == 6


def test_lora_adapters_never_share_a_block(make, run):
    mgr = make(num_device_pages=16)
    run(mgr, "a", P, extras=KeyExtras(lora_id=1))
    assert mgr.estimate_reusable_tokens(P, extras=KeyExtras(lora_id=2)) == 0
    assert mgr.estimate_reusable_tokens(P, extras=KeyExtras(lora_id=1)) == 11


def test_mm_hash_is_blake3_of_content_or_of_uuid_and_content():
    plain = MultimodalItem("image", b"pixels", 0, 4)
    assert mm_hash(plain) == blake3.blake3(b"pixels").digest()
    same_uuid_other_content = mm_hash(MultimodalItem("image", b"other", 0, 4, uuid="u1"))
    assert len({mm_hash(plain), mm_hash(MultimodalItem("image", b"pixels", 0, 4, uuid="u1")),
                mm_hash(MultimodalItem("image", b"pixels", 0, 4, uuid="u2")), same_uuid_other_content}) == 4
    # the UUID is length-prefixed: ("ab", "c") and ("a", "bc") are different entries
    assert mm_hash(MultimodalItem("image", b"c", 0, 1, uuid="ab")) != mm_hash(
        MultimodalItem("image", b"bc", 0, 1, uuid="a")
    )


@pytest.mark.parametrize(
    "second, reused",
    [
        (dict(content=b"img", uuid="user-1"), 7),  # identical item: reused
        (dict(content=b"IMG", uuid="user-1"), 0),  # same UUID, different content
        (dict(content=b"img", uuid="user-2"), 0),  # same content, different UUID
        (dict(content=b"img", uuid=None), 0),  # content hash only
    ],
)
def test_multimodal_isolation(make, run, second, reused):
    mgr = make(num_device_pages=16)
    prompt = [1, 2, 9, 9, 9, 9, 3, 4]  # image placeholder tokens at [2, 6)
    run(mgr, "a", prompt, extras=KeyExtras(mm_items=[MultimodalItem("image", b"img", 2, 4, uuid="user-1")]))
    item = MultimodalItem("image", offset=2, length=4, **second)
    assert mgr.estimate_reusable_tokens(prompt, extras=KeyExtras(mm_items=[item])) == reused


def test_events_carry_uuid_or_content_hash(make):
    mgr = make(num_device_pages=16)
    items = [MultimodalItem("image", b"a", 0, 2, uuid="img-001"), MultimodalItem("video", b"v", 4, 2)]
    prompt = [9, 9, 1, 2, 8, 8, 3, 4, 5]
    mgr.add_request("a", prompt, extras=KeyExtras(mm_items=items))
    mgr.allocate("a", 9)
    mgr.commit_tokens("a", prompt)
    stored = [e for e in mgr.get_kv_cache_events() if e.kind == "stored"]
    assert [e.mm_ids for e in stored] == [("img-001",), (blake3.blake3(b"v").hexdigest(),)]


@pytest.mark.parametrize(
    "items, match",
    [
        ([MultimodalItem("image", b"x", 3, 3)], r"mm_items\[0\]: span \[3, 6\) must lie inside the prompt \[0, 5\)"),
        ([MultimodalItem("image", b"x", -1, 1)], r"mm_items\[0\]: offset=-1 must be an int >= 0"),
        ([MultimodalItem("", b"x", 0, 1)], r"mm_items\[0\]\.modality=''"),
        ([MultimodalItem("image", b"x", 0, 2), MultimodalItem("image", b"y", 1, 2)], r"overlap"),
    ],
)
def test_bad_multimodal_items_are_rejected(make, items, match):
    mgr = make()
    with pytest.raises(ValueError, match=match):
        mgr.add_request("a", [1, 2, 3, 4, 5], extras=KeyExtras(mm_items=items))
    assert mgr.request_ids() == []


def test_items_in_selects_overlapping_items():
    items = hash_items([MultimodalItem("image", b"x", 2, 4), MultimodalItem("audio", b"y", 8, 1)], 10)
    assert [it.offset for it in items_in(items, 0, 4)] == [2]
    assert [it.offset for it in items_in(items, 4, 8)] == [2]
    assert [it.offset for it in items_in(items, 8, 12)] == [8]


def test_block_priority_takes_the_highest_token_priority():
    r = KvCacheRetentionConfig(
        (TokenRangeRetentionConfig(0, 2, 10), TokenRangeRetentionConfig(2, 6, 90, duration_ms=50.0)),
        decode_retention_priority=60,
    )
    assert block_priority(r, 0, 2, 8) == (10, None)
    assert block_priority(r, 0, 4, 8) == (90, 50.0)
    assert block_priority(r, 6, 8, 8) == (35, None)  # uncovered prompt tokens: default
    assert block_priority(r, 8, 12, 8) == (60, None)  # generated tokens: decode priority
    to_end = KvCacheRetentionConfig((TokenRangeRetentionConfig(4, None, 70),), decode_retention_priority=20)
    assert block_priority(to_end, 8, 12, 8) == (70, None)  # token_end=None covers generated tokens


def test_event_kinds_and_fields(make, run):
    mgr = make(num_device_pages=3, host=1)
    run(mgr, "a", [1, 2, 3, 4, 0])
    (stored,) = mgr.get_kv_cache_events()
    assert (stored.kind, stored.token_ids, stored.priority, stored.tier, stored.group) == (
        "stored", (1, 2, 3, 4), 35, "device", 0)
    assert stored.parent_key == root_key(None, None) and len(stored.block_key) == 32
    mgr.add_request("b", [1, 2, 3, 4, 0], retention=KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, 80),)))
    (updated,) = mgr.get_kv_cache_events()
    assert (updated.kind, updated.priority, updated.block_key) == ("updated", 80, stored.block_key)
    mgr.free_request("b")
    mgr.clear_cache()
    (cleared,) = mgr.get_kv_cache_events()
    assert cleared.kind == "all_cleared" and cleared.block_key is None
    assert mgr.estimate_reusable_tokens([1, 2, 3, 4, 0]) == 0
    mgr.check_consistency()


def test_event_buffer_is_bounded_and_counts_dropped(make, run):
    mgr = make(num_device_pages=16, event_buffer_max_size=2)
    run(mgr, "a", P)  # 3 stored events
    events = mgr.get_kv_cache_events()
    assert [e.event_id for e in events] == [1, 2]
    assert mgr.num_dropped_events == 1
    off = make(num_device_pages=16, event_buffer_max_size=0)
    run(off, "a", P)
    assert off.get_kv_cache_events() == [] and off.num_dropped_events == 0


def test_tokens_of_a_matched_block_are_compared_not_only_the_digest(make, run):
    mgr = make(num_device_pages=16)
    run(mgr, "a", P)
    block = next(iter(mgr.pools[0].tree.blocks.values()))
    block.token_ids = (0, 0, 0, 0)  # simulate a digest collision with other tokens
    assert mgr.estimate_reusable_tokens(P) == 0
