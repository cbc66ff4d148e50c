"""Host bookkeeping of the recurrent state pool of a hybrid model: live slots and snapshots.

A hybrid model's recurrent layers have no KV to share: the state after p tokens summarises
the whole prefix, and a new request can skip a cached prefix only if the state at its end was
saved. The state pool (``kvjax.cache.state_pool``) therefore holds

* a **live slot** per running request, read and written by every step;
* **snapshot slots**: the state after the first p tokens of some sequence, p a block
  boundary, keyed by the block key of the block ending at p (the radix tree's key of that
  prefix). A new request resumes from the deepest snapshot its cached prefix reaches, so a
  hybrid model reuses min(attention match, deepest snapshot) tokens and recomputes the rest.

Which boundaries are snapshotted (``KvCacheConfig.mamba_state_config``,
``block_reuse_config``)::

    prompt |<----------------------- len(prompt) ----------------------->|<-- generated -->
           0     I     2I    3I   ...                                     (periodic: every I)
              ^ from_start offsets (rounded down)        from_end o: ^ len(prompt) - o, rounded down

"all_reusable" takes periodic and offset boundaries; "per_conversation" only the offset
boundaries, keeping per conversation the snapshots of its last ``max_num_turns`` turns.

Eviction: when every snapshot slot is taken, a snapshot whose block has left the cache goes
first (it can no longer be reached: a resume needs the attention KV of its prefix), then the
least recently used one. A restore is executed in the step that admits its request, before
any forward can take (and so evict) a snapshot, so a chosen snapshot is always still there
when it is read. Events "stored"/"removed" with ``state_snapshot=True`` report snapshots.

Slots: ``NULL_SLOT`` (0), then ``num_live`` live slots, then ``max_snapshots`` snapshot slots.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

from kvjax.cache.state_pool import NULL_SLOT
from kvjax.config import KvCacheConfig
from kvjax.manager.events import EventBuffer
from kvjax.manager.hashing import BlockKey

_MAX_CONVERSATION_ENDS_PER_SNAPSHOT = 4
"""Finished turns remembered (to chain conversations) per snapshot slot."""


@dataclasses.dataclass(slots=True)
class StateSnapshot:
    """One saved state.

    Attributes:
      key: block key of the block ending at ``num_tokens``.
      slot: its slot in the state pool.
      num_tokens: tokens the state has seen (a block boundary).
      conversation, turn: the conversation and turn of the request that took it.
    """

    key: BlockKey
    slot: int
    num_tokens: int
    conversation: int
    turn: int


@dataclasses.dataclass(slots=True)
class LiveState:
    """A running request's live slot and its place in a conversation."""

    slot: int
    prompt_len: int
    conversation: int
    turn: int


class StateSnapshotIndex:
    """Slots of the state pool: which request or snapshot holds each.

    Args:
      config: the cache configuration (block_reuse_config, mamba_state_config).
      tokens_per_block: tokens per page and block (the cache layout's ``tokens_per_block``).
      num_live: live slots, at least the most requests running at once.
    """

    def __init__(self, config: KvCacheConfig, *, tokens_per_block: int, num_live: int) -> None:
        if not isinstance(num_live, int) or num_live < 1:
            raise ValueError(f"num_live={num_live!r} must be an int >= 1 (requests running at once)")
        self.config = config
        self.tokens_per_block = tokens_per_block
        self.policy = config.block_reuse_config.policy
        self.max_num_turns = config.block_reuse_config.max_num_turns
        mamba = config.mamba_state_config
        self.interval = mamba.periodic_snapshot_interval if self.policy == "all_reusable" else 0
        ps = self.tokens_per_block
        self.from_start: frozenset[int] = frozenset(
            o // ps * ps for o in mamba.additional_snapshot_offsets_from_start
        ) - {0}
        self.from_end: tuple[int, ...] = tuple(sorted(set(mamba.additional_snapshot_offsets_from_end)))
        self.num_live = num_live
        self.max_snapshots = mamba.max_snapshots
        self.num_slots = 1 + num_live + self.max_snapshots
        self._free_live = list(range(num_live, 0, -1))
        self._free_snapshot = list(range(self.num_slots - 1, num_live, -1))
        self._live: dict[str, LiveState] = {}
        self._snapshots: collections.OrderedDict[BlockKey, StateSnapshot] = collections.OrderedDict()
        """Least recently used first."""
        self._turn_ends: collections.OrderedDict[BlockKey, tuple[int, int]] = collections.OrderedDict()
        """Key of the last full block of a finished request's prompt + output -> (conversation, turn)."""
        self._next_conversation = 0
        self._events: EventBuffer | None = None
        self._group = 0
        self._is_cached: Callable[[BlockKey], bool] = lambda key: True
        self.stats: collections.Counter[str] = collections.Counter()
        """Counters: stored, evicted, orphans_evicted, dropped_turns, restored."""

    def bind(self, events: EventBuffer, group: int, is_cached: Callable[[BlockKey], bool]) -> None:
        """Connects the index to a manager: its event buffer, the group number events carry,
        and whether a block key is still cached (orphaned snapshots are evicted first)."""
        self._events, self._group, self._is_cached = events, group, is_cached

    # ------------------------------------------------------------------ queries

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def has(self, key: BlockKey) -> bool:
        """Whether a snapshot ends at the block with this key (no side effects)."""
        return key in self._snapshots

    def snapshots(self) -> list[StateSnapshot]:
        """Every snapshot, least recently used first."""
        return list(self._snapshots.values())

    def live(self, request_id: str) -> LiveState | None:
        return self._live.get(request_id)

    def is_boundary(self, num_tokens: int, prompt_len: int) -> bool:
        """Whether the state after ``num_tokens`` tokens of a sequence with a prompt of
        ``prompt_len`` tokens is snapshotted."""
        ps = self.tokens_per_block
        if num_tokens <= 0 or num_tokens % ps:
            return False
        if self.interval and num_tokens % self.interval == 0:
            return True
        if num_tokens in self.from_start:
            return True
        return any(num_tokens == (prompt_len - o) // ps * ps for o in self.from_end)

    def boundaries_in(self, start: int, end: int, prompt_len: int) -> list[int]:
        """Snapshot boundaries p with start < p <= end, in order."""
        ps = self.tokens_per_block
        first = start // ps * ps + ps
        return [p for p in range(first, end + 1, ps) if self.is_boundary(p, prompt_len)]

    # ------------------------------------------------------------------ live slots

    def start(self, request_id: str, prompt_keys: Sequence[BlockKey], prompt_len: int) -> LiveState:
        """Gives a request its live slot and places it in a conversation: the one whose
        finished turn its prompt extends (deepest such turn), else a new one."""
        if request_id in self._live:
            raise ValueError(f"request_id={request_id!r} already holds live slot {self._live[request_id].slot}")
        if not self._free_live:
            raise RuntimeError(
                f"all {self.num_live} live state slots are held ({sorted(self._live)[:8]}); "
                "more requests run at once than the state pool was sized for"
            )
        conversation, turn = None, 1
        for key in reversed(prompt_keys):
            hit = self._turn_ends.get(key)
            if hit is not None:
                conversation, turn = hit[0], hit[1] + 1
                break
        if conversation is None:
            conversation, self._next_conversation = self._next_conversation, self._next_conversation + 1
        live = LiveState(self._free_live.pop(), prompt_len, conversation, turn)
        self._live[request_id] = live
        return live

    def end(self, request_id: str, final_key: BlockKey | None = None) -> None:
        """Returns a request's live slot. ``final_key``: the key of the last full block of
        its prompt + output when it finished a turn (a later prompt extending it continues
        the conversation); None when it was preempted, aborted or failed."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self._free_live.append(live.slot)
        if final_key is not None:
            self._turn_ends[final_key] = (live.conversation, live.turn)
            self._turn_ends.move_to_end(final_key)
            while len(self._turn_ends) > _MAX_CONVERSATION_ENDS_PER_SNAPSHOT * self.max_snapshots:
                self._turn_ends.popitem(last=False)

    # ------------------------------------------------------------------ snapshots

    def restore(self, key: BlockKey) -> StateSnapshot:
        """The snapshot to resume from (marked used)."""
        snapshot = self._snapshots.get(key)
        if snapshot is None:
            raise KeyError(f"no recurrent-state snapshot for block key {key.hex()[:16]}...")
        self._snapshots.move_to_end(key)
        self.stats["restored"] += 1
        return snapshot

    def store(self, request_id: str, key: BlockKey, num_tokens: int) -> int | None:
        """Reserves the snapshot slot for the state of ``request_id`` after ``num_tokens``
        tokens, evicting as needed; returns the slot to copy its live slot into, or None if
        that state is already saved (it is marked used)."""
        live = self._live[request_id]
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return None
        if self.policy == "per_conversation":
            self._drop_old_turns(live)
        if not self._free_snapshot:
            victim = next((s for s in self._snapshots.values() if not self._is_cached(s.key)), None)
            if victim is not None:
                self.stats["orphans_evicted"] += 1
            else:
                victim = next(iter(self._snapshots.values()))
            self.stats["evicted"] += 1
            self._remove(victim)
        snapshot = StateSnapshot(key, self._free_snapshot.pop(), num_tokens, live.conversation, live.turn)
        self._snapshots[key] = snapshot
        self.stats["stored"] += 1
        if self._events is not None and self._events.enabled:
            self._events.append("stored", self._group, 0, block_key=key, tier="device", state_snapshot=True)
        return snapshot.slot

    def _drop_old_turns(self, live: LiveState) -> None:
        """per_conversation: forgets the conversation's snapshots older than its last max_num_turns turns."""
        oldest_kept = live.turn - self.max_num_turns + 1
        for snapshot in [
            s for s in self._snapshots.values() if s.conversation == live.conversation and s.turn < oldest_kept
        ]:
            self.stats["dropped_turns"] += 1
            self._remove(snapshot)

    def _remove(self, snapshot: StateSnapshot) -> None:
        del self._snapshots[snapshot.key]
        self._free_snapshot.append(snapshot.slot)
        if self._events is not None and self._events.enabled:
            self._events.append("removed", self._group, 0, block_key=snapshot.key, tier="device", state_snapshot=True)

    def clear(self) -> None:
        """Forgets every snapshot (live slots stay)."""
        for snapshot in list(self._snapshots.values()):
            self._remove(snapshot)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Snapshots and conversation ends as JSON-compatible data; live slots are not saved
        (a snapshot is taken of an idle engine)."""
        return {
            "snapshots": [
                [s.key.hex(), s.slot, s.num_tokens, s.conversation, s.turn] for s in self._snapshots.values()
            ],
            "turn_ends": [[key.hex(), c, t] for key, (c, t) in self._turn_ends.items()],
            "next_conversation": self._next_conversation,
        }

    def load_state_dict(self, state: dict) -> None:
        """Replaces the snapshots and conversation ends by ``state_dict()``'s (no live slot may be held)."""
        if self._live:
            raise RuntimeError(f"load_state_dict needs no live slots, {len(self._live)} are held")
        snapshots = [StateSnapshot(bytes.fromhex(k), slot, n, c, t) for k, slot, n, c, t in state["snapshots"]]
        slots = [s.slot for s in snapshots]
        if len(set(slots)) != len(slots) or not all(self.num_live < s < self.num_slots for s in slots):
            raise ValueError(
                f"snapshot slots {slots[:8]} must be distinct and in [{self.num_live + 1}, {self.num_slots - 1}]"
            )
        self._snapshots = collections.OrderedDict((s.key, s) for s in snapshots)
        self._free_snapshot = [s for s in range(self.num_slots - 1, self.num_live, -1) if s not in set(slots)]
        self._turn_ends = collections.OrderedDict(
            (bytes.fromhex(k), (c, t)) for k, c, t in state["turn_ends"]
        )
        self._next_conversation = state["next_conversation"]


__all__ = ["NULL_SLOT", "LiveState", "StateSnapshot", "StateSnapshotIndex"]
