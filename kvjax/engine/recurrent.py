"""A hybrid model's recurrent state in the engine: the state pool and who holds its slots.

Each running request owns a live slot that its rows read before and write after each forward;
a prefill chunk is cut at the snapshot boundaries of ``mamba_state_config`` inside it and a
decode snapshots when it crosses one, into snapshot slots keyed by the prefix's block key
(``kvjax.manager.state_snapshots``). An admitted request resumes from the snapshot at its
reused prefix (the manager stops reuse there), else from the zero state; a preempted request
returns its slot and is recomputed on re-admission (from the deepest snapshot its prefix
reaches).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import CacheLayout
from kvjax.cache.sizing import free_device_memory
from kvjax.cache.state_pool import (
    NULL_SLOT,
    copy_slots,
    init_state_pool,
    read_slots,
    slot_bytes,
    write_slots,
    zero_slots,
)
from kvjax.config import ConfigError, KvCacheConfig
from kvjax.engine.buckets import pow2_bucket
from kvjax.engine.outputs import RequestRecord
from kvjax.engine.scheduler import ScheduledRequest, SchedulerRequest
from kvjax.manager import hashing
from kvjax.manager.interface import CacheManager
from kvjax.manager.state_snapshots import LiveState, StateSnapshotIndex
from kvjax.model.config import ModelConfig


class RecurrentState:
    """The state pool [R, num_slots, H, d, d] float32 (``kvjax.cache.state_pool``) of a hybrid
    model's R recurrent layers, and ``index``, which request or snapshot holds each slot.

    Args:
      kv_config: its ``mamba_state_config`` sizes the snapshots; ``enable_block_reuse`` turns them on.
      layout: the cache geometry (snapshot boundaries are block boundaries).
      cfg: the hybrid model's config.
      num_live: live slots, one per request running at once (the scheduler's batch size).

    Raises:
      ConfigError: the pool does not fit the free device memory (naming ``max_snapshots``).
    """

    def __init__(self, kv_config: KvCacheConfig, layout: CacheLayout, cfg: ModelConfig, num_live: int) -> None:
        max_snapshots = kv_config.mamba_state_config.max_snapshots
        num_slots = 1 + num_live + max_snapshots
        need, free = (
            num_slots * slot_bytes(len(cfg.recurrent_layers), cfg.num_heads, cfg.head_dim),
            free_device_memory(),
        )
        if need > free:
            raise ConfigError(
                f"kv_cache_config.mamba_state_config.max_snapshots={max_snapshots:,}: the recurrent-state pool of "
                f"{num_slots:,} slots needs {need:,} bytes but {free:,} are free; lower max_snapshots"
            )
        self.reuse = kv_config.enable_block_reuse
        self.tokens_per_block = layout.tokens_per_block
        self.index = StateSnapshotIndex(kv_config, tokens_per_block=layout.tokens_per_block, num_live=num_live)
        """Which request or snapshot holds each slot."""
        self.pool: jax.Array = init_state_pool(
            len(cfg.recurrent_layers), self.index.num_slots, cfg.num_heads, cfg.head_dim
        )
        """[R, num_slots, H, d, d] float32."""

    def start(self, works: Sequence[ScheduledRequest], requests: Mapping[str, RequestRecord]) -> None:
        """Gives newly admitted requests a live slot: restored from the snapshot at their
        reused prefix (a block boundary), or zeroed when nothing was reused."""
        restores, zeros = [], []
        for w in works:
            if self.index.live(w.request_id) is not None:
                continue
            sched = requests[w.request_id].sched
            live = self.index.start(w.request_id, sched.prompt_keys, len(sched.prompt_token_ids))
            if w.start == 0:
                zeros.append(live.slot)
                continue
            if w.start % self.tokens_per_block:
                raise RuntimeError(
                    f"request {w.request_id!r} resumes at {w.start}, not a block boundary (page "
                    f"{self.tokens_per_block})"
                )
            restores.append(
                (self.index.restore(sched.prompt_keys[w.start // self.tokens_per_block - 1]).slot, live.slot)
            )
        if restores:
            self.pool = copy_slots(self.pool, _padded([s for s, _ in restores]), _padded([d for _, d in restores]))
        if zeros:
            self.pool = zero_slots(self.pool, _padded(zeros))

    def end(self, request_id: str, record: RequestRecord | None, finished: bool, manager: CacheManager) -> None:
        """Returns a request's live slot; a request that finished a turn leaves the key of its
        last full block (prompt + output), which a next turn extending it continues."""
        final_key = None
        if finished and record is not None and self.reuse:
            sched = record.sched
            tokens = sched.prompt_token_ids + tuple(sched.output_token_ids)
            full = len(tokens) // self.tokens_per_block * self.tokens_per_block
            if full:
                final_key = _prefix_keys(manager, sched, tokens[:full], self.tokens_per_block)[-1]
        self.index.end(request_id, final_key)

    def slots(self, works: Sequence[ScheduledRequest], rows: int) -> jax.Array:
        """The live slot of each row [rows] int32 (NULL_SLOT for padding rows)."""
        slots = np.full(rows, NULL_SLOT, np.int32)
        for i, w in enumerate(works):
            slots[i] = self._live(w.request_id).slot
        return jnp.asarray(slots)

    def read(self, slots: jax.Array) -> jax.Array:
        return read_slots(self.pool, slots)

    def write(self, slots: jax.Array, state: jax.Array) -> None:
        self.pool = write_slots(self.pool, slots, state)

    def take_snapshots(
        self, works: Sequence[ScheduledRequest], requests: Mapping[str, RequestRecord], manager: CacheManager
    ) -> None:
        """Copies the live state of each row that ended this step on a snapshot boundary
        into a snapshot slot keyed by the block key of that prefix."""
        if not self.reuse:
            return
        copies = []
        for w in works:
            end = w.start + len(w.token_ids)
            live = self._live(w.request_id)
            if not self.index.is_boundary(end, live.prompt_len):
                continue
            sched = requests[w.request_id].sched
            tokens = (sched.prompt_token_ids + tuple(sched.output_token_ids))[:end]
            slot = self.index.store(w.request_id, _prefix_keys(manager, sched, tokens, self.tokens_per_block)[-1], end)
            if slot is not None:
                copies.append((live.slot, slot))
        if copies:
            self.pool = copy_slots(self.pool, _padded([s for s, _ in copies]), _padded([d for _, d in copies]))

    def _live(self, request_id: str) -> LiveState:
        """The live state of a request that started (``start``)."""
        live = self.index.live(request_id)
        if live is None:
            raise KeyError(f"request_id={request_id!r} has no live recurrent state; it was not started")
        return live

    def cuts(self, work: ScheduledRequest) -> list[int]:
        """Where a prefill chunk is cut (the snapshot boundaries inside it, then its end)."""
        end = work.start + len(work.token_ids)
        live = self._live(work.request_id)
        return [p for p in self.index.boundaries_in(work.start, end, live.prompt_len) if p < end] + [end]


def _prefix_keys(
    manager: CacheManager, sched: SchedulerRequest, tokens: tuple[int, ...], tokens_per_block: int
) -> list[hashing.BlockKey]:
    """Block keys of a request's token prefix (its prompt's own keys when it is one)."""
    if len(tokens) <= len(sched.prompt_token_ids):
        return sched.prompt_keys[: len(tokens) // tokens_per_block]
    return manager.prompt_block_keys(tokens, sched.extras)


def _padded(slots: Sequence[int]) -> jax.Array:
    """Slot ids padded with NULL_SLOT to a power-of-two length (few compiled shapes)."""
    padded = np.full(pow2_bucket(len(slots)), NULL_SLOT, np.int32)
    padded[: len(slots)] = slots
    return jnp.asarray(padded)
