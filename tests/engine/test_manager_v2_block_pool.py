"""Manager V2's functional page pool: exact ids on a tiny pool, and hypothesis-driven
sequences of allocate / append / commit / match / free / evict that keep its invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvjax.cache.layout import NULL_PAGE
from kvjax.engine.manager_v2 import block_pool as F
from kvjax.manager.hashing import block_key, root_key

PAGE = 2
PAGES = 9
ROWS = 3
BLOCKS = 4


def chain(tokens: list[int]) -> list[bytes]:
    """Host block keys of the full blocks of ``tokens``."""
    keys, parent = [], root_key(None, None)
    for b in range(len(tokens) // PAGE):
        parent = block_key(parent, tokens[b * PAGE : (b + 1) * PAGE], ())
        keys.append(parent)
    return keys


def commit_all(pool: F.DeviceBlockPool, row: int, keys: list[bytes]) -> F.DeviceBlockPool:
    hi, lo = F.index_keys(keys, BLOCKS)
    n = len(keys)
    return F.commit_blocks(
        pool, jnp.full(BLOCKS, row), jnp.arange(BLOCKS), jnp.asarray(hi), jnp.asarray(lo), jnp.arange(BLOCKS) < n
    )


def test_init_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_pages=1 must be an int >= 2"):
        F.init_block_pool(1, 2, 2, 2)
    with pytest.raises(ValueError, match="tokens_per_block=0"):
        F.init_block_pool(4, 2, 2, 0)


def test_exact_pages_reuse_and_leaf_first_eviction() -> None:
    pool = F.init_block_pool(PAGES, ROWS, BLOCKS, PAGE)
    pool, ok = F.allocate(pool, 0, 7)  # 4 pages, taken from the top of the stack: 1, 2, 3, 4
    assert bool(ok) and pool.block_tables[0].tolist() == [1, 2, 3, 4]
    tokens = [5, 6, 7, 8, 9, 10, 11]
    keys = chain(tokens)
    pool = commit_all(pool, 0, keys)
    hi, lo = F.index_keys(keys, BLOCKS)
    n, pages = F.match_prefix(pool, jnp.asarray(hi), jnp.asarray(lo), 3)
    assert int(n) == 3 and pages.tolist() == [1, 2, 3, -1]
    pool = F.free_row(pool, 0)  # page 4 (partial block) is freed, pages 1-3 stay cached
    F.check_invariants(pool)
    assert int(pool.num_free) == PAGES - 1 - 3
    assert int(F.available(pool)) == PAGES - 1
    pool = F.acquire_prefix(pool, 1, pages, 2)
    assert pool.block_tables[1].tolist() == [1, 2, 0, 0] and pool.ref_counts[1:4].tolist() == [1, 1, 0]
    F.check_invariants(pool)
    pool = F.free_row(pool, 1)
    evicted = F.evict(pool, 1)  # the leaf of the chain (block 2, page 3) goes first
    assert evicted.indexed[1:4].tolist() == [True, True, False]
    evicted = F.evict(pool, 2)
    assert evicted.indexed[1:4].tolist() == [True, False, False]
    F.check_invariants(evicted)


def test_allocate_without_pages_changes_nothing() -> None:
    pool = F.init_block_pool(4, 2, 4, PAGE)  # 3 usable pages
    pool, ok = F.allocate(pool, 0, 4)
    assert bool(ok)
    before = jax.device_get(pool)
    after, ok = F.allocate(pool, 1, 4)
    assert not bool(ok)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(after))):
        np.testing.assert_array_equal(a, b)


def test_duplicate_block_stays_private() -> None:
    pool = F.init_block_pool(PAGES, ROWS, BLOCKS, PAGE)
    keys = chain([1, 2])
    pool, _ = F.allocate(pool, 0, 2)
    pool, _ = F.allocate(pool, 1, 2)
    pool = commit_all(commit_all(pool, 0, keys), 1, keys)
    assert pool.indexed[1:3].tolist() == [True, False]
    pool = F.free_row(pool, 1)
    F.check_invariants(pool)
    assert 2 in pool.free_pages[: int(pool.num_free)].tolist()


class PoolMachine(RuleBasedStateMachine):
    """Random operations on a 9-page pool (3 rows of up to 4 two-token blocks) over a
    two-token alphabet, so prompts share prefixes and the index is hit often."""

    @initialize()
    def start(self) -> None:
        self.pool = F.init_block_pool(PAGES, ROWS, BLOCKS, PAGE)
        self.tokens: list[list[int] | None] = [None] * ROWS

    @rule(row=st.integers(0, ROWS - 1), prompt=st.lists(st.integers(0, 1), min_size=1, max_size=PAGE * BLOCKS - 1))
    def admit(self, row: int, prompt: list[int]) -> None:
        if self.tokens[row] is not None:
            return
        keys = chain(prompt)[: (len(prompt) - 1) // PAGE]
        hi, lo = F.index_keys(keys, BLOCKS)
        n, pages = F.match_prefix(self.pool, jnp.asarray(hi), jnp.asarray(lo), len(keys))
        n = int(n)
        for b in range(n):  # matched pages hold exactly the prompt's blocks
            page = int(pages[b])
            assert bool(self.pool.indexed[page])
            assert (int(self.pool.key_hi[page]), int(self.pool.key_lo[page])) == F.index_key(keys[b])
        if n < len(keys):  # the run is maximal
            assert int(F.lookup(self.pool, jnp.uint32(hi[n]), jnp.uint32(lo[n]))) == -1
        pool = F.acquire_prefix(self.pool, row, pages, n)
        pool, ok = F.allocate(pool, row, len(prompt))
        if not bool(ok):
            pool = F.free_row(pool, row)
            F.check_invariants(pool)
            self.pool = pool
            return
        self.pool = pool
        self.tokens[row] = list(prompt)

    @precondition(lambda self: any(t is not None for t in self.tokens))
    @rule(mask=st.lists(st.booleans(), min_size=ROWS, max_size=ROWS), token=st.integers(0, 1))
    def append(self, mask: list[bool], token: int) -> None:
        active = [m and t is not None and len(t) < PAGE * BLOCKS for m, t in zip(mask, self.tokens)]
        pool, positions, ok = F.append_tokens(self.pool, jnp.asarray(active))
        if not bool(ok):
            return
        for row, a in enumerate(active):
            if a:
                assert int(positions[row]) == len(self.tokens[row])
                self.tokens[row].append(token)
            else:
                assert int(positions[row]) == -1
        self.pool = pool

    @rule(row=st.integers(0, ROWS - 1))
    def commit(self, row: int) -> None:
        if self.tokens[row] is not None:
            self.pool = commit_all(self.pool, row, chain(self.tokens[row]))

    @rule(row=st.integers(0, ROWS - 1))
    def free(self, row: int) -> None:
        if self.tokens[row] is not None:
            self.pool = F.free_row(self.pool, row)
            self.tokens[row] = None

    @rule(count=st.integers(0, PAGES))
    def evict(self, count: int) -> None:
        before = int(self.pool.num_free)
        self.pool = F.evict(self.pool, count)
        assert int(self.pool.num_free) - before <= count

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        F.check_invariants(self.pool)
        s = jax.device_get(self.pool)
        for row, tokens in enumerate(self.tokens):
            if tokens is None:
                assert s.num_blocks[row] == 0 and s.seq_lens[row] == 0
                continue
            assert s.seq_lens[row] == len(tokens) and s.num_blocks[row] == -(-len(tokens) // PAGE)
            assert NULL_PAGE not in s.block_tables[row, : s.num_blocks[row]].tolist()
            for b, key in enumerate(chain(tokens)):  # an indexed page in a row holds that row's block
                page = s.block_tables[row, b]
                if s.indexed[page]:
                    assert (int(s.key_hi[page]), int(s.key_lo[page])) == F.index_key(key)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
