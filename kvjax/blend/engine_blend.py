"""Blended prefill through the engine: fused KV in the request's own pages, then normal
decoding with the other requests (SPEC C5, DESIGN "one tree").

``submit_blended`` for one ``BlendPrompt``:

1. registers the request with the manager under a *blend scope* (``blend_salt``): blocks
   that an earlier blended request of the same scope left in the tree are matched by prefix
   reuse; their tokens are ``num_cached`` and are neither rewritten nor recomputed;
2. acquires the rest of the exact prefix (system prompt) from the ordinary scope (salt None,
   blocks of exact requests) and every chunk from its chunk scope (``ManagedChunkStore``),
   onboarding host blocks, and gathers their KV from the engine's pages in one jitted gather;
   then releases those blocks;
3. allocates the request's pages and runs ``blend_prefill`` on ``engine.pool`` over the
   request's block table: reused KV (keys re-rotated) and the recomputed rows' KV are written
   into its pages;
4. commits the prompt (full blocks enter the tree under the blend scope), samples the first
   token and hands the request to the scheduler (``Engine.adopt_prefilled``).

Token roles (T = padded tokens)::

    | cached (scope match) | prefix rest | chunk 0: stored | tail | ... | suffix | pad |
      pages already hold     exact, from    selectable       forced      forced
      its KV: not written    salt None      (reused KV)     (no KV)

Forced tokens (always recomputed, every layer): the suffix, each chunk's tail (tokens past
its last full stored block, or whose blocks were evicted), and prefix tokens not found in
the ordinary scope. The ratio applies to the stored chunk tokens; forced tokens come on top.

Why a blend scope: the fused KV of chunk tokens is approximate. Committed under the
ordinary scope it would serve an exact request with the same tokens a prefix match of
approximate KV. Under ``blend_salt`` (variant and selection in the salt) it can only serve
a later blended request of the same variant and selection, which would compute the same
fused KV for those tokens (causal: a token's fused KV depends only on the tokens before it
and the selection, and the suffix is forced in every variant). Blend scopes are
``InternalScope`` salts, so no exact request's ``cache_salt`` can reach them either.

Every argument is checked before any chunk is stored or any page is taken; a failure after
that frees the request's pages, so one bad submission leaves the engine as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.blend.blender import BlendPrompt
from kvjax.blend.fusor import BlendInputs, BlendPlan, blend_prefill
from kvjax.blend.managed_store import ManagedChunkStore, gather_slots
from kvjax.blend.selection import Roles, Selection, SelectionConfig, bucket, select_cacheblend
from kvjax.cache import NULL_PAGE
from kvjax.config import KvCacheRetentionConfig, as_retention_config
from kvjax.engine import bucket as pow2_bucket
from kvjax.manager import OutOfPagesError
from kvjax.manager.hashing import InternalScope
from kvjax.sampling import SamplingParams

Selector = Callable[[Roles, int], Selection]
"""(roles of the selectable tokens, padded T) -> Selection."""

_ids = itertools.count()


@dataclasses.dataclass(frozen=True, slots=True)
class BlendReport:
    """What one blended submission reused and recomputed.

    Attributes:
      request_id: the engine request.
      num_cached: leading tokens matched in the blend scope (pages not written).
      prefix_hit: prefix tokens gathered from the ordinary scope.
      chunk_hit: chunk tokens gathered from the chunk store.
      num_forced: tokens always recomputed (suffix, chunk tails, uncached prefix).
      num_tail: of those, chunk tokens without stored KV.
      onboarded_pages: host pages onboarded by the lookups.
      prefill_s: seconds from submission to the first token.
    """

    request_id: str
    num_cached: int
    prefix_hit: int
    chunk_hit: int
    num_forced: int
    num_tail: int
    onboarded_pages: int
    prefill_s: float


def blend_salt(store: ManagedChunkStore, selection: SelectionConfig | str) -> InternalScope:
    """Cache scope of blended requests: the chunk variant and the selection rule (e.g. the ratio)."""
    return InternalScope(f"blend:{store.variant}:{hashlib.blake2s(repr(selection).encode(), digest_size=8).hexdigest()}")


def with_forced(sel: Selection, forced: np.ndarray, num_cached: int, padded: int, row_bucket: int) -> Selection:
    """``sel`` with the ``forced`` token ids recomputed in every layer and no row below ``num_cached``.

    Fixed selections get the forced ids as extra rows; deviation schedules keep
    ``len(forced)`` more rows after each check (forced rows win every check).
    """
    forced = np.asarray(forced, np.int32)
    if not sel.checks:
        ids = sel.rows[sel.rows_valid]
        ids = np.unique(np.concatenate([ids[ids >= num_cached], forced])).astype(np.int32)
        capacity = bucket(len(ids), row_bucket)
        rows = np.zeros(capacity, np.int32)
        rows[: len(ids)] = ids
        return Selection(rows=rows, rows_valid=np.arange(capacity) < len(ids), deviation=sel.deviation)
    counts = sel.counts + len(forced)
    checks, cap = [], padded
    for (layer, _), count in zip(sel.checks, counts):
        cap = min(bucket(int(count), row_bucket), cap)
        checks.append((layer, cap))
    return dataclasses.replace(
        sel, rows_valid=sel.rows_valid & (sel.rows >= num_cached), checks=tuple(checks), counts=counts.astype(np.int32)
    )


def submit_blended(
    store: ManagedChunkStore,
    prompt: BlendPrompt,
    selection: SelectionConfig | Selector,
    sampling: SamplingParams = SamplingParams(),
    *,
    retention: KvCacheRetentionConfig | dict | None = None,
    token_bucket: int = 64,
    row_bucket: int | None = None,
    salt: str | None = None,
) -> BlendReport:
    """Blended prefill of ``prompt`` into the engine's pages; the request then decodes in ``step()``.

    Args:
      store: the chunk store (its engine runs the request). Chunks not stored are computed
        and stored first.
      selection: a CacheBlend ``SelectionConfig``, or a selector over the roles of the
        selectable tokens (e.g. ``lambda roles, T: selection.select_all(roles, 64)``).
      retention: retention of the request's blocks.
      token_bucket: prompt lengths pad to a multiple of this (shared compiled prefills).
      row_bucket: recomputed-row capacities round to this; default the config's (or 64).
      salt: the blend scope's name, made an ``InternalScope`` (a user ``cache_salt`` of the
        same text is another scope); default ``blend_salt(store, selection)`` (a callable
        selector must name its scope).

    Returns:
      The report; ``engine.output(report.request_id)`` gives the tokens once decoded.

    Raises:
      ValueError: before any state changes, naming the bad argument: a token id outside
        [0, vocab_size), a prompt that with ``sampling.max_new_tokens`` exceeds the engine's
        ``max_seq_len``, a bad ``sampling``, ``retention`` or ``salt``.
    """
    engine, manager = store.engine, store.engine.manager
    cfg = engine.model.config
    t0 = time.perf_counter()
    _check_submission(store, prompt, sampling, salt)
    retention = as_retention_config(retention)
    if isinstance(selection, SelectionConfig):
        config = selection
        selection = lambda roles, padded: select_cacheblend(roles, config, padded, cfg.num_layers)  # noqa: E731
        row_bucket = row_bucket or config.row_bucket
        salt = salt or blend_salt(store, config)
    elif salt is None:
        raise ValueError("a callable selection needs salt= (the blend scope of its fused KV)")
    salt = InternalScope(salt)
    row_bucket = row_bucket or 64
    for chunk in prompt.chunks:
        store.put(chunk)
    tokens = prompt.tokens
    padded = bucket(len(tokens), token_bucket)
    rid = f"blend-{next(_ids)}"
    while rid in engine.requests:
        rid = f"blend-{next(_ids)}"
    num_cached = manager.add_request(rid, tuple(int(t) for t in tokens), retention=retention, cache_salt=salt)
    try:
        report, logits = _prefill(store, prompt, selection, rid, num_cached, padded, row_bucket)
        manager.commit_tokens(rid, tuple(int(t) for t in tokens[num_cached:]))
        engine.adopt_prefilled(
            rid, tokens, logits, sampling, retention=retention, cache_salt=salt, num_reused_tokens=num_cached,
            submit_time=t0,
        )
    except Exception:
        if rid not in engine.requests:  # the engine did not take it over: its pages go back
            manager.free_request(rid)
        raise
    return dataclasses.replace(report, prefill_s=engine.requests[rid].first_token_time - t0)


def _check_submission(
    store: ManagedChunkStore, prompt: BlendPrompt, sampling: SamplingParams, salt: str | None
) -> None:
    """``submit_blended``'s argument checks, run before anything is stored or allocated."""
    engine = store.engine
    vocab = engine.model.config.vocab_size
    if not isinstance(prompt, BlendPrompt):
        raise ValueError(f"prompt must be a BlendPrompt, got {type(prompt).__name__}")
    prompt.check_vocab(vocab)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if sampling.stop_token_id is not None and sampling.stop_token_id >= vocab:
        raise ValueError(f"sampling.stop_token_id={sampling.stop_token_id} must be in [0, {vocab})")
    num_tokens = prompt.roles.num_tokens
    if num_tokens + sampling.max_new_tokens > engine.max_seq_len:
        raise ValueError(
            f"len(prompt)={num_tokens} ({prompt.describe()}) + sampling.max_new_tokens={sampling.max_new_tokens} "
            f"exceeds engine.max_seq_len={engine.max_seq_len}"
        )
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"salt={salt!r} must be None or a non-empty str")


def _prefill(
    store: ManagedChunkStore,
    prompt: BlendPrompt,
    selector: Selector,
    rid: str,
    num_cached: int,
    padded: int,
    row_bucket: int,
) -> tuple[BlendReport, jax.Array]:
    """Steps 2-3 of ``submit_blended``; returns (report, logits [V])."""
    engine, manager = store.engine, store.engine.manager
    cfg = engine.model.config
    roles = prompt.roles
    n, p = roles.num_tokens, roles.prefix_len
    page_ids = np.full(padded, NULL_PAGE, np.int32)
    offsets = np.zeros(padded, np.int32)
    valid = np.zeros(padded, bool)

    def place(slots: tuple[np.ndarray, ...]) -> None:
        page_ids[slots[2]], offsets[slots[2]], valid[slots[2]] = slots[0][slots[2]], slots[1][slots[2]], True

    # Exact prefix tokens not matched in the blend scope come from the ordinary scope, the
    # chunks not entirely inside the cached region from their chunk scope.
    todo = [i for i, (s, e) in enumerate(roles.chunk_spans) if e > num_cached]
    onboarded = store.stats.onboarded_pages
    prefix_lease = store.acquire([prompt.prefix], cache_salt=None) if num_cached < p else None
    try:
        lease = store.acquire([store.stored_tokens(prompt.chunks[i]) for i in todo])
    except Exception:
        if prefix_lease is not None:
            store.release(prefix_lease)
        raise
    prefix_hit = 0
    if prefix_lease is not None:
        hit = range(num_cached, max(num_cached, prefix_lease.covered[0]))
        prefix_hit = len(hit)
        place(store.slots(prefix_lease.tables[0], hit, padded, num_cached))
    spans = []
    chunk_hit = 0
    for i, table, covered in zip(todo, lease.tables, lease.covered):
        s, e = roles.chunk_spans[i]
        stored = max(0, covered - store.stored_start)  # chunk tokens with stored KV
        first = max(s, num_cached)
        hit = range(store.stored_start + first - s, store.stored_start + stored)
        if len(hit):
            place(store.slots(table, hit, padded, first))
            spans.append((first, s + stored))
        chunk_hit += len(hit)
    store.stats.lookups += len(todo)
    store.stats.hit_tokens += chunk_hit
    k, v = gather_slots(engine.pool, jnp.asarray(page_ids), jnp.asarray(offsets), jnp.asarray(valid))
    store.release(lease)
    if prefix_lease is not None:
        store.release(prefix_lease)

    in_spans = np.zeros(padded, bool)
    for s, e in spans:
        in_spans[s:e] = True
    chunk_mask = np.zeros(padded, bool)
    for s, e in roles.chunk_spans:
        chunk_mask[s:e] = True
    idx = np.arange(padded)
    tail = chunk_mask & ~in_spans & (idx >= num_cached)
    store.stats.missed_tokens += int(tail.sum())
    forced_mask = (idx >= num_cached) & (idx < n) & ~in_spans & ~((idx < p) & valid)
    extra = np.flatnonzero(forced_mask & (idx < roles.suffix_start)).astype(np.int32)
    sel_roles = Roles(num_tokens=n, prefix_len=max(num_cached, p), chunk_spans=tuple(spans), suffix_start=roles.suffix_start)
    sel = with_forced(selector(sel_roles, padded), extra, num_cached, padded, row_bucket)

    deltas = np.zeros(padded, np.int32)
    for s, e in spans:
        chunk = next(i for i, (cs, ce) in enumerate(roles.chunk_spans) if cs <= s < ce)
        deltas[s:e] = roles.chunk_spans[chunk][0] - store.stored_start

    try:
        manager.allocate(rid, n)
    except OutOfPagesError as err:
        raise OutOfPagesError(f"blended request {rid!r} of {n} tokens does not fit: {err}") from err
    engine.execute_page_ops()
    table = manager.block_table(rid, 0)
    width = pow2_bucket(engine.layout.pages_for(padded), 4)
    block_table = np.full((1, width), NULL_PAGE, np.int32)
    block_table[0, : len(table)] = table
    positions = np.where(idx < n, idx, -1).astype(np.int32)
    tok = np.zeros(padded, np.int32)
    tok[:n] = prompt.tokens
    inputs = BlendInputs(
        tokens=tok, positions=positions, reused_k=k, reused_v=v, deltas=deltas, selectable=in_spans,
        forced=forced_mask, rows=sel.rows, rows_valid=sel.rows_valid, counts=sel.counts, block_table=block_table,
        length=np.asarray([n], np.int32), probes=np.zeros(0, np.int32), num_cached=np.int32(num_cached),
    )
    plan = BlendPlan(checks=sel.checks, deviation=sel.deviation)
    logits, engine.pool, _ = blend_prefill(
        engine.model.params, engine.pool, inputs, cfg=cfg, layout=engine.layout, plan=plan, attn_impl=engine.attn_impl
    )
    report = BlendReport(
        request_id=rid, num_cached=num_cached, prefix_hit=prefix_hit, chunk_hit=chunk_hit,
        num_forced=int(forced_mask.sum()), num_tail=int(tail.sum()),
        onboarded_pages=store.stats.onboarded_pages - onboarded, prefill_s=0.0,
    )
    return report, logits


__all__ = ["BlendReport", "blend_salt", "submit_blended", "with_forced"]
