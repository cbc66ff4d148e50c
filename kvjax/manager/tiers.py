"""Memory tiers and the page operations that move blocks between them.

Pages live in per-group pools: the device pool (``num_pages`` pages, page
``kvjax.cache.NULL_PAGE`` never handed out), the host pool (``num_host_pages`` pages, ids from 0) and
the disk pool (``num_disk_pages`` pages, ids from 0, a file the engine maps into memory).
The manager never touches KV values: it queues :class:`PageOp` records that the engine
executes, in order, before the next forward pass.

A block moves down one tier at a time when its tier needs room (device -> host -> disk, the
least recently used evictable block first) and comes back to the device in one step when a
request reuses it (host -> device or disk -> device).

Offload threshold (decided here, pinned by a test): a block about to leave the device (or
the host) moves down a tier when ``priority >= secondary_offload_min_priority``; blocks
*below* it are dropped. With the default threshold 35 a default-priority block is offloaded
and a block at 34 is not, as the TensorRT-LLM documentation states.
"""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

__all__ = ["PageOp", "Tier", "should_offload"]


class Tier(enum.IntEnum):
    """Where a block's page lives."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


PageOpKind = Literal["offload", "spill", "onboard", "onboard_disk", "copy"]
"""What a page operation does (``PageOp.kind``)."""


class PageOp(NamedTuple):
    """One page movement for the engine to execute (a named tuple: cheap to build per eviction).

    Attributes:
      kind: "offload" (device page src -> host page dst), "spill" (host page src -> disk page
        dst), "onboard" (host page src -> device page dst), "onboard_disk" (disk page src ->
        device page dst) or "copy" (device page src -> device page dst).
      group: layer group whose pools the pages belong to.
      src, dst: page ids in the source and destination pools. A whole page moves, also for a
        partially reused block: its slots past the reused tokens are overwritten by the
        request's own tokens before anything reads them.
    """

    kind: PageOpKind
    group: int
    src: int
    dst: int


def should_offload(priority: int, secondary_offload_min_priority: int) -> bool:
    """Whether an evicted block moves down a tier (>=) or is dropped (<)."""
    return priority >= secondary_offload_min_priority
