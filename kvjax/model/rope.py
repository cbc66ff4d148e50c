"""Rotary position embeddings, half-rotation layout (as in HF Llama), with RoPE scaling.

Rotations compose: rotating a key computed at position p by delta gives the key at
p + delta, which is how CacheBlend moves a stored chunk to a new start: the rotated keys equal
keys computed at the new positions, up to float error. Scaling changes only the frequencies,
so this holds with it too.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_SCALINGS = ("linear", "llama3")
"""Supported ``RopeScaling.kind`` values (Hugging Face ``rope_scaling.rope_type``)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of a long-context model (hashable: part of the static ``ModelConfig``).

    Attributes:
      kind: "linear" (every frequency divided by ``factor``: position interpolation) or
        "llama3" (Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth
        blend between, by wavelength against ``original_max_positions``).
      factor: the scale factor, > 0.
      low_freq_factor, high_freq_factor: llama3's band edges (wavelengths longer than
        ``original_max_positions / low_freq_factor`` are scaled, shorter than
        ``original_max_positions / high_freq_factor`` kept).
      original_max_positions: llama3's pre-extension context length, in tokens.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling kind={self.kind!r} must be one of {ROPE_SCALINGS}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor={self.factor!r} must be > 0")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs 0 < low_freq_factor={self.low_freq_factor} < "
                f"high_freq_factor={self.high_freq_factor}"
            )


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The rotation frequencies [head_dim / 2] float32, in radians per position."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponents)  # float32 throughout, as HF computes it
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    wavelen = np.float32(2 * math.pi) / inv_freq
    old = np.float32(scaling.original_max_positions)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen >= old / scaling.high_freq_factor) & (wavelen <= old / scaling.low_freq_factor)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotates ``x`` by ``positions``.

    Args:
      x: [..., num_tokens, num_heads, head_dim].
      positions: [..., num_tokens] int32 (or float) positions or position deltas.
      theta: RoPE base.
      scaling: the model's frequency scaling of this layer (None = plain RoPE).

    Returns:
      x rotated, same shape and dtype.
    """
    inv_freq = jnp.asarray(inv_frequencies(x.shape[-1], theta, scaling))  # [d/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., t, d/2]
    cos = jnp.cos(angles)[..., None, :]  # [..., t, 1, d/2]
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
