"""Rotary position embeddings, half-rotation layout (as in HF Llama).

Rotations compose: rotating a key computed at position p by delta gives the key at
p + delta, which is how CacheBlend moves a stored chunk to a new start: the rotated keys equal
keys computed at the new positions, up to float error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotates ``x`` by ``positions``.

    Args:
      x: [..., num_tokens, num_heads, head_dim].
      positions: [..., num_tokens] int32 (or float) positions or position deltas.
      theta: RoPE base.

    Returns:
      x rotated, same shape and dtype.
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [d/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., t, d/2]
    cos = jnp.cos(angles)[..., None, :]  # [..., t, 1, d/2]
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
