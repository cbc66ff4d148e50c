"""Plain-jnp reference of paged decode attention (one query token per sequence)."""

from __future__ import annotations

import jax

from pallas_kernels.partial_attention.reference import partial_attention_ref


def paged_attention_ref(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Decode attention: the newest token of each sequence attends over its pages.

    Args:
      q, k_pages, v_pages, lengths, page_indices, sm_scale, sliding_window, logit_soft_cap,
        k_scales, v_scales: the attention arguments of decode
        (``pallas_kernels.common.check_inputs``; the reference does not check them).

    Returns:
      [num_seqs, num_heads, head_dim].
    """
    q_positions = (lengths - 1)[:, None]  # [s, 1]
    out = partial_attention_ref(
        q[:, None],
        q_positions,
        k_pages,
        v_pages,
        lengths,
        page_indices,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    return out[:, 0]
