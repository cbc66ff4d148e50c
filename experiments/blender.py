"""Evaluation harness: every prefill policy of one prompt as requests of an ``Engine``.

``Blender`` owns no pool and no decode loop: every run gets a cache scope of its own, so no
run reuses another's KV; full recompute is an ordinary engine request; every other policy is a blended request
(``Engine.submit(..., chunks=ChunkReuse(...))``) whose ``SelectionConfig.selector`` is the
reuse mode: "prefix" (prefix caching), "none" (full reuse), "all" (every non-prefix token
recomputed), or any other selector of ``selection.SELECTORS``. Teacher forcing feeds a
continuation behind the prompt as extra suffix tokens of the same blended request: they are
recomputed in every layer over the policy's fused KV, so their logits equal a forward over
the request's pages after the policy's prefill (chunk-token selection does not depend on
them, and attention is causal).

A run's KV stays in the engine's tree under its scope (``PolicyRun.scope``), so requests that
continue it (``extend``: teacher forcing along a reference, a greedy answer) are ordinary
requests under that scope: they reuse the run's pages for every chunk token and compute only
what follows, and many of them decode together. When chunk tokens lie in the prompt's last
partial page, a run with ``fill_last_page`` decodes until that page is full (``fill_tokens``),
so the tree holds it and the continuation takes its leading tokens by partial reuse.

Prompts are ``kvjax.blend.prompt.BlendPrompt``s.

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvjax.blend.chunk_store import ChunkStore, Variant
from kvjax.blend.engine_blend import BlendReport, ChunkReuse
from kvjax.blend.prompt import BlendPrompt
from kvjax.blend.selection import SCHEDULE_SELECTORS, SelectionConfig, schedule
from kvjax.cache.pool import read_slots
from kvjax.config import KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.engine import RequestOutput
from kvjax.manager.hashing import KeyExtras, check_token_ids
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import Params
from kvjax.sampling import SamplingParams
from kvjax.testing.blend import tiny_engine

FULL_RECOMPUTE = "full_recompute"
EVALUATION_RETENTION = KvCacheRetentionConfig(
    token_range_retention_configs=(TokenRangeRetentionConfig(0, None, 1),), decode_retention_priority=1
)
"""Blocks of harness requests are evicted before chunk blocks (default priority)."""


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    """One policy's engine request.

    Attributes:
      logits: [len(feed) + len(tokens), v] float32: the logits after the prompt and after each
        fed token (1 + len(feed) rows; 1 for full recompute), then those after each generated
        token but the last.
      tokens: generated tokens (greedy).
      ttft_s: submission to first token, seconds.
      trace: the fusor trace (``attn``, ``recomputed``, ``k``, ``v``) or None.
      report: the blended prefill's reuse report, or None (full recompute).
      scope: the cache scope the run's KV was committed under (``extend`` continues it).
      prompt: the run's prompt.
      qkv_checks: check layers of a deviation schedule.
      feed: the tokens fed behind the prompt.
    """

    logits: np.ndarray
    tokens: list[int]
    ttft_s: float
    trace: dict | None
    report: BlendReport | None
    scope: str
    prompt: BlendPrompt
    qkv_checks: tuple[int, ...] = ()
    feed: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Extension:
    """A request that continues a run's KV: the run's prompt, then ``feed``, under its scope.

    Attributes:
      run: the run whose committed KV serves the prompt.
      feed: tokens behind the prompt (computed over the run's KV).
      max_new_tokens: greedy tokens generated after them.
      prompt_logits: logits kept for this many last positions of prompt + feed, at most
        ``len(feed) + 1`` (teacher forcing: ``len(feed) + 1`` gives the logits after the
        prompt and after every fed token).
      stop_token_id: generation ends after this token; None = exactly ``max_new_tokens``.
    """

    run: PolicyRun
    feed: tuple[int, ...] = ()
    max_new_tokens: int = 1
    prompt_logits: int = 0
    stop_token_id: int | None = None


_READ_BUCKET = 256
"""``Blender.cached_kv`` reads slots in multiples of this (padding slots read the null page)."""


class Blender:
    """Runs prefill policies on blended prompts as requests of ``store.engine``.

    Args:
      store: the chunk store (its engine runs every request).
      token_bucket: blended prompt lengths pad to a multiple of this (shared compiled code).
    """

    def __init__(self, store: ChunkStore, *, token_bucket: int = 256) -> None:
        if isinstance(token_bucket, bool) or not isinstance(token_bucket, int) or token_bucket < 1:
            raise ValueError(f"token_bucket={token_bucket!r} must be an int >= 1")
        self.store, self.engine, self.token_bucket = store, store.engine, token_bucket
        self._nonce = secrets.token_hex(4)  # runs of two Blenders (or a restored snapshot) never share a scope
        self._runs = itertools.count()

    def check_prompt(self, prompt: BlendPrompt, extra: int = 0) -> None:
        """Raises ValueError unless ``prompt`` (plus ``extra`` tokens) fits the engine."""
        if not isinstance(prompt, BlendPrompt):
            raise ValueError(f"prompt must be a BlendPrompt, got {type(prompt).__name__}")
        prompt.check_vocab(self.engine.model.config.vocab_size)
        if prompt.roles.num_tokens + extra > self.engine.max_seq_len:
            raise ValueError(
                f"the prompt holds {prompt.roles.num_tokens} tokens ({prompt.describe()}) + {extra}; the engine's "
                f"max_seq_len is {self.engine.max_seq_len}"
            )

    def run(self, prompt: BlendPrompt, policy: SelectionConfig | str, **options: Any) -> PolicyRun:
        """Runs one policy on ``prompt`` to completion (the engine must be otherwise idle for
        timing): ``run_together`` with one policy and the same options."""
        return self.run_together(prompt, [policy], **options)[0]

    def run_together(
        self,
        prompt: BlendPrompt,
        policies: Sequence[SelectionConfig | str],
        *,
        feed: Sequence[int] = (),
        max_new_tokens: int = 1,
        num_probes: int = 0,
        scores: np.ndarray | None = None,
        pipelined: bool = True,
        timeline: bool = False,
        fill_last_page: bool = False,
    ) -> list[PolicyRun]:
        """Runs policies on ``prompt`` as requests submitted together, to completion. Their
        blended prefills run as one batch (``fusor.blend_prefill``: each layer's reused KV read
        once, the variants' rows through each layer together), so each run's ``ttft_s`` is the
        batch's; one policy alone is timed alone (the engine must be otherwise idle).

        Args:
          policies: each ``FULL_RECOMPUTE`` or a ``SelectionConfig`` (its selector is the reuse mode).
          feed: tokens fed behind the prompt (teacher forcing); their logits come back too.
          max_new_tokens: greedy tokens generated after the prompt and ``feed``.
          num_probes: > 0 keeps the fusor trace (probe attention, rows, fused KV); such runs
            prefill one by one.
          scores: [l, T] true deviation for the "oracle" selector.
          pipelined, timeline: ``ChunkReuse.pipelined`` and ``ChunkReuse.timeline``.
          fill_last_page: generate at least ``fill_tokens(prompt)`` tokens, so that ``extend``
            can continue the run over every chunk token (the first token alone sets the TTFT;
            ``logits[0]`` stays the logits after the prompt).
        """
        feed = check_token_ids(feed, "feed", self.engine.model.config.vocab_size)
        if fill_last_page and not feed:
            max_new_tokens = max(max_new_tokens, self.fill_tokens(prompt))
        self.check_prompt(prompt, len(feed) + max_new_tokens)
        tokens = [*prompt.tokens.tolist(), *feed]
        sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, return_logits=True)
        if scores is not None:
            scores = np.pad(scores, ((0, 0), (0, max(0, len(tokens) + self.token_bucket - scores.shape[1]))))
        submitted = []
        for policy in policies:
            scope = f"eval-{self._nonce}-{next(self._runs)}"
            if isinstance(policy, str):
                if policy != FULL_RECOMPUTE or feed or num_probes:
                    raise ValueError(
                        f"policy={policy!r}: the only named policy is {FULL_RECOMPUTE!r}, without feed or probes"
                    )
                rid = self.engine.submit(tokens, sampling, cache_salt=scope, retention=EVALUATION_RETENTION)
            else:
                reuse = ChunkReuse(
                    self.store,
                    prompt.roles.chunk_spans,
                    policy,
                    num_prompt_logits=len(feed) + 1,
                    num_probes=num_probes,
                    scores=scores,
                    scope=scope,
                    token_bucket=self.token_bucket,
                    pipelined=pipelined,
                    timeline=timeline,
                )
                rid = self.engine.submit(tokens, sampling, chunks=reuse, retention=EVALUATION_RETENTION)
                scope = reuse.salt
            submitted.append((policy, rid, scope))
        while not all(self.engine.requests[rid].finished for _, rid, _ in submitted):
            self.engine.step()
        done = [(self.engine.requests[rid].blend_trace, self.engine.pop_output(rid)) for _, rid, _ in submitted]
        for (policy, rid, _), (_, out) in zip(submitted, done):
            if out.error is not None:
                raise RuntimeError(f"policy {policy!r} failed in request {rid!r}: {out.error}")
        runs = []
        for (policy, _, scope), (trace, out) in zip(submitted, done):
            logits = (
                np.stack(out.logits)
                if out.prompt_logits is None
                else np.concatenate([out.prompt_logits, *(x[None] for x in out.logits[1:])])
            )
            checks = (
                schedule(policy)[0] if not isinstance(policy, str) and policy.selector in SCHEDULE_SELECTORS else ()
            )
            assert out.ttft_s is not None, "a finished request has its first token"
            report = out.blend_report if isinstance(out.blend_report, BlendReport) else None
            runs.append(PolicyRun(logits=np.asarray(logits), tokens=out.output, ttft_s=out.ttft_s, trace=trace,
                                  report=report, scope=scope, prompt=prompt, qkv_checks=checks, feed=feed))
        return runs

    def fill_tokens(self, prompt: BlendPrompt) -> int:
        """Greedy tokens a run of ``prompt`` generates so that every chunk token's page is
        committed to the tree: 1 when the chunks end inside the prompt's full pages, else
        enough to fill the last partial page (a generated token's KV is written by the next
        step, so one more than the page's free slots)."""
        ps, n = self.engine.layout.tokens_per_block, prompt.roles.num_tokens
        if n // ps * ps >= prompt.roles.suffix_start:
            return 1
        return -n % ps + 1

    def cached_kv(self, run: PolicyRun) -> tuple[np.ndarray, np.ndarray]:
        """The KV a run left in the engine's pages for its prompt's full blocks (the tokens
        a continuation reuses), as the engine holds it: k, v [l, covered, h, d] (quantized
        pages dequantized), ``covered`` = the prompt's tokens up to its last full block.

        Raises:
          RuntimeError: the run's blocks were evicted (fewer tokens cached than its full blocks).
        """
        tokens = run.prompt.tokens.tolist()
        lease = self.store.acquire([tokens], KeyExtras(cache_salt=run.scope))
        try:
            ps = self.store.tokens_per_block
            full = len(tokens) // ps * ps
            if lease.covered[0] < full:
                raise RuntimeError(
                    f"run {run.scope!r} has {lease.covered[0]} of its prompt's {full} full-block tokens cached: its "
                    f"blocks "
                    "were evicted"
                )
            padded = -(-full // _READ_BUCKET) * _READ_BUCKET  # a few gather shapes, not one per prompt length
            page_ids, offsets, _ = self.store.slots(lease.tables[0], range(full), padded, 0)
            pool, groups = self.engine.pool, self.engine.layout.layer_group
            ids, slots = jnp.asarray(page_ids), jnp.asarray(offsets)
            k, v = (
                np.stack([np.asarray(read_slots(pages[layer], ids[g], slots))[:full] for layer, g in enumerate(groups)])
                for pages in (pool.k, pool.v)
            )
        finally:
            self.store.release(lease)
        return k, v

    def extend(self, extensions: Sequence[Extension]) -> list[RequestOutput]:
        """Runs the extensions together (their decodes batch) and returns their outputs.

        Each is an ordinary request of ``run.prompt + feed`` under ``run.scope``, so the run's
        committed blocks serve its prompt (its last partial page by partial reuse, see
        ``fill_tokens``); only the tokens after the reused ones are computed, over the run's
        KV. Each output's ``prompt_logits`` holds all ``ext.prompt_logits`` rows: positions
        served from the cache (the prompt's last position, fed tokens equal to the run's own
        greedy tokens, or to those of a sibling extension that committed them first) take
        the logits computed there (``_served_logits``).

        Raises:
          ValueError: an extension asks for more than ``len(feed) + 1`` prompt logits.
          RuntimeError: an extension failed, or recomputed chunk tokens because the run's
            blocks were evicted or its chunks end in its last partial page and it ran without
            ``fill_last_page`` (then its result would mix in exact KV); the message says which.
        """
        vocab = self.engine.model.config.vocab_size
        pending = []
        for i, ext in enumerate(extensions):
            feed = check_token_ids(ext.feed, f"extensions[{i}].feed", vocab)
            if ext.prompt_logits > len(feed) + 1:
                raise ValueError(f"extensions[{i}].prompt_logits={ext.prompt_logits} must be in [0, len(feed) + 1 = "
                                 f"{len(feed) + 1}]: the positions before the prompt's last are the run's, not kept")
            self.check_prompt(ext.run.prompt, len(feed) + ext.max_new_tokens)
            sampling = SamplingParams(max_new_tokens=ext.max_new_tokens, ignore_eos=ext.stop_token_id is None,
                                      stop_token_id=ext.stop_token_id, prompt_logits=ext.prompt_logits)
            tokens = [*ext.run.prompt.tokens.tolist(), *feed]
            pending.append(
                self.engine.submit(tokens, sampling, cache_salt=ext.run.scope, retention=EVALUATION_RETENTION)
            )
        while not all(self.engine.requests[rid].finished for rid in pending):
            self.engine.step()
        outputs = [self.engine.pop_output(rid) for rid in pending]
        for ext, out in zip(extensions, outputs):
            needed = ext.run.prompt.roles.suffix_start
            if out.error is not None:
                raise RuntimeError(f"extension request {out.request_id!r} failed: {out.error}")
            if out.num_reused_tokens < needed:
                raise RuntimeError(
                    f"extension request {out.request_id!r} reused {out.num_reused_tokens} tokens of its run's KV but "
                    f"the "
                    f"prompt's chunks end at token {needed} ({ext.run.prompt.describe()}): the run's blocks were "
                    f"evicted "
                    f"(raise the cache size) or, as its chunks end in its last partial page, it ran without "
                    f"fill_last_page"
                )
        return self._served_logits(extensions, outputs)

    @staticmethod
    def _served_logits(extensions: Sequence[Extension], outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs`` with every kept prompt position's logits: a position whose KV was
        served from the cache (the run's blocks, or blocks a sibling extension of the same run
        committed first) takes the logits computed there by whoever computed it with the same
        tokens up to it over the same run's KV: the run (row i of ``run.logits`` is position
        ``n - 1 + i`` of prompt + feed + generated) or that sibling. Runs of other policies
        share the tokens, not the KV, so they never serve each other.

        Raises:
          RuntimeError: no run or sibling computed some kept position.
        """
        known: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}  # (run, tokens through position p) -> logits at p

        def learn(run: PolicyRun, tokens: tuple[int, ...], rows: np.ndarray, first: int) -> None:
            for i, row in enumerate(rows):
                known.setdefault((id(run), tokens[: first + i + 1]), row)

        runs = {id(ext.run): ext.run for ext in extensions}
        for run in runs.values():
            learn(
                run, (*run.prompt.tokens.tolist(), *run.feed, *run.tokens), run.logits, run.prompt.roles.num_tokens - 1
            )
        for ext, out in zip(extensions, outputs):
            if out.prompt_logits is not None:
                tokens = (*ext.run.prompt.tokens.tolist(), *ext.feed)
                learn(ext.run, tokens, out.prompt_logits, len(tokens) - len(out.prompt_logits))
        completed = []
        for ext, out in zip(extensions, outputs):
            have = 0 if out.prompt_logits is None else len(out.prompt_logits)
            if ext.prompt_logits <= have:
                completed.append(out)
                continue
            tokens = (*ext.run.prompt.tokens.tolist(), *ext.feed)
            positions = range(len(tokens) - ext.prompt_logits, len(tokens))
            missing = [p for p in positions if (id(ext.run), tokens[: p + 1]) not in known]
            if missing:
                raise RuntimeError(
                    f"extension request {out.request_id!r} reused {out.num_reused_tokens} tokens, but no run or "
                    f"sibling extension computed the logits at positions {missing}"
                )
            completed.append(
                dataclasses.replace(
                    out, prompt_logits=np.stack([known[id(ext.run), tokens[: p + 1]] for p in positions])
                )
            )
        return completed

    def exact_prefix_len(self, prompt: BlendPrompt) -> int:
        """Tokens whose stored KV is exact: the prefix, plus chunk 0 when it was stored behind it."""
        exact = len(prompt.prefix)
        if prompt.chunks and prompt.prefix and self.store.variant_prefix == prompt.prefix:
            exact += len(prompt.chunks[0])
        return exact



def make_blender(
    cfg: ModelConfig, params: Params, prompt: BlendPrompt, *, variant: Variant = "system", max_tokens: int = 512,
    mesh: Mesh | None = None,
) -> Blender:
    """A Blender over a fresh engine and store holding ``prompt``'s chunks (16-token pages, 64-token buckets).

    Args:
      max_tokens: the engine's ``max_seq_len`` (longest prompt plus continuation).
      mesh: the device mesh the engine is sharded over (None = one device).
    """
    store = ChunkStore(tiny_engine(cfg, params, max_seq_len=max_tokens, mesh=mesh), variant=variant,
                       prefix_tokens=prompt.prefix)
    for chunk in prompt.chunks:
        store.put(chunk)
    return Blender(store, token_bucket=64)


__all__ = ["EVALUATION_RETENTION", "FULL_RECOMPUTE", "Blender", "Extension", "PolicyRun", "make_blender"]
