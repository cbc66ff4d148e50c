"""``KVCacheManagerV2``: the thin host face of Manager V2 (``block_pool``), and its extension of
the ``CacheManager`` interface, ``DeviceBlockPoolManager``.

The allocation state of every layer group lives on the device as one ``DeviceBlockPool`` per
group; this class validates arguments, hashes blocks (the same BLAKE3 chain as the host
manager, truncated to 64-bit index keys) and calls the pure functions. It implements
``CacheManager`` (so the same scheduler drives it) and ``DeviceBlockPoolManager``: it exposes
``block_pools`` and ``row_of`` so the engine's on-device decode loop (``decode.DeviceDecode``) can take
pages without asking the host.

What V2 does not offer (it is no ``TieredCacheManager``; the engine refuses
``use_kv_cache_manager_v2='true'`` with them): host / disk tiers, KV cache events, retention
priorities, speculative decoding, CacheBlend chunks, recurrent state, snapshots. It reuses
whole blocks only (no partial-block reuse), and windowed layer groups keep every block of a
sequence (no release outside the window).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.layout import CacheLayout
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig
from kvjax.engine.manager_v2 import block_pool as F
from kvjax.manager.hashing import (
    NO_EXTRAS,
    BlockKey,
    KeyExtras,
    chain_keys,
    check_extras,
    check_token_ids,
    hash_items,
    pack_ids,
)
from kvjax.manager.interface import CacheManager, LayoutGeometry, OutOfPagesError
from kvjax.manager.stats import CacheStats, RequestStats
from kvjax.manager.tiers import PageOp


@runtime_checkable
class DeviceBlockPoolManager(CacheManager, Protocol):
    """A manager whose allocation state lives on the device (``KVCacheManagerV2``): the
    on-device decode loop (``decode.DeviceDecode``) reads and replaces ``block_pools`` and
    finds requests by row."""

    block_pools: tuple[F.DeviceBlockPool, ...]
    """One device block pool per layer group."""

    @property
    def max_blocks(self) -> int:
        """Block-table width: blocks of the longest sequence."""

    def row_of(self, request_id: str) -> int:
        """The block-table row holding ``request_id``."""


@dataclasses.dataclass(slots=True)
class _Row:
    """Host view of one request: its block-table row, its committed tokens and block keys."""

    row: int
    prompt: tuple[int, ...]
    root: BlockKey
    keys: list[BlockKey]
    tokens: list[int]
    num_allocated: int
    num_committed_blocks: int
    stats: RequestStats


class KVCacheManagerV2(LayoutGeometry):
    """Manager V2 over ``layout``'s device pools, one ``DeviceBlockPool`` per layer group.

    Args:
      config: reuse on/off (``enable_block_reuse``); the other policies are V1-only.
      layout: the cache geometry (pages per group, page size, max_seq_len).
      max_seqs: block-table rows, the most requests held at once (the scheduler's batch size).
    """

    def __init__(self, config: KvCacheConfig, layout: CacheLayout, max_seqs: int) -> None:
        self.config = config
        self.layout = layout
        max_blocks = layout.pages_for(layout.max_seq_len)
        self.block_pools: tuple[F.DeviceBlockPool, ...] = tuple(
            F.init_block_pool(n, max_seqs, max_blocks, layout.tokens_per_block) for n in layout.num_pages
        )
        """One device block pool per layer group; replaced by every call that changes it."""
        self._rows: dict[str, _Row] = {}
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._stats = CacheStats()

    @property
    def max_seqs(self) -> int:
        """Block-table rows: the most requests held at once."""
        return self.block_pools[0].max_seqs

    @property
    def max_blocks(self) -> int:
        """Block-table width: blocks of the longest sequence."""
        return self.block_pools[0].max_blocks

    def num_cached_blocks(self, group: int, tier: str = "device") -> int:
        """Indexed (reusable) blocks of ``group`` on ``tier`` ("device", "host" or "disk"; V2
        caches on the device only)."""
        if tier not in ("device", "host", "disk"):
            raise ValueError(f"tier={tier!r} must be 'device', 'host' or 'disk'")
        return int(np.asarray(self.block_pools[group].indexed).sum()) if tier == "device" else 0

    @property
    def stats(self) -> CacheStats:
        """Cumulative reuse counters (live object); V2 counts requests, prompt and reused
        tokens and blocks, and blocks entered into the index."""
        return self._stats

    def request_stats(self, request_id: str) -> RequestStats:
        return self._row(request_id).stats

    def request_ids(self) -> list[str]:
        return list(self._rows)

    def row_of(self, request_id: str) -> int:
        """The block-table row holding ``request_id``."""
        return self._row(request_id).row

    def num_tokens(self, request_id: str) -> int:
        """Committed tokens of a request (reused prefix included)."""
        return len(self._row(request_id).tokens)

    def num_free_pages(self, group: int) -> int:
        """Pages of ``group`` that can be handed out now (free plus unreferenced cached)."""
        return int(F.available(self.block_pools[group]))

    def block_table(self, request_id: str, group: int) -> list[int]:
        seq = self._row(request_id)
        block_pool = self.block_pools[group]
        n = -(-seq.num_allocated // self.tokens_per_block)
        return np.asarray(block_pool.block_tables[seq.row, :n]).tolist()

    def take_page_ops(self) -> list[PageOp]:
        """V2 queues no page copies (no tiers, no partial reuse)."""
        return []

    def prompt_block_keys(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> list[BlockKey]:
        """BLAKE3 keys of the prompt's full blocks (empty with enable_block_reuse=False)."""
        prompt = self._check_prompt(prompt_token_ids)
        check_extras(extras)
        if not self.config.enable_block_reuse:
            return []
        items = hash_items(extras.mm_items, len(prompt)) if extras.mm_items else ()
        return chain_keys(extras.root(), pack_ids(prompt), self.tokens_per_block, items)

    def estimate_reusable_tokens(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> int:
        """Tokens ``add_request`` would reuse right now (no side effects)."""
        keys = self.prompt_block_keys(prompt_token_ids, extras)
        return self._match(keys, len(prompt_token_ids))[0] * self.tokens_per_block

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        extras: KeyExtras = NO_EXTRAS,
        *,
        retention: KvCacheRetentionConfig | None = None,
        admit: Callable[[int], bool] | None = None,
    ) -> int | None:
        """Takes a block-table row and references the longest cached prefix held by every
        group (at most ``len(prompt) - 1`` tokens); returns the reused token count, or None
        when ``admit`` declines it (see ``CacheManager.add_request``).

        Raises:
          ValueError: a bad argument, a retention priority (V1 only), or every row is taken.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        if request_id in self._rows:
            raise ValueError(f"request_id={request_id!r} is already active; free it first or pick a new id")
        if retention is not None and retention != KvCacheRetentionConfig():
            raise ValueError("retention: retention priorities need the V1 manager (use_kv_cache_manager_v2='false')")
        if not self._free_rows:
            raise ValueError(f"all max_seqs={self.max_seqs} block-table rows are taken; free a request first")
        prompt = self._check_prompt(prompt_token_ids)
        keys = self.prompt_block_keys(prompt, extras)
        num_matched, pages = self._match(keys, len(prompt))
        if admit is not None and not admit(num_matched * self.tokens_per_block):
            return None
        row = self._free_rows.pop()
        self.block_pools = tuple(
            F.acquire_prefix(s, row, jnp.asarray(p), num_matched) for s, p in zip(self.block_pools, pages)
        )
        reused = num_matched * self.tokens_per_block
        stats = RequestStats(
            prompt_tokens=len(prompt), reused_tokens=reused, prompt_blocks=len(prompt) // self.tokens_per_block,
            reused_blocks=num_matched,
        )
        self._stats.add_request(stats)
        self._rows[request_id] = _Row(
            row=row, prompt=prompt, root=extras.root(), keys=list(keys), tokens=list(prompt[:reused]),
            num_allocated=reused, num_committed_blocks=num_matched, stats=stats,
        )
        return reused

    def allocate(self, request_id: str, num_total_tokens: int) -> None:
        """Takes device pages from each group's free stack (evicting least recently used cached
        pages when it runs short) until the request holds ``num_total_tokens`` slots; ``OutOfPagesError`` when a
        group runs out, with nothing changed (``CacheManager.allocate``)."""
        seq = self._row(request_id)
        self.check_num_tokens(num_total_tokens)
        if num_total_tokens <= seq.num_allocated:
            return
        new = []
        for g, block_pool in enumerate(self.block_pools):
            block_pool, ok = F.allocate(block_pool, seq.row, num_total_tokens)
            if not bool(ok):
                raise OutOfPagesError(
                    f"layer group {g} has {self.num_free_pages(g)} available page(s), too few for "
                    f"{num_total_tokens} tokens of request {request_id!r}"
                )
            new.append(block_pool)
        self.block_pools = tuple(new)
        seq.num_allocated = num_total_tokens

    def commit_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Records that the KV of ``token_ids`` (the request's next tokens) is written, and enters
        the blocks this fills into every group's index. Tokens written by the on-device decode
        loop (``decode.DeviceDecode``), whose slots the loop took itself, are reported here too."""
        seq = self._row(request_id)
        seq.tokens.extend(int(t) for t in token_ids)
        seq.num_allocated = max(seq.num_allocated, len(seq.tokens))
        if not self.config.enable_block_reuse:
            return
        full = len(seq.tokens) // self.tokens_per_block
        if full <= seq.num_committed_blocks:
            return
        ps = self.tokens_per_block
        if len(seq.keys) < full:
            parent = seq.keys[-1] if seq.keys else seq.root
            tail = pack_ids(seq.tokens[len(seq.keys) * ps : full * ps])
            seq.keys.extend(chain_keys(parent, tail, ps))
        first = seq.num_committed_blocks
        width = max(4, 1 << (full - first - 1).bit_length())
        hi, lo = F.index_keys(seq.keys[first:full], width)
        blocks = np.arange(first, first + width, dtype=np.int32)
        valid = np.arange(width) < full - first
        rows = np.full(width, seq.row, np.int32)
        self.block_pools = tuple(
            F.commit_blocks(s, jnp.asarray(rows), jnp.asarray(np.minimum(blocks, self.max_blocks - 1)), jnp.asarray(hi),
                            jnp.asarray(lo), jnp.asarray(valid))
            for s in self.block_pools
        )
        self._stats.stored_blocks += full - first
        seq.num_committed_blocks = full

    def free_request(self, request_id: str) -> None:
        """Drops the request's references; its indexed blocks stay matchable until evicted."""
        seq = self._row(request_id)
        self.block_pools = tuple(F.free_row(s, seq.row) for s in self.block_pools)
        self._free_rows.append(seq.row)
        del self._rows[request_id]

    def check_consistency(self) -> None:
        """Raises ``AssertionError`` if a group's device block pool breaks its invariants."""
        for block_pool in self.block_pools:
            F.check_invariants(block_pool)

    def _row(self, request_id: str) -> _Row:
        seq = self._rows.get(request_id)
        if seq is None:
            raise KeyError(f"request_id={request_id!r} is not active in the manager")
        return seq

    def _check_prompt(self, prompt_token_ids: Sequence[int]) -> tuple[int, ...]:
        prompt = check_token_ids(prompt_token_ids, "prompt_token_ids")
        if not 1 <= len(prompt) <= self.max_seq_len:
            raise ValueError(f"len(prompt_token_ids)={len(prompt)} must be in [1, max_seq_len={self.max_seq_len}]")
        return prompt

    def _match(self, keys: list[BlockKey], prompt_len: int) -> tuple[int, list[np.ndarray]]:
        """(blocks matched in every group, each group's matched pages [max_blocks])."""
        usable = min(len(keys), (prompt_len - 1) // self.tokens_per_block)
        empty = [np.full(self.max_blocks, -1, np.int32) for _ in self.block_pools]
        if usable < 1:
            return 0, empty
        hi, lo = F.index_keys(keys[:usable], self.max_blocks)
        found = [F.match_prefix(s, jnp.asarray(hi), jnp.asarray(lo), usable) for s in self.block_pools]
        num, pages = jax.device_get(found[0][0]), []
        for n, p in found:
            num = min(num, int(n))
            pages.append(np.asarray(p))
        return int(num), pages


__all__ = ["KVCacheManagerV2"]
