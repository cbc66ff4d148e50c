"""Layer-by-layer blended prefill into the paged cache (SPEC C5).

For every layer l (compiled as a check phase plus one reused layer step, see ``blend_prefill``):

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
      num_cached: [] int32 leading tokens whose KV the pages already hold (blocks matched by
        prefix reuse, possibly shared with other requests): their reused KV is not written
        and they must not be rows, so no shared page is ever written (0 = write all).
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
    num_cached: jax.Array


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
    write_pos = jnp.where(inputs.positions >= inputs.num_cached, inputs.positions, -1)  # [T]
    page_ids, offsets = slot_mapping(bt, write_pos[None], layout.page_size)
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


def _trace(inputs: BlendInputs, rows: RowState, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention output [P, H*d] at the probe positions and the recomputed mask [T] of one layer."""
    row_pos = jnp.where(rows.valid, inputs.positions[rows.idx], -1)  # [M]
    match = (inputs.probes[:, None] == row_pos[None, :]) & (inputs.probes[:, None] >= 0)  # [P, M]
    attn = match.astype(out.dtype) @ out.reshape(out.shape[0], -1)  # [P, H*d]
    return attn, jnp.zeros(inputs.tokens.shape[0], bool).at[rows.idx].max(rows.valid)


@functools.partial(
    jax.jit, static_argnames=("cfg", "layout", "checks", "deviation", "num_probes", "attn_impl"),
    donate_argnames=("pool_k", "pool_v"),
)
def _check_phase(
    params: transformer.Params,
    pool_k: tuple[jax.Array, ...],
    pool_v: tuple[jax.Array, ...],
    inputs: BlendInputs,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    checks: tuple[tuple[int, int], ...],
    deviation: Deviation,
    num_probes: int,
    attn_impl: attention.Impl,
) -> tuple[RowState, tuple[jax.Array, ...], tuple[jax.Array, ...], list]:
    """Layers 0 .. last check layer in one program: all tokens, then narrowing at each check.

    ``pool_k``/``pool_v`` hold the pages of exactly these layers.
    """
    check_at = {layer: (i, capacity) for i, (layer, capacity) in enumerate(checks)}
    rows = initial_rows(params, cfg, inputs)
    pool_k, pool_v, traces = list(pool_k), list(pool_v), []
    for layer in range(len(pool_k)):
        check = None
        if layer in check_at:
            i, capacity = check_at[layer]
            check = (capacity, inputs.counts[i])
        rows, pool_k[layer], pool_v[layer], out = blend_layer(
            params.layers[layer], cfg, layout, layer, pool_k[layer], pool_v[layer], rows,
            inputs.reused_k[layer], inputs.reused_v[layer], inputs, check, deviation, attn_impl,
        )
        if num_probes:
            traces.append(_trace(inputs, rows, out))
    return rows, tuple(pool_k), tuple(pool_v), traces


@functools.partial(
    jax.jit, static_argnames=("cfg", "layout", "layer", "capacity", "deviation", "num_probes", "attn_impl"),
    donate_argnames=("pool_k", "pool_v"),
)
def layer_step(
    lp: transformer.LayerParams,
    pool_k: jax.Array,
    pool_v: jax.Array,
    rows: RowState,
    reused_k: jax.Array,
    reused_v: jax.Array,
    inputs: BlendInputs,
    count: jax.Array,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    layer: int,
    capacity: int,
    deviation: Deviation,
    num_probes: int,
    attn_impl: attention.Impl,
) -> tuple[RowState, jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """``blend_layer`` as its own program; ``capacity`` > 0 narrows to ``count`` rows.

    ``layer`` only fixes the RoPE base and window, so one compiled step serves every layer
    with the same pair (see ``representative_layer``).

    Returns:
      (rows, pool_k, pool_v, (attn [P, H*d], recomputed [T]) or None).
    """
    check = (capacity, count) if capacity else None
    rows, pool_k, pool_v, out = blend_layer(
        lp, cfg, layout, layer, pool_k, pool_v, rows, reused_k, reused_v, inputs, check, deviation, attn_impl
    )
    return rows, pool_k, pool_v, (_trace(inputs, rows, out) if num_probes else None)


def representative_layer(cfg: ModelConfig, layout: CacheLayout, layer: int) -> int:
    """First layer with the same RoPE base and window as ``layer``."""
    key = (cfg.layer_rope_theta[layer], layout.window_of(layer))
    return next(i for i in range(cfg.num_layers) if (cfg.layer_rope_theta[i], layout.window_of(i)) == key)


initial_rows_jit = jax.jit(initial_rows, static_argnames=("cfg",))
last_logits_jit = jax.jit(last_logits, static_argnames=("cfg",))


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

    Two compiled phases: the check phase (layers 0 .. last check layer, all tokens, then
    gradual filtering) as one program, then one compiled layer step for the selected rows,
    dispatched asynchronously per remaining layer (a 30-layer unrolled program would take
    ~5x longer to compile for every new row capacity, with no faster run time).

    Returns:
      (logits [V] float32 of the last prompt token, the pool, trace or None). With
      ``plan.num_probes > 0`` the trace holds ``attn`` [L, P, H*d] (attention output of the
      probe positions, zeros where a probe was not recomputed) and ``recomputed`` [L, T] bool.
    """
    inputs = jax.device_put(inputs)
    first = plan.checks[-1][0] + 1 if plan.checks else 0
    options = dict(cfg=cfg, layout=layout, deviation=plan.deviation, num_probes=plan.num_probes, attn_impl=attn_impl)
    if first:
        rows, head_k, head_v, traces = _check_phase(params, pool.k[:first], pool.v[:first], inputs, checks=plan.checks, **options)
    else:
        rows, head_k, head_v, traces = initial_rows_jit(params, cfg=cfg, inputs=inputs), (), (), []
    pool_k, pool_v = list(head_k) + list(pool.k[first:]), list(head_v) + list(pool.v[first:])
    zero = jnp.zeros((), jnp.int32)
    for layer in range(first, cfg.num_layers):
        rows, pool_k[layer], pool_v[layer], trace = layer_step(
            params.layers[layer], pool_k[layer], pool_v[layer], rows, inputs.reused_k[layer], inputs.reused_v[layer],
            inputs, zero, layer=representative_layer(cfg, layout, layer), capacity=0, **options,
        )
        if trace is not None:
            traces.append(trace)
    logits = last_logits_jit(params, cfg=cfg, rows=rows, positions=inputs.positions)
    out = None
    if plan.num_probes:
        out = {"attn": jnp.stack([t[0] for t in traces]), "recomputed": jnp.stack([t[1] for t in traces])}
    return logits, PagePool(k=tuple(pool_k), v=tuple(pool_v)), out


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
