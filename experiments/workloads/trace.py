"""A synthetic request trace and its replay through the manager alone (no model), shared by the
eviction, manager-cost and speculative-decoding experiments.

A seeded trace mixes three kinds of content::

    doc request:  | system prompt (prio 90) | document (Zipf-popular, prio 35) | one-off question (prio 10..34) |
    chat turn:    | system prompt (prio 90) | history: earlier turns and answers (35)        | new user turn (35) |

``replay`` runs it through a ``KVCacheManager`` built on ``sim_layout`` and times every call.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence

import ml_collections
import numpy as np
from tqdm import tqdm

from kvjax.cache import CacheLayout
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import KVCacheManager


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a synthetic trace.

    Attributes:
      kind: "doc" (system + document + one-off question) or "chat" (system + history + turn).
      prompt: prompt token ids.
      output: the tokens the request generates (committed one at a time in replays).
      ranges: retention ranges (token_start, token_end, priority) covering the prompt.
      decode_priority: priority of generated tokens.
    """

    kind: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    ranges: tuple[tuple[int, int, int], ...]
    decode_priority: int

    def retention(self) -> KvCacheRetentionConfig:
        """The request's priority-LRU retention config."""
        return KvCacheRetentionConfig(
            tuple(TokenRangeRetentionConfig(s, e, p) for s, e, p in self.ranges),
            decode_retention_priority=self.decode_priority,
        )


def make_trace(cfg: ml_collections.ConfigDict, vocab_size: int) -> list[TraceRequest]:
    """A seeded trace of ``cfg.num_requests`` requests (see the module docstring).

    Fields used: seed, num_requests, chat_fraction, num_system_prompts, system_tokens,
    num_documents, document_tokens, zipf_alpha, question_tokens, num_active_chats,
    max_turns, turn_tokens, doc_output_tokens, chat_output_tokens. Lengths are tokens.
    """
    rng = np.random.default_rng(cfg.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(1, vocab_size, n))

    systems = [tokens(cfg.system_tokens) for _ in range(cfg.num_system_prompts)]
    docs = [tokens(cfg.document_tokens) for _ in range(cfg.num_documents)]
    ranks = np.arange(1, cfg.num_documents + 1, dtype=np.float64)
    popularity = ranks ** -cfg.zipf_alpha
    popularity /= popularity.sum()
    chats: list[dict] = [{} for _ in range(cfg.num_active_chats)]
    trace = []
    for _ in range(cfg.num_requests):
        if rng.random() < cfg.chat_fraction:
            slot = int(rng.integers(cfg.num_active_chats))
            chat = chats[slot]
            if not chat or chat["turns"] >= chat["max_turns"]:
                system = systems[int(rng.integers(cfg.num_system_prompts))]
                chat = chats[slot] = {"history": system, "system": len(system), "turns": 0,
                                      "max_turns": int(rng.integers(1, cfg.max_turns + 1))}
            prompt = chat["history"] + tokens(cfg.turn_tokens)
            output = tokens(cfg.chat_output_tokens)
            chat["history"], chat["turns"] = prompt + output, chat["turns"] + 1
            ranges = ((0, chat["system"], 90), (chat["system"], len(prompt), 35))
            trace.append(TraceRequest("chat", prompt, output, ranges, 35))
        else:
            d = int(rng.choice(cfg.num_documents, p=popularity))
            system = systems[d % cfg.num_system_prompts]
            prompt = system + docs[d] + tokens(cfg.question_tokens)
            s, e = len(system), len(system) + len(docs[d])
            ranges = ((0, s, 90), (s, e, 35), (e, len(prompt), int(rng.integers(10, 35))))
            trace.append(TraceRequest("doc", prompt, tokens(cfg.doc_output_tokens), ranges, 10))
    return trace


def sim_layout(cfg: ml_collections.ConfigDict, num_host_pages: int = 0, num_disk_pages: int = 0) -> CacheLayout:
    """The cache geometry of a manager-only replay: ``cfg.num_device_pages`` device pages (null page
    included), full attention over ``cfg.max_seq_len`` tokens, ``cfg.tokens_per_block`` tokens per
    page, and pages of ``cfg.bytes_per_page`` bytes: one float32 layer with one KV head, as wide as
    that takes, so the byte counters equal those of the model the bytes were taken from."""
    unit = CacheLayout(layer_windows=(cfg.max_seq_len,), num_pages=(cfg.num_device_pages,),
                       tokens_per_block=cfg.tokens_per_block, num_kv_heads=1, head_dim=1, max_seq_len=cfg.max_seq_len)
    if cfg.bytes_per_page % unit.bytes_per_page(0):
        raise ValueError(
            f"bytes_per_page={cfg.bytes_per_page} must be a multiple of {unit.bytes_per_page(0)} (the bytes of a "
            f"{cfg.tokens_per_block}-token float32 page with head_dim 1)"
        )
    return dataclasses.replace(unit, head_dim=cfg.bytes_per_page // unit.bytes_per_page(0),
                               num_host_pages=num_host_pages, num_disk_pages=num_disk_pages)


def make_manager(cfg: ml_collections.ConfigDict, num_host_pages: int, num_disk_pages: int = 0) -> KVCacheManager:
    """A manager on ``sim_layout(cfg, num_host_pages, num_disk_pages)``."""
    return KVCacheManager(KvCacheConfig(tokens_per_block=cfg.tokens_per_block),
                          sim_layout(cfg, num_host_pages, num_disk_pages))


OP_KINDS = ("match", "allocate", "commit", "decode", "free")
"""Timed manager calls: add_request (prefix match and reservation, per prompt block),
allocate (the prompt's pages, evictions included, per new block), commit (the computed
prompt tokens, per stored block), decode (allocate + commit of one generated token, per
call) and free_request (per released block)."""


@dataclasses.dataclass(slots=True)
class ReplayResult:
    """Counters and host time of one replay.

    Attributes:
      seconds: total host seconds per op kind (see OP_KINDS), wall clock per call.
      cpu_share: process CPU time / wall time over the replay (< 1 when other jobs took the
        cores); µs figures are scaled by it to count only the time the manager ran.
      blocks: block operations per op kind (the divisor of the µs/op figures).
      calls: manager calls per op kind.
    """

    token_hit_rate: float
    block_hit_rate: float
    device_evictions: int
    host_evictions: int
    offloaded_bytes: int
    spilled_bytes: int
    onboarded_bytes: int
    disk_onboarded_bytes: int
    seconds: dict[str, float]
    blocks: dict[str, int]
    calls: dict[str, int]
    cpu_share: float

    def us_per_block(self, kind: str) -> float:
        """CPU microseconds per block operation of ``kind``."""
        return 1e6 * self.cpu_share * self.seconds[kind] / max(self.blocks[kind], 1)

    @property
    def total_s(self) -> float:
        """CPU seconds in manager calls."""
        return self.cpu_share * sum(self.seconds.values())


def replay(mgr: KVCacheManager, trace: Sequence[TraceRequest], *, priorities: bool, concurrency: int = 1,
           desc: str | None = None) -> ReplayResult:
    """Runs the trace through the manager, ``concurrency`` requests at a time.

    Each request is admitted (add_request), its prompt allocated and committed in one chunk,
    then its output decoded one token per round (allocate + commit), round-robin over the
    active requests, and freed after its last token. Every manager call is timed.
    """
    ps = mgr.tokens_per_block
    seconds = dict.fromkeys(OP_KINDS, 0.0)
    blocks = dict.fromkeys(OP_KINDS, 0)
    calls = dict.fromkeys(OP_KINDS, 0)
    clock = time.perf_counter
    active: dict[str, tuple[TraceRequest, int]] = {}
    pending = iter(enumerate(trace))
    progress = tqdm(total=len(trace), desc=desc, leave=False, disable=desc is None)
    wall0, cpu0 = clock(), time.process_time()

    def admit() -> bool:
        nxt = next(pending, None)
        if nxt is None:
            return False
        i, req = nxt
        rid = f"r{i}"
        retention = req.retention() if priorities else None
        t0 = clock()
        reused = mgr.add_request(rid, req.prompt, retention=retention)
        t1 = clock()
        mgr.allocate(rid, len(req.prompt))
        t2 = clock()
        mgr.commit_tokens(rid, req.prompt[reused:])
        t3 = clock()
        n = len(req.prompt)
        for kind, dt, nb in (("match", t1 - t0, n // ps), ("allocate", t2 - t1, -(-n // ps) - reused // ps),
                             ("commit", t3 - t2, n // ps - reused // ps)):
            seconds[kind] += dt
            blocks[kind] += nb
            calls[kind] += 1
        active[rid] = (req, 0)
        return True

    def finish(rid: str) -> None:
        req, _ = active.pop(rid)
        t0 = clock()
        mgr.free_request(rid)
        seconds["free"] += clock() - t0
        blocks["free"] += -(-(len(req.prompt) + len(req.output)) // ps)
        calls["free"] += 1
        progress.update()

    while True:
        while len(active) < concurrency and admit():
            pass
        if not active:
            break
        for rid, (req, done) in list(active.items()):
            if done == len(req.output):
                finish(rid)
                continue
            n = len(req.prompt) + done + 1
            t0 = clock()
            mgr.allocate(rid, n)
            mgr.commit_tokens(rid, req.output[done : done + 1])
            seconds["decode"] += clock() - t0
            blocks["decode"] += 1
            calls["decode"] += 1
            active[rid] = (req, done + 1)
    progress.close()
    cpu_share = min(1.0, (time.process_time() - cpu0) / max(clock() - wall0, 1e-9))
    s = mgr.stats
    return ReplayResult(s.token_hit_rate, s.block_hit_rate, s.device_evictions, s.host_evictions,
                        s.offloaded_bytes, s.spilled_bytes, s.onboarded_bytes, s.disk_onboarded_bytes, seconds,
                        blocks, calls, cpu_share)


def belady_hit_rate(accesses: Sequence[tuple[bytes, bool]], capacity: int) -> float:
    """Block hit rate of Belady's MIN with bypass over the prompt-block accesses.

    On a miss with a full cache, the cached block or the incoming one whose next use is
    farthest (never = infinity) is left out. Runs in O(n log n) with a lazy max-heap.
    """
    n = len(accesses)
    next_use = [n] * n
    last: dict[bytes, int] = {}
    for i in range(n - 1, -1, -1):
        key = accesses[i][0]
        next_use[i] = last.get(key, n + i)  # distinct "never" values keep the heap order total
        last[key] = i
    cached: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale when cached[key] differs
    hits = prompt_blocks = 0
    for i, (key, is_prompt) in enumerate(accesses):
        prompt_blocks += is_prompt
        if key in cached:
            hits += is_prompt
        elif capacity == 0:
            continue
        elif len(cached) >= capacity:
            while -heap[0][0] != cached.get(heap[0][1]):
                heapq.heappop(heap)
            if -heap[0][0] <= next_use[i]:
                continue  # bypass: the incoming block is needed last
            del cached[heapq.heappop(heap)[1]]
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits / prompt_blocks if prompt_blocks else 0.0
