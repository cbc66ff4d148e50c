"""Manager V2: the device-side allocation state of one layer group's page pool.

The whole state (free page stack, reference counts, release stamps, block tables, sequence
lengths and a hashed block index for prefix reuse) is one ``flax.struct`` pytree,
``DeviceBlockPool``, updated by pure jitted functions, so allocation can run inside a jitted
decode loop with no host round trip (``decode.decode_steps``). The host only hashes: it derives
each full block's 64-bit index key from the BLAKE3 block key it already computes
(``index_key``).

Axis names are ``kvjax/axes.py``'s: ``num_pages`` (the group's pool, the null page
``NULL_PAGE`` included), ``max_seqs`` (block-table rows, the sequence slots),
``pages_per_seq`` (block-table width; ``DeviceBlockPool.max_blocks`` holds it) and
``tokens_per_block`` (tokens per page and block). Besides them, ``index_slots`` counts the
slots of the open-addressing block index (a power of two >= 2 num_pages).

Life of a page (the null page is never handed out)::

    free --take--> private --commit_blocks--> cached, referenced --free_row--> cached, unreferenced
      ^               |                                ^                               |
      |            free_row                         match_prefix + acquire_prefix  <---+
      +---------------+-----------------------------------------------evict_lru <------+

A page is on the free stack iff no row holds it and it holds no indexed block. An indexed
page with reference count 0 stays matchable until ``evict_lru`` (or a ``take_pages`` that
runs out of free pages) reclaims the least recently released one. Release stamps number the
blocks of a released row from its last block, so a sequence's leaves go before its parents.

Identical blocks are not merged: committing a block whose key is already indexed leaves the
new page private (freed with its row), so block tables never change under a running row.

Index keys are the first 64 bits of a BLAKE3 digest that already chains the whole prefix
(salt, adapter and multimodal items included), so two different prefixes share an index key
with probability about n^2 / 2^65 for n cached blocks; a shared key would hand the wrong
block to a request, as a shared digest would in the host manager.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.layout import NULL_PAGE

EMPTY = -1
"""Index slot never used since the index was built (ends a probe sequence)."""
TOMBSTONE = -2
"""Index slot whose block was evicted (probes go on past it; inserts may reuse it)."""
_NO_PAGE = -1
_MAX_STAMP = np.iinfo(np.int32).max


@flax.struct.dataclass
class DeviceBlockPool:
    """Allocation state of one page pool (all arrays int32 unless noted).

    Attributes:
      free_pages: [num_pages] stack; entries [0, num_free) are the free page ids.
      num_free: [] free pages on the stack.
      ref_counts: [num_pages] block-table entries pointing at each page.
      last_use: [num_pages] release stamp (larger = released later).
      clock: [] next release stamp.
      key_hi, key_lo: [num_pages] uint32 index key of the block a page holds (where indexed).
      indexed: [num_pages] bool, the page holds a block present in the index.
      index_slot: [num_pages] the index slot naming the page (-1 where not indexed).
      index: [index_slots] page id per slot, ``EMPTY`` or ``TOMBSTONE``.
      block_tables: [max_seqs, pages_per_seq] page of each block of each row (``NULL_PAGE`` past
        ``num_blocks``).
      num_blocks: [max_seqs] pages held by each row.
      seq_lens: [max_seqs] tokens each row has cache slots for.
      tokens_per_block: tokens per page (static).
    """

    free_pages: jax.Array
    num_free: jax.Array
    ref_counts: jax.Array
    last_use: jax.Array
    clock: jax.Array
    key_hi: jax.Array
    key_lo: jax.Array
    indexed: jax.Array
    index_slot: jax.Array
    index: jax.Array
    block_tables: jax.Array
    num_blocks: jax.Array
    seq_lens: jax.Array
    tokens_per_block: int = flax.struct.field(pytree_node=False)

    @property
    def num_pages(self) -> int:
        return self.ref_counts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_blocks(self) -> int:
        """pages_per_seq, the block-table width."""
        return self.block_tables.shape[1]


def init_block_pool(num_pages: int, max_seqs: int, max_blocks: int, tokens_per_block: int) -> DeviceBlockPool:
    """An empty pool: every page but ``NULL_PAGE`` free, no rows, an empty index.

    Raises:
      ValueError: naming the argument outside its range.
    """
    for name, value, low in (("num_pages", num_pages, 2), ("max_seqs", max_seqs, 1), ("max_blocks", max_blocks, 1),
                             ("tokens_per_block", tokens_per_block, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    slots = 1 << (2 * num_pages - 1).bit_length()
    free = np.zeros(num_pages, np.int32)
    free[: num_pages - 1] = np.arange(num_pages - 1, 0, -1)  # page 1 on top
    return DeviceBlockPool(
        free_pages=jnp.asarray(free),
        num_free=jnp.int32(num_pages - 1),
        ref_counts=jnp.zeros(num_pages, jnp.int32),
        last_use=jnp.zeros(num_pages, jnp.int32),
        clock=jnp.int32(1),
        key_hi=jnp.zeros(num_pages, jnp.uint32),
        key_lo=jnp.zeros(num_pages, jnp.uint32),
        indexed=jnp.zeros(num_pages, bool),
        index_slot=jnp.full(num_pages, _NO_PAGE, jnp.int32),
        index=jnp.full(slots, EMPTY, jnp.int32),
        block_tables=jnp.full((max_seqs, max_blocks), NULL_PAGE, jnp.int32),
        num_blocks=jnp.zeros(max_seqs, jnp.int32),
        seq_lens=jnp.zeros(max_seqs, jnp.int32),
        tokens_per_block=int(tokens_per_block),
    )


def index_key(block_key: bytes) -> tuple[int, int]:
    """(hi, lo) uint32 words of a block's 64-bit index key: the first 8 bytes of its BLAKE3
    key, little-endian (lo = bytes 0-3)."""
    lo = int.from_bytes(block_key[0:4], "little")
    hi = int.from_bytes(block_key[4:8], "little")
    return hi, lo


def index_keys(block_keys: list[bytes], width: int) -> tuple[np.ndarray, np.ndarray]:
    """([width] hi, [width] lo) uint32 index keys of ``block_keys``, zero-padded to ``width``."""
    hi = np.zeros(width, np.uint32)
    lo = np.zeros(width, np.uint32)
    for i, key in enumerate(block_keys):
        hi[i], lo[i] = index_key(key)
    return hi, lo


def select(ok: jax.Array, new: DeviceBlockPool, old: DeviceBlockPool) -> DeviceBlockPool:
    """``new`` where ``ok`` ([] bool) else ``old``, leaf by leaf (to discard a failed update)."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _home(pool: DeviceBlockPool, lo: jax.Array) -> jax.Array:
    return (lo & jnp.uint32(pool.index.shape[0] - 1)).astype(jnp.int32)


def lookup(pool: DeviceBlockPool, hi: jax.Array, lo: jax.Array) -> jax.Array:
    """[] page holding the block with index key (hi, lo), or -1 (linear probing from the key's
    home slot until an ``EMPTY`` slot, at most index_slots probes)."""
    mask = pool.index.shape[0] - 1

    def cond(carry: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        slot, steps, found = carry
        return (found < 0) & (steps <= mask) & (pool.index[slot] != EMPTY)

    def body(carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        slot, steps, found = carry
        page = pool.index[slot]
        p = jnp.maximum(page, 0)
        hit = (page >= 0) & (pool.key_hi[p] == hi) & (pool.key_lo[p] == lo)
        return (slot + 1) & mask, steps + 1, jnp.where(hit, page, found)

    _, _, found = jax.lax.while_loop(cond, body, (_home(pool, lo), jnp.int32(0), jnp.int32(_NO_PAGE)))
    return found


@jax.jit
def match_prefix(
    pool: DeviceBlockPool, hi: jax.Array, lo: jax.Array, num_keys: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Longest run of leading blocks found in the index.

    Args:
      hi, lo: [width] uint32 index keys of a prompt's full blocks, in order (``index_keys``;
        the manager pads them to pages_per_seq).
      num_keys: [] how many of them are real (the rest is padding).

    Returns:
      (num_matched [], pages [width]: the matched blocks' pages, -1 past the run).
    """
    pages = jax.vmap(lambda h, low: lookup(pool, h, low))(hi, lo)
    hit = (pages >= 0) & (jnp.arange(pages.shape[0]) < num_keys)
    run = jnp.cumprod(hit.astype(jnp.int32))
    return run.sum(), jnp.where(run > 0, pages, _NO_PAGE)


def num_available(pool: DeviceBlockPool) -> jax.Array:
    """[] pages that can be handed out now: free ones plus indexed unreferenced ones."""
    return pool.num_free + jnp.sum(pool.indexed & (pool.ref_counts == 0))


def evict_lru(pool: DeviceBlockPool, count: jax.Array) -> DeviceBlockPool:
    """Evicts up to ``count`` indexed unreferenced pages, least recently released first (ties
    by page id): they leave the index and go on the free stack."""
    n = pool.num_pages
    candidate = pool.indexed & (pool.ref_counts == 0)
    order = jnp.argsort(jnp.where(candidate, pool.last_use, _MAX_STAMP), stable=True)
    rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    evict = candidate & (rank < count)
    slots = jnp.where(evict, pool.index_slot, pool.index.shape[0])
    position = pool.num_free + jnp.cumsum(evict) - 1
    return dataclasses.replace(
        pool,
        index=pool.index.at[slots].set(TOMBSTONE, mode="drop"),
        index_slot=jnp.where(evict, _NO_PAGE, pool.index_slot),
        indexed=pool.indexed & ~evict,
        free_pages=pool.free_pages.at[jnp.where(evict, position, n)].set(jnp.arange(n, dtype=jnp.int32), mode="drop"),
        num_free=pool.num_free + jnp.sum(evict, dtype=jnp.int32),
    )


def take_pages(pool: DeviceBlockPool, need: jax.Array) -> tuple[DeviceBlockPool, jax.Array, jax.Array]:
    """One page for each True entry of ``need`` (1-D bool: a row's [pages_per_seq] blocks or
    the [max_seqs] rows), from the free stack, evicting LRU pages when the stack runs short.
    The pages get reference count 1.

    Returns:
      (pool, pages shaped like ``need``: ``NULL_PAGE`` where not needed, ok []: enough pages
      were available; when False the returned pool must be discarded).
    """
    m = jnp.sum(need, dtype=jnp.int32)
    ok = m <= num_available(pool)
    pool = evict_lru(pool, jnp.maximum(m - pool.num_free, 0))
    rank = jnp.cumsum(need) - 1
    pages = jnp.where(need, pool.free_pages[jnp.clip(pool.num_free - 1 - rank, 0)], NULL_PAGE)
    pool = dataclasses.replace(
        pool,
        num_free=pool.num_free - m,
        ref_counts=pool.ref_counts.at[pages].add(need.astype(jnp.int32)),
    )
    return pool, pages, ok


@jax.jit
def allocate(pool: DeviceBlockPool, row: jax.Array, num_tokens: jax.Array) -> tuple[DeviceBlockPool, jax.Array]:
    """Grows ``row`` to cache slots for its first ``num_tokens`` tokens (<= pages_per_seq pages).

    Returns:
      (pool, ok []): unchanged pool and False when the pool lacks the pages.
    """
    j = jnp.arange(pool.max_blocks)
    held = pool.num_blocks[row]
    target = (num_tokens + pool.tokens_per_block - 1) // pool.tokens_per_block
    need = (j >= held) & (j < target)
    new, pages, ok = take_pages(pool, need)
    new = dataclasses.replace(
        new,
        block_tables=new.block_tables.at[row].set(jnp.where(need, pages, new.block_tables[row])),
        num_blocks=new.num_blocks.at[row].set(jnp.maximum(held, target)),
        seq_lens=new.seq_lens.at[row].set(jnp.maximum(new.seq_lens[row], num_tokens)),
    )
    return select(ok, new, pool), ok


def append_tokens(pool: DeviceBlockPool, active: jax.Array) -> tuple[DeviceBlockPool, jax.Array, jax.Array]:
    """Gives every active row a cache slot for one more token, taking a page for each row
    whose last page is full.

    Args:
      active: [max_seqs] bool.

    Returns:
      (pool, positions [max_seqs]: the new tokens' positions, -1 for inactive rows, ok []);
      when ok is False the returned pool must be discarded.
    """
    rows = jnp.arange(pool.max_seqs)
    position = pool.seq_lens
    need = active & (position == pool.num_blocks * pool.tokens_per_block)
    pool, pages, ok = take_pages(pool, need)
    column = jnp.where(need, pool.num_blocks, pool.max_blocks)
    pool = dataclasses.replace(
        pool,
        block_tables=pool.block_tables.at[rows, column].set(pages, mode="drop"),
        num_blocks=pool.num_blocks + need,
        seq_lens=pool.seq_lens + active,
    )
    return pool, jnp.where(active, position, -1), ok


def _insert(pool: DeviceBlockPool, page: jax.Array, hi: jax.Array, lo: jax.Array) -> DeviceBlockPool:
    mask = pool.index.shape[0] - 1
    slot = jax.lax.while_loop(lambda s: pool.index[s] >= 0, lambda s: (s + 1) & mask, _home(pool, lo))
    return dataclasses.replace(
        pool,
        index=pool.index.at[slot].set(page),
        index_slot=pool.index_slot.at[page].set(slot),
        indexed=pool.indexed.at[page].set(True),
        key_hi=pool.key_hi.at[page].set(hi),
        key_lo=pool.key_lo.at[page].set(lo),
    )


@jax.jit
def commit_blocks(
    pool: DeviceBlockPool, rows: jax.Array, blocks: jax.Array, hi: jax.Array, lo: jax.Array, valid: jax.Array
) -> DeviceBlockPool:
    """Enters full blocks into the index, in order.

    Args:
      rows, blocks: [width] block ``blocks[i]`` of row ``rows[i]``, whose page holds its tokens.
      hi, lo: [width] uint32 index keys of those blocks (``index_keys``).
      valid: [width] bool; False entries are padding.

    A block whose key is already indexed (an identical block in another page), or whose page
    is already indexed, is skipped.
    """

    def body(i: int, pool: DeviceBlockPool) -> DeviceBlockPool:
        page = pool.block_tables[rows[i], blocks[i]]
        fresh = valid[i] & (page != NULL_PAGE) & ~pool.indexed[page] & (lookup(pool, hi[i], lo[i]) < 0)
        return jax.lax.cond(fresh, lambda s: _insert(s, page, hi[i], lo[i]), lambda s: s, pool)

    return jax.lax.fori_loop(0, rows.shape[0], body, pool)


@jax.jit
def acquire_prefix(pool: DeviceBlockPool, row: jax.Array, pages: jax.Array, num_matched: jax.Array) -> DeviceBlockPool:
    """Points an empty ``row`` at the first ``num_matched`` of ``pages`` [width] (from
    ``match_prefix``; width <= pages_per_seq), taking a reference on each."""
    j = jnp.arange(pages.shape[0])
    take = j < num_matched
    table = pool.block_tables[row].at[j].set(jnp.where(take, pages, NULL_PAGE))
    return dataclasses.replace(
        pool,
        ref_counts=pool.ref_counts.at[jnp.where(take, pages, pool.num_pages)].add(1, mode="drop"),
        block_tables=pool.block_tables.at[row].set(table),
        num_blocks=pool.num_blocks.at[row].set(num_matched),
        seq_lens=pool.seq_lens.at[row].set(num_matched * pool.tokens_per_block),
    )


@jax.jit
def free_row(pool: DeviceBlockPool, row: jax.Array) -> DeviceBlockPool:
    """Releases every page of ``row`` and empties it. Pages left unreferenced go back to the
    free stack unless they hold an indexed block, which stays matchable (and evictable),
    stamped so that the row's later blocks are evicted before its earlier ones."""
    n = pool.num_pages
    j = jnp.arange(pool.max_blocks)
    count = pool.num_blocks[row]
    held = j < count
    pages = pool.block_tables[row]
    target = jnp.where(held, pages, n)
    ref_counts = pool.ref_counts.at[target].add(-1, mode="drop")
    last_use = pool.last_use.at[target].set(pool.clock + count - 1 - j, mode="drop")
    freed = held & (ref_counts[pages] == 0) & ~pool.indexed[pages]
    position = pool.num_free + jnp.cumsum(freed) - 1
    return dataclasses.replace(
        pool,
        ref_counts=ref_counts,
        last_use=last_use,
        clock=pool.clock + count,
        free_pages=pool.free_pages.at[jnp.where(freed, position, n)].set(pages, mode="drop"),
        num_free=pool.num_free + jnp.sum(freed, dtype=jnp.int32),
        block_tables=pool.block_tables.at[row].set(NULL_PAGE),
        num_blocks=pool.num_blocks.at[row].set(0),
        seq_lens=pool.seq_lens.at[row].set(0),
    )


evict = jax.jit(evict_lru)
"""``evict_lru`` as its own dispatch (host callers)."""


available = jax.jit(num_available)
"""``num_available`` as its own dispatch (host callers)."""


def check_invariants(pool: DeviceBlockPool) -> None:
    """Raises ``AssertionError`` naming the first broken invariant (host-side, for tests):

    * the free stack holds distinct pages, none the null page, each unreferenced and not
      indexed, and every other page is referenced or indexed;
    * each page's reference count equals the block-table entries pointing at it;
    * the index names exactly the indexed pages, each at its recorded slot, under its key.
    """
    s = jax.device_get(pool)
    n = s.ref_counts.shape[0]
    free = s.free_pages[: int(s.num_free)]
    assert len(set(free.tolist())) == len(free), f"free stack has duplicates: {sorted(free.tolist())}"
    assert NULL_PAGE not in free, "the null page is on the free stack"
    assert not s.ref_counts[free].any(), f"free pages {free[s.ref_counts[free] > 0]} are referenced"
    assert not s.indexed[free].any(), f"free pages {free[s.indexed[free]]} are indexed"
    in_use = (s.ref_counts > 0) | s.indexed
    assert len(free) + int(in_use[1:].sum()) == n - 1, "a page is neither free nor referenced nor indexed"
    expected = np.zeros(n, np.int64)
    for row in range(s.block_tables.shape[0]):
        for page in s.block_tables[row, : int(s.num_blocks[row])]:
            expected[page] += 1
        assert (s.block_tables[row, int(s.num_blocks[row]) :] == NULL_PAGE).all(), (
            f"row {row} has pages past num_blocks"
        )
    assert (expected == s.ref_counts).all(), f"ref counts {s.ref_counts} != block-table entries {expected}"
    named = {int(p): slot for slot, p in enumerate(s.index) if p >= 0}
    assert set(named) == set(np.flatnonzero(s.indexed).tolist()), "index and indexed pages disagree"
    for page, slot in named.items():
        assert s.index_slot[page] == slot, f"page {page} is at slot {slot} but records {s.index_slot[page]}"
    keys = {(int(s.key_hi[p]), int(s.key_lo[p])) for p in named}
    assert len(keys) == len(named), "two indexed pages share a key"


__all__ = [
    "EMPTY",
    "TOMBSTONE",
    "DeviceBlockPool",
    "acquire_prefix",
    "allocate",
    "append_tokens",
    "available",
    "check_invariants",
    "commit_blocks",
    "evict",
    "evict_lru",
    "free_row",
    "index_key",
    "index_keys",
    "init_block_pool",
    "lookup",
    "match_prefix",
    "num_available",
    "select",
    "take_pages",
]
