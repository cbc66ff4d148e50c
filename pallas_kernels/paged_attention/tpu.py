"""Paged decode attention: Pallas TPU kernel.

Decode is partial-token attention with one query row per sequence at ``length - 1``, so it
runs the TPU kernel of ``pallas_kernels.partial_attention.tpu``: grid
``(num_seqs, num_kv_heads, 1)``, the ``group`` query heads of a KV head as rows, block tables
scalar-prefetched into SMEM and K/V pages DMA'd from HBM into a double-buffered VMEM scratch.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import common
from pallas_kernels.partial_attention import tpu as partial_tpu
from pallas_kernels.tuned_sizes import block_sizes


@functools.partial(jax.jit, static_argnames=("spec", "pages_per_block", "interpret"))
def paged_attention(
    q: jax.Array,
    kv: common.PagedKV,
    spec: common.AttentionSpec,
    *,
    pages_per_block: int | None = None,
    interpret: partial_tpu.InterpretArg = False,
) -> jax.Array:
    """Decode attention on TPU: the newest token of each sequence over its pages.

    Args:
      q, kv, spec: the attention arguments of decode (``pallas_kernels.common.check_inputs``);
        pages and scales stay in HBM.
      pages_per_block: pages per DMA'd KV block; None = tuned table.
      interpret: False on TPU; True or ``pltpu.InterpretParams()`` to run on CPU.

    Returns:
      [num_seqs, num_heads, head_dim] in q's dtype.
    """
    common.check_inputs(q, None, kv)
    if pages_per_block is None:
        pages_per_block = block_sizes("tpu", "decode").pages_per_block(kv.k_pages.shape[1])
    out = partial_tpu.partial_attention(
        q[:, None], (kv.lengths - 1)[:, None], kv, spec, block_q=1, pages_per_block=pages_per_block, interpret=interpret
    )
    return out[:, 0]
