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

When a step cannot get pages, the scheduler preempts the newest running request (its
blocks stay cached) and re-admits it later; no page another request owns is ever written.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax.cache import NULL_PAGE, CacheLayout, CacheSize, PagePool, choose_cache_size, init_pool
from kvjax.cache.pool import copy_pages, read_pages, write_pages
from kvjax.config import ConfigError, KvCacheConfig, KvCacheRetentionConfig, SchedulerConfig, as_retention_config
from kvjax.manager import KVCacheManager, MultimodalItem, PageOp
from kvjax.manager.scheduler import ScheduledRequest, Scheduler, SchedulerRequest
from kvjax.model.registry import Model
from kvjax.model.transformer import forward
from kvjax.sampling import SamplingParams, sample


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    m = max(int(n), minimum, 1)
    return 1 << (m - 1).bit_length()


PREFILL_STEP = 256
"""Prefill chunks longer than this pad to a multiple of it rather than to a power of two, so a
cache hit of 30% on a 1k-token prompt computes 768 tokens, not 1024 (a few more compiled shapes)."""


def prefill_bucket(n: int) -> int:
    """Padded length of a prefill chunk of ``n`` tokens: a power of two >= 16 up to
    PREFILL_STEP, then a multiple of PREFILL_STEP."""
    return bucket(n, 16) if n <= PREFILL_STEP else -(-n // PREFILL_STEP) * PREFILL_STEP


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """What the engine keeps per request beside the scheduler's progress.

    Attributes:
      logits: each generated position's logits [V] when ``sampling.return_logits``.
      submit_time, first_token_time, finish_time: ``time.perf_counter()`` seconds.
    """

    sched: SchedulerRequest
    sampling: SamplingParams
    submit_time: float
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    finished: bool = False
    num_preemptions: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's result.

    Attributes:
      num_reused_tokens: prompt tokens served from the cache (prefill skipped).
      ttft_s: seconds from submission to the first generated token.
      latency_s: seconds from submission to the last token.
      logits: per generated token, [V] float32 (only with ``return_logits``).
    """

    request_id: str
    prompt: list[int]
    output: list[int]
    finish_reason: str | None
    num_reused_tokens: int
    ttft_s: float | None
    latency_s: float | None
    logits: list[np.ndarray]


class Engine:
    """Continuous batching over a paged KV cache with cross-request reuse.

    Args:
      model: a loaded model (``kvjax.model.registry.load_model``).
      kv_cache_config: cache sizing, reuse, offload, windows, events.
      scheduler_config: token budget, batch size, chunking, prefix-aware scheduling.
      max_seq_len: longest prompt + generation; default the model's context length.
      attn_impl: "auto" | "reference" | "interpret" (see ``kvjax.attention``).
    """

    def __init__(
        self,
        model: Model,
        kv_cache_config: KvCacheConfig = KvCacheConfig(),
        scheduler_config: SchedulerConfig = SchedulerConfig(),
        *,
        max_seq_len: int | None = None,
        attn_impl: attention.Impl = "auto",
    ) -> None:
        cfg = model.config
        if kv_cache_config.use_kv_cache_manager_v2 == "true":
            raise ConfigError(
                f"use_kv_cache_manager_v2='true' is not supported for model {cfg.name!r}: kvjax implements the "
                "host-side (V1) manager only; use 'auto' or 'false'"
            )
        self.model = model
        self.kv_config = kv_cache_config
        self.scheduler_config = scheduler_config
        self.max_seq_len = min(max_seq_len or cfg.max_seq_len, cfg.max_seq_len)
        self.attn_impl = attn_impl
        if kv_cache_config.max_attention_window is not None:
            windows = kv_cache_config.windows_for(cfg.num_layers, self.max_seq_len)
        else:
            windows = tuple(min(w, self.max_seq_len) for w in cfg.layer_windows)
        dtype = str(model.params.embed.dtype) if kv_cache_config.dtype == "auto" else kv_cache_config.dtype
        page = kv_cache_config.tokens_per_block
        probe = CacheLayout(
            layer_windows=windows, num_pages=(2,) * len(dict.fromkeys(windows)), page_size=page,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_seq_len=self.max_seq_len, dtype=dtype,
        )
        self.cache_size: CacheSize = choose_cache_size(kv_cache_config, probe.bytes_per_token)
        num_pages = probe.pages_for(self.cache_size.num_tokens) + 1
        if num_pages - 1 < probe.pages_for(self.max_seq_len):
            raise ValueError(
                f"the cache holds {self.cache_size.num_tokens} tokens, fewer than max_seq_len={self.max_seq_len}; "
                "raise kv_cache_config.max_tokens / free_gpu_memory_fraction or lower max_seq_len"
            )
        self.layout = dataclasses.replace(probe, num_pages=(num_pages,) * probe.num_groups)
        bytes_per_page = [self.layout.bytes_per_page(g) for g in range(self.layout.num_groups)]
        num_host_pages = kv_cache_config.host_cache_size // sum(bytes_per_page)
        self.manager = KVCacheManager(
            kv_cache_config, layer_windows=windows, num_device_pages=num_pages, num_host_pages=num_host_pages,
            max_seq_len=self.max_seq_len, bytes_per_page=bytes_per_page,
        )
        self.pool: PagePool = init_pool(self.layout)
        self.host_pools = [self.layout.host_zeros(g, num_host_pages) for g in range(self.layout.num_groups)] if num_host_pages else []
        self.scheduler = Scheduler(scheduler_config, self.manager)
        self.requests: dict[str, RequestRecord] = {}
        self._ids = itertools.count()
        self.timings = collections.Counter()
        """Cumulative seconds and token counts by phase (prefill / decode / page_ops)."""

    def set_manager(self, manager: KVCacheManager) -> None:
        """Swaps in another manager (a restored snapshot); the engine must be idle."""
        if self.has_work:
            raise ValueError("set_manager needs an idle engine: finish or drop queued/running requests first")
        self.manager = manager
        self.scheduler = Scheduler(self.scheduler_config, manager)

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
    ) -> str:
        """Queues a request; returns its id. Validates before touching any state."""
        prompt = tuple(int(t) for t in prompt_token_ids)
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]}: token ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        stop = None if sampling.ignore_eos else (
            sampling.stop_token_id if sampling.stop_token_id is not None else self.model.config.eos_ids[0]
        )
        sched = SchedulerRequest(
            request_id=request_id, prompt_token_ids=prompt, max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stop, retention=as_retention_config(retention), cache_salt=cache_salt,
            lora_id=lora_id, mm_items=tuple(mm_items),
        )
        self.scheduler.add(sched)
        self.requests[request_id] = RequestRecord(sched=sched, sampling=sampling, submit_time=time.perf_counter())
        return request_id

    def adopt_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        logits: jax.Array,
        sampling: SamplingParams = SamplingParams(),
        *,
        retention: KvCacheRetentionConfig | dict | None = None,
        cache_salt: str | None = None,
        num_reused_tokens: int = 0,
        submit_time: float | None = None,
    ) -> str:
        """Adds a request whose prompt KV is already in its pages (registered with the manager,
        every prompt token committed): samples its first token from ``logits`` [V] and hands
        it to the scheduler, which decodes it with the other requests (``Scheduler.adopt``).

        Args:
          submit_time: ``time.perf_counter()`` when its prefill began (TTFT), default now.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        stop = None if sampling.ignore_eos else (
            sampling.stop_token_id if sampling.stop_token_id is not None else self.model.config.eos_ids[0]
        )
        sched = SchedulerRequest(
            request_id=request_id, prompt_token_ids=tuple(int(t) for t in prompt_token_ids),
            max_new_tokens=sampling.max_new_tokens, eos_token_id=stop, retention=as_retention_config(retention),
            cache_salt=cache_salt, num_reused_tokens=num_reused_tokens,
        )
        record = RequestRecord(sched=sched, sampling=sampling, submit_time=submit_time or time.perf_counter())
        self.requests[request_id] = record
        work = ScheduledRequest(request_id, (), len(sched.prompt_token_ids), True, True)
        try:
            token = self._sample([work], logits[None])[request_id]
            sched.output_token_ids.append(token)
            finished = self.scheduler.adopt(sched)
        except Exception:
            del self.requests[request_id]
            raise
        record.first_token_time = time.perf_counter()
        if finished:
            record.finished, record.finish_time = True, record.first_token_time
        return request_id

    def execute_page_ops(self) -> None:
        """Runs the manager's queued page operations (offload, onboard, copy) on the pools now;
        for callers that acquire or allocate blocks outside ``step()``."""
        self._execute_page_ops()

    # ------------------------------------------------------------------ stepping

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[tuple[str, int]]:
        """One engine iteration; returns the (request_id, token) pairs generated."""
        plan = self.scheduler.schedule()
        for rid in plan.preempted:
            record = self.requests[rid]
            record.num_preemptions += 1
            record.logits.clear()
            record.first_token_time = None
        self._execute_page_ops()
        sampled: dict[str, int] = {}
        prefills = [w for w in plan.scheduled if w.is_prefill]
        decodes = [w for w in plan.scheduled if not w.is_prefill]
        for work in prefills:
            sampled.update(self._run([work], "prefill"))
        if decodes:
            sampled.update(self._run(decodes, "decode"))
        now = time.perf_counter()
        for rid in sampled:
            record = self.requests[rid]
            if record.first_token_time is None:
                record.first_token_time = now
        for rid in self.scheduler.finish_step(sampled):
            self.requests[rid].finished = True
            self.requests[rid].finish_time = now
        return list(sampled.items())

    def run(self) -> list[RequestOutput]:
        """Steps until every submitted request has finished; outputs in submission order."""
        pending = [rid for rid, r in self.requests.items() if not r.finished]
        while self.has_work:
            self.step()
        return [self.output(rid) for rid in pending]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(), **kwargs) -> list[RequestOutput]:
        """Submits ``prompts`` (token ids) and runs them to completion."""
        ids = [self.submit(p, sampling, **kwargs) for p in prompts]
        while not all(self.requests[i].finished for i in ids):
            self.step()
        return [self.output(i) for i in ids]

    def stream(self, prompt_token_ids: Sequence[int], sampling: SamplingParams = SamplingParams(), **kwargs) -> Iterator[int]:
        """Yields a request's tokens as they are generated (other requests keep running)."""
        rid = self.submit(prompt_token_ids, sampling, **kwargs)
        while not self.requests[rid].finished:
            for emitted_id, token in self.step():
                if emitted_id == rid:
                    yield token

    def output(self, request_id: str) -> RequestOutput:
        r = self.requests[request_id]
        output = list(r.sched.output_token_ids)
        reason = None
        if r.finished:
            reason = "stop" if output and output[-1] == r.sched.eos_token_id else "length"
        return RequestOutput(
            request_id=request_id, prompt=list(r.sched.prompt_token_ids), output=output, finish_reason=reason,
            num_reused_tokens=r.sched.num_reused_tokens,
            ttft_s=None if r.first_token_time is None else r.first_token_time - r.submit_time,
            latency_s=None if r.finish_time is None else r.finish_time - r.submit_time,
            logits=list(r.logits),
        )

    # ------------------------------------------------------------------ execution

    def _execute_page_ops(self) -> None:
        ops = self.manager.take_page_ops()
        if not ops:
            return
        start = time.perf_counter()
        for (kind, group), run in itertools.groupby(ops, key=lambda op: (op.kind, op.group)):
            self._apply(kind, group, list(run))
        self.timings["page_ops_s"] += time.perf_counter() - start
        self.timings["page_ops"] += len(ops)

    def _apply(self, kind: str, group: int, ops: list[PageOp]) -> None:
        n = bucket(len(ops))
        src = np.full(n, NULL_PAGE, np.int32)
        dst = np.full(n, NULL_PAGE, np.int32)
        src[: len(ops)] = [op.src for op in ops]
        dst[: len(ops)] = [op.dst for op in ops]
        if kind == "copy":
            self.pool = copy_pages(self.pool, self.layout, group, jnp.asarray(src), jnp.asarray(dst))
        elif kind == "offload":
            kv = np.asarray(read_pages(self.pool, self.layout, group, jnp.asarray(src)))
            self.host_pools[group][:, :, dst[: len(ops)]] = kv[:, :, : len(ops)]
        elif kind == "onboard":
            kv = np.zeros((2, self.layout.group_layers[group], n, *self.host_pools[group].shape[3:]), self.host_pools[group].dtype)
            kv[:, :, : len(ops)] = self.host_pools[group][:, :, src[: len(ops)]]
            self.pool = write_pages(self.pool, self.layout, group, jnp.asarray(dst), jnp.asarray(kv))
        else:
            raise ValueError(f"page op kind={kind!r} must be 'copy', 'offload' or 'onboard'")

    def _block_tables(self, works: Sequence[ScheduledRequest], num_rows: int, width: int) -> tuple[jax.Array, ...]:
        tables = []
        for g in range(self.layout.num_groups):
            table = np.full((num_rows, width), NULL_PAGE, np.int32)
            for i, w in enumerate(works):
                pages = self.manager.block_table(w.request_id, g)
                table[i, : len(pages)] = pages
            tables.append(jnp.asarray(table))
        return tuple(tables)

    def _run(self, works: Sequence[ScheduledRequest], phase: str) -> dict[str, int]:
        """One forward over ``works`` (one prefill chunk, or a batch of decodes); samples
        the rows that sample and returns their tokens."""
        start = time.perf_counter()
        rows = bucket(len(works))
        longest = max(len(w.token_ids) for w in works)
        t = prefill_bucket(longest) if phase == "prefill" else bucket(longest)
        tokens = np.zeros((rows, t), np.int32)
        positions = np.full((rows, t), -1, np.int32)
        lengths = np.zeros(rows, np.int32)
        for i, w in enumerate(works):
            n = len(w.token_ids)
            tokens[i, :n] = w.token_ids
            positions[i, :n] = np.arange(w.start, w.start + n)
            lengths[i] = w.start + n
        width = bucket(self.layout.pages_for(int(lengths.max())), 4)
        tables = self._block_tables(works, rows, width)
        samples = any(w.samples for w in works)
        logits, self.pool = forward(
            self.model.params, self.pool, jnp.asarray(tokens), jnp.asarray(positions), tables, jnp.asarray(lengths),
            cfg=self.model.config, layout=self.layout, logits_mode="last" if samples else "none", attn_impl=self.attn_impl,
        )
        sampled = self._sample(works, logits) if samples else {}
        jax.block_until_ready(self.pool.k[0])
        self.timings[f"{phase}_s"] += time.perf_counter() - start
        self.timings[f"{phase}_tokens"] += sum(len(w.token_ids) for w in works)
        self.timings[f"{phase}_steps"] += 1
        return sampled

    def _sample(self, works: Sequence[ScheduledRequest], logits: jax.Array) -> dict[str, int]:
        s = logits.shape[0]
        temperature = np.zeros(s, np.float32)
        top_p = np.ones(s, np.float32)
        seeds = np.zeros(s, np.int32)
        counters = np.zeros(s, np.int32)
        for i, w in enumerate(works):
            r = self.requests[w.request_id]
            temperature[i], top_p[i] = r.sampling.temperature, r.sampling.top_p
            seeds[i], counters[i] = r.sampling.seed, len(r.sched.output_token_ids)
        tokens = np.asarray(sample(logits, jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(seeds), jnp.asarray(counters)))
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
