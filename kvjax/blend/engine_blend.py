"""Blended prefill of an engine request: which tokens come from stored chunks (``ChunkReuse``),
and the step that runs it on the request's pages (``blended_prefill``).

A request submitted with ``Engine.submit(..., chunks=ChunkReuse(...))`` is scheduled like any
other (``Scheduler`` charges it the rows it recomputes and runs its whole prompt in one step);
when its prefill comes, the engine calls ``blended_prefill``:

1. the manager registered the request under a *blend scope* (``ChunkReuse.salt``): blocks
   that an earlier blended request of the same scope left in the tree are matched by prefix
   reuse; their tokens are ``num_cached`` and are neither rewritten nor recomputed;
2. every chunk is looked up in its chunk scope (``ChunkStore.acquire``, onboarding host
   blocks) and the exact prefix (system prompt) either from chunk 0's lookup (when the
   prompt's prefix is the store's variant prefix) or from the ordinary scope (salt None);
   their slots in the engine's pages are held until the prefill has read them;
3. ``selection.plan`` builds the rows to recompute, and ``fusor.blend_prefill`` reads the
   reused KV from those slots layer by layer (keys re-rotated) and writes it with the
   recomputed rows' KV into the request's pages. Chunk blocks that were on the host or disk
   tier are onboarded layer by layer meanwhile (``pipelined``): a loader thread reads layer
   l + 1 from its tier while layer l computes (``kvjax.engine.page_ops.LayerwiseOnboard``);
4. the scheduler commits the prompt (full blocks enter the tree under the blend scope) and
   the engine samples the first token; decoding goes on with the other requests.

Token roles (T = padded tokens)::

    | cached (scope match) | prefix rest | chunk 0 | ... | chunk n-1 | suffix | pad |
      pages already hold     exact, from    selectable (reused KV)     forced
      its KV: not written    the tree

Forced tokens (recomputed in every layer): the suffix, tokens between chunks, chunk tokens
whose blocks were evicted, and prefix tokens found nowhere. The ratio applies to the stored
chunk tokens; forced tokens come on top.

Why a blend scope: the fused KV of chunk tokens is approximate. Committed under the
ordinary scope it would serve an exact request with the same tokens a prefix match of
approximate KV. Under the blend scope (variant and selection in the salt) it can only serve
a later blended request of the same variant and selection, which would compute the same
fused KV for those tokens (causal: a token's fused KV depends only on the tokens before it
and the selection, and the suffix is forced in every variant). Blend scopes are
``InternalScope`` salts, so no exact request's ``cache_salt`` can reach them either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from kvjax.blend.fusor import BlendInputs, BlendPlan, PrefillInterrupted, blend_prefill
from kvjax.blend.selection import (
    SCHEDULE_SELECTORS,
    Roles,
    SelectionConfig,
    check_scores,
    estimated_rows,
    plan,
    round_up,
    schedule,
)
from kvjax.blend.timeline import ComputeTimeline
from kvjax.cache import NULL_PAGE
from kvjax.cache.pool import sequence_slots
from kvjax.config import check_optional_str
from kvjax.engine import table_width
from kvjax.engine.page_ops import LayerwiseOnboard, apply_page_ops, split_layerwise
from kvjax.engine.requests import ChunkedWork
from kvjax.engine.runner import StepContext
from kvjax.manager.hashing import NO_EXTRAS, InternalScope

if TYPE_CHECKING:
    from kvjax.blend.chunk_store import ChunkStore


@dataclasses.dataclass(frozen=True)
class ChunkReuse:
    """Which prompt tokens are stored chunks, and how their blended prefill recomputes.

    Attributes:
      store: the chunk store (of the engine that runs the request).
      spans: (start, end) token range of every chunk in the prompt, increasing and disjoint,
        ending before the prompt's last token. Tokens before the first chunk are the exact
        prefix, tokens after the last the suffix.
      selection: the selector, its recompute ratio and schedule.
      num_prompt_logits: the request's ``prompt_logits`` holds the logits [V] of this many last
        prompt positions (>= 1; each must lie after the last chunk, i.e. in the suffix).
      num_probes: > 0 traces the first ``num_probes`` suffix rows per layer and keeps the
        fused KV in the request's ``blend_trace`` (evaluation).
      scores: [L, T] true deviation for the "oracle" selector.
      scope: the blend scope's name; default derived from the store variant and selection.
      token_bucket: prompt paddings round to this for shared compiled code.
      pipelined: onboard host and disk chunk blocks layer by layer while the prefill computes
        (False: every block is on the device before the first layer starts).
      timeline: record when each layer was loaded and computed (``BlendReport.timeline``).
    """

    store: ChunkStore
    spans: tuple[tuple[int, int], ...]
    selection: SelectionConfig = SelectionConfig()
    num_prompt_logits: int = 1
    num_probes: int = 0
    scores: np.ndarray | None = dataclasses.field(default=None, compare=False)
    scope: str | None = None
    token_bucket: int = 64
    pipelined: bool = True
    timeline: bool = False

    @property
    def salt(self) -> InternalScope:
        """Cache scope of the request's fused KV."""
        if self.scope is not None:
            return InternalScope(f"blend:{self.scope}")
        digest = hashlib.blake2s(repr(self.selection).encode(), digest_size=8).hexdigest()
        return InternalScope(f"blend:{self.store.variant}:{digest}")

    def roles(self, num_tokens: int) -> Roles:
        """Token roles of a ``num_tokens`` prompt (chunk spans: all chunk tokens)."""
        prefix = self.spans[0][0] if self.spans else num_tokens - 1
        suffix = self.spans[-1][1] if self.spans else num_tokens - 1
        return Roles(num_tokens=num_tokens, prefix_len=prefix, chunk_spans=self.spans, suffix_start=suffix)

    def check(self, context: StepContext, prompt: Sequence[int]) -> None:
        """Raises ValueError naming the field that does not fit ``prompt`` on the engine whose
        step context is ``context``."""
        engine = getattr(self.store, "engine", None)  # a ChunkStore (not imported: it runs the fidelity gate)
        if not hasattr(self.store, "acquire") or getattr(engine, "manager", None) is not context.manager:
            raise ValueError("chunks.store must be a ChunkStore of this engine")
        if not isinstance(self.selection, SelectionConfig):
            raise ValueError(f"chunks.selection must be a SelectionConfig, got {type(self.selection).__name__}")
        n, last = len(prompt), 0
        for i, span in enumerate(self.spans):
            if not (
                isinstance(span, tuple)
                and len(span) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in span)
            ):
                raise ValueError(f"chunks.spans[{i}]={span!r} must be a (start, end) pair of ints")
            s, e = span
            if not last <= s < e <= n - 1:
                raise ValueError(
                    f"chunks.spans[{i}]=({s}, {e}) must be non-empty, after the previous span (>= {last}) and end "
                    f"before the prompt's last token (<= {n - 1})"
                )
            last = e
        suffix = self.spans[-1][1] if self.spans else 0
        for field, value, low, high in (
            ("num_prompt_logits", self.num_prompt_logits, 1, n - suffix),
            ("num_probes", self.num_probes, 0, None),
            ("token_bucket", self.token_bucket, 1, None),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < low
                or (high is not None and value > high)
            ):
                raise ValueError(
                    f"chunks.{field}={value!r} must be an int in [{low}, {high if high is not None else 'inf'})"
                )
        for field in ("pipelined", "timeline"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"chunks.{field}={getattr(self, field)!r} must be a bool")
        check_optional_str("chunks.scope", self.scope)
        num_layers = context.cfg.num_layers
        if self.selection.selector in SCHEDULE_SELECTORS and schedule(self.selection)[0][-1] >= num_layers:
            raise ValueError(
                f"chunks.selection.check_layers={self.selection.check_layers} must be < num_layers={num_layers} "
                f"of the model {context.cfg.name!r} (selector {self.selection.selector!r} checks there)"
            )
        if self.selection.selector == "oracle":
            if self.scores is None:
                raise ValueError("chunks.selection.selector='oracle' needs chunks.scores")
            check_scores(self.scores, num_layers, n, "chunks.scores")

    def num_rows(self, num_tokens: int, num_layers: int) -> int:
        """Rows the prefill recomputes, averaged over layers (the scheduler's charge)."""
        return estimated_rows(self.roles(num_tokens), self.selection, num_layers)

    def batch_key(self, prompt: Sequence[int], num_cached: int) -> Hashable | None:
        """Requests with equal keys prefill together in one ``blended_prefill`` (the same
        prompt, chunks, store and cached tokens; their selections may differ); None = alone
        (a traced or timed request)."""
        if self.num_probes or self.timeline:
            return None
        scope = self.salt if num_cached else None  # cached tokens are read from the scope's pages
        return (id(self.store), self.spans, tuple(prompt), num_cached, scope, self.num_prompt_logits, self.token_bucket,
                self.pipelined)

    def prefill(
        self, context: StepContext, batch: Sequence[ChunkedWork]
    ) -> list[tuple[jax.Array, dict | None, BlendReport]]:
        """The engine's call for the prompts of ``batch`` (this request's first, the others
        with its ``batch_key``): ``blended_prefill``."""
        return blended_prefill(context, batch)


@dataclasses.dataclass(frozen=True, slots=True)
class BlendReport:
    """What one blended prefill reused and recomputed.

    Attributes:
      num_cached: leading tokens matched in the blend scope (pages not written).
      prefix_hit: prefix tokens gathered from the tree.
      chunk_hit: chunk tokens gathered from the chunk store.
      num_forced: tokens recomputed in every layer (suffix, uncached prefix, missed chunk tokens).
      num_missed: chunk tokens without stored KV (evicted), recomputed.
      onboarded_pages: host pages onboarded by the lookups.
      layerwise_pages: of those, pages onboarded layer by layer during the prefill.
      load_s: seconds to look up the chunks, run the page operations that must come first
        (all onboards unless pipelined) and build the inputs.
      phases: seconds of the fusor's phases (``fusor.blend_prefill``): "check_layers",
        "row_layers", "logits".
      recomputed: [L, T] bool, the prompt tokens each layer recomputed (T = prompt tokens).
      timeline: with ``ChunkReuse.timeline``, "load" (``LayerwiseOnboard.events``) and
        "compute" (``timeline.ComputeTimeline.events``) with times in seconds from the prefill's
        start; else None.
    """

    num_cached: int
    prefix_hit: int
    chunk_hit: int
    num_forced: int
    num_missed: int
    onboarded_pages: int
    layerwise_pages: int
    load_s: float
    phases: dict[str, float]
    recomputed: np.ndarray
    timeline: dict[str, list[dict]] | None = None


def _chunk_reuse(work: ChunkedWork) -> ChunkReuse:
    """``work``'s chunks, which a blended prefill runs only as ``ChunkReuse``."""
    if not isinstance(work.reuse, ChunkReuse):
        raise TypeError(f"a blended prefill runs ChunkReuse requests, got {type(work.reuse).__name__}")
    return work.reuse


def blended_prefill(
    context: StepContext, batch: Sequence[ChunkedWork]
) -> list[tuple[jax.Array, dict | None, BlendReport]]:
    """Blended prefill of scheduled requests (one, or several with one ``batch_key``: the same
    prompt and chunks under different selections) into their allocated pages. The chunks are
    looked up and their slots placed once; ``fusor.blend_prefill`` reads each layer's reused
    KV once for all of them.

    Args:
      context: the engine's step context (weights, model config, layout, manager); its pool
        takes the pages the prefill writes.
      batch: the requests; each one's pages cover its whole prompt.

    Returns:
      per request: (logits [reuse.num_prompt_logits, V] of the last prompt positions, trace
      or None (``fusor.BlendResult``), report).
    """
    t0 = time.perf_counter()
    head = batch[0]
    reuse, prompt, num_cached = _chunk_reuse(head), head.prompt, head.num_cached
    if any(w.reuse.batch_key(w.prompt, w.num_cached) != reuse.batch_key(prompt, num_cached) for w in batch[1:]):
        raise ValueError(
            "the requests of one blended prefill must share their prompt, chunks and cached tokens (batch_key)"
        )
    store, manager, layout = reuse.store, context.manager, context.layout
    cfg = context.cfg
    n = len(prompt)
    roles = reuse.roles(n)
    p = roles.prefix_len
    padded = round_up(n, reuse.token_bucket)
    ps = layout.tokens_per_block
    own = [[manager.block_table(w.request_id, g) for g in range(layout.num_groups)] for w in batch]
    # Tokens matched in the blend scope: their fused KV is already in the request's own pages
    # (a windowed group shows the null page outside its window; no row attends there); the
    # requests of a batch with cached tokens share one scope, so those pages are the same.
    cached = np.arange(num_cached)
    page_ids, offsets, valid = sequence_slots(own[0], cached, cached, padded, ps)  # page_ids: per layer group

    def place(slots: tuple[np.ndarray, ...]) -> None:
        page_ids[:, slots[2]], offsets[slots[2]], valid[slots[2]] = slots[0][:, slots[2]], slots[1][slots[2]], True

    chunks = [prompt[s:e] for s, e in roles.chunk_spans]
    prefix_in_store = bool(chunks) and 0 < p == store.stored_start and tuple(prompt[:p]) == store.variant_prefix
    todo = [i for i, (s, e) in enumerate(roles.chunk_spans) if e > num_cached or (i == 0 and prefix_in_store)]
    onboarded = store.stats.onboarded_pages
    prefix_lease = None
    if num_cached < p and not prefix_in_store:
        prefix_lease = store.acquire([prompt[:p]], NO_EXTRAS)
    try:
        lease = store.acquire([store.stored_tokens(chunks[i]) for i in todo])
    except Exception:
        if prefix_lease is not None:
            store.release(prefix_lease)
        raise
    loader: LayerwiseOnboard | None = None
    try:
        ops = context.manager.take_page_ops()  # the leases' onboards (and the evictions that made room)
        now, later = split_layerwise(ops) if reuse.pipelined else (ops, [])
        context.pool = apply_page_ops(context.pool, layout, context.host_pool, now, end_step=not later)
        if later:
            loader = LayerwiseOnboard(context.host_pool, layout, later)
        prefix_hit = 0
        if prefix_lease is not None:
            hit = range(num_cached, max(num_cached, min(prefix_lease.covered[0], p)))
            prefix_hit = len(hit)
            place(store.slots(prefix_lease.tables[0], hit, padded, num_cached))
        elif prefix_in_store and num_cached < p:
            hit = range(num_cached, min(lease.covered[0], p))
            prefix_hit = len(hit)
            place(store.slots(lease.tables[0], hit, padded, num_cached))
        spans, deltas = [], np.zeros(padded, np.int32)
        chunk_hit = 0
        for i, table, covered in zip(todo, lease.tables, lease.covered):
            s, e = roles.chunk_spans[i]
            stored = min(max(0, covered - store.stored_start), e - s)  # chunk tokens with stored KV
            first = max(s, num_cached)
            hit = range(store.stored_start + first - s, store.stored_start + stored)
            if len(hit):
                place(store.slots(table, hit, padded, first))
                spans.append((first, s + stored))
                deltas[first : s + stored] = s - store.stored_start
            chunk_hit += len(hit)
        store.stats.lookups += len(todo)
        store.stats.hit_tokens += chunk_hit

        idx = np.arange(padded)
        in_spans = np.zeros(padded, bool)
        for s, e in spans:
            in_spans[s:e] = True
        chunk_mask, _ = roles.masks(padded)
        missed = chunk_mask & ~in_spans & (idx >= num_cached)
        store.stats.missed_tokens += int(missed.sum())
        forced_mask = (idx >= num_cached) & (idx < n) & ~in_spans & ~((idx < p) & valid)
        exact_len = p + (len(chunks[0]) if prefix_in_store and roles.chunk_spans[0][0] == p else 0)
        width = table_width(layout.pages_for(padded))
        positions = np.where(idx < n, idx, -1).astype(np.int32)
        tokens = np.zeros(padded, np.int32)
        tokens[:n] = prompt
        probes = np.full(reuse.num_probes, -1, np.int32)
        suffix = np.arange(roles.suffix_start, n)[: reuse.num_probes]
        probes[: len(suffix)] = suffix
        inputs, plans = [], []
        for work, tables in zip(batch, own):
            sel = plan(
                Roles(
                    num_tokens=n,
                    prefix_len=max(num_cached, p),
                    chunk_spans=tuple(spans),
                    suffix_start=roles.suffix_start,
                ),
                _chunk_reuse(work).selection,
                padded,
                cfg.num_layers,
                forced=np.flatnonzero(forced_mask & (idx < roles.suffix_start)),
                num_cached=num_cached,
                exact_len=exact_len,
                scores=_chunk_reuse(work).scores,
            )
            block_table = np.full((len(tables), width), NULL_PAGE, np.int32)
            for g, group_table in enumerate(tables):
                block_table[g, : len(group_table)] = group_table
            inputs.append(
                BlendInputs.on_device(
                    tokens=tokens,
                    positions=positions,
                    page_ids=page_ids,
                    offsets=offsets,
                    reused=valid,
                    deltas=deltas,
                    selectable=in_spans,
                    forced=forced_mask,
                    rows=sel.rows,
                    rows_valid=sel.rows_valid,
                    counts=sel.counts,
                    block_table=block_table,
                    length=np.asarray([n], np.int32),
                    probes=probes,
                    num_cached=np.int32(num_cached),
                )
            )
            plans.append(BlendPlan(checks=sel.checks, score=sel.score, num_probes=reuse.num_probes,
                                   num_logits=reuse.num_prompt_logits))
        load_s = time.perf_counter() - t0
        phases: dict[str, float] = {}
        compute = ComputeTimeline() if reuse.timeline else None
        try:
            results, context.pool = blend_prefill(
                context.params, context.pool, inputs, plans, cfg=cfg, layout=layout, attn_impl=context.attn_impl,
                phases=phases, fetch=loader.fetch if loader else None, timeline=compute,
            )
        except PrefillInterrupted as stop:
            context.pool = stop.pool
            cause = stop.__cause__
            assert cause is not None, "blend_prefill raises PrefillInterrupted from the layer's error"
            raise cause from None
        finally:
            if compute is not None:
                compute.close()
    finally:  # the chunk blocks stay referenced until the fusor has read them
        if loader is not None:
            context.pool = loader.finish(context.pool)
        store.release(lease)
        if prefix_lease is not None:
            store.release(prefix_lease)
    timeline = None
    if compute is not None:
        def since(events: list[dict]) -> list[dict]:
            return [{k: x - t0 if k.endswith("_s") else x for k, x in e.items()} for e in events]

        timeline = {"load": since(loader.events if loader else []), "compute": since(compute.events)}
    out = []
    for result in results:
        trace = result.trace
        if trace is not None:
            trace["k"], trace["v"] = trace["k"][:, :n], trace["v"][:, :n]
        report = BlendReport(
            num_cached=num_cached, prefix_hit=prefix_hit, chunk_hit=chunk_hit, num_forced=int(forced_mask.sum()),
            num_missed=int(missed.sum()), onboarded_pages=store.stats.onboarded_pages - onboarded,
            layerwise_pages=len(later), load_s=load_s, phases=phases, recomputed=np.asarray(result.recomputed)[:, :n],
            timeline=timeline,
        )
        out.append((result.logits, trace, report))
    return out


__all__ = ["BlendReport", "ChunkReuse", "blended_prefill"]
