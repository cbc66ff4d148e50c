"""Reuse planning: which cached blocks a new prompt can take, in every layer group, and whether
the device pools have the pages to take them. Reads the pools, changes nothing.

A plan reuses the longest prefix every group can provide, at most ``len(prompt) - 1`` tokens so
the last prompt token is always computed and yields logits. A full-attention group needs
every block of the prefix; a windowed group needs only the blocks inside the window of the
prefix end, because a token at position p attends to positions ``(p - window, p]``. With
partial reuse, a cached block sharing the leading tokens of the next block fills it (copied,
or taken in place). ``KVCacheManager.add_request`` reserves what the plan names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvjax.config import KvCacheConfig
from kvjax.manager.block_pool import BlockPool
from kvjax.manager.hashing import BlockKey, HashedItem, items_in
from kvjax.manager.radix_tree import Block
from kvjax.manager.tiers import Tier

if TYPE_CHECKING:
    from kvjax.manager.state_snapshots import StateSnapshotIndex


@dataclasses.dataclass(slots=True)
class GroupPlan:
    """One layer group's part of a reuse plan."""

    first: int
    """First block index held (blocks before it are outside the window)."""
    held: list[Block]
    """Tree blocks ``first .. first + len(held) - 1`` to take a reference on."""
    source: Block | None = None
    """Block whose leading tokens fill the partial last block (None: no partial block here)."""
    in_place: bool = False
    """Take ``source`` itself instead of copying it (copy_on_partial_reuse off)."""


@dataclasses.dataclass(slots=True)
class ReusePlan:
    """What a prompt reuses: ``num_tokens = num_full_blocks * tokens_per_block + partial_tokens``."""

    num_tokens: int
    num_full_blocks: int
    partial_tokens: int
    groups: list[GroupPlan]

    @classmethod
    def none(cls, num_groups: int) -> ReusePlan:
        """The plan that reuses nothing."""
        return cls(0, 0, 0, [GroupPlan(0, []) for _ in range(num_groups)])

    def slowest_tiers(self) -> list[str]:
        """The tier label of each reused full block, in prompt order: a block held in several
        layer groups counts at its slowest tier."""
        slowest = [Tier.DEVICE] * self.num_full_blocks
        for gp in self.groups:
            for b, block in enumerate(gp.held, start=gp.first):
                slowest[b] = max(slowest[b], block.tier)
        return [t.label for t in slowest]


def first_in_window(pool: BlockPool, num_tokens: int) -> int:
    """First block a sequence of ``num_tokens`` committed tokens still needs in ``pool``: the
    next token (position ``num_tokens``) attends to positions > ``num_tokens - window``."""
    if pool.tree_rule:
        return 0
    return max(0, num_tokens - pool.window + 1) // pool.tokens_per_block


def plan_reuse(
    pools: Sequence[BlockPool],
    config: KvCacheConfig,
    prompt: tuple[int, ...],
    keys: list[BlockKey],
    root: BlockKey,
    items: tuple[HashedItem, ...],
    snapshots: StateSnapshotIndex | None,
) -> ReusePlan:
    """The longest prefix of ``prompt`` every pool can provide, and where each gets it from.

    Args:
      keys: the prompt's full-block keys under ``root`` (``items`` hashed in).
      snapshots: a hybrid model's recurrent-state snapshots: reuse then stops at the deepest
        block boundary that has one, and no partial block is reused.
    """
    ps = pools[0].tokens_per_block
    cap = len(prompt) - 1
    if not config.enable_block_reuse or cap < 1:
        return ReusePlan.none(len(pools))
    max_full = min(cap // ps, len(keys))
    present: list[list[Block | None]] = []
    feasible = [True] * (max_full + 1)
    for pool in pools:
        hits: list[Block | None] = []
        missing = [0]
        parent = root
        cached = pool.tree.blocks
        for b, key in enumerate(keys):
            hit = cached.get(key)  # the digest, then its parent and tokens (a hash collision must not match)
            if hit is not None and (hit.parent_key != parent or hit.token_ids != prompt[b * ps : (b + 1) * ps]):
                hit = None
            if hit is not None and not pool.intact(hit):
                hit = None
            hits.append(hit)
            missing.append(missing[-1] + (hit is None))
            parent = key
            if hit is None and pool.tree_rule:
                hits.extend([None] * (len(keys) - b - 1))
                break
        present.append(hits)
        for k in range(1, max_full + 1):
            if feasible[k]:
                if pool.tree_rule:
                    feasible[k] = hits[k - 1] is not None
                else:
                    lo = min(first_in_window(pool, k * ps), k)
                    feasible[k] = missing[k] - missing[lo] == 0
    num_full = max(
        k for k in range(max_full + 1) if feasible[k] and (k == 0 or snapshots is None or snapshots.has(keys[k - 1]))
    )
    start = num_full * ps
    partial = 0
    sources: list[tuple[Block | None, bool]] = [(None, False)] * len(pools)
    if config.enable_partial_reuse and start < cap and snapshots is None:
        partial = min(ps - 1, cap - start)
        parent = keys[num_full - 1] if num_full else root
        wanted = prompt[start : start + partial]
        for g, pool in enumerate(pools):  # the partial block holds position L-1: every window needs it
            hit = present[g][num_full] if num_full < len(keys) else None
            source, count = partial_source(pool, config, hit, parent, wanted, items, start)
            partial = min(partial, count)
            sources[g] = (
                source,
                source is not None and not config.copy_on_partial_reuse and source.tier is Tier.DEVICE,
            )
            if partial == 0:
                break
    num_tokens = start + partial
    groups = []
    for g, pool in enumerate(pools):
        first = min(first_in_window(pool, num_tokens), num_full)
        gp = GroupPlan(first, present[g][first:num_full])  # type: ignore[arg-type]  # feasible: none missing
        if partial:
            gp.source, gp.in_place = sources[g]
        groups.append(gp)
    return ReusePlan(num_tokens, num_full, partial, groups)


def partial_source(
    pool: BlockPool,
    config: KvCacheConfig,
    hit: Block | None,
    parent: BlockKey,
    wanted: tuple[int, ...],
    items: tuple[HashedItem, ...],
    start: int,
) -> tuple[Block | None, int]:
    """The cached block of ``pool`` sharing the most leading tokens with ``wanted`` (the block at
    token ``start``), and how many it shares.

    Candidates are the full match of this block if any, else the cached children of the
    previous block that start with the wanted first token. Without copy_on_partial_reuse a
    device candidate qualifies only if it can be taken in place (no holder, no children); a
    host candidate is always copied (onboarded) to a fresh page.
    """
    if hit is not None:
        candidates = [hit]
    else:  # a useful candidate shares at least the first token
        candidates = list(pool.tree.children_starting_with(parent, wanted[0]).values()) if wanted else []
    best: Block | None = None
    best_count = 0
    for block in candidates:
        if not pool.intact(block):
            continue
        if not config.copy_on_partial_reuse and block.tier is Tier.DEVICE and not pool.can_take_in_place(block):
            continue
        count = 0
        for a, b in zip(wanted, block.token_ids):
            if a != b:
                break
            count += 1
        if count and items_in(block.items, start, start + count) != items_in(items, start, start + count):
            continue
        if count > best_count or (count == best_count and best is not None and best.tier is not Tier.DEVICE):
            best, best_count = block, count
    return best, best_count


def fits(pools: Sequence[BlockPool], plan: ReusePlan) -> bool:
    """Whether every pool has the device pages the plan's onboards and copies need."""
    for pool, gp in zip(pools, plan.groups):
        need = sum(1 for b in gp.held if b.tier is not Tier.DEVICE)
        reserved = sum(1 for b in gp.held if b.tier is Tier.DEVICE and b.ref_count == 0)
        if gp.source is not None:
            need += not gp.in_place
            reserved += gp.source.tier is Tier.DEVICE and gp.source.ref_count == 0
        if need > pool.num_available() - reserved:
            return False
    return True
