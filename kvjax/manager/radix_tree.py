"""Blocks and the radix search tree of one layer group.

Blocks of finished or running requests stay in the tree, so a new request walks it to find
its longest reusable prefix; a block in use by any request (reference count > 0) is never
evicted or overwritten, and a freed block stays reusable in the tree until evicted.

The tree holds *full* blocks by key. Because a key chains over its parent's key, a lookup
by key is a walk from the root; children are indexed by their parent key so that the tree
can answer "is this a leaf?" (eviction order) and "which cached blocks continue this prefix?"
(partial reuse). One block per key: two requests that fill identical blocks end up sharing
the tree's block (see ``BlockPool.store``).

Every match also compares the token ids and the parent key, not only the digest.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import DEFAULT_PRIORITY
from kvjax.manager.hashing import BlockKey, HashedItem
from kvjax.manager.tiers import Tier


@dataclasses.dataclass(slots=True, eq=False)
class Block:
    """One block (``tokens_per_block`` tokens) of one layer group, on one tier.

    A block with ``key=None`` is private to one sequence (not full yet, or reuse is off):
    it is never matched and its page is freed as soon as the sequence drops it.

    Attributes:
      page: page id in the pool of its tier.
      tier: device or host.
      ref_count: sequences holding the block; > 0 means never evicted or overwritten.
      key, parent_key: tree identity (None while private).
      token_ids: the block's tokens (tree blocks only).
      items: multimodal items overlapping the block (tree blocks only).
      index: position of the block in its sequence (tokens index*tokens_per_block onward); tree blocks only.
      priority: 0..100 retention priority.
      expiry: clock time (seconds) at which the priority falls back to the default; None = never.
      last_used: release tick (LRU order); larger = more recent.
      device_children: children of this block in the tree that sit on the device tier.
      queue_serial: serial of the block's live eviction-queue entry, -1 when not queued.
    """

    page: int
    tier: Tier = Tier.DEVICE
    ref_count: int = 0
    key: BlockKey | None = None
    parent_key: BlockKey | None = None
    token_ids: tuple[int, ...] = ()
    items: tuple[HashedItem, ...] = ()
    index: int = -1
    priority: int = DEFAULT_PRIORITY
    expiry: float | None = None
    last_used: int = 0
    device_children: int = 0
    queue_serial: int = -1


class RadixTree:
    """Full blocks of one layer group, by key, with children indexed by parent key."""

    __slots__ = ("_by_first_token", "_children", "blocks")

    def __init__(self) -> None:
        self.blocks: dict[BlockKey, Block] = {}
        self._children: dict[BlockKey, dict[BlockKey, Block]] = {}
        self._by_first_token: dict[tuple[BlockKey, int], dict[BlockKey, Block]] = {}
        """Children by (parent key, first token): partial reuse looks only at siblings that
        share at least the first token, not at every one-off continuation of a popular prefix."""

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, key: BlockKey | None) -> Block | None:
        return None if key is None else self.blocks.get(key)

    def children(self, key: BlockKey | None) -> dict[BlockKey, Block]:
        """Cached blocks whose parent key is ``key`` (a root key gives first blocks; a private
        block's None key none). Do not mutate."""
        return _EMPTY if key is None else self._children.get(key, _EMPTY)

    def children_starting_with(self, key: BlockKey | None, token: int) -> dict[BlockKey, Block]:
        """Cached children of ``key`` whose first token is ``token``. Do not mutate."""
        return _EMPTY if key is None else self._by_first_token.get((key, token), _EMPTY)

    def has_children(self, key: BlockKey | None) -> bool:
        return key is not None and key in self._children

    def insert(
        self,
        block: Block,
        key: BlockKey,
        parent_key: BlockKey,
        token_ids: tuple[int, ...],
        items: tuple[HashedItem, ...],
    ) -> None:
        """Makes a private block a tree block; the key must be new."""
        assert key not in self.blocks, "key already cached"
        block.key, block.parent_key, block.token_ids, block.items = key, parent_key, token_ids, items
        self.blocks[key] = block
        self._children.setdefault(parent_key, {})[key] = block
        self._by_first_token.setdefault((parent_key, token_ids[0]), {})[key] = block

    def replace(self, old: Block, new: Block) -> None:
        """Puts private ``new`` in place of tree block ``old`` (same key); children stay attached."""
        key, parent = old.key, old.parent_key
        assert key is not None and parent is not None and self.blocks.get(key) is old
        new.key, new.parent_key, new.token_ids, new.items, new.index = (
            key, old.parent_key, old.token_ids, old.items, old.index
        )
        self.blocks[key] = new
        self._children[parent][key] = new
        self._by_first_token[(parent, old.token_ids[0])][key] = new
        old.key = None

    def remove(self, block: Block) -> None:
        """Makes a tree block private again (its children, if any, keep their parent key)."""
        key, parent = block.key, block.parent_key
        assert key is not None and parent is not None and self.blocks.get(key) is block
        del self.blocks[key]
        siblings = self._children[parent]
        del siblings[key]
        if not siblings:
            del self._children[parent]
        first = (parent, block.token_ids[0])
        twins = self._by_first_token[first]
        del twins[key]
        if not twins:
            del self._by_first_token[first]
        block.key = None


_EMPTY: dict[BlockKey, Block] = {}
