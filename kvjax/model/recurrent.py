"""The recurrent token mixer of hybrid models: gated linear attention with a scalar decay per head.

A recurrent layer replaces attention by a linear recurrence over a per-sequence state
(the selective state space form of Mamba-2 with a scalar decay per head)::

    a_t   = exp(-softplus(h_t @ decay_w + decay_bias))     # [H], in (0, 1)
    S_t   = a_t * S_{t-1} + k_t^T v_t                      # [H, d, d]
    o_t   = q_t @ S_t                                      # [H, d]

with q, k, v per head projected from the normed residual stream (k scaled by d^-1/2, no
RoPE, no q/k norm). The state is the only memory of the layer: there is no KV cache, and a
sequence resumes exactly from any saved state.

Prefill rows run the chunked form: inside a chunk of c tokens the outputs are a masked,
decay-weighted attention over the chunk plus the contribution of the state entering it; a
``lax.scan`` carries the state from chunk to chunk. A decode step is the one-step recurrence
(a chunk of one token). Both compute in float32.

Axis letters are ``kvjax/axes.py``'s (the heads are H, of width d for keys and values
alike); the chunked form's einsums name a chunk's query and key tokens t and u and the value
width e.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64
"""Tokens per chunk of the chunked form (steps of at most CHUNK tokens run as one chunk)."""


def projections(
    h: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    decay_w: jax.Array,
    decay_bias: jax.Array,
    positions: jax.Array,
    num_heads: int,
    head_dim: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Queries, keys, values and log decays of one recurrent layer, padding neutralised.

    Args:
      h: [s, q, D] normed residual stream.
      wq, wk, wv: [D, H*d]; decay_w: [D, H]; decay_bias: [H].
      positions: [s, q] (negative = padding: its decay is 1 and its key 0, so it leaves the
        state unchanged).

    Returns:
      q, k, v [s, q, H, d] float32 and log_a [s, q, H] float32 (<= 0).
    """
    s, t, _ = h.shape
    hf = h.astype(jnp.float32)
    q = (hf @ wq.astype(jnp.float32)).reshape(s, t, num_heads, head_dim)
    k = (hf @ wk.astype(jnp.float32)).reshape(s, t, num_heads, head_dim) * head_dim**-0.5
    v = (hf @ wv.astype(jnp.float32)).reshape(s, t, num_heads, head_dim)
    log_a = -jax.nn.softplus(hf @ decay_w.astype(jnp.float32) + decay_bias.astype(jnp.float32))  # [s, q, H]
    valid = positions >= 0  # [s, q]
    log_a = jnp.where(valid[..., None], log_a, 0.0)
    k = jnp.where(valid[..., None, None], k, 0.0)
    return q, k, v, log_a


def _chunk(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, log_a: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One chunk: state [s, H, d, d], q/k/v [s, c, H, d], log_a [s, c, H] -> (state, o [s, c, H, d])."""
    c = q.shape[1]
    b = jnp.cumsum(log_a, axis=1)  # [s, c, H], log of the decay from the chunk start to t
    bh = jnp.moveaxis(b, 1, 2)  # [s, H, c]
    causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]  # [c, c]: query token t, key token u
    gap = jnp.where(causal, bh[..., :, None] - bh[..., None, :], -jnp.inf)  # [s, H, c, c]
    scores = jnp.einsum("sthd,suhd->shtu", q, k) * jnp.exp(gap)
    o = jnp.einsum("shtu,suhe->sthe", scores, v)
    o = o + jnp.einsum("sthd,shde->sthe", q * jnp.exp(b)[..., None], state)
    last = b[:, -1]  # [s, H]
    carried = k * jnp.exp(last[:, None] - b)[..., None]  # [s, c, H, d]
    state = jnp.exp(last)[..., None, None] * state + jnp.einsum("suhd,suhe->shde", carried, v)
    return state, o


def scan(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, log_a: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The recurrence over a step's tokens in chunks of ``CHUNK``.

    Args:
      state: [s, H, d, d] float32 entering the step.
      q, k, v: [s, q, H, d] float32; log_a: [s, q, H] float32.

    Returns:
      (state after the step [s, H, d, d], outputs [s, q, H, d]).
    """
    s, t, h, d = q.shape
    if t <= CHUNK:
        return _chunk(state, q, k, v, log_a)
    n = -(-t // CHUNK)
    pad = n * CHUNK - t  # padded tokens: decay 1, key 0, so the state passes through unchanged
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    log_a = jnp.pad(log_a, ((0, 0), (0, pad), (0, 0)))

    def chunks(x: jax.Array) -> jax.Array:  # [s, n*c, ...] -> [n, s, c, ...]
        return jnp.moveaxis(x.reshape(s, n, CHUNK, *x.shape[2:]), 1, 0)

    state, o = jax.lax.scan(lambda st, xs: _chunk(st, *xs), state, (chunks(q), chunks(k), chunks(v), chunks(log_a)))
    o = jnp.moveaxis(o, 0, 1).reshape(s, n * CHUNK, h, d)  # [s, n*c, H, d]
    return state, o[:, :t]
