"""Pieces shared by the Pallas Triton GPU kernels (decode and partial): Triton's tiling
limits and the per-block gather of quantized pages' scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_DOT_ROWS = 16
"""Smallest ``tl.dot`` operand side: query rows, ``head_dim`` and a KV block are at least this."""


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, ..."""
    return n >= 1 and n & (n - 1) == 0


def check_gpu_shapes(tokens_per_block: int, head_dim: int, pages_per_block: int) -> None:
    """Raises ValueError unless Triton can tile the sizes: powers of two, dot dims >= 16."""
    sizes = (("tokens_per_block", tokens_per_block), ("head_dim", head_dim), ("pages_per_block", pages_per_block))
    for name, value in sizes:
        if not is_power_of_two(value):
            raise ValueError(f"{name}={value} must be a power of two for the Triton GPU kernel")
    if head_dim < MIN_DOT_ROWS:
        raise ValueError(f"{head_dim=} must be >= {MIN_DOT_ROWS} (smallest tl.dot) for the Triton GPU kernel")
    if pages_per_block * tokens_per_block < MIN_DOT_ROWS:
        raise ValueError(
            f"{pages_per_block=} times {tokens_per_block=} must be >= {MIN_DOT_ROWS} (smallest tl.dot) "
            "for the Triton GPU kernel"
        )


def gather_scales(scale_refs: list, pages: jax.Array, tokens_per_block: int) -> dict[str, jax.Array]:
    """The softmax step's ``k_scale`` / ``v_scale`` [1, block_k] for ``pages`` [p] (none for float pages).

    Args:
      scale_refs: [] or [k_scales_ref, v_scales_ref], each [num_pages, tokens_per_block or 1]
        (one KV head).
    """
    if not scale_refs:
        return {}
    k_scales_ref, v_scales_ref = scale_refs
    shape = (pages.shape[0], tokens_per_block)
    row = lambda ref: jnp.broadcast_to(ref[pages], shape).reshape(1, shape[0] * tokens_per_block)
    return {"k_scale": row(k_scales_ref), "v_scale": row(v_scales_ref)}
