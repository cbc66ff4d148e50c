"""CacheBlend in steady-state serving: a long stream of RAG queries through a finite device
cache, eviction and host/disk tiers, measured over time.

The stream (``workloads.rag_stream``: SQuAD passages, BM25 retrieval, Zipf popularity that
drifts, new articles arriving) is generated once and saved as ``stream.jsonl``; every run
serves the same queries. A query's prompt is the document frame (``workloads.frame``): the
system prefix, its retrieved passages as chunks, its question.

A run is ``policy/eviction/tiers`` on the real engine, serving the stream with continuous
batching (``serving.concurrency`` queries in flight: one query's prefill shares steps with the
others' decoding):

  policy    no_reuse         every prompt computed (block reuse off)
            prefix           prefix caching only (the radix tree)
            cacheblend       chunk KV from a ``ChunkStore`` at a fixed recompute ratio; a chunk
                             missing from every tier is recomputed in place until its
                             ``serving.store_after_misses``-th miss, then prefilled into the
                             store first (1: at every miss)
            cacheblend_auto  the same, with the loading controller deciding per tier: chunks
                             on a tier whose read takes longer than recomputing them are
                             recomputed (not read), and the ratio rises to what the reads hide
  eviction  lru              every block at the default priority (plain LRU)
            priority_lru     chunk blocks at ``cache.chunk_priority``, a query's own blocks at
                             ``cache.query_priority`` (below the offload threshold: dropped, not
                             offloaded), the system prefix at ``cache.prefix_priority``
  tiers     device           the device cache only; host: + a host tier; disk: + host + a disk
                             tier throttled to ``cache.disk_read_gbps`` and ``disk_latency_ms``

Exact queries (``stream.exact_fraction``) are always served with prefix caching only; the run
counts any of them that reused a block no exact request wrote (``exact_violations``, always 0:
blended KV lives under its own blend scope).

Every manager call of a run is recorded (``RecordingManager``: the block trace). Replaying the
trace through the manager alone (``replay``) reproduces the run's hit counters exactly, and
replays it at every eviction and tier setting, beside Belady's MIN on the same block accesses
(``workloads.trace.belady_hit_rate``, capacity = all tiers' pages).

Quality is measured on every ``serving.quality_every``-th query against full recompute on a
separate engine: KL of the first answer token's distribution, top-1 agreement, and the greedy
answer's SQuAD F1 against the gold answers.

    python -m experiments.run --config=configs/rag_serving.py
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import pathlib
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report, timing
from experiments.workloads import squad
from experiments.workloads.datasets import SquadParagraph, fetch_squad_v11_dev, load_squad, sha256_file
from experiments.workloads.frame import SYSTEM_PROMPT, chunk_tokens, document_prefix, question_suffix
from experiments.workloads.rag_stream import StreamConfig, StreamQuery, make_stream, read_stream, write_stream
from experiments.workloads.trace import belady_hit_rate
from kvjax import metrics
from kvjax.blend.chunk_store import SENTINEL, ChunkStore
from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.loading_controller import LoadingController
from kvjax.blend.selection import SelectionConfig
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, SchedulerConfig, TokenRangeRetentionConfig
from kvjax.engine import Engine
from kvjax.manager import NO_EXTRAS, KeyExtras, KVCacheManager, OutOfPagesError
from kvjax.model.registry import Model, load_model
from kvjax.sampling import SamplingParams

matplotlib.use("Agg")
import matplotlib.pyplot as plt

POLICIES = ("no_reuse", "prefix", "cacheblend", "cacheblend_auto")
EVICTIONS = ("lru", "priority_lru")
TIER_SETS = ("device", "host", "disk")
HIT_TIERS = ("device", "host", "disk", "miss")


@dataclasses.dataclass(frozen=True)
class Run:
    """One serving run: ``policy/eviction/tiers`` (see the module docstring)."""

    policy: str
    eviction: str
    tiers: str

    @classmethod
    def parse(cls, text: str) -> Run:
        parts = text.split("/")
        if len(parts) != 3 or parts[0] not in POLICIES or parts[1] not in EVICTIONS or parts[2] not in TIER_SETS:
            raise ValueError(
                f"runs entry {text!r} must be policy/eviction/tiers with policy in {POLICIES}, eviction in "
                f"{EVICTIONS}, tiers in {TIER_SETS}"
            )
        return cls(*parts)

    @property
    def name(self) -> str:
        return f"{self.policy}/{self.eviction}/{self.tiers}"

    @property
    def blended(self) -> bool:
        return self.policy.startswith("cacheblend")


# ---------------------------------------------------------------------------- the block trace


class RecordingManager(KVCacheManager):
    """The V1 cache manager, recording every call that changes its blocks (the block trace).

    ``log`` holds, in call order: ("add", request id, prompt, retention, key extras),
    ("allocate", request id, tokens), ("commit", request id, first position, tokens),
    ("rollback", request id, tokens), ("free", request id), and the serving loop's
    ("probe", query index, looked-up tokens, key extras, first block, end block).
    """

    def __init__(self, config: KvCacheConfig, layout: object) -> None:
        super().__init__(config, layout)
        self.log: list[tuple] = []

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS, **kwargs: Any
    ) -> int | None:
        reused = super().add_request(request_id, prompt_token_ids, extras, **kwargs)
        if reused is not None:
            self.log.append(("add", request_id, tuple(prompt_token_ids), kwargs.get("retention"), extras))
        return reused

    def allocate(self, request_id: str, num_total_tokens: int) -> None:
        super().allocate(request_id, num_total_tokens)
        self.log.append(("allocate", request_id, num_total_tokens))

    def commit_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        start = self.num_tokens(request_id)
        super().commit_tokens(request_id, token_ids)
        self.log.append(("commit", request_id, start, tuple(token_ids)))

    def rollback(self, request_id: str, num_tokens: int) -> None:
        super().rollback(request_id, num_tokens)
        self.log.append(("rollback", request_id, num_tokens))

    def free_request(self, request_id: str) -> None:
        super().free_request(request_id)
        self.log.append(("free", request_id))


def is_chunk_scope(salt: object) -> bool:
    return isinstance(salt, str) and salt.startswith("chunk:")


@dataclasses.dataclass
class ReplayResult:
    """A block trace replayed through a manager alone.

    Attributes:
      stats: the manager's cumulative counters (``CacheStats``) as a dict.
      probes: per probed query index, chunk blocks found per tier (``HIT_TIERS``).
      chunk_blocks, chunk_reused: prompt blocks of chunk-scope requests, and of those reused.
      accesses: the block accesses (key, counted: a chunk-scope prompt block) for Belady.
    """

    stats: dict
    probes: dict[int, dict[str, int]]
    chunk_blocks: int
    chunk_reused: int
    accesses: list[tuple[bytes, bool]]

    @property
    def chunk_hit_rate(self) -> float:
        return self.chunk_reused / self.chunk_blocks if self.chunk_blocks else 0.0


def replay(log: Sequence[tuple], manager: KVCacheManager, *, priorities: bool = True) -> ReplayResult:
    """Runs a recorded block trace through ``manager`` (page operations drained, never run).

    At another cache size a request may reuse more or fewer tokens than it did when recorded;
    its commits then start where it stands (a recorded commit it already holds is skipped).
    ``priorities=False`` drops every retention config (plain LRU).
    """
    ps = manager.tokens_per_block
    seqs: dict[str, list[int]] = {}
    extras: dict[str, KeyExtras] = {}
    probes: dict[int, dict[str, int]] = {}
    chunk_blocks = chunk_reused = 0
    accesses: list[tuple[bytes, bool]] = []
    for event in log:
        kind, rid = event[0], event[1]
        if kind == "add":
            _, _, prompt, retention, extras[rid] = event
            manager.add_request(rid, prompt, extras[rid], retention=retention if priorities else None)
            seqs[rid] = list(prompt)
            counted = is_chunk_scope(extras[rid].cache_salt)
            keys = manager.prompt_block_keys(prompt, extras[rid])
            accesses += [(k, counted) for k in keys]
            if counted:
                chunk_blocks += len(prompt) // ps
                chunk_reused += manager.request_stats(rid).reused_blocks
        elif kind == "allocate":
            manager.allocate(rid, event[2])
        elif kind == "commit":
            _, _, start, tokens = event
            seq = seqs[rid]
            blocks_before = len(seq) // ps
            seq[start : start + len(tokens)] = tokens
            have = manager.num_tokens(rid)
            if start + len(tokens) > have:
                manager.commit_tokens(rid, seq[have : start + len(tokens)])
            if len(seq) // ps > blocks_before:  # new full blocks past the prompt (generated tokens)
                keys = manager.prompt_block_keys(seq, extras[rid])
                accesses += [(k, False) for k in keys[blocks_before:]]
        elif kind == "rollback":
            manager.rollback(rid, event[2])
        elif kind == "free":
            manager.free_request(rid)
            seqs.pop(rid, None)
        elif kind == "probe":
            _, query, tokens, lookup, first, end = event
            found = manager.reusable_tiers(tokens, lookup)
            counts = probes.setdefault(query, dict.fromkeys(HIT_TIERS, 0))
            for b in range(first, end):
                counts[found[b] if b < len(found) else "miss"] += 1
        manager.take_page_ops()
    return ReplayResult(dataclasses.asdict(manager.stats), probes, chunk_blocks, chunk_reused, accesses)


# ---------------------------------------------------------------------------- serving


@dataclasses.dataclass
class Workload:
    """The model, its tokenizer's prompt frame, the corpus and the stream."""

    model: Model
    paragraphs: list[SquadParagraph]
    stream: list[StreamQuery]
    prefix: tuple[int, ...]
    stop_ids: tuple[int, ...]
    _chunks: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def chunk(self, passage: int) -> tuple[int, ...]:
        if passage not in self._chunks:
            self._chunks[passage] = chunk_tokens(self.model.tokenizer, self.paragraphs[passage].context)
        return self._chunks[passage]

    def prompt(self, query: StreamQuery) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """A query's prompt and the (start, end) span of each chunk in it."""
        tokens, spans = list(self.prefix), []
        for p in query.passages:
            spans.append((len(tokens), len(tokens) + len(self.chunk(p))))
            tokens += self.chunk(p)
        tokens += question_suffix(self.model.tokenizer, query.question, instruction=squad.INSTRUCTION, stem="",
                                  system_prompt=SYSTEM_PROMPT)
        return tuple(tokens), tuple(spans)

    def answer(self, tokens: Sequence[int]) -> str:
        """The generated answer's text (up to the first stop token)."""
        end = next((i for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
        return self.model.tokenizer.decode(list(tokens[:end])).strip()


def load_workload(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> Workload:
    """The model, SQuAD v1.1 dev and the stream (read from ``stream.trace`` when given, else
    generated); the stream is written to ``workdir/stream.jsonl``."""
    model = load_model(config.model, config.gguf_path or None)
    tok = model.tokenizer
    path = fetch_squad_v11_dev()
    paragraphs = load_squad(path)
    s = config.stream
    stream_config = StreamConfig(**{k: v for k, v in s.to_dict().items() if k != "trace"})
    if s.trace:
        stream, header = read_stream(s.trace)
        if header.get("corpus_sha256") != sha256_file(path):
            raise ValueError(f"stream.trace={s.trace!r} was made from another corpus than {path.name}")
    else:
        stream = make_stream(paragraphs, stream_config)
        header = {"corpus": path.name, "corpus_sha256": sha256_file(path), **dataclasses.asdict(stream_config)}
    write_stream(workdir / "stream.jsonl", stream, header)
    stop_text = "<|im_end|>" if tok.chat_format == "chatml" else "\n"
    stop_ids = tuple(model.config.eos_ids) + tuple(tok.encode(stop_text, add_bos=False))
    return Workload(model, paragraphs, stream, document_prefix(tok, SYSTEM_PROMPT), stop_ids)


def make_engine(config: ml_collections.ConfigDict, work: Workload, run: Run | None, disk_dir: str) -> Engine:
    """The engine of ``run`` (None: the full-recompute reference engine, no reuse, no tiers)."""
    c, longest = config.cache, max(len(work.prompt(q)[0]) for q in work.stream)
    max_seq_len = longest + config.serving.max_new_tokens + config.serving.token_bucket
    tiers = run.tiers if run else "device"
    kv = KvCacheConfig(
        tokens_per_block=c.tokens_per_block,
        max_tokens=c.device_tokens if run else max_seq_len * 2,
        enable_block_reuse=run is not None and run.policy != "no_reuse",
        host_cache_size=int(c.host_mb * 2**20) if tiers in ("host", "disk") else 0,
        disk_cache_size=int(c.disk_mb * 2**20) if tiers == "disk" else 0,
        disk_cache_dir=disk_dir if tiers == "disk" else None,
        host_read_gbps=c.host_read_gbps, host_latency_ms=c.host_latency_ms,
        disk_read_gbps=c.disk_read_gbps, disk_latency_ms=c.disk_latency_ms,
        use_kv_cache_manager_v2="false",
    )
    engine = Engine(
        work.model, kv,
        SchedulerConfig(max_num_tokens=max_seq_len, prefill_chunk_size=max_seq_len,
                        max_batch_size=config.serving.concurrency + 1),  # + a chunk being stored
        max_seq_len=max_seq_len, max_finished_requests=4 * config.serving.concurrency + 16,
    )
    engine.set_manager(RecordingManager(kv, engine.layout))
    return engine


@dataclasses.dataclass
class Reference:
    """Full recompute of one query: the first answer token's logits [V] and the greedy answer."""

    logits: np.ndarray
    answer: str


def references(config: ml_collections.ConfigDict, work: Workload, disk_dir: str) -> dict[int, Reference]:
    """Full recompute of every ``serving.quality_every``-th query, on an engine of its own."""
    engine = make_engine(config, work, None, disk_dir)
    sampled = [q for q in work.stream if q.index % config.serving.quality_every == 0]
    sampling = SamplingParams(max_new_tokens=config.serving.max_new_tokens, prompt_logits=1)
    out = {}
    for q in tqdm(sampled, desc="full recompute (quality reference)", leave=False):
        result = engine.generate([work.prompt(q)[0]], sampling)[0]
        out[q.index] = Reference(np.asarray(result.prompt_logits[-1]), work.answer(result.output))
    return out


def retention(config: ml_collections.ConfigDict, run: Run, prefix_len: int,
              blended: bool) -> KvCacheRetentionConfig | None:
    """A query request's retention under ``run``'s eviction (None: plain LRU)."""
    c = config.cache
    if run.eviction == "lru":
        return None
    if blended:  # its blocks live in the blend scope: reusable only by the same blended prompt
        return KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, c.query_priority),),
                                      decode_retention_priority=c.query_priority)
    return KvCacheRetentionConfig(
        (TokenRangeRetentionConfig(0, prefix_len, c.prefix_priority), TokenRangeRetentionConfig(prefix_len, None, 35)),
        decode_retention_priority=c.query_priority,
    )


@dataclasses.dataclass
class InFlight:
    """A query between admission and its last token."""

    query: StreamQuery
    admitted_s: float
    compiles: int
    record: dict


class Server:
    """Serves the stream on one run's engine and records each query (``serve``)."""

    def __init__(self, config: ml_collections.ConfigDict, work: Workload, run: Run, refs: dict[int, Reference],
                 disk_dir: str) -> None:
        after = config.serving.store_after_misses
        if not isinstance(after, int) or isinstance(after, bool) or after < 1:
            raise ValueError(f"serving.store_after_misses={after!r} must be an int >= 1 (1: store at every miss)")
        self.config, self.work, self.run, self.refs = config, work, run, refs
        self.engine = make_engine(config, work, run, disk_dir)
        self.manager: RecordingManager = self.engine.manager  # type: ignore[assignment]
        s = config.serving
        self.selection = SelectionConfig(recompute_ratio=s.recompute_ratio, selector=s.selector,
                                         seed=config.stream.seed)
        self.store: ChunkStore | None = None
        self.controller: LoadingController | None = None
        if run.blended:
            chunk_retention = None if run.eviction == "lru" else KvCacheRetentionConfig(
                (TokenRangeRetentionConfig(0, None, config.cache.chunk_priority),),
                decode_retention_priority=config.cache.query_priority)
            self.store = ChunkStore(self.engine, variant="system", prefix_tokens=work.prefix, retention=chunk_retention)
        if run.policy == "cacheblend_auto":
            mean_tokens = int(np.mean([len(work.prompt(q)[0]) for q in work.stream[:50]]))
            self.controller = LoadingController.measured(
                work.model.params, work.model.config, self.engine.layout, self.engine.host_pool.throttles,
                mean_tokens, min_ratio=s.recompute_ratio, disk_dir=disk_dir)
        self.misses: collections.Counter[int] = collections.Counter()  # passage -> misses on every tier so far
        self.exact_keys: set[bytes] = set()
        self.compiles = timing.compile_counter()

    def _chunk_plan(self, query: StreamQuery, spans: Sequence[tuple[int, int]],
                    record: dict) -> tuple[tuple[tuple[int, int], ...], float]:
        """Probes each chunk's tiers (recorded) and returns the spans to read from the store and
        the recompute ratio. A chunk found on no tier is stored (prefilled alone) on its
        ``serving.store_after_misses``-th miss; before that it is left out and recomputed in
        place. ``cacheblend_auto`` also leaves out the chunks on a tier slower than recomputing
        them, and its ratio hides the slowest read."""
        store, ps = self.store, self.engine.manager.tokens_per_block
        assert store is not None
        slowest = []
        for p in query.passages:
            chunk = self.work.chunk(p)
            found = store.tiers(chunk)
            first = store.stored_start // ps
            self.manager.log.append(("probe", query.index, (*store.stored_tokens(chunk), SENTINEL), store.extras, first,
                                     first + len(found)))
            for t in found:
                record[f"blocks_{t}"] += 1
            if "miss" in found:
                self.misses[p] += 1
                stored = self.misses[p] >= self.config.serving.store_after_misses
                if stored:
                    store.put(chunk)
                slowest.append("device" if stored else "miss")
            else:
                slowest.append(max(found, key=("device", "host", "disk").index))
            record[f"chunks_{slowest[-1]}"] += 1
        kept = [(span, t) for span, t in zip(spans, slowest) if t != "miss"]
        if self.controller is None:
            return tuple(span for span, _ in kept), self.selection.recompute_ratio
        tokens = collections.Counter()
        for (s, e), tier in kept:
            tokens[tier] += e - s
        skipped = {t for t in ("host", "disk") if tokens[t] and self.controller.break_even_ratio(t, tokens[t]) >= 1.0}
        kept = [(span, t) for span, t in kept if t not in skipped]
        record["recomputed_chunks"] = sum(t in skipped for t in slowest)
        loaded = [t for _, t in kept]
        tier = max(loaded, key=("device", "host", "disk").index) if loaded else "device"
        ratio = self.controller.choose_ratio(tier, sum(e - s for (s, e), _ in kept)) if loaded else 1.0
        return tuple(span for span, _ in kept), ratio

    def _admit(self, query: StreamQuery) -> tuple[str, InFlight]:
        prompt, spans = self.work.prompt(query)
        admitted = time.perf_counter()
        compiles = self.compiles.programs
        record = {"query": query.index, "exact": query.exact, "prompt_tokens": len(prompt),
                  **{f"blocks_{t}": 0 for t in HIT_TIERS}, **{f"chunks_{t}": 0 for t in HIT_TIERS},
                  "recomputed_chunks": 0}
        sampled = query.index in self.refs
        sampling = SamplingParams(max_new_tokens=self.config.serving.max_new_tokens, prompt_logits=int(sampled))
        reuse = None
        if self.run.blended and not query.exact:
            spans, ratio = self._chunk_plan(query, spans, record)
            record["ratio"] = ratio
            reuse = ChunkReuse(self.store, spans, dataclasses.replace(self.selection, recompute_ratio=ratio),
                               token_bucket=self.config.serving.token_bucket)
        rid = self.engine.submit(prompt, sampling, chunks=reuse,
                                 retention=retention(self.config, self.run, len(self.work.prefix), reuse is not None))
        return rid, InFlight(query, admitted, compiles, record)

    def _first_token(self, rid: str, job: InFlight) -> None:
        rec = self.engine.requests[rid]
        job.record["ttft_s"] = rec.first_token_time - job.admitted_s
        job.record["prefill_s"] = rec.first_token_time - rec.submit_time
        job.record["compiled"] = self.compiles.programs != job.compiles
        if rec.chunks is None and self.run.policy != "no_reuse":  # an exact request: did it reuse blended KV?
            keys = self.manager.prompt_block_keys(rec.sched.prompt_token_ids)
            reused = rec.sched.num_reused_tokens // self.manager.tokens_per_block
            job.record["exact_violation"] = any(k not in self.exact_keys for k in keys[:reused])
            self.exact_keys.update(keys)  # its prompt blocks are in the tree from now on

    def _finish(self, rid: str, job: InFlight) -> dict:
        out = self.engine.pop_output(rid)
        if out.error is not None:
            raise RuntimeError(f"query {job.query.index} failed: {out.error}")
        record, n = job.record, len(out.prompt)
        record["output_tokens"] = len(out.output)
        record["finish_s"] = time.perf_counter()
        record["reused_tokens"] = out.num_reused_tokens
        report_ = out.blend_report
        if report_ is not None:
            record["recomputed_share"] = float(np.asarray(report_.recomputed).mean())
            record["onboarded_pages"] = report_.onboarded_pages
            record["missed_tokens"] = report_.num_missed  # chunk blocks evicted between the probe and the prefill
        else:
            record["recomputed_share"] = 1.0 - out.num_reused_tokens / n
            if self.run.policy != "no_reuse":  # and the blocks its answer filled
                self.exact_keys.update(self.manager.prompt_block_keys(out.prompt + out.output))
        answer = self.work.answer(out.output)
        record["f1"] = metrics.squad_f1(answer, job.query.gold_answers)
        ref = self.refs.get(job.query.index)
        if ref is not None:
            logits = np.asarray(out.prompt_logits[-1])
            record["kl"] = float(metrics.kl_divergence(ref.logits, logits))
            record["top1"] = float(metrics.top1_agreement(ref.logits, logits))
            record["ref_f1"] = metrics.squad_f1(ref.answer, job.query.gold_answers)
        return record

    def serve(self, progress: Callable[[], None] = lambda: None) -> list[dict]:
        """Serves every query, ``serving.concurrency`` at a time; one record per query."""
        pending = collections.deque(self.work.stream)
        inflight: dict[str, InFlight] = {}
        records = []
        start = time.perf_counter()
        while pending or inflight:
            while pending and len(inflight) < self.config.serving.concurrency:
                rid, job = self._admit(pending.popleft())
                inflight[rid] = job
            self.engine.step()
            for rid, job in list(inflight.items()):
                rec = self.engine.requests[rid]
                if rec.first_token_time is not None and "ttft_s" not in job.record:
                    self._first_token(rid, job)
                if rec.finished:
                    record = self._finish(rid, inflight.pop(rid))
                    record["finish_s"] -= start
                    records.append(record)
                    progress()
        return sorted(records, key=lambda r: r["query"])


# ---------------------------------------------------------------------------- summaries


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def window_rows(records: Sequence[dict], window: int) -> list[dict]:
    """Per window of ``window`` queries: chunk blocks by tier (shares of the probed blocks),
    recomputed share, TTFT p50/p95 (queries that compiled left out), output tokens per second,
    quality means over the sampled queries."""
    rows = []
    for w in range(0, len(records), window):
        part = records[w : w + window]
        blocks = {t: sum(r[f"blocks_{t}"] for r in part) for t in HIT_TIERS}
        total = sum(blocks.values())
        ttft = [r["ttft_s"] for r in part if not r["compiled"]]
        span = max(r["finish_s"] for r in part) - max((r["finish_s"] for r in records[:w]), default=0.0)
        row = {"window": w // window, "first_query": part[0]["query"],
               **{f"hit_{t}": blocks[t] / total if total else float("nan") for t in HIT_TIERS},
               "recomputed_share": float(np.mean([r["recomputed_share"] for r in part])),
               "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
               "compiled_queries": sum(r["compiled"] for r in part),
               "output_tok_per_s": sum(r["output_tokens"] for r in part) / span if span > 0 else float("nan")}
        sampled = [r for r in part if "kl" in r and not r["exact"]]
        for key in ("kl", "top1", "f1"):
            row[key] = float(np.mean([r[key] for r in sampled])) if sampled else float("nan")
        rows.append(row)
    return rows


def steady_row(run: Run, records: Sequence[dict], warmup: int) -> dict:
    """One run's figures over the queries after ``warmup``."""
    after = [r for r in records if r["query"] >= warmup]
    blocks = {t: sum(r[f"blocks_{t}"] for r in after) for t in HIT_TIERS}
    total = sum(blocks.values())
    ttft = [r["ttft_s"] for r in after if not r["compiled"]]
    sampled = [r for r in after if "kl" in r and not r["exact"]]  # the same queries in every run
    span = max(r["finish_s"] for r in after) - max((r["finish_s"] for r in records if r["query"] < warmup),
                                                   default=0.0)
    return {
        "run": run.name, "queries": len(after),
        **{f"hit_{t}": blocks[t] / total if total else float("nan") for t in HIT_TIERS},
        "recomputed_share": float(np.mean([r["recomputed_share"] for r in after])),
        "recomputed_chunks": int(sum(r["recomputed_chunks"] for r in after)),
        "unstored_chunks": int(sum(r["chunks_miss"] for r in after)),
        "host_chunks": int(sum(r["chunks_host"] for r in after)),
        "disk_chunks": int(sum(r["chunks_disk"] for r in after)),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "compiled_queries": sum(r["compiled"] for r in after),
        "output_tok_per_s": sum(r["output_tokens"] for r in after) / span if span > 0 else float("nan"),
        "kl": float(np.mean([r["kl"] for r in sampled])) if sampled else float("nan"),
        "top1": float(np.mean([r["top1"] for r in sampled])) if sampled else float("nan"),
        "f1": float(np.mean([r["f1"] for r in sampled])) if sampled else float("nan"),
        "ref_f1": float(np.mean([r["ref_f1"] for r in sampled])) if sampled else float("nan"),
        "quality_n": len(sampled),
        "exact_requests": sum("exact_violation" in r for r in records),
        "exact_violations": sum(bool(r.get("exact_violation")) for r in records),
    }


def replay_rows(config: ml_collections.ConfigDict, run: Run, engine: Engine, log: Sequence[tuple]) -> list[dict]:
    """The run's block trace replayed through the manager alone at every eviction and tier
    setting, at the run's device cache and at ``config.replay_device_scales`` times it, with
    Belady's MIN at each total capacity. A scale whose device cache cannot hold the requests
    in flight is left out (the engine would preempt; the trace cannot)."""
    layout = engine.layout
    kv = KvCacheConfig(tokens_per_block=config.cache.tokens_per_block)
    rows = []
    for scale in config.replay_device_scales:
        device = tuple(max(2, round((n - 1) * scale) + 1) for n in layout.num_pages)
        for tiers in TIER_SETS:
            if (tiers != "device" and not layout.num_host_pages) or (tiers == "disk" and not layout.num_disk_pages):
                continue
            host = layout.num_host_pages if tiers in ("host", "disk") else 0
            disk = layout.num_disk_pages if tiers == "disk" else 0
            sim_layout = dataclasses.replace(layout, num_pages=device, num_host_pages=host, num_disk_pages=disk)
            head = {"trace": run.name, "device_pages": device[0] - 1, "tiers": tiers}
            try:
                results = {e: replay(log, KVCacheManager(kv, sim_layout), priorities=e == "priority_lru")
                           for e in EVICTIONS}
            except OutOfPagesError:
                continue
            for eviction, result in results.items():
                probed = {t: sum(p[t] for p in result.probes.values()) for t in HIT_TIERS}
                total = sum(probed.values())
                rows.append({**head, "eviction": eviction,
                             "block_hit_rate": result.stats["reused_blocks"] / max(result.stats["prompt_blocks"], 1),
                             "chunk_block_hit_rate": result.chunk_hit_rate,
                             **{f"probe_{t}": probed[t] / total if total else float("nan") for t in HIT_TIERS}})
            capacity = device[0] - 1 + host + disk
            rows.append({**head, "eviction": "belady",
                         "chunk_block_hit_rate": belady_hit_rate(results["lru"].accesses, capacity)})
    return rows


def findings(steady: Sequence[dict], windows: dict[str, list[dict]], replays: Sequence[dict],
             config: ml_collections.ConfigDict) -> str:
    """The answers the summary states, from the numbers: decay over time, auto against the
    fixed ratio, priority-LRU against Belady, exact requests."""
    lines = []
    warm = config.serving.warmup_queries
    for row in steady:
        name, rows = row["run"], [w for w in windows[row["run"]] if w["first_query"] >= warm]
        if len(rows) >= 2:
            first, last = rows[0], rows[-1]
            lines.append(
                f"- `{name}`: TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms ({row['ttft_speedup_p50']:.2f}x no reuse), "
                f"chunk blocks found {1 - first['hit_miss']:.2f} -> {1 - last['hit_miss']:.2f} and TTFT p50 "
                f"{first['ttft_p50_s'] * 1e3:.0f} -> {last['ttft_p50_s'] * 1e3:.0f} ms from queries "
                f"{first['first_query']} to {last['first_query']}; KL {row['kl']:.3g}, top-1 {row['top1']:.2f}, "
                f"F1 {row['f1']:.3f} (full recompute {row['ref_f1']:.3f}, n = {row['quality_n']})."
            )
    for row in steady:
        if row["run"].startswith("cacheblend_auto"):
            lines.append(f"- `{row['run']}` recomputed {row['recomputed_chunks']} chunks instead of reading them, of "
                         f"{row['host_chunks']} whose slowest blocks were on the host tier and {row['disk_chunks']} on "
                         f"the disk tier.")
        if row["run"].startswith("cacheblend"):
            lines.append(f"- `{row['run']}` recomputed {row['unstored_chunks']} missing chunks in place (a chunk is "
                         f"stored at miss number {config.serving.store_after_misses}).")
    for r in replay_pivot(replays):
        if r["device_pages"] == config.cache.device_tokens // config.cache.tokens_per_block and "belady" in r:
            lines.append(f"- `{r['trace']}` trace, tiers {r['tiers']}: chunk-block hit rate LRU "
                         f"{r.get('lru', float('nan')):.3f}, priority-LRU {r.get('priority_lru', float('nan')):.3f}, "
                         f"Belady {r['belady']:.3f}.")
    checked = sum(r["exact_requests"] for r in steady)
    lines.append(f"- Exact requests that reused a block no exact request wrote: "
                 f"{sum(r['exact_violations'] for r in steady)} of {checked}.")
    return "\n".join(lines) + "\n"


def replay_pivot(replays: Sequence[dict]) -> list[dict]:
    """One row per (trace, device pages, tiers): the chunk-block hit rate under LRU,
    priority-LRU and Belady, and the probed chunk blocks found under each policy."""
    rows: dict[tuple, dict] = {}
    for r in replays:
        row = rows.setdefault((r["trace"], r["device_pages"], r["tiers"]),
                              {"trace": r["trace"], "device_pages": r["device_pages"], "tiers": r["tiers"]})
        row[r["eviction"]] = r["chunk_block_hit_rate"]
        if "probe_miss" in r:
            row[f"found_{r['eviction']}"] = 1.0 - r["probe_miss"]
    return list(rows.values())


def plot(windows: dict[str, list[dict]], path: pathlib.Path) -> None:
    """Chunk hit share (all tiers), TTFT p50 and KL against the query index, one line per run."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in windows.items():
        x = [r["first_query"] for r in rows]
        axes[0].plot(x, [1 - r["hit_miss"] for r in rows], marker=".", label=name)
        axes[1].plot(x, [r["ttft_p50_s"] for r in rows], marker=".", label=name)
        axes[2].plot(x, [r["kl"] for r in rows], marker=".", label=name)
    for ax, label in zip(axes, ("chunk blocks found (any tier)", "TTFT p50 (s)", "KL vs full recompute (nats)")):
        ax.set_xlabel("query index")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    report.save_figure(fig, path, dpi=110)


def _comparable(config: ml_collections.ConfigDict) -> dict:
    """The config a run's record was served under, less what pieces may change (``piece``, ``runs``)."""
    fields = config.to_dict()
    fields.pop("piece", None)
    fields.pop("runs", None)
    return json.loads(json.dumps(fields, default=str))


def _run_file(workdir: pathlib.Path, run: Run) -> pathlib.Path:
    """Where a served run's record is kept (its steady row, windows and replay rows)."""
    return workdir / f"run-{run.name.replace('/', '-')}.json"


def serve_run(config: ml_collections.ConfigDict, work: Workload, run: Run, refs: dict[int, Reference],
              disk_dir: str, workdir: pathlib.Path) -> dict:
    """Serves the stream with ``run`` and keeps its record in ``workdir`` (``_run_file``, and
    its queries as ``queries-<run>.csv``); returns the record."""
    server = Server(config, work, run, refs, disk_dir)
    bar = tqdm(total=len(work.stream), desc=run.name, leave=False)
    recs = server.serve(bar.update)
    bar.close()
    steady = steady_row(run, recs, config.serving.warmup_queries)
    exact = replay(server.manager.log, KVCacheManager(server.manager.config, server.engine.layout),
                   priorities=run.eviction == "priority_lru")
    served = dataclasses.asdict(server.manager.stats)
    steady["replay_equal"] = exact.stats == served
    steady["replay_diff"] = " ".join(f"{k}:{served[k]}/{v}" for k, v in exact.stats.items()
                                     if v != served[k])  # counter:served/replayed
    record = {"run": run.name, "config": _comparable(config), "steady": steady,
              "windows": window_rows(recs, config.serving.window),
              "replays": replay_rows(config, run, server.engine, server.manager.log) if run.blended else [],
              "machine": timing.machine_limits(), "code": report.code_commit()}
    report.write_csv(workdir / f"queries-{run.name.replace('/', '-')}.csv", recs,
                     list(dict.fromkeys(k for rec in recs for k in rec)))
    kept = report.jsonable(record, nan_as_text=False)  # NaN stays a float through the record
    _run_file(workdir, run).write_text(json.dumps(kept, indent=1) + "\n")
    del server
    gc.collect()
    return record


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Serves every run of ``config.runs`` not yet served in ``workdir`` (at most
    ``piece.max_runs`` of them: a long stream runs in pieces, each resuming from the records
    the pieces before it kept), then, once every run has its record, writes the summary."""
    runs = [Run.parse(r) for r in config.runs]
    want = _comparable(config)
    for r in runs:
        if _run_file(workdir, r).is_file():
            got = json.loads(_run_file(workdir, r).read_text())["config"]
            if got != want:
                fields = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
                raise ValueError(f"{workdir} holds run {r.name!r} of another config (fields {fields} differ): "
                                 "serve it in its own folder, or remove the folder's run-*.json files")
    work = load_workload(config, workdir)
    todo = [r for r in runs if not _run_file(workdir, r).is_file()]
    if config.piece.max_runs:
        todo = todo[: config.piece.max_runs]
    if todo:
        with tempfile.TemporaryDirectory(dir=workdir) as disk_dir:
            refs = references(config, work, disk_dir)
            for r in todo:
                serve_run(config, work, r, refs, disk_dir, workdir)
                if config.piece.commit:
                    report.commit_folder(workdir, f"Results: rag_serving {workdir.name}, run {r.name} "
                                                  f"({len(work.stream)} queries), code {report.code_commit()}")
    left = [r.name for r in runs if not _run_file(workdir, r).is_file()]
    if left:
        return {"runs_left": left}
    return assemble(config, workdir, runs, len(work.stream))


def assemble(config: ml_collections.ConfigDict, workdir: pathlib.Path, runs: Sequence[Run], num_queries: int) -> dict:
    """The summary, tables and figure of the runs' records in ``workdir``."""
    records = [json.loads(_run_file(workdir, r).read_text()) for r in runs]
    windows = {rec["run"]: rec["windows"] for rec in records}
    steady = [rec["steady"] for rec in records]
    replays = [row for rec in records for row in rec["replays"]]
    machines = {rec["run"]: rec["machine"] for rec in records}
    base = next((s for s in steady if s["run"].startswith("no_reuse")), None)
    for s in steady:
        s["ttft_speedup_p50"] = base["ttft_p50_s"] / s["ttft_p50_s"] if base else float("nan")
    plot(windows, workdir / "over_time.png")
    report.write_csv(workdir / "windows.csv", [{"run": k, **row} for k, rows in windows.items() for row in rows])
    sections = [
        ("Findings", findings(steady, windows, replays, config)),
        ("Setup", f"{num_queries} queries, {config.stream.top_k} passages each ({config.stream.retriever}), "
                  f"device cache {config.cache.device_tokens} tokens, host {config.cache.host_mb} MiB, disk "
                  f"{config.cache.disk_mb} MiB at {config.cache.disk_read_gbps} GB/s; concurrency "
                  f"{config.serving.concurrency}.\n"),
        ("Runs: code and machine", report.markdown_table(
            [{"run": rec["run"], "code": rec["code"], **rec["machine"]} for rec in records])),
        (f"Steady state (queries from {config.serving.warmup_queries})", report.markdown_table(steady)),
        ("Over time", "![over time](over_time.png)\n"),
        ("The block traces replayed through the manager alone, and Belady",
         "Chunk-block hit rate of the chunk-scope lookups and stores (every tier counts as a hit), and the share of "
         "probed chunk blocks found on some tier; all rows in `replays.csv`.\n\n" + report.markdown_table(
             replay_pivot(replays))),
    ]
    report.write_csv(workdir / "replays.csv", replays, list(dict.fromkeys(k for row in replays for k in row)))
    report.write_summary(workdir, "RAG serving: CacheBlend in steady state", sections)
    return {"machines": machines, "steady": steady, "replays": replays, "windows": windows}
