"""The engine: requests in, tokens out, over one shared page pool.

Each ``step()``:

1. schedules: running requests decode one token each; waiting requests are admitted
   (the manager matches their longest cached prefix, which is skipped) and prefilled
   in chunks, all under the step's token budget (``SchedulerConfig``);
2. executes the manager's page operations (offload, onboard, copy) on the pools;
3. runs one jitted forward per prefill chunk and one batched forward for all decodes,
   with shapes padded to power-of-two buckets so nothing recompiles per request;
4. samples on device, commits the computed tokens to the manager (full blocks enter the
   radix tree) and finishes requests on EOS or length.

When the pool cannot hold a decode step, the newest running request is preempted (its
pages freed, its tokens kept) and re-prefilled later — with block reuse, mostly from the
cache. No page is ever written that another request owns.
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
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, SchedulerConfig, as_retention_config
from kvjax.manager import KVCacheManager, MultimodalItem, OutOfPagesError, PageOp
from kvjax.model.registry import Model
from kvjax.model.transformer import forward
from kvjax.sampling import SamplingParams, sample


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    m = max(int(n), minimum, 1)
    return 1 << (m - 1).bit_length()


@dataclasses.dataclass(slots=True)
class Request:
    """A request's host state.

    Attributes:
      prompt: prompt token ids.
      output: generated token ids so far.
      num_computed: tokens of prompt + output whose KV is in the cache.
      num_reused: prompt tokens served from the cache at admission.
    """

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    retention: KvCacheRetentionConfig
    cache_salt: str | None
    lora_id: int | None
    mm_items: tuple[MultimodalItem, ...]
    output: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    num_reused: int = 0
    finished: bool = False
    finish_reason: str | None = None
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before decoding: the prompt, or after a preemption every token
        but the last generated one (the next decode input)."""
        return len(self.prompt) + len(self.output) - (1 if self.output else 0)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished (or streamed) request.

    Attributes:
      ttft_s: seconds from submission to the first generated token.
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
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.timings = collections.Counter()
        """Cumulative seconds and token counts by phase (prefill / decode / page_ops)."""

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
        prompt = [int(t) for t in prompt_token_ids]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]}: token ids must be in [0, {vocab})")
        if len(prompt) + sampling.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"len(prompt_token_ids)={len(prompt)} + max_new_tokens={sampling.max_new_tokens} exceeds "
                f"max_seq_len={self.max_seq_len}"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        request = Request(
            request_id=request_id, prompt=prompt, sampling=sampling, retention=as_retention_config(retention),
            cache_salt=cache_salt, lora_id=lora_id, mm_items=tuple(mm_items), submit_time=time.perf_counter(),
        )
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    # ------------------------------------------------------------------ stepping

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[tuple[str, int]]:
        """One engine iteration; returns the (request_id, token) pairs generated."""
        budget = self.scheduler_config.max_num_tokens
        decodes = [r for r in self.running if not r.in_prefill]
        decodes = self._reserve_decodes(decodes)
        budget -= len(decodes)
        prefills = self._schedule_prefills(budget)
        self._execute_page_ops()
        emitted: list[tuple[str, int]] = []
        for request, size in prefills:
            emitted += self._run_prefill(request, size)
        if decodes:
            emitted += self._run_decode(decodes)
        return emitted

    def run(self) -> list[RequestOutput]:
        """Steps until every submitted request has finished; outputs in submission order."""
        pending = [r.request_id for r in self.requests.values() if not r.finished]
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
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt, output=list(r.output), finish_reason=r.finish_reason,
            num_reused_tokens=r.num_reused,
            ttft_s=None if r.first_token_time is None else r.first_token_time - r.submit_time,
            latency_s=None if r.finish_time is None else r.finish_time - r.submit_time,
            logits=list(r.logits),
        )

    # ------------------------------------------------------------------ scheduling

    def _reserve_decodes(self, decodes: list[Request]) -> list[Request]:
        """Makes room for one more token per decoding request, preempting the newest if needed."""
        kept = []
        for request in sorted(decodes, key=lambda r: r.submit_time)[: self.scheduler_config.max_batch_size]:
            while True:
                try:
                    self.manager.allocate(request.request_id, request.num_computed + 1)
                    kept.append(request)
                    break
                except OutOfPagesError:
                    victim = max((r for r in self.running if r is not request), key=lambda r: r.submit_time, default=None)
                    if victim is None:
                        raise
                    self._preempt(victim)
                    if victim in kept:
                        kept.remove(victim)
        return kept

    def _preempt(self, request: Request) -> None:
        """Frees a running request's pages; it re-enters the queue with its tokens so far."""
        self.manager.free_request(request.request_id)
        self.running.remove(request)
        request.num_computed = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, request: Request) -> bool:
        tokens = request.tokens
        try:
            reused = self.manager.add_request(
                request.request_id, tokens, retention=request.retention, cache_salt=request.cache_salt,
                lora_id=request.lora_id, mm_items=request.mm_items,
            )
        except OutOfPagesError:
            return False
        request.num_computed = reused
        if request.num_preemptions == 0:
            request.num_reused = reused
        self.running.append(request)
        return True

    def _in_flight_first_keys(self) -> set:
        return {
            self.manager.first_block_key(r.prompt, cache_salt=r.cache_salt, lora_id=r.lora_id, mm_items=r.mm_items)
            for r in self.running
            if r.in_prefill
        }

    def _schedule_prefills(self, budget: int) -> list[tuple[Request, int]]:
        """Chooses prefill chunks under ``budget`` tokens: running prefills first, then admissions.

        With prefix-aware scheduling, a waiting request whose first block duplicates one
        being prefilled waits a step (it will then reuse those blocks), and admissions are
        charged only for their non-reusable tokens."""
        sched = self.scheduler_config
        chunks: list[tuple[Request, int]] = []
        for request in self.running:
            if request.in_prefill and budget > 0:
                size = min(request.prefill_target - request.num_computed, sched.prefill_chunk_size, budget)
                if self._grow(request, size):
                    chunks.append((request, size))
                    budget -= size
        deferred = []
        in_flight = self._in_flight_first_keys() if sched.enable_prefix_aware_scheduling else set()
        while self.waiting and budget > 0 and len(self.running) < sched.max_batch_size:
            request = self.waiting[0]
            if sched.enable_prefix_aware_scheduling:
                key = self.manager.first_block_key(request.prompt, cache_salt=request.cache_salt,
                                                   lora_id=request.lora_id, mm_items=request.mm_items)
                if key is not None and key in in_flight:
                    deferred.append(self.waiting.popleft())
                    continue
                cost = len(request.tokens) - self.manager.estimate_reusable_tokens(
                    request.tokens, cache_salt=request.cache_salt, lora_id=request.lora_id, mm_items=request.mm_items)
            else:
                cost = len(request.tokens)
            if cost > budget and chunks:
                break
            if not self._admit(request):
                break
            self.waiting.popleft()
            size = min(request.prefill_target - request.num_computed, sched.prefill_chunk_size, budget)
            if not self._grow(request, size):
                break
            chunks.append((request, size))
            budget -= size
            if sched.enable_prefix_aware_scheduling:
                in_flight = self._in_flight_first_keys()
        self.waiting.extendleft(reversed(deferred))
        return chunks

    def _grow(self, request: Request, size: int) -> bool:
        try:
            self.manager.allocate(request.request_id, request.num_computed + size)
            return True
        except OutOfPagesError:
            if request.num_computed == 0 or len(self.running) > 1:
                self._preempt(request)
                return False
            raise

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

    def _block_tables(self, requests: Sequence[Request], num_rows: int, width: int) -> tuple[jax.Array, ...]:
        tables = []
        for g in range(self.layout.num_groups):
            table = np.full((num_rows, width), NULL_PAGE, np.int32)
            for i, r in enumerate(requests):
                pages = self.manager.block_table(r.request_id, g)
                table[i, : len(pages)] = pages
            tables.append(jnp.asarray(table))
        return tuple(tables)

    def _forward(self, requests: Sequence[Request], tokens: np.ndarray, positions: np.ndarray, lengths: np.ndarray, logits_mode: str):
        width = bucket(self.layout.pages_for(int(lengths.max())), 4)
        tables = self._block_tables(requests, tokens.shape[0], width)
        logits, self.pool = forward(
            self.model.params, self.pool, jnp.asarray(tokens), jnp.asarray(positions), tables, jnp.asarray(lengths),
            cfg=self.model.config, layout=self.layout, logits_mode=logits_mode, attn_impl=self.attn_impl,
        )
        return logits

    def _run_prefill(self, request: Request, size: int) -> list[tuple[str, int]]:
        start = time.perf_counter()
        t = bucket(size, 16)
        tokens = np.zeros((1, t), np.int32)
        positions = np.full((1, t), -1, np.int32)
        begin = request.num_computed
        tokens[0, :size] = request.tokens[begin : begin + size]
        positions[0, :size] = np.arange(begin, begin + size)
        lengths = np.array([begin + size], np.int32)
        done = begin + size == request.prefill_target and not request.output
        logits = self._forward([request], tokens, positions, lengths, "last" if done else "none")
        self.manager.commit_tokens(request.request_id, request.tokens[begin : begin + size])
        request.num_computed = begin + size
        emitted = self._sample_and_append([request], logits) if done else []
        jax.block_until_ready(self.pool.k[0])
        self.timings["prefill_s"] += time.perf_counter() - start
        self.timings["prefill_tokens"] += size
        return emitted

    def _run_decode(self, requests: list[Request]) -> list[tuple[str, int]]:
        start = time.perf_counter()
        s = bucket(len(requests))
        tokens = np.zeros((s, 1), np.int32)
        positions = np.full((s, 1), -1, np.int32)
        lengths = np.zeros(s, np.int32)
        for i, r in enumerate(requests):
            tokens[i, 0] = r.tokens[r.num_computed]
            positions[i, 0] = r.num_computed
            lengths[i] = r.num_computed + 1
        logits = self._forward(requests, tokens, positions, lengths, "last")
        for r in requests:
            self.manager.commit_tokens(r.request_id, [r.tokens[r.num_computed]])
            r.num_computed += 1
        emitted = self._sample_and_append(requests, logits)
        self.timings["decode_s"] += time.perf_counter() - start
        self.timings["decode_tokens"] += len(requests)
        self.timings["decode_steps"] += 1
        return emitted

    def _sample_and_append(self, requests: Sequence[Request], logits: jax.Array) -> list[tuple[str, int]]:
        s = logits.shape[0]
        temperature = np.zeros(s, np.float32)
        top_p = np.ones(s, np.float32)
        seeds = np.zeros(s, np.int32)
        counters = np.zeros(s, np.int32)
        for i, r in enumerate(requests):
            temperature[i], top_p[i], seeds[i], counters[i] = r.sampling.temperature, r.sampling.top_p, r.sampling.seed, len(r.output)
        tokens = np.asarray(sample(logits, jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(seeds), jnp.asarray(counters)))
        now = time.perf_counter()
        host_logits = np.asarray(logits) if any(r.sampling.return_logits for r in requests) else None
        emitted = []
        for i, r in enumerate(requests):
            token = int(tokens[i])
            r.output.append(token)
            if host_logits is not None and r.sampling.return_logits:
                r.logits.append(host_logits[i])
            emitted.append((r.request_id, token))
            if r.first_token_time is None:
                r.first_token_time = now
            stops = r.sampling.stop_token_ids if r.sampling.stop_token_ids is not None else self.model.config.eos_ids
            if not r.sampling.ignore_eos and token in stops:
                self._finish(r, "stop", now)
            elif len(r.output) >= r.sampling.max_new_tokens:
                self._finish(r, "length", now)
        return emitted

    def _finish(self, request: Request, reason: str, now: float) -> None:
        request.finished = True
        request.finish_reason = reason
        request.finish_time = now
        self.running.remove(request)
        self.manager.free_request(request.request_id)
