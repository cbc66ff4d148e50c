"""Layer-by-layer blended prefill into the paged cache (SPEC C5).

For every layer l, in one jitted function over all layers:

1. the reused KV of every prompt token (chunks precomputed alone, keys re-rotated to their
   actual positions, C2) is written into the sequence's pages of layer l;
2. the rows still being recomputed get fresh q/k/v from their own hidden states; at a check
   layer their deviation from the reused KV narrows the set (``selection.narrow``);
3. the recomputed rows' K/V overwrite the reused ones in the pages (the fused KV);
4. the recomputed rows attend over the fused pages with ``attention.partial_attention``,
   whose causal mask is exact by position (``key_pos <= query_pos``), and run the MLP.

After the prefill the pages hold the fused KV and decoding continues with
``transformer.forward`` like after any prefill. Recomputing every row reproduces full
recompute; recomputing only the suffix is full KV reuse.

Shapes: L = layers, T = padded prompt tokens, M = recomputed row capacity, K = kv heads,
H = heads, d = head_dim, D = d_model, V = vocab, P = probe rows, pages_per_seq = block-table width.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import attention
from kvjax.blend.reposition import reposition_keys
from kvjax.blend.selection import Deviation, narrow, token_deviation
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import PagePool, slot_mapping, write_layer
from kvjax.model import transformer
from kvjax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class BlendPlan:
    """Static part of a blended prefill (a jit static argument).

    Attributes:
      checks: (layer, row capacity after narrowing) per check layer; empty = fixed rows.
      deviation: "k", "v" or "kv" scoring at the checks.
      num_probes: rows whose per-layer attention output is traced (0 = no trace).
    """

    checks: tuple[tuple[int, int], ...] = ()
    deviation: Deviation = "kv"
    num_probes: int = 0


@flax.struct.dataclass
class BlendInputs:
    """Device inputs of one blended prefill (one sequence).

    Attributes:
      tokens: [T] int32 prompt ids (padding: any id).
      positions: [T] int32 absolute positions; -1 = padding.
      reused_k, reused_v: [L, T, K, d] stored KV of each token (keys rotated for the stored
        positions; zeros where a token has no stored KV, i.e. the suffix).
      deltas: [T] int32 actual minus stored position of each token.
      selectable: [T] bool chunk tokens (may be selected).
      forced: [T] bool suffix tokens (always recomputed).
      rows: [M0] int32 tokens recomputed from layer 0; rows_valid: [M0] bool.
      counts: [num_checks] int32 rows kept after each check.
      block_table: [1, pages_per_seq] int32 pages of the sequence.
      length: [1] int32 prompt length.
      probes: [P] int32 positions whose attention output is traced (-1 = none).
    """

    tokens: jax.Array
    positions: jax.Array
    reused_k: jax.Array
    reused_v: jax.Array
    deltas: jax.Array
    selectable: jax.Array
    forced: jax.Array
    rows: jax.Array
    rows_valid: jax.Array
    counts: jax.Array
    block_table: jax.Array
    length: jax.Array
    probes: jax.Array


@flax.struct.dataclass
class RowState:
    """The rows being recomputed.

    Attributes:
      idx: [M] int32 token index of each row.
      valid: [M] bool.
      x: [M, D] residual stream of each row.
    """

    idx: jax.Array
    valid: jax.Array
    x: jax.Array


def blend_layer(
    lp: transformer.LayerParams,
    cfg: ModelConfig,
    layout: CacheLayout,
    layer: int,
    pool_k: jax.Array,
    pool_v: jax.Array,
    rows: RowState,
    reused_k: jax.Array,
    reused_v: jax.Array,
    inputs: BlendInputs,
    check: tuple[int, jax.Array] | None,
    deviation: Deviation,
    attn_impl: attention.Impl,
) -> tuple[RowState, jax.Array, jax.Array, jax.Array]:
    """One layer of the blended prefill.

    Args:
      layer: layer index (static: RoPE base and window).
      pool_k, pool_v: [num_pages, page_size, K, d] pages of this layer.
      rows: the rows entering the layer.
      reused_k, reused_v: [T, K, d] stored KV of this layer (keys at stored positions).
      check: (capacity, count) to narrow the rows at this layer, or None.

    Returns:
      (rows leaving the layer, pool_k, pool_v, attention output [M, H, d] of the rows).
    """
    theta = cfg.layer_rope_theta[layer]
    bt = inputs.block_table
    reused_k = reposition_keys(reused_k, inputs.deltas, theta)  # [T, K, d]
    page_ids, offsets = slot_mapping(bt, inputs.positions[None], layout.page_size)
    pool_k = write_layer(pool_k, page_ids, offsets, reused_k[None])
    pool_v = write_layer(pool_v, page_ids, offsets, reused_v[None])

    row_pos = jnp.where(rows.valid, inputs.positions[rows.idx], -1)  # [M]
    q, k, v = transformer.qkv(lp, cfg, layer, rows.x[None], row_pos[None])  # [1, M, *, d]
    if check is not None:
        capacity, count = check
        dev = token_deviation(k[0], v[0], reused_k[rows.idx], reused_v[rows.idx], deviation)  # [M]
        forced = inputs.forced[rows.idx] & rows.valid
        eligible = (inputs.selectable[rows.idx] | inputs.forced[rows.idx]) & rows.valid
        picked, valid = narrow(dev, forced, eligible, count, capacity)
        rows = RowState(idx=rows.idx[picked], valid=valid, x=rows.x[picked])
        q, k, v = q[:, picked], k[:, picked], v[:, picked]
        row_pos = jnp.where(valid, inputs.positions[rows.idx], -1)

    page_ids, offsets = slot_mapping(bt, row_pos[None], layout.page_size)
    pool_k = write_layer(pool_k, page_ids, offsets, k)
    pool_v = write_layer(pool_v, page_ids, offsets, v)
    out = attention.partial_attention(
        q, row_pos[None], pool_k, pool_v, inputs.length, bt,
        sm_scale=cfg.sm_scale, sliding_window=layout.window_of(layer), impl=attn_impl,
    )  # [1, M, H, d]
    x = transformer.finish_layer(lp, cfg, rows.x[None], out)[0]
    return rows.replace(x=x), pool_k, pool_v, out[0]


def initial_rows(params: transformer.Params, cfg: ModelConfig, inputs: BlendInputs) -> RowState:
    """Embeddings of the rows recomputed from layer 0."""
    x = transformer.embed_tokens(params, cfg, inputs.tokens[inputs.rows][None])[0]  # [M0, D]
    return RowState(idx=inputs.rows, valid=inputs.rows_valid, x=x)


def last_logits(params: transformer.Params, cfg: ModelConfig, rows: RowState, positions: jax.Array) -> jax.Array:
    """Logits [V] of the row at the highest valid position (the prompt's last token)."""
    row_pos = jnp.where(rows.valid, positions[rows.idx], -1)
    return transformer.logits_of(params, cfg, rows.x[jnp.argmax(row_pos)])


@functools.partial(jax.jit, static_argnames=("cfg", "layout", "plan", "attn_impl"), donate_argnames=("pool",))
def blend_prefill(
    params: transformer.Params,
    pool: PagePool,
    inputs: BlendInputs,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    plan: BlendPlan,
    attn_impl: attention.Impl = "auto",
) -> tuple[jax.Array, PagePool, dict[str, jax.Array] | None]:
    """Blended prefill of one prompt; writes the fused KV into the pool (donated).

    Returns:
      (logits [V] float32 of the last prompt token, the pool, trace or None). With
      ``plan.num_probes > 0`` the trace holds ``attn`` [L, P, H*d] (attention output of the
      probe positions, zeros where a probe was not recomputed) and ``recomputed`` [L, T] bool.
    """
    check_at = {layer: (i, capacity) for i, (layer, capacity) in enumerate(plan.checks)}
    rows = initial_rows(params, cfg, inputs)
    pool_k, pool_v = list(pool.k), list(pool.v)
    attn_trace, recomputed = [], []
    for layer, lp in enumerate(params.layers):
        check = None
        if layer in check_at:
            i, capacity = check_at[layer]
            check = (capacity, inputs.counts[i])
        rows, pool_k[layer], pool_v[layer], out = blend_layer(
            lp, cfg, layout, layer, pool_k[layer], pool_v[layer], rows,
            inputs.reused_k[layer], inputs.reused_v[layer], inputs, check, plan.deviation, attn_impl,
        )
        if plan.num_probes:
            row_pos = jnp.where(rows.valid, inputs.positions[rows.idx], -1)  # [M]
            match = (inputs.probes[:, None] == row_pos[None, :]) & (inputs.probes[:, None] >= 0)  # [P, M]
            attn_trace.append(match.astype(out.dtype) @ out.reshape(out.shape[0], -1))  # [P, H*d]
            mask = jnp.zeros(inputs.tokens.shape[0], bool).at[rows.idx].max(rows.valid)
            recomputed.append(mask)
    logits = last_logits(params, cfg, rows, inputs.positions)
    trace = {"attn": jnp.stack(attn_trace), "recomputed": jnp.stack(recomputed)} if plan.num_probes else None
    return logits, PagePool(k=tuple(pool_k), v=tuple(pool_v)), trace


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def gather_kv(pool: PagePool, block_table: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """The first ``num_tokens`` KV slots of one sequence in every layer.

    Args:
      block_table: [pages_per_seq] int32.

    Returns:
      (k, v), each [L, num_tokens, K, d].
    """

    def seq(pages: jax.Array) -> jax.Array:
        flat = pages[block_table].reshape(-1, *pages.shape[2:])  # [pages_per_seq * page_size, K, d]
        return flat[:num_tokens]

    return jnp.stack([seq(p) for p in pool.k]), jnp.stack([seq(p) for p in pool.v])


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("pool",))
def fill_pages(
    pool: PagePool, k: jax.Array, v: jax.Array, positions: jax.Array, block_table: jax.Array, *, layout: CacheLayout
) -> PagePool:
    """Writes known KV (e.g. an exact cached prefix) into one sequence's pages in every layer.

    Args:
      k, v: [L, T, K, d]; positions: [T] int32 (-1 = padding); block_table: [1, pages_per_seq].
    """
    page_ids, offsets = slot_mapping(block_table, positions[None], layout.page_size)
    new_k = tuple(write_layer(p, page_ids, offsets, k[i][None]) for i, p in enumerate(pool.k))
    new_v = tuple(write_layer(p, page_ids, offsets, v[i][None]) for i, p in enumerate(pool.v))
    return PagePool(k=new_k, v=new_v)
