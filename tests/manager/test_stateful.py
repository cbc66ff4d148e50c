"""Random add/allocate/commit/rollback/free/expire sequences against a simulated engine.

The simulated engine executes every PageOp on fake device and host pools and writes, for each
committed token, a stand-in for its KV: (root key, all tokens up to and including it), which
is exactly what a token's KV depends on. After every step:

* ``check_consistency()``: no leaked or double-owned page, exact ref counts and queues,
  consistent tree, ordered slot counts;
* every page a live request holds contains that request's KV for its committed positions, so
  no block in use was evicted or overwritten and every reuse (full, partial, onboarded) read
  the right data;
* every cached block, on any tier (device, host, disk), holds the KV of its key's prefix;
* stats agree with the requests.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvjax.cache import NULL_PAGE, CacheLayout
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import KeyExtras, KVCacheManager, OutOfPagesError
from kvjax.manager.tiers import Tier

PS = 4
MAX_LEN = 48
BASES = [(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), (1, 2, 3, 4, 20, 21), (30, 31, 32, 33, 34, 35, 36, 37)]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        windows=st.sampled_from([(MAX_LEN,), (MAX_LEN, 8), (MAX_LEN, 5, MAX_LEN)]),
        device_pages=st.integers(5, 12),
        host_pages=st.sampled_from([0, 2, 6]),
        disk_pages=st.sampled_from([0, 3, 8]),
        reuse=st.sampled_from([True, True, True, False]),
        partial=st.booleans(),
        copy=st.booleans(),
        offload_min=st.sampled_from([0, 35, 60]),
    )
    def setup(self, windows, device_pages, host_pages, disk_pages, reuse, partial, copy, offload_min):
        self.clock = Clock()
        disk_pages = disk_pages if host_pages else 0
        config = KvCacheConfig(
            tokens_per_block=PS,
            enable_block_reuse=reuse,
            enable_partial_reuse=partial,
            copy_on_partial_reuse=copy,
            secondary_offload_min_priority=offload_min,
            event_buffer_max_size=64,
        )
        capped = tuple(min(w, MAX_LEN) for w in windows)
        layout = CacheLayout(
            layer_windows=capped, num_pages=(device_pages,) * len(dict.fromkeys(capped)), tokens_per_block=PS,
            num_kv_heads=1, head_dim=1, max_seq_len=MAX_LEN, num_host_pages=host_pages, num_disk_pages=disk_pages,
        )
        self.mgr = KVCacheManager(config, layout, clock=self.clock)
        groups = len(self.mgr.group_windows)
        self.device = [[[None] * PS for _ in range(device_pages)] for _ in range(groups)]
        self.host = [[[None] * PS for _ in range(host_pages)] for _ in range(groups)]
        self.disk = [[[None] * PS for _ in range(disk_pages)] for _ in range(groups)]
        self.expected: dict[bytes, tuple] = {}
        self.next_id = 0

    # ------------------------------------------------------------------ simulated engine

    def _kv(self, rid: str, pos: int):
        seq = self.mgr.sequences[rid]
        return (seq.root, tuple(seq.tokens[: pos + 1]))

    def _execute_ops(self) -> None:
        for op in self.mgr.take_page_ops():
            if op.kind == "offload":
                self.host[op.group][op.dst] = list(self.device[op.group][op.src])
            elif op.kind == "spill":
                self.disk[op.group][op.dst] = list(self.host[op.group][op.src])
            elif op.kind in ("onboard", "onboard_disk"):
                source = self.host if op.kind == "onboard" else self.disk
                self.device[op.group][op.dst] = list(source[op.group][op.src])
            else:
                assert op.src != op.dst
                self.device[op.group][op.dst] = list(self.device[op.group][op.src])

    def _live(self):
        return list(self.mgr.sequences)

    # ------------------------------------------------------------------ rules

    def _write_and_commit(self, rid: str, tokens: list[int]) -> None:
        """The forward pass writes the new tokens' KV through the block table, then commits."""
        seq = self.mgr.sequences[rid]
        n0 = len(seq.tokens)
        everything = seq.tokens + tokens
        for g in range(len(self.mgr.pools)):
            table = self.mgr.block_table(rid, g)
            for p in range(n0, n0 + len(tokens)):
                page = table[p // PS]
                assert page != NULL_PAGE, "a slot to write has no page"
                self.device[g][page][p % PS] = (seq.root, tuple(everything[: p + 1]))
        self.mgr.commit_tokens(rid, tokens)
        for b, key in enumerate(seq.keys):
            self.expected.setdefault(key, tuple(self._kv(rid, p) for p in range(b * PS, (b + 1) * PS)))
        self._execute_ops()

    def _allocate(self, rid: str, total: int) -> bool:
        before = self.mgr.state_dict()
        try:
            self.mgr.allocate(rid, min(total, MAX_LEN))
        except OutOfPagesError:
            assert self.mgr.state_dict() == before, "a failed allocate changed the state"
            return False
        self._execute_ops()
        return True

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(1, 10),
        suffix=st.sampled_from([[], [0], [0, 1, 2, 3], [1, 1, 1, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3, 9]])
        | st.lists(st.integers(0, 3), max_size=12),
        salt=st.sampled_from([None, None, None, "tenant"]),
        priority=st.sampled_from([None, None, 10, 34, 35, 80]),
        duration=st.sampled_from([None, 500.0]),
        chunk=st.sampled_from([None, 3, 5, 64]),
    )
    def add(self, base, cut, suffix, salt, priority, duration, chunk):
        """Adds a request; unless ``chunk`` is None, prefills its whole prompt in chunks."""
        prompt = list(base[:cut]) + suffix
        retention = None
        if priority is not None:
            retention = KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, priority, duration),))
        rid = f"r{self.next_id}"
        self.next_id += 1
        reused = self.mgr.add_request(rid, prompt, retention=retention, extras=KeyExtras(cache_salt=salt))
        assert 0 <= reused <= len(prompt) - 1
        self._execute_ops()
        if not self._allocate(rid, len(prompt)):
            self.mgr.free_request(rid)
            return
        seq = self.mgr.sequences[rid]
        while chunk is not None and len(seq.tokens) < len(prompt):
            n0 = len(seq.tokens)
            self._write_and_commit(rid, prompt[n0 : n0 + chunk])

    @precondition(lambda self: any(len(s.tokens) < len(s.prompt) for s in self.mgr.sequences.values()))
    @rule(data=st.data())
    def prefill_chunk(self, data):
        rid = data.draw(st.sampled_from([r for r, s in self.mgr.sequences.items() if len(s.tokens) < len(s.prompt)]))
        seq = self.mgr.sequences[rid]
        n0 = len(seq.tokens)
        if seq.num_allocated == n0 and not self._allocate(rid, len(seq.prompt)):
            return
        k = data.draw(st.integers(1, min(seq.num_allocated, len(seq.prompt)) - n0))
        self._write_and_commit(rid, list(seq.prompt[n0 : n0 + k]))

    @precondition(lambda self: any(len(s.tokens) >= len(s.prompt) for s in self.mgr.sequences.values()))
    @rule(data=st.data(), drafts=st.integers(0, 4), token=st.integers(0, 2))
    def decode(self, data, drafts, token):
        """One target token plus ``drafts`` draft tokens; a random number are accepted."""
        rid = data.draw(st.sampled_from([r for r, s in self.mgr.sequences.items() if len(s.tokens) >= len(s.prompt)]))
        seq = self.mgr.sequences[rid]
        n0 = len(seq.tokens)
        if n0 >= MAX_LEN or not self._allocate(rid, n0 + 1 + drafts):
            return
        accepted = data.draw(st.integers(1, seq.num_allocated - n0))
        self._write_and_commit(rid, [token] * accepted)
        self.mgr.rollback(rid, seq.num_allocated - len(seq.tokens))

    @precondition(lambda self: self.mgr.sequences)
    @rule(data=st.data(), extra=st.integers(0, 12))
    def allocate(self, data, extra):
        rid = data.draw(st.sampled_from(self._live()))
        self._allocate(rid, self.mgr.sequences[rid].num_allocated + extra)

    @precondition(lambda self: self.mgr.sequences)
    @rule(data=st.data())
    def rollback(self, data):
        rid = data.draw(st.sampled_from(self._live()))
        seq = self.mgr.sequences[rid]
        self.mgr.rollback(rid, data.draw(st.integers(0, seq.num_allocated - len(seq.tokens))))

    @precondition(lambda self: self.mgr.sequences)
    @rule(data=st.data())
    def free(self, data):
        self.mgr.free_request(data.draw(st.sampled_from(self._live())))

    @rule(seconds=st.sampled_from([0.1, 0.6]))
    def tick(self, seconds):
        self.clock.now += seconds

    @precondition(lambda self: not self.mgr.sequences)
    @rule()
    def clear(self):
        self.mgr.clear_cache()
        self.expected.clear()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def bookkeeping_is_consistent(self):
        self.mgr.check_consistency()

    @invariant()
    def held_pages_hold_the_requests_kv(self):
        for rid, seq in self.mgr.sequences.items():
            for g, blocks in enumerate(seq.blocks):
                for b, block in enumerate(blocks):
                    if block is None:
                        continue
                    for p in range(b * PS, min((b + 1) * PS, len(seq.tokens))):
                        assert self.device[g][block.page][p % PS] == self._kv(rid, p), (rid, g, b, p)

    @invariant()
    def cached_blocks_hold_their_prefix_kv(self):
        for g, pool in enumerate(self.mgr.pools):
            for key, block in pool.tree.blocks.items():
                pages = {Tier.DEVICE: self.device, Tier.HOST: self.host, Tier.DISK: self.disk}[block.tier][g]
                assert tuple(pages[block.page]) == self.expected[key], (g, block)

    @invariant()
    def stats_agree_with_requests(self):
        s = self.mgr.stats
        assert s.reused_tokens <= s.prompt_tokens and s.reused_blocks <= s.prompt_blocks
        assert s.device_evictions >= s.offloaded_pages >= 0 and s.host_evictions >= s.spilled_pages >= 0
        assert s.onboarded_pages >= s.disk_onboarded_pages >= 0
        for seq in self.mgr.sequences.values():
            assert seq.stats.reused_tokens < max(seq.stats.prompt_tokens, 1)


class _Draws:
    """Stands in for hypothesis' ``data`` in a replayed example: draws come from a list."""

    def __init__(self, *values) -> None:
        self.values = list(values)

    def draw(self, _strategy):
        return self.values.pop(0)


def test_spilling_a_host_block_that_drops_its_last_disk_child_queues_it_once():
    """A host victim spilled to a full disk tier whose LRU victim is the host block's own disk
    child: dropping the child must not queue the host block on the host tier again (it left
    that queue; it lands on the disk tier). Found by the machine above."""
    m = CacheMachine()
    m.setup(windows=(MAX_LEN,), device_pages=6, host_pages=2, disk_pages=3, reuse=True, partial=False, copy=False,
            offload_min=0)
    steps = [
        ("add", dict(base=BASES[0], cut=3, suffix=[], chunk=3, priority=None)),
        ("decode", dict(data=_Draws("r0", 1), drafts=0, token=0)),
        ("free", dict(data=_Draws("r0"))),
        ("add", dict(base=BASES[2], cut=8, suffix=[0, 1, 2, 3, 0, 1, 2, 3, 9], chunk=3, priority=None)),
        ("decode", dict(data=_Draws("r1", 3), drafts=2, token=0)),
        ("free", dict(data=_Draws("r1"))),
        ("add", dict(base=BASES[0], cut=8, suffix=[], chunk=3, priority=10)),
        ("free", dict(data=_Draws("r2"))),
        ("add", dict(base=BASES[0], cut=1, suffix=[], chunk=None, priority=None)),
        ("add", dict(base=BASES[0], cut=1, suffix=[0, 1, 2, 3], chunk=None, priority=None)),
        ("allocate", dict(data=_Draws("r3"), extra=8)),
    ]
    for name, kwargs in steps:
        if name == "add":
            kwargs = dict(salt=None, duration=None, **kwargs)
        getattr(m, name)(**kwargs)
        m.bookkeeping_is_consistent()
        m.cached_blocks_hold_their_prefix_kv()
        m.held_pages_hold_the_requests_kv()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
