"""Decode steps as one device program: page allocation, forward and sampling, several steps per dispatch.

With Manager V2 (``kvjax.manager.functional``) the allocation state is a pytree, so a decode
step needs nothing from the host: ``decode_steps`` runs, inside one ``lax.while_loop``,
up to ``num_steps`` iterations of

1. ``append_tokens`` on every layer group's ``PageState`` (a fresh page for each row whose
   last page is full, LRU eviction if the free stack runs short);
2. the model's forward over one token per row (``kvjax.model.transformer.forward``);
3. sampling (``kvjax.sampling.sample``, so greedy rows emit exactly the engine's tokens);
4. stop handling: a row that samples its stop token or reaches its token budget finishes
   and writes nothing more (its later iterations are padding rows); the loop ends early
   once every row has finished.

Axis letters are ``kvjax/axes.py``'s: the forward runs s rows (a bucket of the running
requests) out of the S block-table rows, over p = ``width`` block-table columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax import attention
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import PagePool
from kvjax.manager import functional as F
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import Params, forward
from kvjax.sampling import sample


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "num_steps", "width", "attn_impl"),
    donate_argnames=("pool", "states"),
)
def decode_steps(
    params: Params,
    pool: PagePool,
    states: tuple[F.PageState, ...],
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
) -> tuple[PagePool, tuple[F.PageState, ...], jax.Array, jax.Array, jax.Array]:
    """Up to ``num_steps`` decode steps of every active row, on the device.

    Args:
      params: model weights.
      pool: the page pool (donated).
      states: one ``PageState`` per layer group (donated); its ``seq_lens`` are the tokens
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
      (pool, states, emitted [s, num_steps] int32 tokens per step (-1 after a row finished),
      num_emitted [s] int32, ok [] bool: False if a group ran out of pages, in which case
      the rows stopped at the step that lacked them and their states are those before it).
    """
    rows = tokens.shape[0]
    emitted = jnp.full((rows, num_steps), -1, jnp.int32)

    def cond(carry: tuple) -> jax.Array:
        step, active, ok = carry[0], carry[4], carry[-1]
        return (step < num_steps) & jnp.any(active) & ok

    def body(carry: tuple) -> tuple:
        step, pool, states, tokens, active, budgets, counters, emitted, num_emitted, ok = carry
        held = jnp.zeros(states[0].max_seqs, bool).at[row_ids].max(active)  # [S]
        grown = [F.append_tokens(s, held) for s in states]
        ok = jnp.all(jnp.stack([g[2] for g in grown]))
        states = tuple(F.select(ok, g[0], s) for g, s in zip(grown, states))
        active = active & ok
        positions = jnp.where(active, grown[0][1][row_ids], -1)
        lengths = jnp.where(active, states[0].seq_lens[row_ids], 0)
        tables = tuple(s.block_tables[row_ids, :width] for s in states)
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
        return step + 1, pool, states, tokens, active & ~done, budgets, counters, emitted, num_emitted, ok

    carry = (jnp.int32(0), pool, states, tokens, active, budgets, counters, emitted,
             jnp.zeros(rows, jnp.int32), jnp.bool_(True))
    _, pool, states, _, _, _, _, emitted, num_emitted, ok = jax.lax.while_loop(cond, body, carry)
    return pool, states, emitted, num_emitted, ok
