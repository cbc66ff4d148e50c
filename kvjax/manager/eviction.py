"""Priority-LRU free-block queues, one per layer group and tier.

Order: the lowest priority first; within a priority, the block released longest ago
(``last_used``, a tick taken when its reference count drops to zero). The queue is a binary
heap with lazy deletion: removing a block or changing its priority only invalidates its
entry (the block remembers the serial of its live entry), so every operation is O(log n)
and nothing is searched. Stale entries are dropped on pop and by compaction once they
outnumber live ones.

Which blocks are eligible is decided by the block pool, not here (leaves before parents).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, Protocol, TypeVar

_SERIALS = itertools.count(1)
"""Entry serials, unique across all queues so a block moving between tiers can never match
a stale entry of the queue it left."""


class Queueable(Protocol):
    priority: int
    last_used: int
    queue_serial: int
    """Serial of the block's live entry; -1 when it is in no queue."""


QueuedT = TypeVar("QueuedT", bound=Queueable)


class EvictionQueue(Generic[QueuedT]):
    """The evictable blocks of one tier of one layer group."""

    __slots__ = ("_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, QueuedT]] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, block: QueuedT) -> None:
        """Adds a block that is in no queue; its position follows (priority, last_used)."""
        assert block.queue_serial < 0, "block is already queued"
        serial = next(_SERIALS)
        block.queue_serial = serial
        heapq.heappush(self._heap, (block.priority, block.last_used, serial, block))
        self._live += 1
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if e[3].queue_serial == e[2]]
            heapq.heapify(self._heap)

    def discard(self, block: QueuedT) -> None:
        """Removes a queued block (its entry goes stale)."""
        assert block.queue_serial >= 0, "block is not queued"
        block.queue_serial = -1
        self._live -= 1

    def pop(self) -> QueuedT | None:
        """Removes and returns the next victim, or None when the queue is empty."""
        heap = self._heap
        while heap:
            _, _, serial, block = heapq.heappop(heap)
            if block.queue_serial == serial:
                block.queue_serial = -1
                self._live -= 1
                return block
        return None

    def ordered(self) -> list[QueuedT]:
        """The queued blocks in eviction order (O(n log n); snapshots and tests)."""
        live = [e for e in self._heap if e[3].queue_serial == e[2]]
        return [e[3] for e in sorted(live, key=lambda e: e[:3])]
