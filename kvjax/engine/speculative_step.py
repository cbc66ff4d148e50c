"""A speculative decode step: draft, verify in one forward, roll back the rejected slots.

Each decoding sequence gets up to k draft slots in its own pages, taken only from free pages
after the scheduler's allocations (so a draft never evicts a cached block); the drafter
(``kvjax.speculative``) proposes drafts; one forward over the input token and the drafts
(T = 1 + k per row) verifies them (``kvjax.speculative.verify``: greedy rows emit exactly the
non-speculative tokens); the slots of rejected drafts are rolled back. Drafts are not charged
to the token budget.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import SpeculativeConfig
from kvjax.engine.buckets import pow2_bucket, table_width
from kvjax.engine.runner import Sampled, StepRunner, sampling_arrays, step_inputs
from kvjax.engine.scheduler import ScheduledRequest
from kvjax.manager import TieredCacheManager, require_tiered
from kvjax.speculative import DraftRow, make_drafter, verify


class SpeculativeDecode:
    """The decode runner of an engine with speculative decoding.

    Args:
      config: the speculative decoding config (drafter, ``num_draft_tokens`` = k).
      runner: the engine's step runner (context, records, timings; plain decodes).
      max_seq_len: the engine's longest sequence (no draft slot past it).
    """

    def __init__(self, config: SpeculativeConfig, runner: StepRunner, max_seq_len: int) -> None:
        ctx = runner.context
        self.config = config
        self.runner = runner
        self.max_seq_len = max_seq_len
        self.drafter = make_drafter(config, ctx.params, ctx.cfg, ctx.layout, ctx.attn_impl)

    def __call__(self, works: Sequence[ScheduledRequest]) -> Sampled:
        """A batch of decodes, speculatively; returns the tokens each request emits (accepted drafts, then the token
        after them). A step where the drafter proposes
        nothing runs as a plain decode."""
        start_time = time.perf_counter()
        runner, ctx, k = self.runner, self.runner.context, self.config.num_draft_tokens
        manager = require_tiered(ctx.manager, "speculative decoding")
        rows = pow2_bucket(len(works))
        draft_rows, allocated = self._draft_rows(works, manager)
        tables = ctx.block_tables(works, rows, table_width(ctx.layout.pages_for(max(allocated))))
        drafts, ctx.pool = self.drafter.propose(draft_rows, rows, ctx.pool, tables)
        num_drafts = drafts.num_drafts
        runner.timings["draft_s"] += time.perf_counter() - start_time
        if not num_drafts.any():
            for w, slots in zip(works, allocated):
                manager.rollback(w.request_id, slots - w.start - 1)
            return runner.decode(works)
        draft_tokens = np.zeros((rows, k), np.int32)
        draft_tokens[:, : drafts.tokens.shape[1]] = drafts.tokens
        verified = [
            dataclasses.replace(w, token_ids=(w.token_ids[0], *draft_tokens[i, : int(num_drafts[i])].tolist()))
            for i, w in enumerate(works)
        ]
        inputs = step_inputs(ctx.layout, verified, 1 + k, ctx.manager.block_table, num_slots=max(allocated))
        logits, ctx.pool = ctx.forward(
            ctx.params, ctx.pool, inputs.tokens, inputs.positions, inputs.block_tables, inputs.lengths,
            cfg=ctx.cfg, layout=ctx.layout, logits_mode="all", attn_impl=ctx.attn_impl,
        )
        probs = drafts.probs
        if probs is not None and probs.shape[1] < k:
            probs = jnp.pad(probs, ((0, 0), (0, k - probs.shape[1]), (0, 0)))
        accepted, following = verify(
            logits,
            jnp.asarray(draft_tokens),
            jnp.asarray(num_drafts),
            *sampling_arrays(works, runner.records, rows),
            probs,
        )
        accepted, following = np.asarray(accepted), np.asarray(following)
        wants_logits = any(runner.records[w.request_id].sampling.return_logits for w in works)
        host_logits = np.asarray(logits) if wants_logits else None
        emitted: Sampled = {}
        for i, (w, slots) in enumerate(zip(works, allocated)):
            a = int(accepted[i])
            manager.rollback(w.request_id, slots - (w.start + 1 + a))
            emitted[w.request_id] = draft_tokens[i, :a].tolist() + [int(following[i])]
            record = runner.records[w.request_id]
            if host_logits is not None and record.sampling.return_logits:
                record.logits.extend(host_logits[i, : a + 1])
        jax.block_until_ready(ctx.pool.k[0])
        timings = runner.timings
        timings["decode_s"] += time.perf_counter() - start_time
        timings["decode_tokens"] += int(accepted[: len(works)].sum()) + len(works)
        timings["decode_steps"] += 1
        timings["spec_rows"] += len(works)
        timings["spec_drafted"] += int(num_drafts.sum())
        timings["spec_accepted"] += int(accepted.sum())
        return emitted

    def _draft_rows(
        self, works: Sequence[ScheduledRequest], manager: TieredCacheManager
    ) -> tuple[list[DraftRow], list[int]]:
        """Takes each decode's draft slots from ``manager`` (free pages only, after the
        scheduler's allocations) and describes it to the drafter; returns (rows, each
        request's slot count now)."""
        k = self.config.num_draft_tokens
        rows, allocated = [], []
        for w in works:
            record = self.runner.records[w.request_id]
            sched, sp = record.sched, record.sampling
            emitted = len(sched.output_token_ids)
            want = max(0, min(k, sched.max_new_tokens - emitted - 1, self.max_seq_len - w.start - 1))
            slots = manager.allocate_drafts(w.request_id, w.start + 1 + want)
            allocated.append(slots)
            rows.append(DraftRow(
                context=sched.prompt_token_ids + tuple(sched.output_token_ids), start=w.start,
                max_drafts=min(want, slots - w.start - 1), temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                counter=emitted,
            ))
        return rows, allocated
