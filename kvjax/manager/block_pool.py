"""The blocks of one layer group: device, host and disk page pools, radix tree, eviction.

Each layer group (one per distinct attention window) owns a ``BlockPool``; groups never
share pages. A device page is in exactly one of three states::

    free list ──allocate──► private block ──fills, committed──► tree block (ref > 0)
        ▲                        │ dropped                          │ last ref dropped
        └────────────────────────┴──────────◄── evicted ◄── tree block (ref 0, queued)

Eviction rules and their reasons:

* Only blocks with ``ref_count == 0`` are evictable: a block in use is never overwritten.
* Full-attention groups evict **leaves before parents**. A block is a prefix of its
  descendants, which are useless without it, so a device block is evictable only when no
  child sits on the device, a host block only when no child sits on the host (children on
  the disk tier may stay), and a disk block only when it has no children at all. Hence a
  cached block's parent is always cached and on the same or a faster tier. When a block
  is dropped instead of moved down a tier, its (slower-tier) descendants are dropped with it.
* Tiers below the device are LRU caches of their own: a host victim spills to the disk tier
  (when there is one and its priority allows offloading), a disk victim is dropped.
* Windowed groups evict in plain priority-LRU order: a reuse there needs only the blocks
  inside the window of the match end, so an old parent is worth less than its child.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from kvjax.manager.events import EventBuffer, EventKind
from kvjax.manager.eviction import EvictionQueue
from kvjax.manager.hashing import BlockKey, HashedItem
from kvjax.manager.radix_tree import Block, RadixTree
from kvjax.manager.retention import ExpiryQueue
from kvjax.manager.stats import CacheStats
from kvjax.manager.tiers import PageOp, PageOpKind, Tier, should_offload


class FreeList:
    """The free page ids of one pool, handed out first in, first out.

    Ids never handed out are a range ``[next, stop)`` rather than entries, so an empty pool of
    any size costs no memory per page; returned ids queue behind that range (the order of a
    deque that starts as ``range(start, stop)``).

    Args:
      start, stop: the pool's first and past-the-last page id.
    """

    __slots__ = ("next", "returned", "stop")

    def __init__(self, start: int, stop: int) -> None:
        self.next = start
        self.stop = max(start, stop)
        self.returned: collections.deque[int] = collections.deque()

    def __len__(self) -> int:
        return self.stop - self.next + len(self.returned)

    def __bool__(self) -> bool:
        return self.next < self.stop or bool(self.returned)

    def __iter__(self) -> Iterator[int]:
        yield from range(self.next, self.stop)
        yield from self.returned

    def popleft(self) -> int:
        if self.next < self.stop:
            self.next += 1
            return self.next - 1
        return self.returned.popleft()

    def append(self, page: int) -> None:
        self.returned.append(page)

    def state(self) -> list:
        """[next, stop, returned ids] (``load_state`` reads it back)."""
        return [self.next, self.stop, list(self.returned)]

    def load_state(self, state: list) -> None:
        next_, stop, returned = state
        self.next, self.stop = int(next_), int(stop)
        self.returned = collections.deque(int(p) for p in returned)


class BlockPool:
    """Pages, tree and free-block queues of one layer group.

    Args:
      group: layer-group index; window: its attention window in tokens.
      tree_rule: True for full-attention groups (leaves-before-parents eviction).
      num_device_pages: device pool size, the null page included.
      num_host_pages: host pool size (0 = no offload).
      num_disk_pages: disk pool size (0 = host victims are dropped); needs a host tier.
      tokens_per_block: tokens per page (the layout's ``tokens_per_block``).
      offload_min_priority: ``secondary_offload_min_priority``.
      bytes_per_page: bytes moved by one page operation (0 = not counted).
      ops, events, stats: shared with the manager (page-op queue, event buffer, counters).
    """

    def __init__(
        self,
        *,
        group: int,
        window: int,
        tree_rule: bool,
        num_device_pages: int,
        num_host_pages: int,
        num_disk_pages: int = 0,
        tokens_per_block: int,
        offload_min_priority: int,
        bytes_per_page: int,
        ops: list[PageOp],
        events: EventBuffer,
        stats: CacheStats,
    ) -> None:
        self.group = group
        self.window = window
        self.tree_rule = tree_rule
        self.num_device_pages = num_device_pages
        self.num_host_pages = num_host_pages
        self.num_disk_pages = num_disk_pages
        self.tokens_per_block = tokens_per_block
        self.offload_min_priority = offload_min_priority
        self.bytes_per_page = bytes_per_page
        self.ops = ops
        self.events = events
        self._events_on = events.enabled
        """Events on (the buffer's capacity never changes): checked before building one."""
        self.stats = stats
        self.disk_check: Callable[[int, int], bool] | None = None
        """(group, disk page) -> whether the page is intact (``KVCacheManager.attach_disk_check``)."""
        self._empty()

    def _empty(self) -> None:
        """Every page free, no cached block."""
        self.device_free = FreeList(1, self.num_device_pages)
        self.host_free = FreeList(0, self.num_host_pages)
        self.disk_free = FreeList(0, self.num_disk_pages)
        self.tree = RadixTree()
        self.device_queue: EvictionQueue[Block] = EvictionQueue()
        self.host_queue: EvictionQueue[Block] = EvictionQueue()
        self.disk_queue: EvictionQueue[Block] = EvictionQueue()
        self.num_free_cached = 0
        """Tree blocks on the device with ref_count 0 (all eventually evictable)."""
        self.expiry: ExpiryQueue[Block] = ExpiryQueue()
        """Blocks whose retention priority expires."""

    # ------------------------------------------------------------------ capacity

    def num_available(self) -> int:
        """Device pages that can be handed out now: free pages plus evictable cached blocks."""
        return len(self.device_free) + self.num_free_cached

    # ------------------------------------------------------------------ events

    def emit(self, kind: EventKind, block: Block, *, with_tokens: bool = False) -> None:
        if self._events_on:
            self.events.append(
                kind,
                self.group,
                self.window,
                block_key=block.key,
                parent_key=block.parent_key,
                token_ids=block.token_ids if with_tokens else (),
                priority=block.priority,
                tier=block.tier.label,
                mm_ids=tuple(it.label for it in block.items),
            )

    # ------------------------------------------------------------------ queue membership

    def _evictable(self, block: Block) -> bool:
        if block.ref_count or block.key is None:
            return False
        if not self.tree_rule:
            return True
        if block.tier is Tier.DEVICE:
            return block.device_children == 0
        children = self.tree.children(block.key).values()
        if block.tier is Tier.HOST:
            return all(child.tier is Tier.DISK for child in children)
        return not children

    def _queue(self, block: Block) -> EvictionQueue:
        if block.tier is Tier.DEVICE:
            return self.device_queue
        return self.host_queue if block.tier is Tier.HOST else self.disk_queue

    def _free_pages(self, tier: Tier) -> FreeList:
        """The free list of a tier's pool."""
        if tier is Tier.DEVICE:
            return self.device_free
        return self.host_free if tier is Tier.HOST else self.disk_free

    def requeue(self, block: Block) -> None:
        """Brings the block's queue membership in line with its state."""
        evictable = self._evictable(block)
        queued = block.queue_serial >= 0
        if evictable and not queued:
            self._queue(block).push(block)
        elif queued and not evictable:
            self._queue(block).discard(block)

    def _unqueue(self, block: Block) -> None:
        if block.queue_serial >= 0:
            self._queue(block).discard(block)

    def _device_child_moved(self, block: Block, delta: int) -> None:
        """Keeps the parent's ``device_children`` count (full groups only) and its queue entry."""
        if not self.tree_rule:
            return
        parent = self.tree.get(block.parent_key)
        if parent is not None:
            parent.device_children += delta
            self.requeue(parent)

    # ------------------------------------------------------------------ references

    def acquire(self, block: Block) -> None:
        """Takes a reference. Sequences hold device blocks; a host or disk block is referenced
        only while it is being onboarded or copied (so nothing evicts it meanwhile)."""
        if block.ref_count == 0 and block.key is not None:
            if block.tier is Tier.DEVICE:
                self.num_free_cached -= 1
            self._unqueue(block)
        block.ref_count += 1

    def release(self, block: Block, tick: int | None) -> None:
        """Drops a reference; ``tick`` is the LRU time of the release (None keeps the block's
        place, for references taken only while copying from it)."""
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.key is None:
            self.device_free.append(block.page)
            return
        if tick is not None:
            block.last_used = tick
        if block.tier is Tier.DEVICE:
            self.num_free_cached += 1
        self.requeue(block)

    def set_priority(self, block: Block, priority: int, expiry: float | None) -> bool:
        """Sets priority and expiry; returns True (and emits "updated") when the priority changed."""
        block.expiry = expiry
        if block.priority == priority:
            return False
        queued = block.queue_serial >= 0
        if queued:
            self._queue(block).discard(block)
        block.priority = priority
        if queued:
            self._queue(block).push(block)
        self.emit("updated", block)
        return True

    # ------------------------------------------------------------------ allocation and eviction

    def new_block(self) -> Block:
        """A private device block on a fresh page (evicts if needed; caller checked capacity)."""
        return Block(page=self.take_device_page())

    def take_device_page(self) -> int:
        if not self.device_free:
            victim = self.device_queue.pop()
            assert victim is not None, "no evictable device block; capacity was not checked"
            self._evict_device(victim)
        return self.device_free.popleft()

    def _take_lower_page(self, tier: Tier) -> int | None:
        """A free page of the host or disk tier, making room if needed: the host LRU victim
        moves down to the disk tier (or is dropped), the disk LRU victim is dropped; None
        when every block of the tier is referenced (being onboarded)."""
        free = self._free_pages(tier)
        if not free:
            victim = (self.host_queue if tier is Tier.HOST else self.disk_queue).pop()
            if victim is None:
                return None
            if tier is Tier.HOST:
                self.stats.host_evictions += 1
                self._spill(victim)
            else:
                self.stats.disk_evictions += 1
                self._drop(victim)
        return free.popleft()

    def _spill(self, victim: Block) -> None:
        """Moves an unreferenced host block (out of the host queue; its children, if any, are
        on the disk tier) to the disk tier, or drops it (with its subtree)
        when there is no disk tier, its priority is below the offload threshold, or every disk
        block is referenced; its host page joins the free list either way."""
        disk_page = None
        if self.num_disk_pages and should_offload(victim.priority, self.offload_min_priority):
            # Making room on the disk may drop the victim's last disk child; the reference
            # keeps the victim (already out of the host queue) from being queued again there.
            victim.ref_count += 1
            disk_page = self._take_lower_page(Tier.DISK)
            victim.ref_count -= 1
        if disk_page is None:
            self._drop(victim)
            return
        self.ops.append(PageOp("spill", self.group, victim.page, disk_page))
        self.stats.spilled_pages += 1
        self.stats.spilled_bytes += self.bytes_per_page
        self.host_free.append(victim.page)
        victim.tier, victim.page = Tier.DISK, disk_page
        self.requeue(victim)
        parent = self.tree.get(victim.parent_key)
        if parent is not None and self.tree_rule:
            self.requeue(parent)  # a host parent may have no host child left
        self.emit("updated", victim)

    def _evict_device(self, victim: Block) -> None:
        """Offloads the victim to the host tier, or drops it (its page joins the free list)."""
        self.stats.device_evictions += 1
        host_page = None
        if self.num_host_pages and should_offload(victim.priority, self.offload_min_priority):
            # Making room on the host may drop the victim's last host child; the reference
            # keeps the victim (already out of the device queue) from being queued again.
            victim.ref_count += 1
            host_page = self._take_lower_page(Tier.HOST)
            victim.ref_count -= 1
        if host_page is None:
            self._drop(victim)
            return
        self.ops.append(PageOp("offload", self.group, victim.page, host_page))
        self.stats.offloaded_pages += 1
        self.stats.offloaded_bytes += self.bytes_per_page
        self.device_free.append(victim.page)
        self.num_free_cached -= 1
        victim.tier, victim.page = Tier.HOST, host_page
        self.requeue(victim)
        self._device_child_moved(victim, -1)
        self.emit("updated", victim)

    def demote_cached(self, to_disk: bool) -> int:
        """Moves every unreferenced cached device block down to the host tier (as eviction
        would: dropped where the host tier cannot take it), then with ``to_disk`` every
        unreferenced host block on to the disk tier; returns the blocks moved or dropped."""
        moved = 0
        while (victim := self.device_queue.pop()) is not None:
            self._evict_device(victim)
            moved += 1
        while to_disk and (victim := self.host_queue.pop()) is not None:
            self._spill(victim)
            moved += 1
        return moved

    def _subtree_postorder(self, block: Block) -> Iterator[Block]:
        """``block`` and its cached descendants, children before parents (no recursion)."""
        stack = [(block, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                yield node
                continue
            stack.append((node, True))
            if self.tree_rule:
                stack.extend((child, False) for child in self.tree.children(node.key).values())

    def _drop(self, block: Block) -> None:
        """Removes an unreferenced tree block (and, in full groups, its subtree) from the cache."""
        leaf = not (self.tree_rule and self.tree.has_children(block.key))
        for node in [block] if leaf else list(self._subtree_postorder(block)):
            self._unqueue(node)
            self.emit("removed", node)
            on_device = node.tier is Tier.DEVICE
            self.tree.remove(node)
            if on_device:
                self.num_free_cached -= 1
                self.device_free.append(node.page)
                self._device_child_moved(node, -1)
            else:
                self._free_pages(node.tier).append(node.page)
                parent = self.tree.get(node.parent_key)
                if parent is not None and self.tree_rule:
                    self.requeue(parent)

    def intact(self, block: Block) -> bool:
        """Whether a matched block can be reused: True unless it sits on the disk tier and its
        page (written, not a queued spill's destination) fails the disk check; then the block
        (with its subtree in full groups) is dropped ("removed" events) and counted in
        ``lost_disk_pages``. The block must be unreferenced."""
        if block.tier is not Tier.DISK or self.disk_check is None or self._spill_queued(block.page):
            return True
        if self.disk_check(self.group, block.page):
            return True
        self.stats.lost_disk_pages += 1
        self._drop(block)
        return False

    def _spill_queued(self, disk_page: int) -> bool:
        """Whether a queued (not yet executed) spill writes ``disk_page``: the page file cannot
        vouch for it yet, and the ops run in order, so an onboard queued after it reads it."""
        return any(op.kind == "spill" and op.group == self.group and op.dst == disk_page for op in self.ops)

    def _count_onboard(self, tier: Tier) -> None:
        self.stats.onboarded_pages += 1
        self.stats.onboarded_bytes += self.bytes_per_page
        if tier is Tier.DISK:
            self.stats.disk_onboarded_pages += 1
            self.stats.disk_onboarded_bytes += self.bytes_per_page

    def onboard(self, block: Block) -> None:
        """Moves a host or disk tree block to a fresh device page (queues an "onboard" or
        "onboard_disk" op)."""
        assert block.tier is not Tier.DEVICE
        self._unqueue(block)
        page = self.take_device_page()
        kind: PageOpKind = "onboard" if block.tier is Tier.HOST else "onboard_disk"
        self.ops.append(PageOp(kind, self.group, block.page, page))
        self._count_onboard(block.tier)
        self._free_pages(block.tier).append(block.page)
        block.tier, block.page = Tier.DEVICE, page
        if block.ref_count == 0:
            self.num_free_cached += 1
        self._device_child_moved(block, +1)
        self.requeue(block)
        self.emit("updated", block)

    def copy_prefix(self, source: Block) -> Block:
        """A private block holding a copy of ``source``'s page, for reuse of its leading tokens
        (partial reuse; the request writes its own tokens after them).

        The caller holds a reference on the source so that finding the destination page
        cannot evict it and the copy (or onboard, for a host or disk source) reads the right page.
        """
        assert source.ref_count > 0, "acquire the source first"
        block = self.new_block()
        if source.tier is Tier.DEVICE:
            self.ops.append(PageOp("copy", self.group, source.page, block.page))
            self.stats.copied_pages += 1
            self.stats.copied_bytes += self.bytes_per_page
        else:
            kind: PageOpKind = "onboard" if source.tier is Tier.HOST else "onboard_disk"
            self.ops.append(PageOp(kind, self.group, source.page, block.page))
            self._count_onboard(source.tier)
        return block

    def can_take_in_place(self, block: Block) -> bool:
        """Whether a partially matched block may be reused in place (no copy): on the device,
        no other holder, and no cached children (taking it must not cut the tree)."""
        return block.tier is Tier.DEVICE and block.ref_count == 0 and not self.tree.has_children(block.key)

    def take_in_place(self, block: Block) -> None:
        """Removes a leaf that only the caller references (one reference, taken for this) from
        the tree: it becomes that sequence's private block, to be overwritten past the match."""
        assert block.ref_count == 1 and block.tier is Tier.DEVICE and not self.tree.has_children(block.key)
        self.emit("removed", block)
        self.tree.remove(block)
        self._device_child_moved(block, -1)

    # ------------------------------------------------------------------ storing

    def store(
        self,
        block: Block,
        key: BlockKey,
        parent_key: BlockKey,
        token_ids: tuple[int, ...],
        items: tuple[HashedItem, ...],
        index: int,
        priority: int,
        expiry: float | None,
    ) -> Block:
        """Inserts a full private block held by one sequence; returns the block it should hold.

        If the key is cached already, the identical cached block wins: on the device the
        sequence switches to it and the private page is freed; on the host or disk the private
        block replaces it (an onboard without a copy) and that page is freed. Either way one key
        has one block and the sequence's chain stays in the tree.
        """
        assert block.key is None and block.ref_count == 1 and block.tier is Tier.DEVICE
        cached = self.tree.blocks.get(key)
        if cached is not None and cached.tier is Tier.DEVICE:
            self.acquire(cached)
            self.set_priority(cached, priority, expiry)
            block.ref_count = 0
            self.device_free.append(block.page)
            return cached
        block.priority, block.expiry = priority, expiry
        if cached is not None:
            self._unqueue(cached)
            self._free_pages(cached.tier).append(cached.page)
            self.tree.replace(cached, block)
            block.device_children = 0
            self.emit("updated", block)
        else:
            self.tree.insert(block, key, parent_key, token_ids, items)
            block.index = index
            self.stats.stored_blocks += 1
            self.emit("stored", block, with_tokens=True)
        self._device_child_moved(block, +1)
        return block

    def clear(self) -> None:
        """Forgets every cached block of every tier; no block may be referenced (nothing is copied)."""
        assert all(b.ref_count == 0 for b in self.tree.blocks.values()), "clear() with blocks in use"
        self._empty()
