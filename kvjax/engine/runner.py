"""The step runner: one step's forwards, from scheduled works to sampled tokens.

``StepRunner`` turns the works of a step plan (``kvjax.engine.scheduler.ScheduledRequest``)
into padded device inputs (``step_inputs``: tokens, positions, block tables, lengths, with
shapes from ``kvjax.engine.buckets`` so nothing recompiles per request), runs the forward on
the page pool and samples. Each kind of work has one runner: ``prefill`` (one prompt chunk;
a hybrid model's chunk is cut at its snapshot boundaries), ``blend`` (a blended request's
whole prompt, through its ``ChunkedPrompt``) and ``decode`` (a batch of decode tokens; the
speculative decoder in ``kvjax.engine.speculative_step`` has the same signature). The page
pool lives in the step context (``StepContext.pool``, its one owner): every forward donates it
and the context takes the new pool as soon as the forward returns, so a failure after a
forward never leaves the context holding a donated pool.

``run_isolated`` confines a failure to the request whose work raised: a failing batch is run
again one request at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvjax import attention
from kvjax.cache import NULL_PAGE, CacheLayout, HostPool, PagePool
from kvjax.distributed import replicate
from kvjax.engine.buckets import PREFILL_BATCH_TOKENS, pow2_bucket, prefill_bucket, table_width
from kvjax.engine.outputs import RequestRecord
from kvjax.engine.page_ops import apply_page_ops
from kvjax.engine.recurrent import RecurrentState
from kvjax.engine.requests import ChunkedWork
from kvjax.engine.scheduler import ScheduledRequest
from kvjax.manager.interface import CacheManager
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import Params, forward
from kvjax.sampling import sample

log = logging.getLogger(__name__)

Sampled = dict[str, int | list[int]]
"""Tokens a step emits per request id: one token, or (speculative decoding) a list."""
Runner = Callable[[Sequence[ScheduledRequest]], Sampled]
"""A step's runner: works -> the tokens sampled for the works that sample."""


@dataclasses.dataclass
class StepContext:
    """What a step's forwards read and write: the narrow view a blended prefill gets.

    Attributes:
      params: the model's weights.
      cfg: the model's config.
      layout: the cache geometry (pages of every layer group, tokens per block, windows).
      attn_impl: the attention implementation (``kvjax.attention.IMPLS``).
      manager: the cache manager; runners read block tables and roll back draft slots.
      host_pool: the host and disk tiers' pages (``execute_page_ops`` moves pages to and from them).
      pool: the device page pool; replaced by every call that donates it.
      mesh: the device mesh the weights and the pool are sharded over (``kvjax.distributed``;
        attention then runs per device, the step's inputs are replicated); None = one device.
      forward: the model's forward, whole or layer by layer (``transformer.forward_for``);
        both have ``transformer.forward``'s signature.
    """

    params: Params
    cfg: ModelConfig
    layout: CacheLayout
    attn_impl: attention.Impl
    manager: CacheManager
    host_pool: HostPool
    pool: PagePool
    mesh: Mesh | None = None
    forward: Callable[..., tuple] = forward

    def execute_page_ops(self) -> int:
        """Runs the manager's queued page operations (offload, onboard, copy) on the pool and
        the host tiers; returns how many ran."""
        ops = self.manager.take_page_ops()
        self.pool = apply_page_ops(self.pool, self.layout, self.host_pool, ops)
        return len(ops)

    def block_tables(self, works: Sequence[ScheduledRequest], num_rows: int, width: int) -> tuple[jax.Array, ...]:
        """Per layer group, [num_rows, width] int32: each work's pages (the null page past them)."""
        return block_tables(self.layout.num_groups, works, num_rows, width, self.manager.block_table)


@flax.struct.dataclass
class StepInputs:
    """The device inputs of one forward over S rows of T token slots.

    Attributes:
      tokens: [S, T] int32 (0 in padding slots).
      positions: [S, T] int32, each token's position in its sequence; -1 = padding.
      block_tables: per layer group, [S, width] int32 pages (``NULL_PAGE`` past a row's pages).
      lengths: [S] int32, tokens each row's sequence holds after the step (0 = padding row).
    """

    tokens: jax.Array
    positions: jax.Array
    block_tables: tuple[jax.Array, ...]
    lengths: jax.Array


def block_tables(
    num_groups: int,
    works: Sequence[ScheduledRequest],
    num_rows: int,
    width: int,
    table_of: Callable[[str, int], Sequence[int]],
) -> tuple[jax.Array, ...]:
    """Per layer group, [num_rows, width] int32: row i holds ``table_of(works[i].request_id,
    group)`` cut to ``width`` pages (pages past the step are not read), ``NULL_PAGE`` after."""
    tables = []
    for g in range(num_groups):
        table = np.full((num_rows, width), NULL_PAGE, np.int32)
        for i, w in enumerate(works):
            pages = table_of(w.request_id, g)[:width]
            table[i, : len(pages)] = pages
        tables.append(jnp.asarray(table))
    return tuple(tables)


def step_inputs(
    layout: CacheLayout,
    works: Sequence[ScheduledRequest],
    num_tokens: int,
    table_of: Callable[[str, int], Sequence[int]],
    num_slots: int = 0,
) -> StepInputs:
    """Pads ``works`` to ``pow2_bucket(len(works))`` rows of ``num_tokens`` slots; the block
    tables are ``table_width`` pages wide for the longest row (or ``num_slots`` tokens, if more).

    Args:
      layout: the cache geometry.
      works: the rows; ``works[i].token_ids`` (at most ``num_tokens``) sit at positions
        ``works[i].start`` onwards.
      num_tokens: T, the token bucket (``prefill_bucket`` of a prefill chunk, ``pow2_bucket``
        of a decode batch's longest row).
      table_of: (request id, layer group) -> the request's pages.
      num_slots: tokens the tables must cover at least (a speculative step's draft slots).
    """
    rows = pow2_bucket(len(works))
    tokens = np.zeros((rows, num_tokens), np.int32)
    positions = np.full((rows, num_tokens), -1, np.int32)
    lengths = np.zeros(rows, np.int32)
    for i, w in enumerate(works):
        n = len(w.token_ids)
        tokens[i, :n] = w.token_ids
        positions[i, :n] = np.arange(w.start, w.start + n)
        lengths[i] = w.start + n
    width = table_width(layout.pages_for(max(int(lengths.max()), num_slots)))
    tables = block_tables(layout.num_groups, works, rows, width, table_of)
    return StepInputs(jnp.asarray(tokens), jnp.asarray(positions), tables, jnp.asarray(lengths))


def sampling_arrays(
    works: Sequence[ScheduledRequest], records: Mapping[str, RequestRecord], num_rows: int
) -> tuple[jax.Array, ...]:
    """(temperature, top_p, seeds, counters), each [num_rows], of the works' requests; a
    counter is the number of tokens the request has generated (padding rows: greedy, 0)."""
    temperature = np.zeros(num_rows, np.float32)
    top_p = np.ones(num_rows, np.float32)
    seeds = np.zeros(num_rows, np.int32)
    counters = np.zeros(num_rows, np.int32)
    for i, w in enumerate(works):
        r = records[w.request_id]
        temperature[i], top_p[i] = r.sampling.temperature, r.sampling.top_p
        seeds[i], counters[i] = r.sampling.seed, len(r.sched.output_token_ids)
    return jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(seeds), jnp.asarray(counters)


class StepRunner:
    """Runs the prefill, blend and decode works of a step (see the module docstring).

    Args:
      context: the step context; replaced (``context = ...``) when the manager is.
      records: the engine's request records by id (read for sampling parameters; prompt
        logits, logits and blend results are stored on them).
      timings: the engine's cumulative seconds and token counts by phase.
      recurrent: a hybrid model's recurrent state (None for pure-attention models).
    """

    def __init__(
        self,
        context: StepContext,
        records: Mapping[str, RequestRecord],
        timings: collections.defaultdict[str, float],
        recurrent: RecurrentState | None,
    ) -> None:
        self.context = context
        self.records = records
        self.timings = timings
        self.recurrent = recurrent

    def prefill(self, works: Sequence[ScheduledRequest]) -> Sampled:
        """Prefill chunks of one token bucket (``run_works`` groups them) in one batched
        forward; a hybrid model's chunks run one by one, each cut at the snapshot boundaries
        inside it so the state at each is taken (only the last piece samples)."""
        if self.recurrent is None:
            return self.forward(works, "prefill")
        sampled: Sampled = {}
        for work in works:
            end, start = work.start + len(work.token_ids), work.start
            for cut in self.recurrent.cuts(work):
                piece = dataclasses.replace(
                    work, token_ids=work.token_ids[start - work.start : cut - work.start], start=start,
                    samples=work.samples and cut == end,
                )
                sampled.update(self.forward([piece], "prefill"))
                start = cut
        return sampled

    def decode(self, works: Sequence[ScheduledRequest]) -> Sampled:
        """One decode token for each of ``works``, in one batched forward."""
        return self.forward(works, "decode")

    def blend(self, works: Sequence[ScheduledRequest]) -> Sampled:
        """Blended requests' whole prompts (``work.start`` tokens cached; one request, or
        several with one ``chunks.batch_key``) through the first one's ``chunks.prefill``;
        samples each one's first token."""
        start = time.perf_counter()
        records = [self.records[w.request_id] for w in works]
        batch = []
        for w, r in zip(works, records):
            if r.chunks is None:
                raise ValueError(f"request {w.request_id!r} has no chunks: the blend runner takes blended ones only")
            batch.append(ChunkedWork(w.request_id, tuple(r.sched.prompt_token_ids), w.start, r.chunks))
        results = batch[0].reuse.prefill(self.context, batch)
        for record, (logits, trace, report) in zip(records, results):
            record.prompt_logits, record.blend_trace, record.blend_report = np.asarray(logits), trace, report
        sampled = self.sample(works, jnp.stack([logits[-1] for logits, _, _ in results]))
        self._account("blend", start, sum(len(w.token_ids) for w in works))
        return sampled

    def forward(self, works: Sequence[ScheduledRequest], phase: str) -> Sampled:
        """One forward over ``works`` (one prefill chunk, or a batch of decodes); samples the
        rows that sample. ``phase`` ("prefill" | "decode") picks the token bucket and the
        timings' keys."""
        start = time.perf_counter()
        ctx = self.context
        longest = max(len(w.token_ids) for w in works)
        inputs = step_inputs(ctx.layout, works, prefill_bucket(longest) if phase == "prefill" else pow2_bucket(longest),
                             ctx.manager.block_table)
        if ctx.mesh is not None:
            inputs = replicate(inputs, ctx.mesh)
        rows = inputs.tokens.shape[0]
        samples = any(w.samples for w in works)
        keeps = phase == "prefill" and any(self.records[w.request_id].sampling.prompt_logits for w in works)
        recurrent = self.recurrent
        slots = None if recurrent is None else recurrent.slots(works, rows)
        logits, ctx.pool, *state = ctx.forward(
            ctx.params, ctx.pool, inputs.tokens, inputs.positions, inputs.block_tables, inputs.lengths,
            cfg=ctx.cfg, layout=ctx.layout, attn_impl=ctx.attn_impl, mesh=ctx.mesh,
            logits_mode="all" if keeps else "last" if samples else "none",
            state=None if recurrent is None or slots is None else recurrent.read(slots),
        )
        if keeps:
            logits = self._keep_prompt_logits(works, logits)
        if recurrent is not None and slots is not None:
            recurrent.write(slots, state[0])
            recurrent.take_snapshots(works, self.records, ctx.manager)
        sampled = self.sample(works, logits) if samples else {}
        jax.block_until_ready(ctx.pool.k[0])
        self._account(phase, start, sum(len(w.token_ids) for w in works))
        return sampled

    def sample(self, works: Sequence[ScheduledRequest], logits: jax.Array) -> Sampled:
        """Samples logits [S, V] (row i: ``works[i]``'s last token) for the works that sample;
        keeps each sampled row's logits on requests with ``sampling.return_logits``."""
        tokens = np.asarray(sample(logits, *sampling_arrays(works, self.records, logits.shape[0])))
        wants_logits = [self.records[w.request_id].sampling.return_logits for w in works]
        host_logits = np.asarray(logits) if any(wants_logits) else None
        sampled: Sampled = {}
        for i, w in enumerate(works):
            if not w.samples:
                continue
            sampled[w.request_id] = int(tokens[i])
            if host_logits is not None and wants_logits[i]:
                self.records[w.request_id].logits.append(host_logits[i])
        return sampled

    def _keep_prompt_logits(self, works: Sequence[ScheduledRequest], logits: jax.Array) -> jax.Array:
        """Appends each prefill chunk's rows among its request's last ``sampling.prompt_logits``
        prompt positions to ``record.prompt_logits``; returns the logits [S, V] of each row's
        last token (what sampling reads) from the chunk's logits [S, T, V]."""
        host = np.asarray(logits)
        for i, w in enumerate(works):
            record = self.records[w.request_id]
            first = len(record.sched.prompt_token_ids) - record.sampling.prompt_logits  # first kept position
            rows = host[i, max(0, first - w.start) : len(w.token_ids)]
            if record.sampling.prompt_logits and len(rows):
                kept = record.prompt_logits
                record.prompt_logits = rows.copy() if kept is None else np.concatenate([kept, rows])
        last = np.asarray([max(len(w.token_ids) - 1, 0) for w in works] + [0] * (host.shape[0] - len(works)))
        return jnp.asarray(host[np.arange(host.shape[0]), last])

    def _account(self, phase: str, start: float, num_tokens: int) -> None:
        self.timings[f"{phase}_s"] += time.perf_counter() - start
        self.timings[f"{phase}_tokens"] += num_tokens
        self.timings[f"{phase}_steps"] += 1


def run_works(
    runners: Mapping[str, Runner], works: Sequence[ScheduledRequest], records: Mapping[str, RequestRecord]
) -> tuple[Sampled, dict[str, str]]:
    """Sends a step's works to their runners: the prefill chunks of ordinary requests to
    "prefill" in batches of one token bucket (``prefill_bucket``: a short chunk is never
    padded to a long one's length) of at most ``PREFILL_BATCH_TOKENS`` padded tokens, the
    prompts of blended requests to "blend" together when their ``chunks.batch_key`` is equal
    (variants of one prompt), else alone, all decodes together to "decode".

    Returns:
      (the tokens sampled, the failed requests: id -> "ErrorType: message").
    """
    by_bucket: dict[int, list[ScheduledRequest]] = {}
    by_key: dict[Hashable, list[ScheduledRequest]] = {}
    batches = []
    for w in works:
        chunks = records[w.request_id].chunks
        if w.is_prefill and chunks is not None:
            key = chunks.batch_key(records[w.request_id].sched.prompt_token_ids, w.start)
            if key is None:
                batches.append(("blend", [w]))
            else:
                by_key.setdefault(key, []).append(w)
        elif w.is_prefill:
            by_bucket.setdefault(prefill_bucket(len(w.token_ids)), []).append(w)
    batches += [("blend", batch) for batch in by_key.values()]
    for bucket, group in by_bucket.items():
        size = max(1, PREFILL_BATCH_TOKENS // bucket)
        batches += [("prefill", group[i : i + size]) for i in range(0, len(group), size)]
    decodes = [w for w in works if not w.is_prefill]
    batches += [("decode", decodes)] if decodes else []
    sampled: Sampled = {}
    failed: dict[str, str] = {}
    for kind, batch in batches:
        sampled.update(run_isolated(runners[kind], batch, failed, kind))
    return sampled, failed


def run_isolated(runner: Runner, works: Sequence[ScheduledRequest], failed: dict[str, str], phase: str) -> Sampled:
    """``runner`` over ``works``, confining a failure to the request that caused it: if the
    batch raises, each work runs alone; a work that raises alone goes into ``failed``
    (request id -> "ErrorType: message") and samples nothing."""
    try:
        return runner(works)
    except Exception as e:
        if len(works) == 1:
            _record_failure(works[0], phase, e, failed)
            return {}
    sampled: Sampled = {}
    for work in works:
        try:
            sampled.update(runner([work]))
        except Exception as e:
            _record_failure(work, phase, e, failed)
    return sampled


def _record_failure(work: ScheduledRequest, phase: str, error: Exception, failed: dict[str, str]) -> None:
    log.warning("request %r failed in %s: %s: %s", work.request_id, phase, type(error).__name__, error)
    failed[work.request_id] = f"{type(error).__name__}: {error}"
