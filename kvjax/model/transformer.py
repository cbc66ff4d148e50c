"""A decoder-only transformer (Llama family; Gemma 3 through config flags) over the paged cache.

Pure functions over a ``Params`` pytree. One forward serves prefill, chunked prefill,
decode and partial recompute: every step writes the new tokens' K/V into their pages,
then lets the step's query rows attend over the sequence's pages with the exact causal
mask by position. Layers run in a ``lax.scan`` over periods of the layer pattern (one
period = a run of layers whose windows and RoPE bases repeat), so compile time does not
grow with depth.

Shapes: S = sequences, T = query tokens per sequence, D = d_model, H = heads,
K = kv heads, d = head_dim, F = ffn_dim, V = vocab.
"""

from __future__ import annotations

import functools
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import attention
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import PagePool, slot_mapping, write_layer
from kvjax.model.config import ModelConfig
from kvjax.model.rope import apply_rope

LogitsMode = Literal["last", "all", "none"]


@flax.struct.dataclass
class LayerParams:
    """Weights of all layers stacked on axis 0 ([L, ...]); optional ones are None."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, H*d]
    wk: jax.Array  # [L, D, K*d]
    wv: jax.Array  # [L, D, K*d]
    wo: jax.Array  # [L, H*d, D]
    ffn_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    q_norm: jax.Array | None = None  # [L, d]
    k_norm: jax.Array | None = None  # [L, d]
    post_attn_norm: jax.Array | None = None  # [L, D]
    post_ffn_norm: jax.Array | None = None  # [L, D]


@flax.struct.dataclass
class Params:
    embed: jax.Array  # [V, D], tied with the output projection
    layers: LayerParams
    final_norm: jax.Array  # [D]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * weight).astype(x.dtype)


def layer_slice(layers: LayerParams, index: int | jax.Array) -> LayerParams:
    """One layer's weights."""
    return jax.tree.map(lambda a: a[index], layers)


def embed_tokens(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """[S, T] int32 -> [S, T, D]."""
    x = params.embed[tokens]
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.d_model**0.5, x.dtype)
    return x


def qkv(
    lp: LayerParams, cfg: ModelConfig, layer: int, x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries, keys and values of one layer.

    Args:
      lp: this layer's weights.
      layer: layer index (static; selects the RoPE base).
      x: [S, T, D] residual stream entering the layer.
      positions: [S, T] absolute positions.

    Returns:
      q [S, T, H, d], k [S, T, K, d], v [S, T, K, d].
    """
    h = rms_norm(x, lp.attn_norm, cfg.rms_eps)
    q = (h @ lp.wq).reshape(*h.shape[:2], cfg.num_heads, cfg.head_dim)
    k = (h @ lp.wk).reshape(*h.shape[:2], cfg.num_kv_heads, cfg.head_dim)
    v = (h @ lp.wv).reshape(*h.shape[:2], cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_eps)
    theta = cfg.layer_rope_theta[layer]
    return apply_rope(q, positions, theta), apply_rope(k, positions, theta), v


def finish_layer(lp: LayerParams, cfg: ModelConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection, residual, MLP, residual.

    Args:
      x: [S, T, D] residual stream entering the layer.
      attn: [S, T, H, d] attention output.

    Returns:
      [S, T, D] residual stream leaving the layer.
    """
    o = attn.reshape(*attn.shape[:2], cfg.num_heads * cfg.head_dim) @ lp.wo
    if cfg.sandwich_norm:
        o = rms_norm(o, lp.post_attn_norm, cfg.rms_eps)
    x = x + o
    h = rms_norm(x, lp.ffn_norm, cfg.rms_eps)
    gate = h @ lp.w_gate
    act = jax.nn.silu(gate) if cfg.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    m = (act * (h @ lp.w_up)) @ lp.w_down
    if cfg.sandwich_norm:
        m = rms_norm(m, lp.post_ffn_norm, cfg.rms_eps)
    return x + m


def logits_of(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm and tied output projection: [..., D] -> [..., V] float32."""
    h = rms_norm(x, params.final_norm, cfg.rms_eps)
    return jnp.einsum("...d,vd->...v", h, params.embed, preferred_element_type=jnp.float32)


def layer_period(cfg: ModelConfig, layout: CacheLayout) -> int:
    """Smallest P dividing num_layers such that windows and RoPE bases repeat every P layers."""
    pattern = list(zip(layout.layer_windows, cfg.layer_rope_theta, layout.layer_group))
    for p in range(1, cfg.num_layers + 1):
        if cfg.num_layers % p == 0 and all(pattern[i] == pattern[i % p] for i in range(cfg.num_layers)):
            return p
    return cfg.num_layers


def attend_layer(
    lp: LayerParams,
    cfg: ModelConfig,
    layout: CacheLayout,
    layer: int,
    slot: jax.Array | int,
    pool_k: jax.Array,
    pool_v: jax.Array,
    x: jax.Array,
    positions: jax.Array,
    block_table: jax.Array,
    lengths: jax.Array,
    attn_impl: attention.Impl,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer: write this step's K/V into the group pool, attend, MLP.

    Args:
      layer: index of the layer's position in the pattern (static: window, RoPE base).
      slot: index of the layer within its group pool.
      pool_k, pool_v: [group_layers, num_pages, page_size, K, d] of the layer's group.
      x: [S, T, D]; positions: [S, T] (negative = padding).
      block_table: [S, pages_per_seq] of the layer's group; lengths: [S] KV lengths after the write.

    Returns:
      (x leaving the layer [S, T, D], pool_k, pool_v).
    """
    q, k, v = qkv(lp, cfg, layer, x, positions)
    page_ids, offsets = slot_mapping(block_table, positions, layout.page_size)
    pool_k = write_layer(pool_k, slot, page_ids, offsets, k)
    pool_v = write_layer(pool_v, slot, page_ids, offsets, v)
    window = layout.layer_windows[layer]
    out = attention.partial_attention(
        q,
        positions,
        pool_k[slot],
        pool_v[slot],
        lengths,
        block_table,
        sm_scale=cfg.sm_scale,
        sliding_window=window if window < cfg.max_seq_len else None,
        impl=attn_impl,
    )
    return finish_layer(lp, cfg, x, out), pool_k, pool_v


@functools.partial(
    jax.jit, static_argnames=("cfg", "layout", "logits_mode", "attn_impl"), donate_argnames=("pool",)
)
def forward(
    params: Params,
    pool: PagePool,
    tokens: jax.Array,
    positions: jax.Array,
    block_tables: tuple[jax.Array, ...],
    lengths: jax.Array,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    logits_mode: LogitsMode = "last",
    attn_impl: attention.Impl = "auto",
) -> tuple[jax.Array | None, PagePool]:
    """Runs the step's tokens through the model, writing their K/V into the pool.

    Args:
      params: model weights.
      pool: the page pool (donated; the updated pool is returned).
      tokens: [S, T] int32 token ids (padding rows: any id).
      positions: [S, T] int32 absolute positions, increasing within a row; -1 = padding.
      block_tables: one [S, pages_per_seq] int32 table per layer group.
      lengths: [S] int32 KV length of each sequence after this step.
      logits_mode: "last" -> [S, V] at each row's last valid token; "all" -> [S, T, V];
        "none" -> None (prefill of a chunk that is not the last).

    Returns:
      (logits float32 or None, updated pool).
    """
    x = embed_tokens(params, cfg, tokens)
    period = layer_period(cfg, layout)
    num_periods = cfg.num_layers // period
    stacked = jax.tree.map(lambda a: a.reshape(num_periods, period, *a.shape[1:]), params.layers)
    per_group = [layout.layer_group[:period].count(g) for g in range(layout.num_groups)]

    def body(carry, xs):
        x, pool_k, pool_v = carry
        lps, i = xs
        pool_k, pool_v = list(pool_k), list(pool_v)
        for j in range(period):
            g = layout.layer_group[j]
            slot = i * per_group[g] + layout.layer_group[:j].count(g)
            x, pool_k[g], pool_v[g] = attend_layer(
                layer_slice(lps, j), cfg, layout, j, slot, pool_k[g], pool_v[g],
                x, positions, block_tables[g], lengths, attn_impl,
            )
        return (x, tuple(pool_k), tuple(pool_v)), None

    (x, pool_k, pool_v), _ = jax.lax.scan(
        body, (x, pool.k, pool.v), (stacked, jnp.arange(num_periods, dtype=jnp.int32))
    )
    pool = PagePool(k=pool_k, v=pool_v)
    if logits_mode == "none":
        return None, pool
    if logits_mode == "all":
        return logits_of(params, cfg, x), pool
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)  # [S]
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [S, D]
    return logits_of(params, cfg, x_last), pool
