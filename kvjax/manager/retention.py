"""Block priorities and their expiry, from a request's ``KvCacheRetentionConfig``.

Every token of a sequence has a priority: the priority of the token range covering it
(a range with ``token_end=None`` covers generated tokens too), else the decode priority for
generated tokens, else the default (35). A block spans ``tokens_per_block`` tokens and takes
the **highest** priority among its tokens, so a block holding one important token is kept
as long as that token is wanted. Its duration is the duration of that winning priority
(ties prefer no expiry, then the longer duration). When a duration runs out the block falls
back to the default priority.

The request that last stores or reuses a block sets its priority ("latest request wins",
as in TensorRT-LLM), so a block's priority reflects its current users.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from kvjax.config import DEFAULT_PRIORITY, KvCacheRetentionConfig


def block_priority(
    retention: KvCacheRetentionConfig, start: int, end: int, prompt_len: int
) -> tuple[int, float | None]:
    """(priority, duration_ms) of the block holding tokens ``[start, end)``.

    Args:
      retention: the request's retention policy.
      start, end: token positions of the block, start < end.
      prompt_len: tokens in the prompt; positions >= prompt_len are generated tokens.
    """
    default = not retention.token_range_retention_configs and retention.decode_retention_priority == DEFAULT_PRIORITY
    if default and (end <= prompt_len or retention.decode_duration_ms is None):  # the default policy
        return DEFAULT_PRIORITY, None
    # The winner maximizes (priority, no expiry, duration); the first of equals is kept.
    best_priority, best_duration = -1, None
    covered = prompt_covered = 0
    for r in retention.token_range_retention_configs:
        lo = r.token_start if r.token_start > start else start
        hi = end if r.token_end is None or r.token_end > end else r.token_end
        if lo < hi:
            p, d = r.priority, r.duration_ms
            if p > best_priority or (
                p == best_priority and best_duration is not None and (d is None or d > best_duration)
            ):
                best_priority, best_duration = p, d
            covered += hi - lo
            if lo < prompt_len:
                prompt_covered += (hi if hi < prompt_len else prompt_len) - lo
    prompt_tokens = max(0, min(end, prompt_len) - start)
    if prompt_covered < prompt_tokens:
        p, d = DEFAULT_PRIORITY, None
        if p > best_priority or (p == best_priority and best_duration is not None):
            best_priority, best_duration = p, d
    if covered - prompt_covered < (end - start) - prompt_tokens:
        p, d = retention.decode_retention_priority, retention.decode_duration_ms
        if p > best_priority or (p == best_priority and best_duration is not None and (d is None or d > best_duration)):
            best_priority, best_duration = p, d
    return best_priority, best_duration


class _Expirable(Protocol):
    priority: int
    expiry: float | None


ExpirableT = TypeVar("ExpirableT", bound=_Expirable)


class ExpiryQueue(Generic[ExpirableT]):
    """Blocks whose priority expires, ordered by expiry time (seconds on the manager's clock).

    Entries go stale when a block's expiry is reset or the block leaves the cache; a stale
    entry is recognised by comparing the stored time with the block's current ``expiry`` and
    skipped, so no operation searches the heap. Push and pop are O(log n).
    """

    __slots__ = ("_heap", "_serial")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, ExpirableT]] = []
        self._serial = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, block: ExpirableT) -> None:
        """Tracks ``block``, whose ``expiry`` must be set."""
        assert block.expiry is not None
        heapq.heappush(self._heap, (block.expiry, next(self._serial), block))

    def pop_expired(self, now: float, alive: Callable[[ExpirableT], bool]) -> Iterator[ExpirableT]:
        """Yields, in expiry order, the live blocks whose expiry is <= ``now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            expiry, _, block = heapq.heappop(heap)
            if block.expiry == expiry and alive(block):
                yield block

    def compact(self, alive: Callable[[ExpirableT], bool]) -> None:
        """Drops stale entries; the caller runs it when the heap outgrows the live blocks."""
        self._heap = [e for e in self._heap if e[2].expiry == e[0] and alive(e[2])]
        heapq.heapify(self._heap)
