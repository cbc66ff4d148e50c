"""Manager V2's decode on the device: allocation, forward and sampling, several steps per dispatch.

Manager V2's allocation state is a pytree (``block_pool.DeviceBlockPool``), so a decode step
needs nothing from the host: ``decode_steps`` runs, inside one ``lax.while_loop``, up to
``num_steps`` iterations of

1. ``append_tokens`` on every layer group's ``DeviceBlockPool`` (a fresh page for each row whose
   last page is full, LRU eviction if the free stack runs short);
2. the model's forward over one token per row (``kvjax.model.transformer.forward``);
3. sampling (``kvjax.sampling.sample``, so greedy rows emit exactly the engine's tokens);
4. stop handling: a row that samples its stop token or reaches its token budget finishes
   and writes nothing more (its later iterations are padding rows); the loop ends early
   once every row has finished.

``DeviceDecode`` is the engine's side of it: when every running request decodes and nothing
admissible waits, the engine hands the step to it, and it runs one dispatch of
``decode_steps`` for ``num_decode_steps_per_dispatch`` tokens of every running request.

Axis letters are ``kvjax/axes.py``'s: the forward runs s rows (a bucket of the running
requests) out of the S block-table rows, over p = ``width`` block-table columns.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import PagePool
from kvjax.engine.buckets import pow2_bucket, table_width
from kvjax.engine.manager_v2 import block_pool as F
from kvjax.engine.manager_v2.manager import DeviceBlockPoolManager
from kvjax.engine.runner import StepRunner, sampling_arrays
from kvjax.engine.scheduler import ScheduledRequest, SchedulerRequest
from kvjax.manager import CacheManager
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import Params, forward
from kvjax.sampling import sample


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "num_steps", "width", "attn_impl"),
    donate_argnames=("pool", "block_pools"),
)
def decode_steps(
    params: Params,
    pool: PagePool,
    block_pools: tuple[F.DeviceBlockPool, ...],
    row_ids: jax.Array,
    tokens: jax.Array,
    active: jax.Array,
    stop_ids: jax.Array,
    budgets: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    num_steps: int,
    width: int,
    attn_impl: attention.Impl = "auto",
) -> tuple[PagePool, tuple[F.DeviceBlockPool, ...], jax.Array, jax.Array, jax.Array]:
    """Up to ``num_steps`` decode steps of every active row, on the device.

    Args:
      params: model weights.
      pool: the page pool (donated).
      block_pools: one ``DeviceBlockPool`` per layer group (donated); its ``seq_lens`` are the tokens
        whose KV is written.
      row_ids: [s] int32 the block-table row of each batch row (distinct; padding rows repeat
        any row and are inactive).
      tokens: [s] int32 each row's input token (its last sampled one, KV not yet written).
      active: [s] bool rows that decode.
      stop_ids: [s] int32 stop token per row (-1 = none).
      budgets: [s] int32 tokens each row may still emit, >= 1 for active rows.
      temperature, top_p: [s] float32; seeds: [s] int32; counters: [s] int32 tokens each
        row has generated (its sampling-key counter).
      num_steps: iterations at most.
      width: p, block-table columns the forward reads: at least the pages of the longest
        row after ``num_steps`` steps (static, so a bucket of it).

    Returns:
      (pool, block_pools, emitted [s, num_steps] int32 tokens per step (-1 after a row finished),
      num_emitted [s] int32, ok [] bool: False if a group ran out of pages, in which case
      the rows stopped at the step that lacked them and their block_pools are those before it).
    """
    rows = tokens.shape[0]
    emitted = jnp.full((rows, num_steps), -1, jnp.int32)

    def cond(carry: tuple) -> jax.Array:
        step, active, ok = carry[0], carry[4], carry[-1]
        return (step < num_steps) & jnp.any(active) & ok

    def body(carry: tuple) -> tuple:
        step, pool, block_pools, tokens, active, budgets, counters, emitted, num_emitted, ok = carry
        held = jnp.zeros(block_pools[0].max_seqs, bool).at[row_ids].max(active)  # [S]
        grown = [F.append_tokens(s, held) for s in block_pools]
        ok = jnp.all(jnp.stack([g[2] for g in grown]))
        block_pools = tuple(F.select(ok, g[0], s) for g, s in zip(grown, block_pools))
        active = active & ok
        positions = jnp.where(active, grown[0][1][row_ids], -1)
        lengths = jnp.where(active, block_pools[0].seq_lens[row_ids], 0)
        tables = tuple(s.block_tables[row_ids, :width] for s in block_pools)
        logits, pool = forward(
            params, pool, tokens[:, None], positions[:, None], tables, lengths,
            cfg=cfg, layout=layout, logits_mode="last", attn_impl=attn_impl,
        )
        sampled = sample(logits, temperature, top_p, seeds, counters)  # [s]
        emitted = emitted.at[:, step].set(jnp.where(active, sampled, -1))
        num_emitted = num_emitted + active
        counters = counters + active
        budgets = budgets - active
        done = (sampled == stop_ids) | (budgets <= 0)
        tokens = jnp.where(active, sampled, tokens)
        return step + 1, pool, block_pools, tokens, active & ~done, budgets, counters, emitted, num_emitted, ok

    carry = (jnp.int32(0), pool, block_pools, tokens, active, budgets, counters, emitted,
             jnp.zeros(rows, jnp.int32), jnp.bool_(True))
    _, pool, block_pools, _, _, _, _, emitted, num_emitted, ok = jax.lax.while_loop(cond, body, carry)
    return pool, block_pools, emitted, num_emitted, ok


class DeviceDecode:
    """The on-device decode loop of an engine whose manager keeps its allocation state on the
    device (Manager V2).

    Args:
      manager: the engine's manager (its ``block_pools`` are replaced by each dispatch).
      runner: the engine's step runner (context, records, timings).
      num_steps: tokens per request per dispatch at most (``num_decode_steps_per_dispatch``).
    """

    def __init__(self, manager: DeviceBlockPoolManager, runner: StepRunner, num_steps: int) -> None:
        self.manager = manager
        self.runner = runner
        self.num_steps = num_steps

    def __call__(self, running: Sequence[SchedulerRequest]) -> tuple[dict[str, list[int]], bool]:
        """One dispatch for the ``running`` requests (all decoding).

        Returns:
          (each request's emitted tokens (possibly none), whether the dispatch had the pages
          it wanted: False = it stopped short, the scheduler must preempt).

        Raises:
          Whatever the dispatch raised (the engine then steps through the scheduler).
        """
        start = time.perf_counter()
        manager, n = self.manager, self.num_steps
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
        ctx = self.runner.context
        width = min(table_width(ctx.layout.pages_for(longest)), manager.max_blocks)
        ctx.pool, manager.block_pools, emitted, counts, ok = decode_steps(
            ctx.params, ctx.pool, manager.block_pools, jnp.asarray(row_ids), jnp.asarray(tokens), jnp.asarray(active),
            jnp.asarray(stop_ids), jnp.asarray(budgets), *sampling_arrays(works, self.runner.records, rows),
            cfg=ctx.cfg, layout=ctx.layout, num_steps=n, width=width, attn_impl=ctx.attn_impl,
        )
        emitted, counts, ok = jax.device_get((emitted, counts, ok))
        timings = self.runner.timings
        timings["decode_s"] += time.perf_counter() - start
        timings["decode_tokens"] += int(counts.sum())
        timings["decode_steps"] += int(counts.max(initial=0))
        timings["decode_dispatches"] += 1
        return {w.request_id: emitted[i, : counts[i]].tolist() for i, w in enumerate(works)}, bool(ok)


def device_decode_for(manager: CacheManager, runner: StepRunner, num_steps: int) -> DeviceDecode | None:
    """The engine's on-device decode loop over ``manager``, or None when ``manager`` keeps its
    allocation state on the host (every decode then steps through the scheduler)."""
    return DeviceDecode(manager, runner, num_steps) if isinstance(manager, DeviceBlockPoolManager) else None
