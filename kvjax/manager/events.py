"""KV cache events: what entered, left or changed in the reuse cache.

Consumers (routers, cache-aware load balancers) mirror the tree from this stream. Events are
kept in a bounded buffer of ``event_buffer_max_size``; when it is full the oldest event is
dropped and counted, so a slow consumer loses history, never the manager's memory.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Literal

EventKind = Literal["stored", "removed", "updated", "all_cleared"]


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """One change of the reuse cache.

    Attributes:
      event_id: increasing over the manager's life (gaps = dropped events).
      kind: "stored" (a full block entered the tree), "removed" (it left), "updated"
        (its priority or tier changed), "all_cleared" (every cached block was dropped).
      group: layer group; window: that group's attention window (tokens).
      block_key, parent_key: 32-byte keys (None for "all_cleared").
      token_ids: the block's tokens ("stored" only, else empty).
      priority: the block's priority after the change.
      tier: "device" or "host" after the change (where it was, for "removed").
      mm_ids: per multimodal item overlapping the block, the user's UUID where given, else
        the hex content hash.
      state_snapshot: the event is about a recurrent-state snapshot of a hybrid model
        (``kvjax.manager.state_snapshots``), not KV pages: ``block_key`` is the key of the
        block its state ends at, ``group`` the state pool's (after the attention groups),
        ``window`` 0.
    """

    event_id: int
    kind: EventKind
    group: int
    window: int
    block_key: bytes | None = None
    parent_key: bytes | None = None
    token_ids: tuple[int, ...] = ()
    priority: int | None = None
    tier: str | None = None
    mm_ids: tuple[str, ...] = ()
    state_snapshot: bool = False


class EventBuffer:
    """Bounded FIFO of events; capacity 0 turns events off."""

    __slots__ = ("_events", "capacity", "next_id", "num_dropped")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.next_id = 0
        self.num_dropped = 0
        self._events: collections.deque[KVCacheEvent] = collections.deque(maxlen=capacity or None)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._events)

    def append(self, kind: EventKind, group: int, window: int, **fields) -> None:
        """Records an event (callers check ``enabled`` first to skip building fields)."""
        if len(self._events) == self.capacity:
            self.num_dropped += 1
        self._events.append(KVCacheEvent(self.next_id, kind, group, window, **fields))
        self.next_id += 1

    def drain(self) -> list[KVCacheEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def peek(self) -> list[KVCacheEvent]:
        return list(self._events)

    def load(self, next_id: int, num_dropped: int, pending: list[KVCacheEvent]) -> None:
        """Replaces the buffer's state with a snapshot's: its id counter, drop count and the
        events not yet drained (oldest first)."""
        self.next_id, self.num_dropped = next_id, num_dropped
        self._events.clear()
        self._events.extend(pending)
