"""``KVCacheManager``: host-side bookkeeping of the paged KV cache with cross-request reuse.

The manager decides which page holds which tokens; it never touches KV values. Per step the
engine calls ``allocate``, executes ``take_page_ops()`` in order, runs the forward pass over
``block_table(...)`` and reports written tokens with ``commit_tokens``.

Its parts, one concern each: ``sequence`` (the record of one request), ``planning`` (which
cached blocks a prompt can reuse, ``add_request``'s plan), ``block_pool`` (one layer group's
pages, tree, tiers and eviction) and ``bookkeeping`` (this manager's state as plain data and
its invariants, read and restored through its snapshot API: ``sequences``, ``tick``,
``event_buffer``, ``pending_page_ops``).
Blocks entirely before a windowed group's window are released as the sequence grows (a
windowed layer's memory is bounded by its window, not the sequence) and show ``NULL_PAGE``
in the block table.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvjax.cache import NULL_PAGE, CacheLayout
from kvjax.config import DEFAULT_PRIORITY, KvCacheConfig, KvCacheRetentionConfig, as_retention_config
from kvjax.manager import bookkeeping
from kvjax.manager.block_pool import BlockPool
from kvjax.manager.events import EventBuffer, KVCacheEvent
from kvjax.manager.hashing import (
    NO_EXTRAS,
    BlockKey,
    HashedItem,
    KeyExtras,
    block_key,
    check_extras,
    check_token_ids,
    hash_items,
    items_in,
)
from kvjax.manager.interface import LayoutGeometry, OutOfPagesError
from kvjax.manager.planning import GroupPlan, ReusePlan, first_in_window, fits, plan_reuse
from kvjax.manager.radix_tree import Block
from kvjax.manager.retention import block_priority
from kvjax.manager.sequence import SequenceRecord, committed_ids, prompt_keys
from kvjax.manager.stats import CacheStats, RequestStats
from kvjax.manager.tiers import PageOp, Tier

if TYPE_CHECKING:
    from kvjax.manager.state_snapshots import StateSnapshotIndex


_PROMPT_MEMO_SIZE = 256
"""Prompts whose validation and block keys are remembered: the scheduler asks for the keys,
then the reusable estimate, then admits, all for one prompt, and each would hash it again."""


class KVCacheManager(LayoutGeometry):
    """Paged KV cache bookkeeping with radix-tree reuse, priority-LRU eviction and host / disk offload.

    Args:
      config: the cache policy (reuse, partial reuse, offload threshold, events, ...).
      layout: the cache geometry (``CacheLayout.for_model``): layer windows, device pages per
        group (``NULL_PAGE`` included), host and disk pages per group, ``max_seq_len``, the
        page size and the bytes of a page of each group (only counted). Its ``tokens_per_block``
        must equal ``config.tokens_per_block``.
      clock: seconds, monotonic; drives retention durations (inject a fake one in tests).
    """

    def __init__(
        self,
        config: KvCacheConfig,
        layout: CacheLayout,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, KvCacheConfig):
            raise TypeError(f"config must be a KvCacheConfig, got {type(config).__name__}")
        if not isinstance(layout, CacheLayout):
            raise TypeError(f"layout must be a CacheLayout, got {type(layout).__name__}")
        if layout.tokens_per_block != config.tokens_per_block:
            raise ValueError(
                f"layout.tokens_per_block={layout.tokens_per_block} must equal "
                f"config.tokens_per_block={config.tokens_per_block}; "
                "build the layout from this config (CacheLayout.for_model)"
            )
        self.config = config
        self.layout = layout
        self.clock = clock
        self._ops: list[PageOp] = []
        self._events = EventBuffer(config.event_buffer_max_size)
        self._stats = CacheStats()
        self._tick = 0
        self._sequences: dict[str, SequenceRecord] = {}
        self._prompt_memo: dict[tuple, tuple[tuple[int, ...], BlockKey, list[BlockKey]]] = {}
        """(prompt, key extras) -> (validated prompt, root key, block keys); no mm items."""
        self._roots: dict[tuple[str | None, int | None], BlockKey] = {}
        self.pools: tuple[BlockPool, ...] = tuple(
            BlockPool(
                group=g,
                window=w,
                tree_rule=w >= layout.max_seq_len,
                num_device_pages=layout.num_pages[g],
                num_host_pages=layout.num_host_pages,
                num_disk_pages=layout.num_disk_pages,
                tokens_per_block=layout.tokens_per_block,
                offload_min_priority=config.secondary_offload_min_priority,
                bytes_per_page=layout.bytes_per_page(g),
                ops=self._ops,
                events=self._events,
                stats=self._stats,
            )
            for g, w in enumerate(self.group_windows)
        )
        self._windowed = tuple(g for g, pool in enumerate(self.pools) if not pool.tree_rule)
        """Groups that release blocks outside their window as sequences grow."""
        self.state_snapshots: StateSnapshotIndex | None = None
        """A hybrid model's recurrent-state snapshots (``attach_state_snapshots``); None otherwise."""

    # ================================================================== queries

    @property
    def stats(self) -> CacheStats:
        """Cumulative counters (live object)."""
        return self._stats

    @property
    def num_dropped_events(self) -> int:
        """Events lost because the buffer was full."""
        return self._events.num_dropped

    def request_stats(self, request_id: str) -> RequestStats:
        return self._seq(request_id).stats

    def request_ids(self) -> list[str]:
        return list(self._sequences)

    def num_free_pages(self, group: int) -> int:
        """Device pages of ``group`` that can be handed out now: free pages plus cached blocks
        no request holds (evicted on demand)."""
        return self._pool(group).num_available()

    def num_cached_blocks(self, group: int, tier: str = "device") -> int:
        """Tree blocks of ``group`` on ``tier`` ("device", "host" or "disk")."""
        want = Tier[tier.upper()]
        return sum(1 for b in self._pool(group).tree.blocks.values() if b.tier is want)

    def num_tokens(self, request_id: str) -> int:
        """Committed tokens of a request (reused prefix included)."""
        return len(self._seq(request_id).tokens)

    def block_table(self, request_id: str, group: int) -> list[int]:
        """Device page ids of the request in ``group``, one per block; NULL_PAGE for blocks
        released outside a window."""
        pool = self._pool(group)
        return [NULL_PAGE if b is None else b.page for b in self._seq(request_id).blocks[pool.group]]

    def take_page_ops(self) -> list[PageOp]:
        """Drains the queued page operations; execute them in order before the next forward."""
        ops = self._ops[:]
        self._ops.clear()
        return ops

    def get_kv_cache_events(self) -> list[KVCacheEvent]:
        """Drains the event buffer (empty when event_buffer_max_size is 0)."""
        return self._events.drain()

    def estimate_reusable_tokens(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> int:
        """Tokens ``add_request`` would reuse right now (no side effects)."""
        prompt, items, root, keys = self._prepare(prompt_token_ids, extras)
        plan = self._plan(prompt, keys, root, items)
        return plan.num_tokens if fits(self.pools, plan) else 0

    def reusable_tiers(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> list[str]:
        """Where the full blocks ``add_request`` would reuse right now live (no side effects):
        one tier name ("device", "host" or "disk") per reused full block, in prompt order; a
        block held in several layer groups counts at its slowest tier."""
        prompt, items, root, keys = self._prepare(prompt_token_ids, extras)
        plan = self._plan(prompt, keys, root, items)
        return plan.slowest_tiers() if fits(self.pools, plan) else []

    def prompt_block_keys(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> list[BlockKey]:
        """Keys of the prompt's full blocks (empty with enable_block_reuse=False)."""
        return list(self._prepare(prompt_token_ids, extras)[3])

    # ================================================================== request life cycle

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        extras: KeyExtras = NO_EXTRAS,
        *,
        retention: KvCacheRetentionConfig | None = None,
        admit: Callable[[int], bool] | None = None,
    ) -> int | None:
        """Registers a request and reserves its reusable prefix; returns the reused token count.

        Host blocks of the prefix are onboarded and a partially matching last block is copied
        (page ops queued). If a group lacks the pages for that, the request starts without
        reuse rather than failing. ``admit`` (see ``CacheManager.add_request``) may decline the
        request once its reusable tokens are known: then nothing is registered and it returns None.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        if request_id in self._sequences:
            raise ValueError(f"request_id={request_id!r} is already active; free it first or pick a new id")
        retention = as_retention_config(retention)
        prompt, items, root, keys = self._prepare(prompt_token_ids, extras)
        self._expire()
        plan = self._plan(prompt, keys, root, items)
        if not fits(self.pools, plan):
            plan = ReusePlan.none(len(self.pools))
        if admit is not None and not admit(plan.num_tokens):
            return None
        stats = RequestStats(
            prompt_tokens=len(prompt),
            reused_tokens=plan.num_tokens,
            prompt_blocks=len(prompt) // self.tokens_per_block,
            reused_blocks=plan.num_full_blocks,
        )
        seq = SequenceRecord(
            request_id=request_id,
            prompt=prompt,
            retention=retention,
            cache_salt=extras.cache_salt,
            lora_id=extras.lora_id,
            items=items,
            root=root,
            prompt_keys=keys,
            tokens=list(prompt[: plan.num_tokens]),
            num_allocated=plan.num_tokens,
            keys=keys[: plan.num_full_blocks],
            blocks=[],
            first_held=[],
            stats=stats,
        )
        onboarded, copied = self._stats.onboarded_pages, self._stats.copied_pages
        now = self.clock()
        for pool, gp in zip(self.pools, plan.groups):
            seq.blocks.append(self._reserve(pool, gp, plan, seq, now))
            seq.first_held.append(gp.first)
        stats.onboarded_pages = self._stats.onboarded_pages - onboarded
        stats.copied_pages = self._stats.copied_pages - copied
        self._stats.add_request(stats)
        self._sequences[request_id] = seq
        return plan.num_tokens

    def allocate(self, request_id: str, num_total_tokens: int) -> None:
        """Makes sure the request has a cache slot for each of its first ``num_total_tokens`` tokens.

        Raises:
          OutOfPagesError: a group lacks free or evictable pages (nothing changed).
        """
        seq = self._seq(request_id)
        self.check_num_tokens(num_total_tokens)
        if num_total_tokens <= seq.num_allocated:
            return
        num_blocks = -(-num_total_tokens // self.tokens_per_block)
        for blocks in seq.blocks:
            if len(blocks) < num_blocks:
                break
        else:  # the new tokens fit in the blocks held (most decode steps)
            seq.num_allocated = num_total_tokens
            return
        for pool, blocks in zip(self.pools, seq.blocks):
            need = num_blocks - len(blocks)
            if need > pool.num_available():
                raise OutOfPagesError(
                    f"request {request_id!r} needs {need} more page(s) in layer group {pool.group} "
                    f"(window {pool.window}) for num_total_tokens={num_total_tokens}, but only "
                    f"{pool.num_available()} of {pool.num_device_pages - 1} are free or evictable; "
                    "free or preempt a request, or give the cache more pages"
                )
        self._expire()
        for pool, blocks in zip(self.pools, seq.blocks):
            while len(blocks) < num_blocks:
                block = pool.new_block()
                block.ref_count = 1
                blocks.append(block)
        seq.num_allocated = num_total_tokens

    def allocate_drafts(self, request_id: str, num_total_tokens: int) -> int:
        """Cache slots for speculative draft tokens, up to ``num_total_tokens``, from free pages only.

        Unlike ``allocate`` it never evicts a cached block and never fails: a draft may be
        rejected, and a block evicted to hold a rejected draft would be a hit lost to a later
        request. It grants what the pages already held and the free pages allow; the granted
        slots are uncommitted (commit the accepted drafts, ``rollback`` the rest).

        Returns:
          The request's slot count afterwards, in [its slot count before, max(that, num_total_tokens)].
        """
        seq = self._seq(request_id)
        self.check_num_tokens(num_total_tokens)
        if num_total_tokens <= seq.num_allocated:
            return seq.num_allocated
        held = len(seq.blocks[0])
        extra = max(
            0, min([-(-num_total_tokens // self.tokens_per_block) - held] + [len(p.device_free) for p in self.pools])
        )
        for pool, blocks in zip(self.pools, seq.blocks):
            for _ in range(extra):
                block = pool.new_block()
                block.ref_count = 1
                blocks.append(block)
        seq.num_allocated = max(seq.num_allocated, min(num_total_tokens, (held + extra) * self.tokens_per_block))
        return seq.num_allocated

    def commit_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Records that these tokens' KV is written (a prompt chunk or generated tokens).

        Each block that becomes full is keyed and inserted into the tree of every group that
        still holds it (event "stored"); windowed groups then release blocks that fell out of
        the window.
        """
        seq = self._seq(request_id)
        tokens = committed_ids(seq, token_ids)
        n0 = len(seq.tokens)
        n1 = n0 + len(tokens)
        if n1 > seq.num_allocated:
            raise ValueError(
                f"committing {len(tokens)} token(s) to request {request_id!r} would reach {n1} tokens, but only "
                f"{seq.num_allocated} have slots; call allocate(request_id, {n1}) first"
            )
        prompt_part = seq.prompt[n0 : min(n1, len(seq.prompt))]
        if tokens[: len(prompt_part)] != prompt_part:
            bad = next(i for i, (a, b) in enumerate(zip(tokens, prompt_part)) if a != b)
            raise ValueError(
                f"token_ids[{bad}]={tokens[bad]} differs from prompt token {prompt_part[bad]} at position {n0 + bad}; "
                "prompt chunks must be committed in order"
            )
        self._expire()
        seq.tokens.extend(tokens)
        ps = self.tokens_per_block
        if self.config.enable_block_reuse and n1 // ps > n0 // ps:
            now = self.clock()
            for b in range(n0 // ps, n1 // ps):
                self._store_block(seq, b, now)
        for g in self._windowed:
            pool, blocks = self.pools[g], seq.blocks[g]
            first = min(first_in_window(pool, n1), len(blocks))
            for b in range(seq.first_held[g], first):
                held = blocks[b]
                if held is not None:
                    self._tick += 1
                    pool.release(held, self._tick)
                    blocks[b] = None
            seq.first_held[g] = max(seq.first_held[g], first)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Drops the slots of the last ``num_tokens`` uncommitted tokens (rejected drafts).

        Only committed tokens ever enter reusable blocks, so nothing cached changes and no
        event is emitted; pages that no longer hold any slot return to the free list, and a
        partly filled last page keeps only its committed and remaining slots.
        """
        seq = self._seq(request_id)
        pending = seq.num_allocated - len(seq.tokens)
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= pending:
            raise ValueError(
                f"num_tokens={num_tokens!r} must be an int in [0, {pending}] (uncommitted slots of {request_id!r})"
            )
        seq.num_allocated -= num_tokens
        num_blocks = -(-seq.num_allocated // self.tokens_per_block)
        for pool, blocks in zip(self.pools, seq.blocks):
            while len(blocks) > num_blocks:
                block = blocks.pop()
                assert block is not None, "a slot past the committed tokens is held"
                self._tick += 1
                pool.release(block, self._tick)

    def free_request(self, request_id: str) -> None:
        """Drops the request's references. Its full blocks stay cached and matchable until
        evicted (with enable_block_reuse=False nothing is cached and every page is freed).
        Blocks are released tail first, so a sequence's last blocks are evicted first."""
        seq = self._seq(request_id)
        for pool, blocks in zip(self.pools, seq.blocks):
            for block in reversed(blocks):
                if block is not None:
                    self._tick += 1
                    pool.release(block, self._tick)
        del self._sequences[request_id]

    def attach_state_snapshots(self, snapshots: StateSnapshotIndex) -> None:
        """Hybrid models: reuse stops at the deepest block boundary of the cached prefix that
        has a recurrent-state snapshot, since the recurrent layers can resume only from a
        saved state (partial reuse is off: states exist only at block boundaries); snapshot
        events enter this manager's buffer as the group after the attention groups."""
        snapshots.bind(self._events, len(self.pools), lambda key: any(key in pool.tree.blocks for pool in self.pools))
        self.state_snapshots = snapshots

    def attach_disk_check(self, check: Callable[[int, int], bool]) -> None:
        """Sets the disk tier's page check, ``check(group, page) -> intact``: a disk block is
        reused only after its page passes it, and dropped (then recomputed) when it fails."""
        for pool in self.pools:
            pool.disk_check = check

    def drop_lost_disk_blocks(self) -> int:
        """Checks every unreferenced disk block's page and drops the lost ones (before a
        snapshot saves the tier); returns how many blocks were dropped, subtrees included."""
        before = sum(len(pool.tree.blocks) for pool in self.pools)
        for pool in self.pools:
            for block in [b for b in pool.tree.blocks.values() if b.tier is Tier.DISK]:
                if block.key in pool.tree.blocks and block.ref_count == 0:
                    pool.intact(block)
        return before - sum(len(pool.tree.blocks) for pool in self.pools)

    def demote_cached(self, tier: str) -> int:
        """Moves every unreferenced cached block of the device tier down to ``tier`` ("host",
        or "disk": through the host tier), as eviction would move it; the page operations are
        queued like any others. Blocks a tier cannot take are dropped. Returns the blocks
        moved or dropped (all groups).

        Raises:
          ValueError: ``tier`` is not "host" or "disk", or the engine has no such tier.
        """
        have = {"host": self.layout.num_host_pages, "disk": self.layout.num_disk_pages}
        if tier not in have or not have[tier]:
            raise ValueError(
                f"tier={tier!r} must be 'host' or 'disk', a tier of this cache (pages: host {have['host']}, "
                f"disk {have['disk']}; kv_cache_config.host_cache_size / disk_cache_size)"
            )
        return sum(pool.demote_cached(to_disk=tier == "disk") for pool in self.pools)

    def clear_cache(self) -> None:
        """Forgets every cached block (event "all_cleared" per group); no request may be active."""
        if self._sequences:
            raise RuntimeError(
                f"clear_cache() needs no active requests, {len(self._sequences)} are active "
                f"(e.g. {next(iter(self._sequences))!r}); free them first"
            )
        for pool in self.pools:
            pool.clear()
            if self._events.enabled:
                self._events.append("all_cleared", pool.group, pool.window)
        self._ops.clear()

    # ================================================================== snapshots

    @property
    def sequences(self) -> Mapping[str, SequenceRecord]:
        """The active requests' records by id (a read-only view; ``kvjax.manager.bookkeeping``)."""
        return types.MappingProxyType(self._sequences)

    @property
    def tick(self) -> int:
        """Block releases so far: the eviction order's clock."""
        return self._tick

    @property
    def event_buffer(self) -> EventBuffer:
        """The KV cache events not yet drained (``get_kv_cache_events``)."""
        return self._events

    def pending_page_ops(self) -> list[PageOp]:
        """The queued page operations, not drained (``take_page_ops`` drains them)."""
        return list(self._ops)

    def state_dict(self) -> dict:
        """The whole host state as JSON-compatible data (see ``kvjax.manager.bookkeeping``)."""
        return bookkeeping.state_dict(self)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: dict,
        config: KvCacheConfig,
        layout: CacheLayout,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> KVCacheManager:
        """A manager restored from ``state_dict()``.

        Raises:
          SnapshotError: wrong format version, a different config or layout, or damaged contents.
        """
        bookkeeping.check_header(state_dict)
        mgr = cls(config, layout, clock=clock)
        resumed = bookkeeping.restore(mgr, state_dict)
        mgr._sequences.update((seq.request_id, seq) for seq in resumed.sequences)
        mgr._tick = resumed.tick
        mgr._ops.extend(resumed.page_ops)
        bookkeeping.check_restored(mgr)
        return mgr

    def check_consistency(self) -> None:
        """Raises ConsistencyError if any bookkeeping invariant is broken (O(cache size))."""
        bookkeeping.check_consistency(self)

    # ================================================================== internals: validation

    def _seq(self, request_id: str) -> SequenceRecord:
        seq = self._sequences.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request_id={request_id!r}; active: {sorted(self._sequences)[:8]}")
        return seq

    def _pool(self, group: int) -> BlockPool:
        if not isinstance(group, int) or not 0 <= group < len(self.pools):
            raise ValueError(f"group={group!r} must be an int in [0, {len(self.pools) - 1}]")
        return self.pools[group]

    def _prepare(
        self,
        prompt_token_ids: Sequence[int],
        extras: KeyExtras,
    ) -> tuple[tuple[int, ...], tuple[HashedItem, ...], BlockKey, list[BlockKey]]:
        """Validates a prompt and computes its block keys: (prompt, items, root key, keys).

        Prompts without multimodal items are remembered (the last ``_PROMPT_MEMO_SIZE``), so
        the scheduler's key lookup, estimate and admission validate and hash a prompt once.
        The returned key list is shared with the memo: do not mutate it.
        """
        check_extras(extras)
        memo_key = None
        if not extras.mm_items and type(prompt_token_ids) is tuple:
            memo_key = (prompt_token_ids, extras)
            try:
                hit = self._prompt_memo.get(memo_key)
            except TypeError:  # unhashable ids: let validation name them
                hit = memo_key = None
            if hit is not None:
                return hit[0], (), hit[1], hit[2]
        prompt = check_token_ids(prompt_token_ids, "prompt_token_ids")
        if not 1 <= len(prompt) <= self.max_seq_len:
            raise ValueError(f"len(prompt_token_ids)={len(prompt)} must be in [1, max_seq_len={self.max_seq_len}]")
        items = hash_items(extras.mm_items, len(prompt)) if extras.mm_items else ()
        root = self._root(extras)
        keys = prompt_keys(prompt, items, root, self.tokens_per_block, self.config.enable_block_reuse)
        if memo_key is not None:
            if len(self._prompt_memo) >= _PROMPT_MEMO_SIZE:
                del self._prompt_memo[next(iter(self._prompt_memo))]
            self._prompt_memo[memo_key] = (prompt, root, keys)
        return prompt, items, root, keys

    def _root(self, extras: KeyExtras) -> BlockKey:
        """The request root key (memoized: tenants and adapters are few)."""
        scope = (extras.cache_salt, extras.lora_id)
        root = self._roots.get(scope)
        if root is None:
            root = self._roots[scope] = extras.root()
        return root

    # ================================================================== internals: reuse

    def _plan(
        self, prompt: tuple[int, ...], keys: list[BlockKey], root: BlockKey, items: tuple[HashedItem, ...]
    ) -> ReusePlan:
        """The longest prefix every group can provide now (``kvjax.manager.planning``)."""
        return plan_reuse(self.pools, self.config, prompt, keys, root, items, self.state_snapshots)

    def _reserve(
        self, pool: BlockPool, gp: GroupPlan, plan: ReusePlan, seq: SequenceRecord, now: float
    ) -> list[Block | None]:
        """Takes the references (and queues onboards/copies) of one group's part of the plan."""
        for block in gp.held:
            pool.acquire(block)
        if gp.source is not None:
            pool.acquire(gp.source)
        blocks: list[Block | None] = [None] * gp.first
        for b, block in enumerate(gp.held, start=gp.first):
            if block.tier is not Tier.DEVICE:
                pool.onboard(block)
            self._set_priority(pool, block, seq, b, now)
            blocks.append(block)
        if gp.source is not None:
            if gp.in_place:
                pool.take_in_place(gp.source)
                blocks.append(gp.source)
            else:
                block = pool.copy_prefix(gp.source)
                block.ref_count = 1
                pool.release(gp.source, None)
                blocks.append(block)
        return blocks

    def _set_priority(self, pool: BlockPool, block: Block, seq: SequenceRecord, b: int, now: float) -> None:
        priority, duration_ms = block_priority(
            seq.retention, b * self.tokens_per_block, (b + 1) * self.tokens_per_block, len(seq.prompt)
        )
        expiry = None if duration_ms is None else now + duration_ms / 1000.0
        pool.set_priority(block, priority, expiry)
        if expiry is not None:
            pool.expiry.push(block)

    def _store_block(self, seq: SequenceRecord, b: int, now: float) -> None:
        """Keys full block ``b`` of a sequence and inserts it in every group holding it."""
        ps = self.tokens_per_block
        parent = seq.keys[b - 1] if b else seq.root
        tokens = tuple(seq.tokens[b * ps : (b + 1) * ps])
        items = items_in(seq.items, b * ps, (b + 1) * ps) if seq.items else ()
        key = seq.prompt_keys[b] if b < len(seq.prompt_keys) else block_key(parent, tokens, items)
        seq.keys.append(key)
        priority, duration_ms = block_priority(seq.retention, b * ps, (b + 1) * ps, len(seq.prompt))
        expiry = None if duration_ms is None else now + duration_ms / 1000.0
        for pool, blocks in zip(self.pools, seq.blocks):
            block = blocks[b]
            if block is None or block.key is not None:
                continue
            stored = pool.store(block, key, parent, tokens, items, b, priority, expiry)
            blocks[b] = stored
            if expiry is not None:
                pool.expiry.push(stored)

    def _expire(self) -> None:
        """Returns blocks whose retention duration ran out to the default priority."""
        now = None
        for pool in self.pools:
            if not pool.expiry:
                continue
            if now is None:
                now = self.clock()
            for block in pool.expiry.pop_expired(now, _in_tree):
                pool.set_priority(block, DEFAULT_PRIORITY, None)
            if len(pool.expiry) > 2 * len(pool.tree) + 64:
                pool.expiry.compact(_in_tree)


def _in_tree(block: Block) -> bool:
    return block.key is not None
