"""Plain-jnp reference of paged decode attention (one query token per sequence)."""

from __future__ import annotations

import jax

from pallas_kernels.common import AttentionSpec, PagedKV
from pallas_kernels.partial_attention.reference import partial_attention_ref


def paged_attention_ref(q: jax.Array, kv: PagedKV, spec: AttentionSpec) -> jax.Array:
    """Decode attention: the newest token of each sequence attends over its pages.

    Args:
      q, kv, spec: the attention arguments of decode (``pallas_kernels.common.check_inputs``;
        the reference does not check them).

    Returns:
      [num_seqs, num_heads, head_dim].
    """
    q_positions = (kv.lengths - 1)[:, None]  # [s, 1]
    return partial_attention_ref(q[:, None], q_positions, kv, spec)[:, 0]
