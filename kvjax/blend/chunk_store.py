"""Chunk KV stored as blocks in the engine's cache manager: the one chunk store.

Storing a chunk prefills it through the engine as an ordinary request under a per-variant
*chunk scope*: the cache salt ``InternalScope("chunk:<variant>")`` gives its blocks their own
root, which no user ``cache_salt`` string can produce (``kvjax.manager.hashing``), so the
same radix tree, priority-LRU eviction, retention priorities, host offload, events and
snapshots serve chunks and prefixes alike, while no chunk block can ever match a request
prefix (different root) and the three variants never match each other:

  "pos0"    stored request = chunk            (the chunk starts at position 0)
  "bos"     stored request = BOS + chunk      (the chunk KV is computed behind BOS)
  "system"  stored request = system + chunk   (behind the shared system prompt)

The stored request is padded with ``PAD`` tokens up to a block boundary, so a chunk's last
partial block is a full block of the tree too and every chunk token has stored KV (the pads
come after the chunk, so causal attention leaves the chunk's KV unchanged).

Looking chunks up (``acquire``) registers one short-lived lookup request per chunk with the
same tokens under the same salt: the manager matches the chunk's cached blocks, takes
references on them and queues onboards for blocks offloaded to the host tier, which the
engine executes at once. ``slots`` maps the looked-up positions to prompt tokens, the
blended prefill reads their KV from the engine's pages (``fusor.read_layer``), and ``release``
drops the references (the blocks stay cached, LRU-ordered by this use). A lookup appends
one sentinel token so the last block matches too (the manager always leaves the last
prompt token to compute).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from kvjax.blend.fidelity import FidelityConfig, FidelityReport, require
from kvjax.cache.pool import sequence_slots
from kvjax.config import KvCacheRetentionConfig, as_retention_config
from kvjax.manager import require_tiered
from kvjax.manager.hashing import InternalScope, KeyExtras, check_token_ids
from kvjax.sampling import SamplingParams

if TYPE_CHECKING:
    from kvjax.engine import Engine

Variant = Literal["pos0", "bos", "system"]
VARIANTS = ("pos0", "bos", "system")
SENTINEL = 0
"""Token appended to a lookup so its last block is matchable (never stored)."""
PAD = 0
"""Token filling a stored chunk's last block (after the chunk: its KV is not used)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """Blocks held by a lookup, until ``release``.

    Attributes:
      request_ids: one lookup request per looked-up token sequence.
      tables: per lookup, per layer group, its device page ids (one per block).
      covered: per lookup, leading tokens of the looked-up sequence with stored KV.
    """

    request_ids: tuple[str, ...]
    tables: tuple[tuple[tuple[int, ...], ...], ...]
    covered: tuple[int, ...]


@dataclasses.dataclass(slots=True)
class StoreStats:
    """Counters of a managed chunk store.

    Attributes:
      puts: ``put`` calls; computed: chunks prefilled through the engine (the rest were
        already cached on some tier).
      lookups: chunks looked up; hit_tokens: chunk tokens whose KV a lookup found;
        missed_tokens: chunk tokens without stored KV (evicted blocks), recomputed.
      onboarded_pages: host pages brought back to the device by lookups.
    """

    puts: int = 0
    computed: int = 0
    lookups: int = 0
    hit_tokens: int = 0
    missed_tokens: int = 0
    onboarded_pages: int = 0


class ChunkStore:
    """Chunk KV as blocks of ``engine.manager`` under a chunk scope.

    Args:
      engine: the engine whose manager, pages and host tier hold the chunks. With several
        layer groups (sliding-window layers) a chunk is stored in every group, so a stored
        chunk (with its prefix) must fit the smallest window (``put`` checks it).
      variant: start variant ("pos0", "bos", "system").
      prefix_tokens: the shared system prompt (the "system" variant).
      retention: retention of chunk blocks (priorities, durations), applied when stored and
        again on every lookup; None = default priority.
      fidelity: the fidelity gate's settings (``kvjax.blend.fidelity``): the engine's model is
        checked once (re-rotation and blended KL on a calibration prompt, on an engine of its
        own) and refused with ``FidelityError`` if it fails; None = no gate.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        variant: Variant = "system",
        prefix_tokens: Sequence[int] = (),
        retention: KvCacheRetentionConfig | dict | None = None,
        fidelity: FidelityConfig | None = FidelityConfig(),
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
        if variant == "system" and not prefix_tokens:
            raise ValueError("variant='system' needs the shared prefix_tokens")
        if not engine.kv_config.enable_block_reuse:
            raise ValueError("kv_cache_config.enable_block_reuse=False: chunks cannot be stored as reusable blocks")
        require_tiered(engine.manager, "a ChunkStore (CacheBlend chunks)")
        self.engine = engine
        self.variant = variant
        self.retention = None if retention is None else as_retention_config(retention)
        self.prefix_tokens = check_token_ids(prefix_tokens, "prefix_tokens", engine.model.config.vocab_size)
        bos = engine.model.config.bos_id
        self.variant_prefix: tuple[int, ...] = {"pos0": (), "bos": (bos,), "system": self.prefix_tokens}[variant]
        self.salt = InternalScope(f"chunk:{variant}")
        self.extras = KeyExtras(cache_salt=self.salt)
        """The chunk scope's key extras (its salt alone)."""
        self.stats = StoreStats()
        self._ids = itertools.count()
        self.fidelity: FidelityReport | None = None if fidelity is None else require(self, fidelity)
        """What the fidelity gate measured for the engine's model (None without the gate)."""

    @property
    def stored_start(self) -> int:
        """Position of a chunk's first token when its KV was computed."""
        return len(self.variant_prefix)

    @property
    def tokens_per_block(self) -> int:
        return self.engine.manager.tokens_per_block

    def stored_tokens(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The request that stores a chunk: variant prefix + chunk + ``PAD`` up to a block boundary."""
        stored = (*self.variant_prefix, *(int(t) for t in tokens))
        return (*stored, *(PAD,) * (-len(stored) % self.tokens_per_block))

    def block_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Manager keys of the chunk's full blocks under its chunk scope."""
        return self.engine.manager.prompt_block_keys(self.stored_tokens(tokens), self.extras)

    def num_cached(self, tokens: Sequence[int]) -> int:
        """Chunk tokens whose blocks are cached now, on any tier (no side effects)."""
        lookup = (*self.stored_tokens(tokens), SENTINEL)
        found = self.engine.manager.estimate_reusable_tokens(lookup, self.extras)
        return max(0, min(found - self.stored_start, len(tokens)))

    def tiers(self, tokens: Sequence[int]) -> list[str]:
        """Where each block of the chunk's stored KV lives now (no side effects): one entry per
        block holding chunk tokens, "device", "host", "disk" or "miss" (not cached: a lookup
        stops at the first missing block, so every later block is a miss too)."""
        stored = self.stored_tokens(tokens)
        ps = self.tokens_per_block
        manager = require_tiered(self.engine.manager, "ChunkStore")
        found = manager.reusable_tiers((*stored, SENTINEL), self.extras)
        first = self.stored_start // ps  # the first block holding a chunk token
        last = -(-(self.stored_start + len(tokens)) // ps)
        return [found[b] if b < len(found) else "miss" for b in range(first, last)]

    # ------------------------------------------------------------------ store
    def put(self, tokens: Sequence[int]) -> int:
        """Stores a chunk (prefilled through the engine unless its blocks are all cached).

        The prefill runs as a request of the engine, so ``engine.step()`` runs until it ends:
        other requests in flight advance meanwhile.

        Returns:
          The chunk tokens with stored KV (all of them).

        Raises:
          ValueError: before any work, for an empty chunk, a token id outside [0, vocab_size)
            a chunk that does not fit the engine's ``max_seq_len`` behind the variant prefix, or
            (sliding-window layers) whose stored request does not fit the smallest window.
          RuntimeError: the engine failed the prefill (the other requests went on).
        """
        tokens = check_token_ids(tokens, "tokens", self.engine.model.config.vocab_size)
        limit = self.engine.max_seq_len - self.stored_start - self.tokens_per_block  # room for the pads and one sample
        if not 1 <= len(tokens) <= limit:
            raise ValueError(
                f"a chunk of {len(tokens)} tokens must hold between 1 and engine.max_seq_len={self.engine.max_seq_len} "
                f"- {self.stored_start} (the {self.variant!r} prefix) - tokens_per_block = {limit} tokens"
            )
        windows = self.engine.manager.group_windows
        if len(windows) > 1 and len(self.stored_tokens(tokens)) + 1 > min(windows):
            raise ValueError(
                f"a chunk of {len(tokens)} tokens is stored as {len(self.stored_tokens(tokens))} tokens (the "
                f"{self.variant!r} prefix, the chunk, pads to a block boundary) plus one sampled token; a windowed "
                f"layer group keeps only the blocks inside its window, so with windows {windows} this must be at most "
                f"{min(windows)} tokens"
            )
        self.stats.puts += 1
        if self.num_cached(tokens) >= len(tokens):
            return len(tokens)
        rid = self.engine.submit(
            self.stored_tokens(tokens),
            SamplingParams(max_new_tokens=1, ignore_eos=True),
            retention=self.retention,
            cache_salt=self.salt,
            request_id=InternalScope(f"{self.salt}/store-{next(self._ids)}"),
        )
        record = self.engine.requests[rid]
        while not record.finished:
            self.engine.step()
        error = self.engine.pop_output(rid).error  # the engine forgets it: only its blocks stay
        if error is not None:
            raise RuntimeError(f"storing a chunk of {len(tokens)} tokens failed in request {rid!r}: {error}")
        self.stats.computed += 1
        return len(tokens)

    # ------------------------------------------------------------------ lookup
    def acquire(self, sequences: Sequence[Sequence[int]], extras: KeyExtras | None = None) -> Lease:
        """Takes references on the cached blocks of each token sequence; host blocks among them
        are queued to come back to the device: run ``StepContext.execute_page_ops`` before
        reading the lease's slots.

        Args:
          sequences: full token sequences as stored (``stored_tokens(chunk)`` for a chunk; an
            ordinary prompt prefix with ``extras=NO_EXTRAS``).
          extras: key extras of the lookups; None = this store's chunk scope.
        """
        manager = self.engine.manager
        extras = self.extras if extras is None else extras
        ids, tables, covered = [], [], []
        onboarded = manager.stats.onboarded_pages
        try:
            for seq in sequences:
                rid = f"{self.salt}/lookup-{next(self._ids)}"
                found = manager.add_request(rid, (*seq, SENTINEL), extras, retention=self.retention)
                assert found is not None, "no admission callback: the request is registered"
                ids.append(rid)
                tables.append(tuple(tuple(manager.block_table(rid, g)) for g in range(self.engine.layout.num_groups)))
                covered.append(min(found, len(seq)))
        except Exception:
            self.release(Lease(tuple(ids), (), ()))
            raise
        self.stats.onboarded_pages += manager.stats.onboarded_pages - onboarded
        return Lease(tuple(ids), tuple(tables), tuple(covered))

    def release(self, lease: Lease) -> None:
        """Drops a lease's references; the blocks stay cached."""
        for rid in lease.request_ids:
            self.engine.manager.free_request(rid)

    def slots(
        self, tables: Sequence[Sequence[int]], stored: range, padded: int, at: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slot arrays placing stored positions ``stored`` at prompt tokens ``at, at + 1, ...``.

        Args:
          tables: one lookup's page ids per layer group (``Lease.tables[i]``).

        Returns:
          (page_ids [G, padded] int32, offsets [padded] int32, valid [padded] bool).
        """
        return sequence_slots(
            tables, np.asarray(stored), np.arange(at, at + len(stored)), padded, self.tokens_per_block
        )


__all__ = ["PAD", "SENTINEL", "VARIANTS", "ChunkStore", "Lease", "StoreStats", "Variant"]
