"""The engine: requests in, tokens out, over one shared page pool.

Each ``step()``: the scheduler (``kvjax.engine.scheduler``) plans the step and reserves its
pages (running requests decode or prefill their next chunk; waiting ones are admitted with
their longest cached prefix skipped); the manager's page operations run on the tiers; the
step's works go to their runners (``self.runners``, ``kvjax.engine.runner``: "prefill",
"blend" for CacheBlend requests, "decode", speculative with a ``SpeculativeConfig``) in
bucketed shapes; the scheduler commits the computed tokens (full blocks enter the radix tree)
and finishes requests on their stop token or length. With Manager V2, a step in which every
running request decodes runs on the device (``kvjax.engine.manager_v2.decode``).

Failures are per request: ``submit()`` validates every argument before touching any state,
and a failure inside a step finishes only the request whose work raised. One re-entrant lock
guards the engine's state. The request walks: ``docs/architecture.md``; the API's contract:
``docs/engine.md``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence

from jax.sharding import Mesh

from kvjax import attention, distributed
from kvjax.cache import CacheLayout, HostPool, PagePool, TierThrottle, init_pool
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine.manager_choice import manager_builder
from kvjax.engine.manager_v2 import DeviceDecode, device_decode_for
from kvjax.engine.outputs import Records, RequestOutput, RequestRecord, to_output
from kvjax.engine.recurrent import RecurrentState
from kvjax.engine.requests import (
    ChunkedPrompt,
    check_engine_options,
    check_request_features,
    check_token_ids,
    scheduler_request,
)
from kvjax.engine.runner import Runner, StepContext, StepRunner, run_works
from kvjax.engine.scheduler import Scheduler
from kvjax.engine.speculative_step import SpeculativeDecode
from kvjax.manager import CacheManager, MultimodalItem, require_tiered
from kvjax.manager.hashing import KeyExtras
from kvjax.model.model import Model
from kvjax.model.transformer import CompileUnit, forward_for
from kvjax.sampling import SamplingParams

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a paged KV cache with cross-request reuse.

    Args:
      model: a loaded model (``kvjax.model.registry.load_model``).
      kv_cache_config: cache sizing, reuse, offload, windows, events.
      scheduler_config: token budget, batch size, chunking, prefix-aware scheduling.
      max_seq_len: longest prompt + generation; default the model's context length.
      attn_impl: "auto" | "blocked" | "reference" | "interpret" (see ``kvjax.attention``).
      compile_unit: "auto" | "model" | "layer": what one compiled program of a step's forward
        covers, the whole model or one layer (``kvjax.model.transformer.COMPILE_UNITS``;
        "auto" = by layer on CPU, where compiling each new step shape dominates).
      max_finished_requests: finished requests whose outputs stay readable by id; older ones
        are forgotten (``generate``/``run``/``stream`` return their own outputs regardless).
      speculative: speculative decoding of every request (None = off).
      mesh: a device mesh (``kvjax.distributed.make_mesh``, over every process's devices in a
        multi-process job): the weights and the page pool are sharded over it and attention
        runs per device. The cache's pages must split over its ``pages`` axis.
    """

    def __init__(
        self,
        model: Model,
        kv_cache_config: KvCacheConfig = KvCacheConfig(),
        scheduler_config: SchedulerConfig = SchedulerConfig(),
        *,
        max_seq_len: int | None = None,
        attn_impl: attention.Impl = "auto",
        compile_unit: CompileUnit = "auto",
        max_finished_requests: int = 1024,
        speculative: SpeculativeConfig | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        cfg = model.config
        check_engine_options(cfg, max_seq_len, attn_impl, max_finished_requests, speculative, mesh, kv_cache_config)
        model_forward = forward_for(compile_unit)  # raises for an unknown compile unit, before anything is built
        build_manager = manager_builder(
            kv_cache_config, cfg, speculative, mesh is not None, scheduler_config.max_batch_size
        )
        self.model, self.kv_config, self.scheduler_config = model, kv_cache_config, scheduler_config
        self.max_seq_len, self.attn_impl, self.speculative = max_seq_len or cfg.max_seq_len, attn_impl, speculative
        self.layout, self.cache_size = CacheLayout.for_model(
            kv_cache_config, model_windows=cfg.layer_windows, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            max_seq_len=self.max_seq_len, model_dtype=str(model.params.embed.dtype), hybrid=bool(cfg.recurrent_layers),
        )
        """The cache geometry (pages of every tier, page size, windows); the one owner of it."""
        kv = kv_cache_config
        self.host_pool = HostPool(
            self.layout,
            kv.disk_cache_dir,
            throttles={
                "host": TierThrottle(kv.host_read_gbps, kv.host_latency_ms),
                "disk": TierThrottle(kv.disk_read_gbps, kv.disk_latency_ms),
            },
        )
        """The host and disk tiers' pages; built before the manager, since it checks the disk
        tier against the free space before any structure is sized by it."""
        manager = build_manager(self.layout)
        self.requests = Records(max_finished_requests)
        self._ids = itertools.count()
        self.lock = threading.RLock()
        """Held by every entry point; hold it to read or replace the engine's state from outside
        (``kvjax.snapshot``)."""
        self.timings: collections.defaultdict[str, float] = collections.defaultdict(float)
        """Cumulative seconds and token counts by phase (see ``docs/engine.md``)."""
        self.recurrent = (RecurrentState(kv_cache_config, self.layout, cfg, scheduler_config.max_batch_size)
                          if cfg.is_hybrid else None)
        """A hybrid model's recurrent state pool and slot index (None for pure-attention models)."""
        if mesh is None:
            params, pool = model.params, init_pool(self.layout)
        else:
            params, pool = (
                distributed.shard_params(model.params, cfg, mesh),
                distributed.init_sharded_pool(self.layout, mesh),
            )
        context = StepContext(params, cfg, self.layout, attn_impl, manager, self.host_pool, pool, mesh, model_forward)
        self.runner = StepRunner(context, self.requests, self.timings, self.recurrent)
        decode = (
            self.runner.decode if speculative is None else SpeculativeDecode(speculative, self.runner, self.max_seq_len)
        )
        self.runners: dict[str, Runner] = {"prefill": self.runner.prefill, "blend": self.runner.blend, "decode": decode}
        """The step's runners by kind of work (see ``kvjax.engine.runner``)."""
        self.device_decode = device_decode_for(manager, self.runner, scheduler_config.num_decode_steps_per_dispatch)
        """The on-device decode loop (None when the manager keeps no allocation state on the device)."""
        self._decode_on_device = True
        """Whether the next pure-decode step may run on the device, if the engine has the loop
        (off for one step after a dispatch that ran out of pages or raised, so the scheduler
        preempts or isolates)."""
        self._attach(manager)

    @property
    def manager(self) -> CacheManager:
        """The cache manager (owned by the step context)."""
        return self.runner.context.manager

    @property
    def pool(self) -> PagePool:
        """The device page pool (owned by the step context)."""
        return self.runner.context.pool

    @pool.setter
    def pool(self, pool: PagePool) -> None:
        self.runner.context.pool = pool

    def set_manager(self, manager: CacheManager) -> None:
        """Swaps in another manager (a restored snapshot); the engine must be idle."""
        with self.lock:
            if self.has_work:
                raise ValueError("set_manager needs an idle engine: finish or drop queued/running requests first")
            require_tiered(self.manager, "set_manager")
            self.runner.context.manager = manager
            self._attach(manager)

    def _attach(self, manager: CacheManager) -> None:
        self.scheduler = Scheduler(self.scheduler_config, manager)
        if self.host_pool.disk:
            require_tiered(manager, "kv_cache_config.disk_cache_size").attach_disk_check(self.host_pool.check_disk)
        if self.recurrent is not None:
            require_tiered(manager, "a hybrid model's recurrent state").attach_state_snapshots(self.recurrent.index)

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
        cfg = self.model.config
        prompt = check_token_ids(prompt_token_ids, cfg.vocab_size)
        extras = KeyExtras(cache_salt, lora_id, mm_items)
        if chunks is not None or retention is not None:
            extras = check_request_features(
                self.runner.context, prompt, retention, chunks, extras, hybrid=self.recurrent is not None
            )
        sched = scheduler_request(prompt, sampling, cfg, self._ids, request_id=request_id, retention=retention,
                                  extras=extras)
        if chunks is not None:
            sched.num_prefill_rows = chunks.num_rows(len(prompt), cfg.num_layers)
        with self.lock:
            self.requests.release(sched.request_id)
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

    def output(self, request_id: str) -> RequestOutput:
        """A request's output so far (final once ``finish_reason`` is set)."""
        with self.lock:
            return self.requests.output(request_id)

    def pop_output(self, request_id: str) -> RequestOutput:
        """A finished request's final output; the engine forgets the request (its logits,
        trace and report are freed, its id may be reused). Its cached blocks stay cached.

        Raises:
          KeyError: the id is unknown (never submitted, or already forgotten).
          ValueError: the request has not finished (``abort`` it first to drop it early).
        """
        with self.lock:
            output = self.requests.output(request_id)
            if not self.requests[request_id].finished:
                raise ValueError(f"request_id={request_id!r} has not finished; pop_output takes finished requests only")
            self.requests.release(request_id)
            return output

    def _finish(self, request_id: str, reason: str | None = None, error: str | None = None) -> None:
        if self.recurrent is not None:
            self.recurrent.end(request_id, self.requests.get(request_id), reason is None, self.manager)
        self.requests.finish(request_id, reason, error)

    def execute_page_ops(self) -> None:
        """Runs the manager's queued page operations (offload, onboard, copy) on the pools now;
        for callers that acquire or allocate blocks outside ``step()``."""
        with self.lock:
            start = time.perf_counter()
            num_ops = self.runner.context.execute_page_ops()
            if num_ops:
                self.timings["page_ops_s"] += time.perf_counter() - start
                self.timings["page_ops"] += num_ops

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[tuple[str, int | list[int]]]:
        """One engine iteration; returns the (request_id, token) pairs generated (with
        speculation or on-device decoding, a decode's pair holds the list of tokens it
        emitted, before a stop or ``max_new_tokens`` cuts it).

        A request whose forward or sampling raises is finished with ``finish_reason="error"``
        (a failing batch is run again one request at a time to find it); the others go on.
        """
        with self.lock:
            running, device_decode = self.scheduler.running, self.device_decode
            if device_decode is not None and self._decode_on_device and self.scheduler.decodes_only and not any(
                    self.requests[rid].sampling.return_logits for rid in running):
                try:
                    return self._step_on_device(device_decode)
                except Exception as e:
                    log.warning("on-device decode failed (%s: %s); stepping through the scheduler", type(e).__name__, e)
            self._decode_on_device = True
            plan = self.scheduler.schedule()
            for rid in plan.preempted:
                self.requests[rid].restart()
                if self.recurrent is not None:  # resumed later from a snapshot, or recomputed
                    self.recurrent.end(rid, self.requests[rid], False, self.manager)
            self.execute_page_ops()
            if self.recurrent is not None:
                self.recurrent.start(plan.scheduled, self.requests)
            sampled, failed = run_works(self.runners, plan.scheduled, self.requests)
            for rid, message in failed.items():
                self.scheduler.abort(rid)
                self._finish(rid, "error", message)
            self.requests.sampled(sampled)
            finished = self.scheduler.finish_step(sampled)
            self.requests.trim_logits(sampled)
            for rid in finished:
                self._finish(rid)
            return list(sampled.items())

    def _step_on_device(self, device_decode: DeviceDecode) -> list[tuple[str, int | list[int]]]:
        """Every running request's next tokens from one dispatch of ``device_decode``; a
        dispatch short of pages hands the next step to the scheduler, which preempts."""
        emitted, self._decode_on_device = device_decode(list(self.scheduler.running.values()))
        for rid in self.scheduler.record_decodes(emitted):
            self._finish(rid)
        return [(rid, tokens) for rid, tokens in emitted.items() if tokens]

    def run(self) -> list[RequestOutput]:
        """Steps until every submitted request has finished; outputs in submission order."""
        with self.lock:
            pending = [(rid, r) for rid, r in self.requests.items() if not r.finished]
        while self.has_work:
            self.step()
        return [to_output(rid, r) for rid, r in pending]

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(), **kwargs
    ) -> list[RequestOutput]:
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

    def stream(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams = SamplingParams(), **kwargs
    ) -> Iterator[int]:
        """Yields a request's tokens as they are generated (other requests keep running)."""
        rid = self.submit(prompt_token_ids, sampling, **kwargs)
        record = self.requests[rid]
        emitted = 0
        while not record.finished:
            self.step()
            tokens = record.sched.output_token_ids
            yield from tokens[emitted:]
            emitted = len(tokens)
