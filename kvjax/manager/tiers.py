"""Memory tiers and the page operations that move blocks between them (SPEC B5, B6).

Pages live in per-group pools: the device pool (``num_device_pages`` pages, page
``NULL_PAGE`` never handed out) and the host pool (``num_host_pages`` pages, ids from 0).
The manager never touches KV values: it queues :class:`PageOp` records that the engine
executes, in order, before the next forward pass.

Offload threshold (decided here, pinned by a test): a block about to be evicted from the
device is offloaded when ``priority >= secondary_offload_min_priority``; blocks *below* it
are dropped. With the default threshold 35 a default-priority block is offloaded and a
block at 34 is not, as the TensorRT-LLM documentation states.
"""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

from kvjax.cache.layout import NULL_PAGE

__all__ = ["NULL_PAGE", "PageOp", "Tier", "should_offload"]


class Tier(enum.IntEnum):
    """Where a block's page lives."""

    DEVICE = 0
    HOST = 1

    @property
    def label(self) -> str:
        return self.name.lower()


class PageOp(NamedTuple):
    """One page movement for the engine to execute (a named tuple: cheap to build per eviction).

    Attributes:
      kind: "offload" (device page src -> host page dst), "onboard" (host page src -> device
        page dst) or "copy" (device page src -> device page dst).
      group: layer group whose pools the pages belong to.
      src, dst: page ids in the source and destination pools.
      num_tokens: leading tokens of the page to move; tokens_per_block for whole pages,
        fewer for the copy of a partially reused block.
    """

    kind: Literal["offload", "onboard", "copy"]
    group: int
    src: int
    dst: int
    num_tokens: int


def should_offload(priority: int, secondary_offload_min_priority: int) -> bool:
    """Whether an evicted device block goes to the host tier (>=) or is dropped (<)."""
    return priority >= secondary_offload_min_priority
