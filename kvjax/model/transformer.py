"""A decoder-only transformer (Llama family; Gemma 3 through config flags) over the paged cache.

Pure functions over a ``Params`` pytree. One forward serves prefill, chunked prefill,
decode and partial recompute: every step writes the new tokens' K/V into their pages,
then lets the step's query rows attend over the sequence's pages with the exact causal
mask by position.

Layers are unrolled over per-layer weight and page arrays rather than scanned over stacked
ones: on CPU, XLA materialises a copy of each dynamically sliced layer (weights and pages),
which made decode memory-bound on copies (measured 1.5-2x slower). ``forward`` compiles the
unrolled model as one program per step shape; ``forward_by_layer`` runs the same layers as
one program per kind of layer (``layer_kind``), dispatched in turn, which compiles a new
shape several times faster (``forward_for`` picks one, ``COMPILE_UNITS``).

A hybrid model (``cfg.layer_types`` with "recurrent" layers) runs its recurrent layers
through ``kvjax.model.recurrent`` instead of attention: they read and write no pages, and
their per-sequence state [R, s, H, d, d] is an explicit input and output of ``forward``.

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kvjax import attention
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import PagePool, Pages, slot_mapping, write_layer
from kvjax.model import recurrent
from kvjax.model.config import ModelConfig
from kvjax.model.rope import apply_rope

LogitsMode = Literal["last", "all", "none"]


@flax.struct.dataclass
class LayerParams:
    """Weights of one layer; optional ones are None.

    A recurrent layer (hybrid models) uses wq, wk, wv as [D, H*d] projections of queries,
    keys and values, plus ``decay_w``, ``decay_bias`` and ``state_norm``.
    """

    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [D, H*d]
    wk: jax.Array  # [D, h*d]
    wv: jax.Array  # [D, h*d]
    wo: jax.Array  # [H*d, D]
    ffn_norm: jax.Array  # [D]
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]
    bq: jax.Array | None = None  # [H*d], attention bias (Qwen2)
    bk: jax.Array | None = None  # [h*d]
    bv: jax.Array | None = None  # [h*d]
    q_norm: jax.Array | None = None  # [d]
    k_norm: jax.Array | None = None  # [d]
    post_attn_norm: jax.Array | None = None  # [D]
    post_ffn_norm: jax.Array | None = None  # [D]
    decay_w: jax.Array | None = None  # [D, H]
    decay_bias: jax.Array | None = None  # [H]
    state_norm: jax.Array | None = None  # [d]


@flax.struct.dataclass
class Params:
    embed: jax.Array  # [v, D], also the output projection unless lm_head is given
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [v, D], an untied output projection


def _present(weight: jax.Array | None, name: str) -> jax.Array:
    """An optional layer weight the model's config says it has (``LayerParams.<name>``)."""
    if weight is None:
        raise ValueError(f"LayerParams.{name} is None, but the model config uses it")
    return weight


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * weight).astype(x.dtype)


CONV_MAX_ROWS = 32
"""Products of at most this many rows run on CPU as width-1 convolutions (``linear``, ``unembed``)."""


def _as_convolution(x: jax.Array) -> bool:
    """Whether the rows of ``x`` (its leading axes) are few enough, on CPU, for the convolution form.

    XLA:CPU's dot is slow at few rows; the same product written as a width-1 convolution is
    rewritten by XLA into a dot of another operand order that streams the weight faster
    (measured on 2-core AVX2, 30 SmolLM2 layers' projections: 8 rows 38 vs 50 ms, and the
    batch-8 decode step 72 vs 87 ms). From ~64 rows on the plain dot is as fast or faster.
    """
    return x.size // x.shape[-1] <= CONV_MAX_ROWS and jax.default_backend() == "cpu"


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w``: activations [..., n_in] times a weight [n_in, n_out] -> [..., n_out] in x's dtype
    (n_in, n_out: the projection's widths, e.g. D and F)."""
    if not _as_convolution(x):
        return x @ w
    rows = x.reshape(1, -1, x.shape[-1])  # x's rows, flattened, as the convolution's width
    out = jax.lax.conv_general_dilated(rows, w[None], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    return out.reshape(*x.shape[:-1], w.shape[-1])


def unembed(h: jax.Array, embed: jax.Array) -> jax.Array:
    """The output projection: ``h`` [..., D] times ``embed`` [v, D] transposed -> [..., v] float32."""
    if not _as_convolution(h):
        return jnp.einsum("...d,vd->...v", h, embed, preferred_element_type=jnp.float32)
    kernel = h.reshape(-1, h.shape[-1]).T[None]  # [1, D, ...]: h's rows, flattened, as output channels
    out = jax.lax.conv_general_dilated(
        embed[None], kernel, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"), preferred_element_type=jnp.float32
    )  # [1, v, ...]
    return out[0].T.reshape(*h.shape[:-1], embed.shape[0])


def embed_tokens(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """[s, q] int32 -> [s, q, D]."""
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
      x: [s, q, D] residual stream entering the layer.
      positions: [s, q] absolute positions.

    Returns:
      q [s, q, H, d], k [s, q, h, d], v [s, q, h, d].
    """
    h = rms_norm(x, lp.attn_norm, cfg.rms_eps)
    q, k, v = (
        linear(h, w) if b is None else linear(h, w) + b
        for w, b in ((lp.wq, lp.bq), (lp.wk, lp.bk), (lp.wv, lp.bv))
    )
    q = q.reshape(*h.shape[:2], cfg.num_heads, cfg.head_dim)
    k = k.reshape(*h.shape[:2], cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*h.shape[:2], cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, _present(lp.q_norm, "q_norm"), cfg.rms_eps)
        k = rms_norm(k, _present(lp.k_norm, "k_norm"), cfg.rms_eps)
    theta, scaling = cfg.layer_rope_theta[layer], cfg.layer_rope_scaling[layer]
    return apply_rope(q, positions, theta, scaling), apply_rope(k, positions, theta, scaling), v


def finish_layer(lp: LayerParams, cfg: ModelConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection, residual, MLP, residual.

    Args:
      x: [s, q, D] residual stream entering the layer.
      attn: [s, q, H, d] attention output.

    Returns:
      [s, q, D] residual stream leaving the layer.
    """
    o = linear(attn.reshape(*attn.shape[:2], cfg.num_heads * cfg.head_dim), lp.wo)
    if cfg.sandwich_norm:
        o = rms_norm(o, _present(lp.post_attn_norm, "post_attn_norm"), cfg.rms_eps)
    x = x + o
    h = rms_norm(x, lp.ffn_norm, cfg.rms_eps)
    gate = linear(h, lp.w_gate)
    act = jax.nn.silu(gate) if cfg.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    m = linear(act * linear(h, lp.w_up), lp.w_down)
    if cfg.sandwich_norm:
        m = rms_norm(m, _present(lp.post_ffn_norm, "post_ffn_norm"), cfg.rms_eps)
    return x + m


def logits_of(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm and output projection (``lm_head``, else the tied embedding): [..., D] -> [..., v] float32."""
    h = rms_norm(x, params.final_norm, cfg.rms_eps)
    return unembed(h, params.embed if params.lm_head is None else params.lm_head)


def attend_layer(
    lp: LayerParams,
    cfg: ModelConfig,
    layout: CacheLayout,
    layer: int,
    pool_k: Pages,
    pool_v: Pages,
    x: jax.Array,
    positions: jax.Array,
    block_table: jax.Array,
    lengths: jax.Array,
    attn_impl: attention.Impl,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, Pages, Pages]:
    """One decoder layer: write this step's K/V into the layer's pages, attend, MLP.

    A one-token step (q = 1) is a decode step and runs the paged decode attention, whose
    query sits at ``lengths - 1``; longer steps run partial attention at ``positions``.

    Args:
      layer: layer index (static: window, RoPE base).
      pool_k, pool_v: [P, t, h, d] of this layer.
      x: [s, q, D]; positions: [s, q] (negative = padding).
      block_table: [s, p] of the layer's group; lengths: [s] KV lengths after the write.
      mesh: the device mesh the pool is sharded over (attention then runs per device, see
        ``kvjax.attention``); None = one device or GSPMD.

    Returns:
      (x leaving the layer [s, q, D], pool_k, pool_v).
    """
    q, k, v = qkv(lp, cfg, layer, x, positions)
    page_ids, offsets = slot_mapping(block_table, positions, layout.tokens_per_block)
    pool_k = write_layer(pool_k, page_ids, offsets, k)
    pool_v = write_layer(pool_v, page_ids, offsets, v)
    kv = attention.paged_kv(pool_k, pool_v, lengths, block_table)
    spec = attention.AttentionSpec(cfg.sm_scale, layout.window_of(layer))
    if q.shape[1] == 1:  # a decode step: each row's query is its sequence's newest token
        out = attention.paged_attention(q[:, 0], kv, spec, impl=attn_impl, mesh=mesh)[:, None]
    else:
        out = attention.partial_attention(q, positions, kv, spec, impl=attn_impl, mesh=mesh)
    return finish_layer(lp, cfg, x, out), pool_k, pool_v


def recurrent_layer(
    lp: LayerParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One recurrent decoder layer: gated linear attention over the state, MLP.

    Args:
      x: [s, q, D]; positions: [s, q] (negative = padding, which leaves the state unchanged).
      state: [s, H, d, d] float32, the layer's state before the step's first token.

    Returns:
      (x leaving the layer [s, q, D], state after the step's last valid token [s, H, d, d]).
    """
    h = rms_norm(x, lp.attn_norm, cfg.rms_eps)
    q, k, v, log_a = recurrent.projections(
        h, lp.wq, lp.wk, lp.wv, _present(lp.decay_w, "decay_w"), _present(lp.decay_bias, "decay_bias"), positions,
        cfg.num_heads, cfg.head_dim,
    )
    state, o = recurrent.scan(state, q, k, v, log_a)
    o = rms_norm(o, _present(lp.state_norm, "state_norm"), cfg.rms_eps).astype(x.dtype)  # [s, q, H, d]
    return finish_layer(lp, cfg, x, o), state


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "logits_mode", "attn_impl", "mesh", "exit_layer"),
    donate_argnames=("pool", "state"),
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
    mesh: Mesh | None = None,
    exit_layer: int | None = None,
    state: jax.Array | None = None,
) -> tuple[jax.Array | None, PagePool] | tuple[jax.Array | None, PagePool, jax.Array]:
    """Runs the step's tokens through the model, writing their K/V into the pool.

    Args:
      params: model weights.
      pool: the page pool (donated; the updated pool is returned).
      tokens: [s, q] int32 token ids (padding rows: any id).
      positions: [s, q] int32 absolute positions, increasing within a row; -1 = padding.
      block_tables: one [s, p] int32 table per layer group.
      lengths: [s] int32 KV length of each sequence after this step.
      logits_mode: "last" -> [s, v] at each row's last valid token; "all" -> [s, q, v];
        "none" -> None (prefill of a chunk that is not the last).
      mesh: the mesh ``pool`` is sharded over (``kvjax.distributed``): attention runs per
        device under ``shard_map``; None = unsharded.
      exit_layer: early exit (self-speculative drafting): run only layers ``[0, exit_layer)``,
        write K/V of those layers only, and apply the final norm and LM head to their output.
        None = every layer.
      state: hybrid models only (required there, else None): [R, s, H, d, d] float32, each
        row's recurrent state before its first token this step (donated). Each row's tokens
        must continue its state: the first valid position is the number of tokens the state
        has seen.

    Returns:
      (logits float32 or None, updated pool), and for a hybrid model the state after each
      row's last valid token as a third element.
    """
    _check_state(cfg, state)
    x, pool, carry = _run_layers(
        params, pool, embed_tokens(params, cfg, tokens), positions, block_tables, lengths, cfg=cfg, layout=layout,
        attn_impl=attn_impl, mesh=mesh, exit_layer=exit_layer, state=state, attend=attend_layer, recur=recurrent_layer,
    )
    logits = output_logits(params, cfg, x, positions, logits_mode)
    return (logits, pool, carry[0]) if carry else (logits, pool)


def _run_layers(
    params: Params,
    pool: PagePool,
    x: jax.Array,
    positions: jax.Array,
    block_tables: tuple[jax.Array, ...],
    lengths: jax.Array,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    attn_impl: attention.Impl,
    mesh: Mesh | None,
    exit_layer: int | None,
    state: jax.Array | None,
    attend: Callable[..., tuple[jax.Array, Pages, Pages]],
    recur: Callable[..., tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, PagePool, tuple[jax.Array, ...]]:
    """The decoder layers [0, exit_layer) of ``forward`` and ``forward_by_layer``: ``attend``
    (``attend_layer``'s signature, given the layer's ``layer_kind``) for attention layers,
    ``recur`` (``recurrent_layer``'s) for recurrent ones.

    Returns:
      (x leaving the last layer [S, T, D], the pool, () or (state [R, S, H, d, d],)).
    """
    pool_k, pool_v = list(pool.k), list(pool.v)
    states = [] if state is None else list(state)
    for layer, lp in enumerate(params.layers[:exit_layer]):
        if cfg.is_recurrent(layer):
            r = cfg.recurrent_layers.index(layer)
            x, states[r] = recur(lp, cfg, x, positions, states[r])
            continue
        x, pool_k[layer], pool_v[layer] = attend(
            lp, cfg, layout, layer_kind(cfg, layout, layer), pool_k[layer], pool_v[layer], x, positions,
            block_tables[layout.layer_group[layer]], lengths, attn_impl, mesh,
        )
    carry = () if state is None else (jnp.stack(states),)
    return x, PagePool(k=tuple(pool_k), v=tuple(pool_v)), carry


def _check_state(cfg: ModelConfig, state: jax.Array | None) -> None:
    if cfg.is_hybrid != (state is not None):
        raise ValueError(
            f"state must be given for a hybrid model and None otherwise; model {cfg.name!r} has "
            f"{len(cfg.recurrent_layers)} recurrent layer(s) and state is {'None' if state is None else 'given'}"
        )


def output_logits(
    params: Params, cfg: ModelConfig, x: jax.Array, positions: jax.Array, logits_mode: LogitsMode
) -> jax.Array | None:
    """The step's logits from the last layer's output ``x`` [s, q, D] (``forward``'s ``logits_mode``):
    [s, v] at each row's last valid position (``positions`` [s, q], -1 = padding), [s, q, v], or None."""
    if logits_mode == "none":
        return None
    if logits_mode == "all":
        return logits_of(params, cfg, x)
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)  # [s]
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [s, D]
    return logits_of(params, cfg, x_last)


def layer_kind(cfg: ModelConfig, layout: CacheLayout, layer: int) -> int:
    """The first layer with ``layer``'s static properties (recurrent or attention, sliding
    window, RoPE base and scaling): the layers of one kind share one compiled program in
    ``forward_by_layer`` (one kind in SmolLM2, local and global in Gemma 3)."""

    def key(i: int) -> tuple:
        return cfg.is_recurrent(i), layout.window_of(i), cfg.layer_rope_theta[i], cfg.layer_rope_scaling[i]

    return next(i for i in range(layer + 1) if key(i) == key(layer))


_embed_step = jax.jit(embed_tokens, static_argnames=("cfg",))
_logits_step = jax.jit(output_logits, static_argnames=("cfg", "logits_mode"))
_recurrent_step = jax.jit(recurrent_layer, static_argnames=("cfg",), donate_argnames=("state",))
_attend_step = jax.jit(
    attend_layer, static_argnames=("cfg", "layout", "layer", "attn_impl", "mesh"), donate_argnames=("pool_k", "pool_v")
)


def forward_by_layer(
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
    mesh: Mesh | None = None,
    exit_layer: int | None = None,
    state: jax.Array | None = None,
) -> tuple[jax.Array | None, PagePool] | tuple[jax.Array | None, PagePool, jax.Array]:
    """``forward``, dispatched as one compiled program per layer call: the embedding, each
    layer (one program per ``layer_kind``, each donating its layer's pages) and the head.

    Same arguments, results and contract as ``forward``. A new step shape compiles a layer
    once instead of the whole unrolled model: on a 2-core CPU (SmolLM2) 3-7x less compile time
    per shape (a 1,024-token prefill 1.0 s against 6.8 s, a batch-8 decode step 0.34 s against
    1.7 s) for 1-6% more run time from the per-layer dispatches, which is what a run of varied
    prompt lengths wants on CPU; ``forward`` (one program) keeps cross-layer fusion and one
    dispatch per step for accelerators (``COMPILE_UNITS``).
    """
    _check_state(cfg, state)
    outer = dataclasses.replace(params, layers=())  # what the embedding and the head read
    x, pool, carry = _run_layers(
        params, pool, _embed_step(outer, cfg, tokens), positions, block_tables, lengths, cfg=cfg, layout=layout,
        attn_impl=attn_impl, mesh=mesh, exit_layer=exit_layer, state=state, attend=_attend_step, recur=_recurrent_step,
    )
    logits = _logits_step(outer, cfg, x, positions, logits_mode)
    return (logits, pool, carry[0]) if carry else (logits, pool)


CompileUnit = Literal["auto", "model", "layer"]
COMPILE_UNITS: tuple[str, ...] = ("auto", "model", "layer")
"""How a step's forward compiles: "model" = ``forward`` (the whole model, one program per
step shape), "layer" = ``forward_by_layer`` (one program per layer kind), "auto" = "layer"
on CPU, where XLA's compile time dominates a run of varied shapes, else "model"."""


def forward_for(compile_unit: CompileUnit) -> Callable[..., tuple]:
    """The forward of ``compile_unit`` (``COMPILE_UNITS``), both with ``forward``'s signature.

    Raises:
      ValueError: an unknown compile unit.
    """
    if compile_unit not in COMPILE_UNITS:
        raise ValueError(f"compile_unit={compile_unit!r} must be one of {COMPILE_UNITS}")
    if compile_unit == "auto":
        compile_unit = "layer" if jax.default_backend() == "cpu" else "model"
    return forward_by_layer if compile_unit == "layer" else forward
