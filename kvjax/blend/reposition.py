"""RoPE repositioning of stored chunk keys.

A chunk's KV is precomputed with the chunk starting at ``stored_start`` (0, 1 behind BOS,
or the length of the shared system prompt). RoPE rotations compose, so moving the chunk
to ``actual_start`` only needs every stored key rotated by ``actual_start - stored_start``;
values carry no position and are reused unchanged. The rotated keys equal keys computed
at the new positions exactly (up to float error) at layer 0, where a key depends only on
its token and position; deeper layers still differ by the missing cross-chunk attention,
which is what selective recompute repairs.

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import jax

from kvjax.model.config import ModelConfig
from kvjax.model.rope import RopeScaling, apply_rope


def reposition_keys(keys: jax.Array, deltas: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotates stored keys by per-token position deltas.

    Args:
      keys: [..., T, h, d] keys rotated for their stored positions.
      deltas: [..., T] int32, actual position - stored position of each token.
      theta: RoPE base of the keys' layer.
      scaling: RoPE scaling of the keys' layer (``ModelConfig.layer_rope_scaling``).

    Returns:
      [..., T, h, d] keys as if computed at the actual positions.
    """
    return apply_rope(keys, deltas, theta, scaling)


def reposition_layers(
    cfg: ModelConfig, keys: tuple[jax.Array, ...], deltas: jax.Array
) -> tuple[jax.Array, ...]:
    """``reposition_keys`` for every layer, each with its own RoPE base and scaling.

    Args:
      keys: one [..., T, h, d] array per layer.
      deltas: [..., T] int32 position deltas shared by all layers.
    """
    if len(keys) != cfg.num_layers:
        raise ValueError(f"got keys for {len(keys)} layers; the model has num_layers={cfg.num_layers}")
    return tuple(
        reposition_keys(k, deltas, cfg.layer_rope_theta[layer], cfg.layer_rope_scaling[layer])
        for layer, k in enumerate(keys)
    )
