"""The manager's whole host state as plain data (the host part of an engine snapshot),
and its invariants.

``state_dict`` returns JSON-compatible Python (dicts, lists, str, int, float, bool, None):
keys and digests as hex strings, retention expiries as seconds *remaining* (the clock is
process-local). ``check_header``, ``restore`` and ``check_restored`` (called by
``KVCacheManager.from_state_dict``, which builds the manager, installs what ``restore``
returns and checks it) refuse a snapshot whose format version, configuration or layout
differ, or whose contents break an invariant, with an error naming what is wrong.
``check_consistency`` is the invariant check shared by restore and tests.

This module reads the manager through its snapshot API (``sequences``, ``tick``,
``event_buffer``, ``pending_page_ops``, ``pools``) and never imports
``kvjax.manager.manager`` at run time (the manager imports it): the manager's type is named
for annotations only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvjax.config import KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager.events import KVCacheEvent
from kvjax.manager.hashing import HashedItem, InternalScope, root_key
from kvjax.manager.radix_tree import Block
from kvjax.manager.sequence import SequenceRecord, prompt_keys
from kvjax.manager.stats import RequestStats
from kvjax.manager.tiers import PageOp, Tier

if TYPE_CHECKING:
    from kvjax.manager.manager import KVCacheManager

FORMAT_VERSION = 4
"""3: the layout holds device pages and bytes per page of every group."""


class SnapshotError(ValueError):
    """A snapshot does not fit this manager (version, config, layout) or is damaged."""


class ConsistencyError(RuntimeError):
    """The manager's bookkeeping broke an invariant (a bug, or a damaged snapshot)."""


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What ``restore`` hands back for the manager to install: its active requests, its
    release clock and its queued page operations."""

    sequences: list[SequenceRecord]
    tick: int
    page_ops: list[PageOp]


def _layout(mgr: KVCacheManager) -> dict[str, Any]:
    """The manager's part of its layout: what its bookkeeping depends on."""
    layout = mgr.layout
    return {
        "layer_windows": list(layout.layer_windows),
        "num_device_pages": list(layout.num_pages),
        "num_host_pages": layout.num_host_pages,
        "num_disk_pages": layout.num_disk_pages,
        "max_seq_len": layout.max_seq_len,
        "bytes_per_page": [layout.bytes_per_page(g) for g in range(layout.num_groups)],
    }


def _items(items: tuple[HashedItem, ...]) -> list[list]:
    return [[it.offset, it.length, it.digest.hex(), it.label] for it in items]


def _load_items(rows: list[list]) -> tuple[HashedItem, ...]:
    return tuple(HashedItem(int(o), int(n), bytes.fromhex(d), str(label)) for o, n, d, label in rows)


def state_dict(mgr: KVCacheManager) -> dict[str, Any]:
    """Everything needed to resume: tree, references, priorities and expiries, every tier,
    free-list and eviction-queue order, sequences, pending page ops, events and stats."""
    now = mgr.clock()
    pools = []
    ids: list[dict[int, int]] = []
    for pool in mgr.pools:
        blocks = list(pool.tree.blocks.values())
        index = {id(b): i for i, b in enumerate(blocks)}
        ids.append(index)
        pools.append(
            {
                "device_free": pool.device_free.state(),
                "host_free": pool.host_free.state(),
                "disk_free": pool.disk_free.state(),
                "blocks": [
                    {
                        "page": b.page,
                        "tier": b.tier.label,
                        "ref_count": b.ref_count,
                        "key": _hex(b.key),
                        "parent_key": _hex(b.parent_key),
                        "token_ids": list(b.token_ids),
                        "items": _items(b.items),
                        "index": b.index,
                        "priority": b.priority,
                        "expires_in": None if b.expiry is None else b.expiry - now,
                        "last_used": b.last_used,
                    }
                    for b in blocks
                ],
                "device_queue": [index[id(b)] for b in pool.device_queue.ordered()],
                "host_queue": [index[id(b)] for b in pool.host_queue.ordered()],
                "disk_queue": [index[id(b)] for b in pool.disk_queue.ordered()],
            }
        )
    sequences = []
    for seq in mgr.sequences.values():
        per_group = []
        for g, held in enumerate(seq.blocks):
            per_group.append(
                [
                    None if b is None else ({"tree": ids[g][id(b)]} if b.key is not None else {"private": b.page})
                    for b in held
                ]
            )
        retention = dataclasses.asdict(seq.retention)
        retention["token_range_retention_configs"] = [
            dataclasses.asdict(r) for r in seq.retention.token_range_retention_configs
        ]
        sequences.append(
            {
                "request_id": seq.request_id,
                "prompt": list(seq.prompt),
                "tokens": list(seq.tokens),
                "num_allocated": seq.num_allocated,
                "retention": retention,
                "cache_salt": seq.cache_salt,
                "internal_scope": isinstance(seq.cache_salt, InternalScope),
                "lora_id": seq.lora_id,
                "items": _items(seq.items),
                "keys": [k.hex() for k in seq.keys],
                "blocks": per_group,
                "first_held": list(seq.first_held),
                "stats": dataclasses.asdict(seq.stats),
            }
        )
    events = mgr.event_buffer
    return {
        "format_version": FORMAT_VERSION,
        "config": mgr.config.content_fields(),
        "layout": _layout(mgr),
        "tick": mgr.tick,
        "pools": pools,
        "sequences": sequences,
        "page_ops": [op._asdict() for op in mgr.pending_page_ops()],
        "events": {
            "next_id": events.next_id,
            "num_dropped": events.num_dropped,
            "pending": [
                {**dataclasses.asdict(e), "block_key": _hex(e.block_key), "parent_key": _hex(e.parent_key),
                 "token_ids": list(e.token_ids), "mm_ids": list(e.mm_ids)}
                for e in events.peek()
            ],
        },
        "stats": dataclasses.asdict(mgr.stats),
    }


def _hex(key: bytes | None) -> str | None:
    return None if key is None else key.hex()


def _unhex(key: str | None) -> bytes | None:
    return None if key is None else bytes.fromhex(key)


def check_header(state: dict[str, Any]) -> None:
    """Refuses what is not a manager state dict of this format version."""
    if not isinstance(state, dict) or "format_version" not in state:
        raise SnapshotError("snapshot is not a KVCacheManager state dict (no 'format_version')")
    if state["format_version"] != FORMAT_VERSION:
        raise SnapshotError(
            f"snapshot format_version={state['format_version']!r}, this kvjax reads version {FORMAT_VERSION}"
        )


def restore(mgr: KVCacheManager, state: dict[str, Any]) -> Resumed:
    """Fills a new, empty manager's pools, events and counters from ``state_dict`` output and
    returns its requests, clock and page operations for it to install (see
    ``KVCacheManager.from_state_dict``, which then calls ``check_restored``).

    Raises:
      SnapshotError: another format version, config or layout, or damaged contents.
    """
    check_header(state)
    want = mgr.config.content_fields()
    got = state.get("config")
    if got != want:
        diff = sorted(k for k in set(want) | set(got or {}) if (got or {}).get(k) != want.get(k))
        raise SnapshotError(
            "snapshot was taken with a different KvCacheConfig; differing fields: "
            + ", ".join(f"{k} (snapshot {(got or {}).get(k)!r}, now {want.get(k)!r})" for k in diff)
        )
    if state.get("layout") != _layout(mgr):
        raise SnapshotError(f"snapshot layout {state.get('layout')!r} differs from this manager's {_layout(mgr)!r}")
    try:
        return _restore(mgr, state)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise SnapshotError(f"snapshot is damaged: {type(err).__name__}: {err}") from err


def check_restored(mgr: KVCacheManager) -> None:
    """``check_consistency`` of a manager just restored; a broken invariant is a damaged
    snapshot (``SnapshotError``)."""
    try:
        check_consistency(mgr)
    except ConsistencyError as err:
        raise SnapshotError(f"snapshot is damaged: {err}") from err


def _restore(mgr: KVCacheManager, state: dict[str, Any]) -> Resumed:
    now = mgr.clock()
    if len(state["pools"]) != len(mgr.pools):
        raise ValueError(f"{len(state['pools'])} pools in the snapshot, {len(mgr.pools)} layer groups here")
    all_blocks: list[list[Block]] = []
    for pool, saved in zip(mgr.pools, state["pools"]):
        pool.device_free.load_state(saved["device_free"])
        pool.host_free.load_state(saved["host_free"])
        pool.disk_free.load_state(saved["disk_free"])
        blocks = []
        for row in saved["blocks"]:
            block = Block(page=int(row["page"]), tier=Tier[row["tier"].upper()], ref_count=int(row["ref_count"]))
            block.priority = int(row["priority"])
            block.last_used = int(row["last_used"])
            if row["expires_in"] is not None:
                block.expiry = now + float(row["expires_in"])
            pool.tree.insert(
                block,
                bytes.fromhex(row["key"]),
                bytes.fromhex(row["parent_key"]),
                tuple(int(t) for t in row["token_ids"]),
                _load_items(row["items"]),
            )
            block.index = int(row["index"])
            blocks.append(block)
        for block in blocks:
            if pool.tree_rule and block.tier is Tier.DEVICE:
                parent = pool.tree.get(block.parent_key)
                if parent is not None:
                    parent.device_children += 1
            if block.tier is Tier.DEVICE and block.ref_count == 0:
                pool.num_free_cached += 1
            if block.expiry is not None:
                pool.expiry.push(block)
        for name, queue in (("device_queue", pool.device_queue), ("host_queue", pool.host_queue),
                            ("disk_queue", pool.disk_queue)):
            for i in saved[name]:
                queue.push(blocks[i])
        all_blocks.append(blocks)
    sequences = []
    for row in state["sequences"]:
        prompt = tuple(int(t) for t in row["prompt"])
        items = _load_items(row["items"])
        cache_salt, lora_id = row["cache_salt"], row["lora_id"]
        if row.get("internal_scope"):
            cache_salt = InternalScope(cache_salt)
        retention = dict(row["retention"])
        retention["token_range_retention_configs"] = tuple(
            TokenRangeRetentionConfig(**r) for r in retention["token_range_retention_configs"]
        )
        root = root_key(cache_salt, lora_id)
        per_group: list[list[Block | None]] = []
        for g, entries in enumerate(row["blocks"]):
            held: list[Block | None] = []
            for entry in entries:
                if entry is None:
                    held.append(None)
                elif "tree" in entry:
                    held.append(all_blocks[g][int(entry["tree"])])
                else:
                    held.append(Block(page=int(entry["private"]), ref_count=1))
            per_group.append(held)
        sequences.append(SequenceRecord(
            request_id=str(row["request_id"]),
            prompt=prompt,
            retention=KvCacheRetentionConfig(**retention),
            cache_salt=cache_salt,
            lora_id=lora_id,
            items=items,
            root=root,
            prompt_keys=prompt_keys(prompt, items, root, mgr.tokens_per_block, mgr.config.enable_block_reuse),
            tokens=[int(t) for t in row["tokens"]],
            num_allocated=int(row["num_allocated"]),
            keys=[bytes.fromhex(k) for k in row["keys"]],
            blocks=per_group,
            first_held=[int(f) for f in row["first_held"]],
            stats=RequestStats(**row["stats"]),
        ))
    events = state["events"]
    mgr.event_buffer.load(
        int(events["next_id"]),
        int(events["num_dropped"]),
        [
            KVCacheEvent(**dict(e, block_key=_unhex(e["block_key"]), parent_key=_unhex(e["parent_key"]),
                                token_ids=tuple(e["token_ids"]), mm_ids=tuple(e["mm_ids"])))
            for e in events["pending"]
        ],
    )
    for name, value in state["stats"].items():
        if not hasattr(mgr.stats, name):
            raise KeyError(f"unknown stats field {name!r}")
        setattr(mgr.stats, name, int(value))
    return Resumed(sequences, int(state["tick"]), [PageOp(**op) for op in state["page_ops"]])


def check_consistency(mgr: KVCacheManager) -> None:
    """Raises ConsistencyError at the first broken invariant.

    Checked: every page of every pool is free or owned by exactly one block; reference
    counts equal the sequences holding each block and only device blocks are held; the
    eviction queues hold exactly the evictable blocks; the tree's child index matches the
    parent keys; in full-attention groups every cached block's parent is cached, a device
    block's parent is on the device and each sequence holds an unbroken chain from its root;
    windowed groups hold nothing before ``first_held``; slot counts are ordered.
    """

    def fail(message: str) -> None:
        raise ConsistencyError(message)

    ps = mgr.tokens_per_block
    for g, pool in enumerate(mgr.pools):
        holders: dict[int, int] = {}
        private: list[Block] = []
        for seq in mgr.sequences.values():
            for b in seq.blocks[g]:
                if b is None:
                    continue
                holders[id(b)] = holders.get(id(b), 0) + 1
                if b.key is None:
                    private.append(b)
        device_pages = list(pool.device_free) + [b.page for b in private]
        tier_pages = {Tier.DEVICE: device_pages, Tier.HOST: list(pool.host_free), Tier.DISK: list(pool.disk_free)}
        num_free_cached = 0
        evictable = {"device": 0, "host": 0, "disk": 0}
        for key, b in pool.tree.blocks.items():
            if b.key != key:
                fail(f"group {g}: block filed under {key.hex()[:12]} has key {_hex(b.key)}")
            if b not in pool.tree.children(b.parent_key).values():
                fail(f"group {g}: block {key.hex()[:12]} missing from its parent's child index")
            if pool.tree.children_starting_with(b.parent_key, b.token_ids[0]).get(key) is not b:
                fail(f"group {g}: block {key.hex()[:12]} missing from the first-token index")
            if b.ref_count != holders.get(id(b), 0):
                fail(f"group {g}: block {key.hex()[:12]} ref_count={b.ref_count}, held by {holders.get(id(b), 0)}")
            tier_pages[b.tier].append(b.page)
            if b.ref_count and b.tier is not Tier.DEVICE:
                fail(f"group {g}: held block {key.hex()[:12]} is on the {b.tier.label} tier")
            if b.tier is Tier.DEVICE and b.ref_count == 0:
                num_free_cached += 1
            is_evictable = pool._evictable(b)
            if is_evictable != (b.queue_serial >= 0):
                fail(f"group {g}: block {key.hex()[:12]} evictable={is_evictable} but queued={b.queue_serial >= 0}")
            evictable[b.tier.label] += is_evictable
            if pool.tree_rule:
                parent = pool.tree.get(b.parent_key)
                if b.index > 0 and (parent is None or parent.index != b.index - 1):
                    fail(f"group {g}: block {key.hex()[:12]} (index {b.index}) has no cached parent")
                if b.index == 0 and parent is not None:
                    fail(f"group {g}: first block {key.hex()[:12]} has a cached parent")
                if parent is not None and parent.tier > b.tier:
                    fail(f"group {g}: {b.tier.label} block {key.hex()[:12]} has a {parent.tier.label} parent")
                children = pool.tree.children(b.key).values()
                if b.device_children != sum(1 for c in children if c.tier is Tier.DEVICE):
                    fail(f"group {g}: block {key.hex()[:12]} device_children={b.device_children} is wrong")
        for b in private:
            if b.ref_count != 1 or holders[id(b)] != 1 or b.tier is not Tier.DEVICE:
                fail(f"group {g}: private page {b.page} is shared or has ref_count={b.ref_count}")
        if sorted(device_pages) != list(range(1, pool.num_device_pages)):
            fail(f"group {g}: device pages leaked or double-owned: {sorted(device_pages)}")
        for tier, size in ((Tier.HOST, pool.num_host_pages), (Tier.DISK, pool.num_disk_pages)):
            if sorted(tier_pages[tier]) != list(range(size)):
                fail(f"group {g}: {tier.label} pages leaked or double-owned: {sorted(tier_pages[tier])}")
        if num_free_cached != pool.num_free_cached:
            fail(f"group {g}: num_free_cached={pool.num_free_cached}, counted {num_free_cached}")
        if (len(pool.device_queue), len(pool.host_queue), len(pool.disk_queue)) != tuple(evictable.values()):
            fail(f"group {g}: eviction queue sizes do not match the evictable blocks")
    for seq in mgr.sequences.values():
        n = len(seq.tokens)
        if not n <= seq.num_allocated <= mgr.max_seq_len:
            fail(f"{seq.request_id!r}: committed {n} > allocated {seq.num_allocated} or beyond max_seq_len")
        for g, (pool, blocks) in enumerate(zip(mgr.pools, seq.blocks)):
            if len(blocks) != -(-seq.num_allocated // ps):
                fail(f"{seq.request_id!r} group {g}: {len(blocks)} blocks for {seq.num_allocated} slots")
            if any(b is not None for b in blocks[: seq.first_held[g]]):
                fail(f"{seq.request_id!r} group {g}: holds a block before first_held={seq.first_held[g]}")
            if pool.tree_rule and mgr.config.enable_block_reuse:
                for i in range(n // ps):
                    b = blocks[i]
                    if b is None or b.key != seq.keys[i]:
                        fail(f"{seq.request_id!r} group {g}: committed block {i} is not the tree block of its key")
    stats = mgr.stats
    if not (0 <= stats.reused_tokens <= stats.prompt_tokens and 0 <= stats.reused_blocks <= stats.prompt_blocks):
        fail(f"stats: reused counts exceed prompt counts: {stats}")
    for seq in mgr.sequences.values():
        if seq.stats.reused_tokens > seq.stats.prompt_tokens - 1:
            fail(f"{seq.request_id!r}: reused {seq.stats.reused_tokens} of {seq.stats.prompt_tokens} prompt tokens")


__all__ = [
    "FORMAT_VERSION",
    "ConsistencyError",
    "Resumed",
    "SnapshotError",
    "check_consistency",
    "check_header",
    "check_restored",
    "restore",
    "state_dict",
]
