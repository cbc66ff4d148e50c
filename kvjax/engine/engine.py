"""The engine: requests in, tokens out, over one shared page pool.

Each ``step()``:

1. the scheduler (``kvjax.manager.scheduler``) plans the step: running requests decode one
   token or prefill their next chunk; waiting requests are admitted (the manager matches
   their longest cached prefix, which is skipped) under the token budget, prefix-aware;
2. the engine executes the manager's page operations (offload, onboard, copy) on the pools;
3. one jitted forward per prefill chunk and one batched forward for all decodes run, with
   shapes padded to power-of-two buckets so nothing recompiles per request;
4. sampling runs on device; the scheduler commits the computed tokens to the manager (full
   blocks enter the radix tree) and finishes requests on EOS or length.

With ``speculative`` (a ``SpeculativeConfig``) the decodes of step 3 are speculative: each
sequence gets up to k draft slots in its own pages, taken only from free pages after the
scheduler's allocations (so a draft never evicts a cached block), the drafter
(``kvjax.speculative``) proposes drafts, one forward over the inputs and drafts verifies them
(``verify``: greedy rows emit exactly the non-speculative tokens), the slots of rejected drafts
are rolled back, and the scheduler commits the input token and the accepted drafts only.
Drafts are not charged to ``max_num_tokens``.

A request submitted with ``chunks`` (a ``ChunkedPrompt``: CacheBlend's
``kvjax.blend.engine_blend.ChunkReuse``) is a blended request: its prompt reuses stored chunk
KV, scheduled like any other and charged the rows it recomputes; its whole prompt runs in one
``chunks.prefill`` in step 3, beside the other prefills and the decode batch. The engine sees
only the ``ChunkedPrompt`` protocol, so it never imports the blend package built on top of it.

A hybrid model (recurrent layers, ``ModelConfig.layer_types``) also has a recurrent state
(``self.recurrent``, ``kvjax.engine.recurrent.RecurrentState``): each running request's rows
read and write a live state slot, snapshots at block boundaries serve reuse.

With Manager V2 (``use_kv_cache_manager_v2``, see ``choose_manager_v2``) the manager is
``kvjax.manager.manager_v2.KVCacheManagerV2``, whose allocation state lives on the device;
the same scheduler drives it, and a step in which every running request decodes (nothing
admissible waits) runs on the device instead: ``num_decode_steps_per_dispatch`` tokens per
request from one dispatch of ``kvjax.decode.decode_steps``.

When a step cannot get pages, the scheduler preempts the newest running request (its
blocks stay cached) and re-admits it later; no page another request owns is ever written.

Failures are per request. ``submit()`` validates every argument before touching any state
and raises ``ValueError`` (``ConfigError`` for retention configs) naming the field; a failure
that still happens inside a step finishes only the request whose work raised, with
``finish_reason="error"`` and the message in ``RequestOutput.error``, while the others go on.

Threading: one re-entrant lock guards the engine's state; ``submit``, ``abort``, ``step``,
``output`` and the blocking helpers (``generate``, ``run``, ``stream``) may be called from any
thread. The intended shape is one thread stepping while others submit; several threads
stepping (e.g. each calling ``generate``) is also safe, each step then serving all requests.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax.cache import NULL_PAGE, CacheLayout, HostPool, PagePool, init_pool
from kvjax.config import (
    ConfigError,
    KvCacheConfig,
    KvCacheRetentionConfig,
    SchedulerConfig,
    SpeculativeConfig,
    as_retention_config,
)
from kvjax.decode import decode_steps
from kvjax.engine.buckets import pow2_bucket, prefill_bucket, table_width
from kvjax.engine.outputs import RequestOutput, RequestRecord, to_output
from kvjax.engine.page_ops import apply_page_ops
from kvjax.engine.recurrent import RecurrentState
from kvjax.engine.requests import ChunkedPrompt, check_optional_str, check_token_ids, check_v2_request
from kvjax.manager import KVCacheManager, MultimodalItem
from kvjax.manager.interface import CacheManager
from kvjax.manager.manager_v2 import KVCacheManagerV2
from kvjax.manager.scheduler import ScheduledRequest, Scheduler, SchedulerRequest
from kvjax.model.config import ModelConfig
from kvjax.model.model import Model
from kvjax.model.transformer import forward
from kvjax.sampling import SamplingParams, sample
from kvjax.speculative import DraftRow, make_drafter, verify

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a paged KV cache with cross-request reuse.

    Args:
      model: a loaded model (``kvjax.model.registry.load_model``).
      kv_cache_config: cache sizing, reuse, offload, windows, events.
      scheduler_config: token budget, batch size, chunking, prefix-aware scheduling.
      max_seq_len: longest prompt + generation; default the model's context length.
      attn_impl: "auto" | "blocked" | "reference" | "interpret" (see ``kvjax.attention``; "auto" is
        the blocked XLA implementation on CPU).
      max_finished_requests: finished requests whose outputs stay readable by id; older ones
        are forgotten (``generate``/``run``/``stream`` return their own outputs regardless).
        A finished request's id may be reused.
      speculative: speculative decoding of every request (None = off).
    """

    def __init__(
        self,
        model: Model,
        kv_cache_config: KvCacheConfig = KvCacheConfig(),
        scheduler_config: SchedulerConfig = SchedulerConfig(),
        *,
        max_seq_len: int | None = None,
        attn_impl: attention.Impl = "auto",
        max_finished_requests: int = 1024,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        cfg = model.config
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be None or a SpeculativeConfig, got {type(speculative).__name__}")
        if isinstance(max_finished_requests, bool) or not isinstance(max_finished_requests, int) or max_finished_requests < 1:
            raise ValueError(f"max_finished_requests={max_finished_requests!r} must be an int >= 1")
        self.uses_manager_v2 = choose_manager_v2(kv_cache_config, cfg, speculative)
        """Manager V2 (device-side allocation state, on-device decode) rather than V1."""
        self.model = model
        self.kv_config = kv_cache_config
        self.scheduler_config = scheduler_config
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or not 1 <= max_seq_len <= cfg.max_seq_len):
            raise ValueError(
                f"max_seq_len={max_seq_len!r} must be None (the model's {cfg.max_seq_len}) or an int in "
                f"[1, {cfg.max_seq_len}] (the model's max_seq_len)"
            )
        if attn_impl not in attention.IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r} must be one of {attention.IMPLS}")
        self.max_seq_len = max_seq_len or cfg.max_seq_len
        self.attn_impl = attn_impl
        self.layout, self.cache_size = CacheLayout.for_model(
            kv_cache_config, model_windows=cfg.layer_windows, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            max_seq_len=self.max_seq_len, model_dtype=str(model.params.embed.dtype), hybrid=bool(cfg.recurrent_layers),
        )
        """The cache geometry (pages of every tier, page size, windows); the one owner of it."""
        self.host_pool = HostPool(self.layout, kv_cache_config.disk_cache_dir)
        """The host and disk tiers' pages (written only through its methods); built first, since
        it checks the disk tier against the free space before any structure is sized by it."""
        self.manager: CacheManager = (
            KVCacheManagerV2(kv_cache_config, self.layout, scheduler_config.max_batch_size)
            if self.uses_manager_v2 else KVCacheManager(kv_cache_config, self.layout)
        )
        if self.host_pool.disk:
            self.manager.attach_disk_check(self.host_pool.check_disk)
        self._decode_on_device = self.uses_manager_v2
        """Whether the next pure-decode step may run on the device (V2; off for one step after
        a dispatch that ran out of pages or raised, so the scheduler preempts or isolates)."""
        self.pool: PagePool = init_pool(self.layout)
        self.scheduler = Scheduler(scheduler_config, self.manager)
        self.requests: dict[str, RequestRecord] = {}
        self.max_finished_requests = max_finished_requests
        self._finished: dict[str, None] = {}
        """Finished request ids, oldest first (an insertion-ordered set)."""
        self.lock = threading.RLock()
        """Held by every entry point; hold it to read or replace the engine's state from outside
        (``kvjax.snapshot``)."""
        self._ids = itertools.count()
        self.speculative = speculative
        self.drafter = None if speculative is None else make_drafter(speculative, model.params, cfg, self.layout, attn_impl)
        self.timings = collections.Counter()
        """Cumulative seconds and token counts by phase (prefill / decode / page_ops). Speculative
        decodes add draft_s (drafting, within decode_s), spec_rows (sequence-steps verified),
        spec_drafted and spec_accepted (draft tokens proposed and accepted)."""
        self.recurrent: RecurrentState | None = None
        """A hybrid model's recurrent state pool and slot index (None for pure-attention models)."""
        if cfg.is_hybrid:
            if speculative is not None:
                raise ValueError(
                    f"speculative decoding is not supported for the hybrid model {cfg.name!r}: a rejected draft "
                    "cannot be rolled back out of a recurrent state; pass speculative=None"
                )
            self.recurrent = RecurrentState(kv_cache_config, self.layout, cfg, scheduler_config.max_batch_size)
            self.manager.attach_state_snapshots(self.recurrent.index)

    def set_manager(self, manager: KVCacheManager) -> None:
        """Swaps in another manager (a restored snapshot); the engine must be idle."""
        with self.lock:
            if self.has_work:
                raise ValueError("set_manager needs an idle engine: finish or drop queued/running requests first")
            if self.uses_manager_v2:
                raise ValueError("set_manager swaps a V1 manager; this engine runs Manager V2 (use_kv_cache_manager_v2)")
            self.manager = manager
            self.scheduler = Scheduler(self.scheduler_config, manager)
            if self.host_pool.disk:
                manager.attach_disk_check(self.host_pool.check_disk)
            if self.recurrent is not None:
                manager.attach_state_snapshots(self.recurrent.index)

    # ------------------------------------------------------------------ submission

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        *,
        retention: KvCacheRetentionConfig | dict | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        mm_items: Sequence[MultimodalItem] = (),
        request_id: str | None = None,
        chunks: ChunkedPrompt | None = None,
    ) -> str:
        """Queues a request; returns its id.

        Every argument is validated before any state changes: a bad one raises ``ValueError``
        (``ConfigError`` for ``retention``) naming it, and the engine goes on as before.

        Args:
          chunks: makes it a blended request: these prompt spans reuse the chunk KV of
            ``chunks.store`` (CacheBlend, ``kvjax.blend.engine_blend``). Its blocks live in
            the blend scope ``chunks.salt``, so ``cache_salt`` must be None.
        """
        vocab = self.model.config.vocab_size
        prompt = check_token_ids(prompt_token_ids, vocab)
        if self.uses_manager_v2:
            check_v2_request(retention, chunks)
        if chunks is not None:
            if self.recurrent is not None:
                raise ValueError(
                    f"chunks: CacheBlend chunk reuse is not supported for the hybrid model {self.model.config.name!r}"
                )
            if cache_salt is not None or lora_id is not None or mm_items:
                raise ValueError("a request with chunks takes no cache_salt, lora_id or mm_items (its scope is chunks.salt)")
            chunks.check(self, prompt)
            cache_salt = chunks.salt
        sched = self._scheduler_request(prompt, sampling, request_id, retention, cache_salt)
        if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, (int, np.integer)) or lora_id < 0):
            raise ValueError(f"lora_id={lora_id!r} must be None or an int >= 0")
        if not all(isinstance(item, MultimodalItem) for item in mm_items):
            raise ValueError(f"mm_items must be a sequence of MultimodalItem, got {list(mm_items)[:3]!r}")
        sched.lora_id, sched.mm_items = lora_id, tuple(mm_items)
        if chunks is not None:
            sched.num_prefill_rows = chunks.num_rows(len(prompt), self.model.config.num_layers)
        with self.lock:
            self._release_id(sched.request_id)
            self.scheduler.add(sched)
            self.requests[sched.request_id] = RequestRecord(
                sched=sched, sampling=sampling, submit_time=time.perf_counter(), chunks=chunks
            )
        return sched.request_id

    def abort(self, request_id: str) -> bool:
        """Stops a queued or running request: its pages are freed (full committed blocks stay
        cached), its output so far is kept with ``finish_reason="abort"``.

        Returns:
          Whether the request was still queued or running (False if finished or unknown).
        """
        if not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} must be a str (one request per call)")
        with self.lock:
            record = self.requests.get(request_id)
            if record is None or record.finished or not self.scheduler.abort(request_id):
                return False
            self._finish(request_id, "abort")
            return True

    def _scheduler_request(
        self,
        prompt: tuple[int, ...],
        sampling: SamplingParams,
        request_id: str | None,
        retention: KvCacheRetentionConfig | dict | None,
        cache_salt: str | None,
    ) -> SchedulerRequest:
        """A request's scheduler entry from validated arguments."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        vocab = self.model.config.vocab_size
        if sampling.stop_token_id is not None and sampling.stop_token_id >= vocab:
            raise ValueError(f"sampling.stop_token_id={sampling.stop_token_id} must be in [0, {vocab})")
        check_optional_str("request_id", request_id)
        check_optional_str("cache_salt", cache_salt)
        stop = None if sampling.ignore_eos else (
            sampling.stop_token_id if sampling.stop_token_id is not None else self.model.config.eos_ids[0]
        )
        return SchedulerRequest(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=prompt, max_new_tokens=sampling.max_new_tokens, eos_token_id=stop,
            retention=as_retention_config(retention), cache_salt=cache_salt,
        )

    def _release_id(self, request_id: str) -> None:
        """Frees a finished request's id for reuse; raises if the id is live."""
        record = self.requests.get(request_id)
        if record is None:
            return
        if not record.finished:
            raise ValueError(f"request_id={request_id!r} is already in use by a request that has not finished")
        del self.requests[request_id]
        self._finished.pop(request_id, None)

    def _forget_oldest_finished(self) -> None:
        while len(self._finished) > self.max_finished_requests:
            oldest = next(iter(self._finished))
            del self._finished[oldest]
            del self.requests[oldest]

    def _finish(self, request_id: str, reason: str | None = None, error: str | None = None) -> None:
        if self.recurrent is not None:
            self.recurrent.end(request_id, self.requests.get(request_id), reason is None, self.manager)
        record = self.requests[request_id]
        record.finished, record.finish_time = True, time.perf_counter()
        record.finish_reason, record.error = reason, error
        self._finished[request_id] = None
        self._forget_oldest_finished()

    def execute_page_ops(self) -> None:
        """Runs the manager's queued page operations (offload, onboard, copy) on the pools now;
        for callers that acquire or allocate blocks outside ``step()``."""
        with self.lock:
            self._execute_page_ops()

    # ------------------------------------------------------------------ stepping

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[tuple[str, int | list[int]]]:
        """One engine iteration; returns the (request_id, token) pairs generated (with
        speculation, a decode's pair holds the list of tokens it emitted, before a stop or
        ``max_new_tokens`` cuts it).

        A request whose forward or sampling raises is finished with ``finish_reason="error"``
        (a failing decode batch is retried one request at a time to find it); the others
        in the step go on.
        """
        with self.lock:
            if self._decode_on_device and self.scheduler.decodes_only and not any(
                self.requests[rid].sampling.return_logits for rid in self.scheduler.running
            ):
                return self._step_on_device()
            self._decode_on_device = self.uses_manager_v2
            plan = self.scheduler.schedule()
            for rid in plan.preempted:
                record = self.requests[rid]
                record.num_preemptions += 1
                record.logits.clear()
                record.prompt_logits = None if record.chunks is None else record.prompt_logits
                record.first_token_time = None
                if self.recurrent is not None:  # resumed later from a snapshot, or recomputed
                    self.recurrent.end(rid, record, False, self.manager)
            self._execute_page_ops()
            if self.recurrent is not None:
                self.recurrent.start(plan.scheduled, self.requests)
            sampled: dict[str, int | list[int]] = {}
            failed: dict[str, str] = {}
            prefills = [w for w in plan.scheduled if w.is_prefill]
            decodes = [w for w in plan.scheduled if not w.is_prefill]
            for work in prefills:
                phase = "prefill" if self.requests[work.request_id].chunks is None else "blend"
                sampled.update(self._run_isolated([work], phase, failed))
            if decodes:
                phase = "decode" if self.speculative is None else "speculative"
                sampled.update(self._run_isolated(decodes, phase, failed))
            for rid, message in failed.items():
                self.scheduler.abort(rid)
                self._finish(rid, "error", message)
            now = time.perf_counter()
            for rid in sampled:
                record = self.requests[rid]
                if record.first_token_time is None:
                    record.first_token_time = now
            finished = self.scheduler.finish_step(sampled)
            if self.speculative is not None:  # logits of emitted tokens past a stop or max_new_tokens
                for rid in sampled:
                    record = self.requests[rid]
                    del record.logits[len(record.sched.output_token_ids) :]
            for rid in finished:
                self._finish(rid)
            return list(sampled.items())

    def _step_on_device(self) -> list[tuple[str, int | list[int]]]:
        """Manager V2's pure-decode step: up to ``num_decode_steps_per_dispatch`` tokens of
        every running request from one dispatch of ``kvjax.decode.decode_steps`` (pages,
        forward, sampling and stops on the device); returns (request_id, tokens) pairs.

        A dispatch that runs out of pages keeps the tokens it emitted and hands the next step
        to the scheduler (which preempts); one that raises runs this step through the
        scheduler instead, which confines the failure to its request.
        """
        start = time.perf_counter()
        manager, n = self.manager, self.scheduler_config.num_decode_steps_per_dispatch
        running = list(self.scheduler.running.values())
        rows = pow2_bucket(len(running))
        row_ids, tokens = np.full(rows, manager.row_of(running[0].request_id), np.int32), np.zeros(rows, np.int32)
        stop_ids, budgets, active = np.full(rows, -1, np.int32), np.zeros(rows, np.int32), np.zeros(rows, bool)
        works = []
        longest = 0
        for i, req in enumerate(running):
            row_ids[i], tokens[i], active[i] = manager.row_of(req.request_id), req.output_token_ids[-1], True
            stop_ids[i] = -1 if req.eos_token_id is None else req.eos_token_id
            budgets[i] = req.max_new_tokens - len(req.output_token_ids)
            longest = max(longest, req.num_computed_tokens + min(n, int(budgets[i])))
            works.append(ScheduledRequest(req.request_id, (int(tokens[i]),), req.num_computed_tokens, False, True))
        width = min(table_width(self.layout.pages_for(longest)), manager.max_blocks)
        try:
            self.pool, states, emitted, counts, ok = decode_steps(
                self.model.params, self.pool, manager.states, jnp.asarray(row_ids), jnp.asarray(tokens),
                jnp.asarray(active), jnp.asarray(stop_ids), jnp.asarray(budgets), *self._sampling_arrays(works, rows),
                cfg=self.model.config, layout=self.layout, num_steps=n, width=width, attn_impl=self.attn_impl,
            )
            emitted, counts, ok = jax.device_get((emitted, counts, ok))
        except Exception as e:
            log.warning("on-device decode failed (%s: %s); stepping through the scheduler", type(e).__name__, e)
            self._decode_on_device = False
            return self.step()
        manager.states = states
        self._decode_on_device = bool(ok)
        out = {w.request_id: emitted[i, : counts[i]].tolist() for i, w in enumerate(works)}
        for rid in self.scheduler.record_decodes(out):
            self._finish(rid)
        self.timings["decode_s"] += time.perf_counter() - start
        self.timings["decode_tokens"] += int(counts.sum())
        self.timings["decode_steps"] += int(counts.max(initial=0))
        self.timings["decode_dispatches"] += 1
        return [(rid, tokens) for rid, tokens in out.items() if tokens]

    def _run_isolated(
        self, works: Sequence[ScheduledRequest], phase: str, failed: dict[str, str]
    ) -> dict[str, int | list[int]]:
        """``_run`` that confines a failure to the request that caused it (into ``failed``)."""
        try:
            if phase == "blend":
                return self._run_blend(works[0])
            if phase == "prefill" and self.recurrent is not None:
                return self._run_prefill_pieces(works[0])
            return self._run_speculative(works) if phase == "speculative" else self._run(works, phase)
        except Exception as e:
            if len(works) > 1:
                sampled: dict[str, int | list[int]] = {}
                for work in works:
                    sampled.update(self._run_isolated([work], phase, failed))
                return sampled
            rid = works[0].request_id
            log.warning("request %r failed in %s: %s: %s", rid, phase, type(e).__name__, e)
            failed[rid] = f"{type(e).__name__}: {e}"
            return {}

    def run(self) -> list[RequestOutput]:
        """Steps until every submitted request has finished; outputs in submission order."""
        with self.lock:
            pending = [(rid, r) for rid, r in self.requests.items() if not r.finished]
        while self.has_work:
            self.step()
        return [to_output(rid, r) for rid, r in pending]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(), **kwargs) -> list[RequestOutput]:
        """Submits ``prompts`` (token ids) and runs them to completion.

        All or nothing at submission: if one prompt is rejected, the ones already queued by
        this call are aborted and the error is raised.
        """
        pending: list[tuple[str, RequestRecord]] = []
        try:
            for p in prompts:
                rid = self.submit(p, sampling, **kwargs)
                pending.append((rid, self.requests[rid]))
        except Exception:
            for rid, _ in pending:
                self.abort(rid)
            raise
        while not all(r.finished for _, r in pending):
            self.step()
        return [to_output(rid, r) for rid, r in pending]

    def stream(self, prompt_token_ids: Sequence[int], sampling: SamplingParams = SamplingParams(), **kwargs) -> Iterator[int]:
        """Yields a request's tokens as they are generated (other requests keep running)."""
        rid = self.submit(prompt_token_ids, sampling, **kwargs)
        record = self.requests[rid]
        emitted = 0
        while not record.finished:
            self.step()
            tokens = record.sched.output_token_ids
            yield from tokens[emitted:]
            emitted = len(tokens)

    def output(self, request_id: str) -> RequestOutput:
        """A request's output so far (final once ``finish_reason`` is set)."""
        with self.lock:
            record = self.requests.get(request_id)
            if record is None:
                raise KeyError(
                    f"request_id={request_id!r} is unknown: never submitted, or finished and forgotten "
                    f"(outputs of the last max_finished_requests={self.max_finished_requests} finished requests are kept)"
                )
            return to_output(request_id, record)

    def pop_output(self, request_id: str) -> RequestOutput:
        """A finished request's final output; the engine forgets the request (its logits,
        trace and report are freed, its id may be reused). Its cached blocks stay cached.

        Raises:
          KeyError: the id is unknown (never submitted, or already forgotten).
          ValueError: the request has not finished (``abort`` it first to drop it early).
        """
        with self.lock:
            output = self.output(request_id)
            if not self.requests[request_id].finished:
                raise ValueError(f"request_id={request_id!r} has not finished; pop_output takes finished requests only")
            self._release_id(request_id)
            return output

    # ------------------------------------------------------------------ execution

    def _execute_page_ops(self) -> None:
        ops = self.manager.take_page_ops()
        start = time.perf_counter()
        self.pool = apply_page_ops(self.pool, self.layout, self.host_pool, ops)
        if ops:
            self.timings["page_ops_s"] += time.perf_counter() - start
            self.timings["page_ops"] += len(ops)

    def _block_tables(self, works: Sequence[ScheduledRequest], num_rows: int, width: int) -> tuple[jax.Array, ...]:
        tables = []
        for g in range(self.layout.num_groups):
            table = np.full((num_rows, width), NULL_PAGE, np.int32)
            for i, w in enumerate(works):
                pages = self.manager.block_table(w.request_id, g)[:width]  # pages past the step are not read
                table[i, : len(pages)] = pages
            tables.append(jnp.asarray(table))
        return tuple(tables)

    def _run(self, works: Sequence[ScheduledRequest], phase: str) -> dict[str, int]:
        """One forward over ``works`` (one prefill chunk, or a batch of decodes); samples
        the rows that sample and returns their tokens."""
        start = time.perf_counter()
        rows = pow2_bucket(len(works))
        longest = max(len(w.token_ids) for w in works)
        t = prefill_bucket(longest) if phase == "prefill" else pow2_bucket(longest)
        tokens = np.zeros((rows, t), np.int32)
        positions = np.full((rows, t), -1, np.int32)
        lengths = np.zeros(rows, np.int32)
        for i, w in enumerate(works):
            n = len(w.token_ids)
            tokens[i, :n] = w.token_ids
            positions[i, :n] = np.arange(w.start, w.start + n)
            lengths[i] = w.start + n
        width = table_width(self.layout.pages_for(int(lengths.max())))
        tables = self._block_tables(works, rows, width)
        samples = any(w.samples for w in works)
        keeps = phase == "prefill" and any(self.requests[w.request_id].sampling.prompt_logits for w in works)
        slots = None if self.recurrent is None else self.recurrent.slots(works, rows)
        logits, self.pool, *state = forward(
            self.model.params, self.pool, jnp.asarray(tokens), jnp.asarray(positions), tables, jnp.asarray(lengths),
            cfg=self.model.config, layout=self.layout, attn_impl=self.attn_impl,
            logits_mode="all" if keeps else "last" if samples else "none",
            state=None if slots is None else self.recurrent.read(slots),
        )
        if keeps:
            logits = self._keep_prompt_logits(works, logits)
        if slots is not None:
            self.recurrent.write(slots, state[0])
            self.recurrent.take_snapshots(works, self.requests, self.manager)
        sampled = self._sample(works, logits) if samples else {}
        jax.block_until_ready(self.pool.k[0])
        self.timings[f"{phase}_s"] += time.perf_counter() - start
        self.timings[f"{phase}_tokens"] += sum(len(w.token_ids) for w in works)
        self.timings[f"{phase}_steps"] += 1
        return sampled

    def _keep_prompt_logits(self, works: Sequence[ScheduledRequest], logits: jax.Array) -> jax.Array:
        """Appends each prefill chunk's rows among its request's last ``sampling.prompt_logits``
        prompt positions to ``record.prompt_logits``; returns the logits [S, V] of each row's
        last token (what sampling reads) from the chunk's logits [S, T, V]."""
        host = np.asarray(logits)
        for i, w in enumerate(works):
            record = self.requests[w.request_id]
            first = len(record.sched.prompt_token_ids) - record.sampling.prompt_logits  # first kept position
            rows = host[i, max(0, first - w.start) : len(w.token_ids)]
            if record.sampling.prompt_logits and len(rows):
                kept = record.prompt_logits
                record.prompt_logits = rows.copy() if kept is None else np.concatenate([kept, rows])
        last = np.asarray([max(len(w.token_ids) - 1, 0) for w in works] + [0] * (host.shape[0] - len(works)))
        return jnp.asarray(host[np.arange(host.shape[0]), last])

    def _draft_rows(self, works: Sequence[ScheduledRequest]) -> tuple[list[DraftRow], list[int]]:
        """Takes each decode's draft slots (free pages only, after the scheduler's allocations)
        and describes it to the drafter; returns (rows, each request's slot count now)."""
        k = self.speculative.num_draft_tokens
        rows, allocated = [], []
        for w in works:
            record = self.requests[w.request_id]
            sched, sp = record.sched, record.sampling
            emitted = len(sched.output_token_ids)
            want = max(0, min(k, sched.max_new_tokens - emitted - 1, self.max_seq_len - w.start - 1))
            slots = self.manager.allocate_drafts(w.request_id, w.start + 1 + want)
            allocated.append(slots)
            rows.append(DraftRow(
                context=sched.prompt_token_ids + tuple(sched.output_token_ids), start=w.start,
                max_drafts=min(want, slots - w.start - 1), temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                counter=emitted,
            ))
        return rows, allocated

    def _run_speculative(self, works: Sequence[ScheduledRequest]) -> dict[str, int | list[int]]:
        """A batch of decodes, speculatively: draft, verify the inputs and drafts in one forward
        of T = 1 + k tokens per row, roll back the rejected drafts' slots; returns the tokens
        each request emits (accepted drafts, then the token after them). A step where the
        drafter proposes nothing runs as a plain decode."""
        start_time = time.perf_counter()
        rows = pow2_bucket(len(works))
        draft_rows, allocated = self._draft_rows(works)
        width = table_width(self.layout.pages_for(max(allocated)))
        tables = self._block_tables(works, rows, width)
        drafts, self.pool = self.drafter.propose(draft_rows, rows, self.pool, tables)
        num_drafts = drafts.num_drafts
        self.timings["draft_s"] += time.perf_counter() - start_time
        if not num_drafts.any():
            for w, slots in zip(works, allocated):
                self.manager.rollback(w.request_id, slots - w.start - 1)
            return self._run(works, "decode")
        k = self.speculative.num_draft_tokens
        t = 1 + k
        tokens = np.zeros((rows, t), np.int32)
        positions = np.full((rows, t), -1, np.int32)
        lengths = np.zeros(rows, np.int32)
        draft_tokens = np.zeros((rows, k), np.int32)
        draft_tokens[:, : drafts.tokens.shape[1]] = drafts.tokens
        for i, w in enumerate(works):
            d = int(num_drafts[i])
            tokens[i, 0] = w.token_ids[0]
            tokens[i, 1 : 1 + d] = draft_tokens[i, :d]
            positions[i, : 1 + d] = np.arange(w.start, w.start + 1 + d)
            lengths[i] = w.start + 1 + d
        logits, self.pool = forward(
            self.model.params, self.pool, jnp.asarray(tokens), jnp.asarray(positions), tables, jnp.asarray(lengths),
            cfg=self.model.config, layout=self.layout, logits_mode="all", attn_impl=self.attn_impl,
        )
        probs = drafts.probs
        if probs is not None and probs.shape[1] < k:
            probs = jnp.pad(probs, ((0, 0), (0, k - probs.shape[1]), (0, 0)))
        accepted, following = verify(
            logits, jnp.asarray(draft_tokens), jnp.asarray(num_drafts), *self._sampling_arrays(works, rows), probs
        )
        accepted, following = np.asarray(accepted), np.asarray(following)
        wants_logits = any(self.requests[w.request_id].sampling.return_logits for w in works)
        host_logits = np.asarray(logits) if wants_logits else None
        emitted: dict[str, int | list[int]] = {}
        for i, (w, slots) in enumerate(zip(works, allocated)):
            a = int(accepted[i])
            self.manager.rollback(w.request_id, slots - (w.start + 1 + a))
            emitted[w.request_id] = draft_tokens[i, :a].tolist() + [int(following[i])]
            record = self.requests[w.request_id]
            if record.sampling.return_logits:
                record.logits.extend(host_logits[i, : a + 1])
        jax.block_until_ready(self.pool.k[0])
        self.timings["decode_s"] += time.perf_counter() - start_time
        self.timings["decode_tokens"] += sum(len(e) for e in emitted.values())
        self.timings["decode_steps"] += 1
        self.timings["spec_rows"] += len(works)
        self.timings["spec_drafted"] += int(num_drafts.sum())
        self.timings["spec_accepted"] += int(accepted.sum())
        return emitted

    def _run_blend(self, work: ScheduledRequest) -> dict[str, int]:
        """A blended request's whole prompt (``work.start`` tokens cached) through
        ``chunks.prefill``; samples its first token."""
        start = time.perf_counter()
        record = self.requests[work.request_id]
        prompt = record.sched.prompt_token_ids
        logits, trace, report = record.chunks.prefill(self, work.request_id, prompt, work.start)
        record.prompt_logits, record.blend_trace, record.blend_report = np.asarray(logits), trace, report
        sampled = self._sample([work], logits[-1:])
        self.timings["blend_s"] += time.perf_counter() - start
        self.timings["blend_tokens"] += len(work.token_ids)
        self.timings["blend_steps"] += 1
        return sampled

    def _sampling_arrays(self, works: Sequence[ScheduledRequest], rows: int) -> tuple[jax.Array, ...]:
        """(temperature, top_p, seeds, counters), each [rows], of the works' requests; a
        counter is the number of tokens the request has generated."""
        temperature = np.zeros(rows, np.float32)
        top_p = np.ones(rows, np.float32)
        seeds = np.zeros(rows, np.int32)
        counters = np.zeros(rows, np.int32)
        for i, w in enumerate(works):
            r = self.requests[w.request_id]
            temperature[i], top_p[i] = r.sampling.temperature, r.sampling.top_p
            seeds[i], counters[i] = r.sampling.seed, len(r.sched.output_token_ids)
        return jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(seeds), jnp.asarray(counters)

    def _sample(self, works: Sequence[ScheduledRequest], logits: jax.Array) -> dict[str, int]:
        tokens = np.asarray(sample(logits, *self._sampling_arrays(works, logits.shape[0])))
        wants_logits = [self.requests[w.request_id].sampling.return_logits for w in works]
        host_logits = np.asarray(logits) if any(wants_logits) else None
        sampled = {}
        for i, w in enumerate(works):
            if not w.samples:
                continue
            sampled[w.request_id] = int(tokens[i])
            if wants_logits[i]:
                self.requests[w.request_id].logits.append(host_logits[i])
        return sampled

    # ------------------------------------------------------------------ recurrent state (hybrid models)

    def _run_prefill_pieces(self, work: ScheduledRequest) -> dict[str, int]:
        """A hybrid model's prefill chunk, cut at the snapshot boundaries inside it so the
        state at each is taken; only the last piece samples."""
        end = work.start + len(work.token_ids)
        cuts = self.recurrent.cuts(work)
        sampled: dict[str, int] = {}
        start = work.start
        for cut in cuts:
            piece = dataclasses.replace(
                work, token_ids=work.token_ids[start - work.start : cut - work.start], start=start,
                samples=work.samples and cut == end,
            )
            sampled = self._run([piece], "prefill")
            start = cut
        return sampled


def choose_manager_v2(config: KvCacheConfig, cfg: ModelConfig, speculative: SpeculativeConfig | None) -> bool:
    """Whether an engine runs Manager V2: ``use_kv_cache_manager_v2`` "true" / "false", or for
    "auto" the model family's ``prefers_kv_cache_manager_v2`` (V1 when it declares none, or
    when it prefers V2 but the configuration needs a V1 feature).

    Raises:
      ConfigError: "true" together with a feature only V1 has, naming the field and why.
    """
    choice = config.use_kv_cache_manager_v2
    if choice == "false" or (choice == "auto" and not cfg.prefers_kv_cache_manager_v2):
        return False
    needs_v1 = [
        reason
        for reason, present in (
            (f"kv_cache_config.host_cache_size={config.host_cache_size} (host offload tier)", config.host_cache_size > 0),
            (f"kv_cache_config.disk_cache_size={config.disk_cache_size} (disk tier)", config.disk_cache_size > 0),
            (f"kv_cache_config.event_buffer_max_size={config.event_buffer_max_size} (KV cache events)",
             config.event_buffer_max_size > 0),
            ("speculative (speculative decoding rolls back slots the host manager owns)", speculative is not None),
            (f"model {cfg.name!r} with recurrent layers (recurrent-state pool and snapshots)", cfg.is_hybrid),
        )
        if present
    ]
    if not needs_v1:
        return True
    if choice == "true":
        raise ConfigError(
            "use_kv_cache_manager_v2='true' is not supported with " + "; ".join(needs_v1)
            + ": Manager V2 implements none of these; use 'false' or 'auto'"
        )
    log.info("use_kv_cache_manager_v2='auto': model prefers V2 but %s needs V1", "; ".join(needs_v1))
    return False
