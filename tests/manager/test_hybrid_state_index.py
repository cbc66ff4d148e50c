"""The host index of recurrent-state snapshots: boundaries, slots, eviction order,
conversations and per_conversation turn limits, events, persistence."""

from __future__ import annotations

import pytest

from kvjax.config import ConfigError, KvCacheConfig, load_llm_config
from kvjax.manager.events import EventBuffer
from kvjax.manager.state_snapshots import NULL_SLOT, StateSnapshotIndex


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def index(num_live: int = 2, **mamba) -> StateSnapshotIndex:
    policy = mamba.pop("policy", "all_reusable")
    turns = mamba.pop("max_num_turns", 8)
    config = KvCacheConfig(
        tokens_per_block=16, block_reuse_config={"policy": policy, "max_num_turns": turns}, mamba_state_config=mamba
    )
    return StateSnapshotIndex(config, tokens_per_block=16, num_live=num_live)


def test_boundaries_all_reusable():
    idx = index(periodic_snapshot_interval=64, additional_snapshot_offsets_from_start=[40],
                additional_snapshot_offsets_from_end=[0, 20])
    # periodic 64, 128; start 40 -> 32; end: 150 -> 144, 130 -> 128
    assert idx.boundaries_in(0, 150, prompt_len=150) == [32, 64, 128, 144]
    assert idx.boundaries_in(64, 200, prompt_len=150) == [128, 144, 192]
    assert not idx.is_boundary(0, 150) and not idx.is_boundary(70, 150)


def test_per_conversation_ignores_the_periodic_interval():
    idx = index(policy="per_conversation", periodic_snapshot_interval=32, additional_snapshot_offsets_from_end=[0])
    assert idx.boundaries_in(0, 200, prompt_len=100) == [96]


def test_slots_are_disjoint_and_skip_the_null_slot():
    idx = index(num_live=2, max_snapshots=3)
    a = idx.start("a", [], 10)
    b = idx.start("b", [], 10)
    with pytest.raises(RuntimeError, match="all 2 live state slots are held"):
        idx.start("c", [], 10)
    slots = {a.slot, b.slot}
    for i in range(3):
        slots.add(idx.store("a", key(i), 16 * (i + 1)))
    assert slots == {1, 2, 3, 4, 5} and NULL_SLOT not in slots and idx.num_slots == 6
    assert idx.store("a", key(1), 32) is None  # already saved: no copy, marked used


def test_eviction_takes_orphans_first_then_least_recently_used():
    idx = index(max_snapshots=3)
    events = EventBuffer(100)
    cached = {key(0), key(1), key(2), key(3), key(4)}
    idx.bind(events, group=1, is_cached=lambda k: k in cached)
    idx.start("a", [], 100)
    slot0 = idx.store("a", key(0), 16)
    idx.store("a", key(1), 32)
    idx.store("a", key(2), 48)
    idx.restore(key(0))  # 0 is now the most recently used
    assert idx.store("a", key(3), 64) is not None
    assert not idx.has(key(1)) and idx.has(key(0))  # LRU victim: 1
    cached.discard(key(0))  # 0's block left the cache: it goes before the LRU one (2)
    assert idx.store("a", key(4), 80) == slot0
    assert not idx.has(key(0)) and idx.has(key(2))
    assert idx.stats["orphans_evicted"] == 1 and idx.stats["evicted"] == 2
    kinds = [(e.kind, e.block_key, e.state_snapshot, e.group) for e in events.drain()]
    assert kinds[:3] == [("stored", key(i), True, 1) for i in range(3)]
    assert ("removed", key(1), True, 1) in kinds and ("removed", key(0), True, 1) in kinds


def test_conversations_chain_and_per_conversation_keeps_the_last_turns():
    idx = index(policy="per_conversation", max_num_turns=2, additional_snapshot_offsets_from_end=[0])
    prompt_keys: list[bytes] = []
    for t in range(4):
        prompt_keys = prompt_keys + [key(10 * t + 1)]
        live = idx.start(f"t{t}", prompt_keys, 16 * len(prompt_keys))
        assert (live.conversation, live.turn) == (0, t + 1)
        idx.store(f"t{t}", key(10 * t + 1), 16 * len(prompt_keys))
        idx.end(f"t{t}", final_key=prompt_keys[-1])
    kept = sorted(s.turn for s in idx.snapshots())
    assert kept == [3, 4] and idx.stats["dropped_turns"] == 2
    other = idx.start("new", [key(999)], 16)
    assert (other.conversation, other.turn) == (1, 1)


def test_state_dict_round_trip():
    idx = index(max_snapshots=4)
    idx.start("a", [], 64)
    idx.store("a", key(7), 32)
    idx.store("a", key(8), 64)
    idx.end("a", final_key=key(8))
    restored = index(max_snapshots=4)
    restored.load_state_dict(idx.state_dict())
    assert [(s.key, s.slot, s.num_tokens) for s in restored.snapshots()] == [
        (s.key, s.slot, s.num_tokens) for s in idx.snapshots()
    ]
    assert restored.start("b", [key(8)], 80).turn == 2
    assert restored.store("b", key(9), 80) not in {s.slot for s in idx.snapshots()}
    with pytest.raises(ValueError, match="must be distinct"):
        index(max_snapshots=4).load_state_dict({**idx.state_dict(), "snapshots": [[key(1).hex(), 1, 16, 0, 1]]})


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(block_reuse_config={"policy": "per_conversation"}),
         "block_reuse_config.policy='per_conversation' turns periodic snapshots off"),
        (dict(block_reuse_config={"policy": "lru"}), r"block_reuse_config.policy='lru' must be one of"),
        (dict(block_reuse_config={"max_num_turns": 0}), "block_reuse_config.max_num_turns=0 must be an int >= 1"),
        (dict(mamba_state_config={"periodic_snapshot_interval": 48}),
         "mamba_state_config.periodic_snapshot_interval=48 must be a multiple of tokens_per_block=32"),
        (dict(mamba_state_config={"periodic_snapshot_interval": -32}),
         "mamba_state_config.periodic_snapshot_interval=-32 must be an int >= 0"),
        (dict(mamba_state_config={"additional_snapshot_offsets_from_end": [0, -1]}),
         r"mamba_state_config.additional_snapshot_offsets_from_end=\(0, -1\) must be a list of ints >= 0"),
        (dict(mamba_state_config={"additional_snapshot_offsets_from_start": 5}),
         "mamba_state_config.additional_snapshot_offsets_from_start=5 must be a list"),
        (dict(mamba_state_config={"max_snapshots": 0}), "mamba_state_config.max_snapshots=0 must be an int >= 1"),
        (dict(mamba_state_config={"interval": 64}), r"mamba_state_config: unknown field\(s\) \['interval'\]"),
        (dict(block_reuse_config="all_reusable"), "block_reuse_config='all_reusable' must be a BlockReuseConfig"),
    ],
)
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        KvCacheConfig(**fields)


def test_config_loads_from_yaml():
    kv, _ = load_llm_config(
        "kv_cache_config:\n  tokens_per_block: 16\n  block_reuse_config:\n    policy: per_conversation\n"
        "    max_num_turns: 3\n  mamba_state_config:\n    additional_snapshot_offsets_from_end: [0, 64]\n"
    )
    assert kv.block_reuse_config.policy == "per_conversation" and kv.block_reuse_config.max_num_turns == 3
    assert kv.mamba_state_config.additional_snapshot_offsets_from_end == (0, 64)
    assert kv.content_fields()["mamba_state_config"]["additional_snapshot_offsets_from_end"] == [0, 64]
