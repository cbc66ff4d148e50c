"""Partial-token attention over a paged KV cache: Pallas Triton GPU kernel.

Grid ``(num_seqs, num_kv_heads, num_query_blocks)``; each program owns ``block_q`` queries
times the (power-of-two padded) query heads of one KV head and loops over the KV blocks its
rows can see, gathering ``pages_per_block`` pages per step straight from the pool through
the block table. Triton wants power-of-two tensor sizes, so ``tokens_per_block`` and
``head_dim`` must be powers of two, ``head_dim`` and a KV block at least 16 (the smallest
``tl.dot``); query heads per KV head are padded to a power of two, and rows to at least 16.

Written for Pallas Triton (``pallas_call`` + ``plgpu.CompilerParams``), which upstream has
deprecated in favour of Mosaic GPU, because it runs on CPU under the generic Pallas
interpreter (``interpret=True``). A Mosaic GPU port (TMA page copies, warpgroup matmuls)
would keep this signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.gpu_common import MIN_DOT_ROWS, check_gpu_shapes, gather_scales, is_power_of_two
from pallas_kernels.tuned_sizes import block_sizes


def _kernel(
    q_ref,  # [block_rows, head_dim]
    row_pos_ref,  # [block_rows] int32
    k_pages_ref,  # [num_pages, tokens_per_block, head_dim], this program's KV head
    v_pages_ref,  # [num_pages, tokens_per_block, head_dim]
    page_indices_ref,  # [pages_per_seq_pad] int32
    lengths_ref,  # [1] int32
    *refs,  # quantized: k_scales_ref, v_scales_ref [num_pages, tokens_per_block or 1]; o_ref [block_rows, head_dim]
    pages_per_block: int,
    spec: common.AttentionSpec,
):
    *scale_refs, o_ref = refs
    block_rows, head_dim = q_ref.shape
    tokens_per_block = k_pages_ref.shape[1]
    block_k = pages_per_block * tokens_per_block
    length = lengths_ref[0]
    q = q_ref[...]
    row_pos = row_pos_ref[...]  # [block_rows]
    kv_start, kv_end = common.kv_token_range(row_pos, length, spec.sliding_window)
    first_block = kv_start // block_k
    end_block = jnp.where(kv_end > kv_start, pl.cdiv(kv_end, block_k), first_block)
    row_pos = row_pos[:, None]  # [block_rows, 1]

    def body(kv_block, carry):
        pages = page_indices_ref[pl.ds(kv_block * pages_per_block, pages_per_block)]  # [pages_per_block]
        k = k_pages_ref[pages].reshape(block_k, head_dim)
        v = v_pages_ref[pages].reshape(block_k, head_dim)
        key_pos = kv_block * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        visible = common.visible_mask(row_pos, key_pos[None, :], length, spec.sliding_window)
        key_live = ((key_pos >= kv_start) & (key_pos < kv_end))[:, None]
        return common.softmax_step(
            carry, q, k, v, visible, key_live, spec=spec,
            **gather_scales(scale_refs, pages, tokens_per_block),
        )

    _, l, acc = lax.fori_loop(first_block, end_block, body, common.initial_carry((block_rows,), head_dim))
    o_ref[...] = common.finish(l, acc).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("spec", "block_q", "pages_per_block", "num_warps", "num_stages", "interpret")
)
def partial_attention(
    q: jax.Array,
    q_positions: jax.Array,
    kv: common.PagedKV,
    spec: common.AttentionSpec,
    *,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Query rows at absolute positions over paged KV, on GPU (Pallas Triton).

    Args:
      q, q_positions, kv, spec: the attention arguments (``pallas_kernels.common.check_inputs``).
      block_q: queries per program, a power of two; None = tuned table.
      pages_per_block: pages gathered per loop step, a power of two; None = tuned table.
      num_warps, num_stages: Triton launch parameters; None = tuned table.
      interpret: run on CPU with the Pallas interpreter.

    Returns:
      [num_seqs, num_queries, num_heads, head_dim] in q's dtype.
    """
    common.check_inputs(q, q_positions, kv)
    k_pages, page_indices, scale_args = kv.k_pages, kv.page_indices, kv.scales
    num_seqs, num_queries, num_heads, head_dim = q.shape
    num_pages, tokens_per_block, num_kv_heads, _ = k_pages.shape
    tuned = block_sizes("gpu", "partial")
    block_q = tuned.block_q if block_q is None else block_q
    pages_per_block = tuned.pages_per_block(tokens_per_block) if pages_per_block is None else pages_per_block
    check_gpu_shapes(tokens_per_block, head_dim, pages_per_block)
    if not is_power_of_two(block_q):
        raise ValueError(f"{block_q=} must be a power of two")
    group = num_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    block_q = max(min(block_q, pl.next_power_of_2(num_queries)), pl.cdiv(MIN_DOT_ROWS, group_pad))
    block_rows = block_q * group_pad
    num_query_blocks = pl.cdiv(num_queries, block_q)
    pages_per_seq_pad = pl.next_power_of_2(pl.cdiv(page_indices.shape[1], pages_per_block)) * pages_per_block

    rows = common.to_rows(q, num_kv_heads, group_pad, num_query_blocks * block_q)  # [s, h, R, d]
    row_pos = common.row_positions(q_positions, group_pad, num_query_blocks * block_q)  # [s, R]
    table = common.pad_page_table(page_indices, pages_per_seq_pad)  # [s, pages_per_seq_pad]

    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, spec=spec)
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_query_blocks),
        in_specs=[
            pl.BlockSpec((None, None, block_rows, head_dim), lambda s, h, b: (s, h, b, 0)),
            pl.BlockSpec((None, block_rows), lambda s, h, b: (s, b)),
            pl.BlockSpec((num_pages, tokens_per_block, None, head_dim), lambda s, h, b: (0, 0, h, 0)),
            pl.BlockSpec((num_pages, tokens_per_block, None, head_dim), lambda s, h, b: (0, 0, h, 0)),
            pl.BlockSpec((None, pages_per_seq_pad), lambda s, h, b: (s, 0)),
            pl.BlockSpec((None, 1), lambda s, h, b: (s, 0)),
            *[pl.BlockSpec((num_pages, a.shape[1], None), lambda s, h, b: (0, 0, h)) for a in scale_args],
        ],
        out_specs=pl.BlockSpec((None, None, block_rows, head_dim), lambda s, h, b: (s, h, b, 0)),
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or tuned.num_warps, num_stages=num_stages or tuned.num_stages
        ),
        interpret=interpret,
        name="partial_attention_gpu",
    )(rows, row_pos, k_pages, kv.v_pages, table, kv.lengths[:, None], *scale_args)
    return common.from_rows(out, num_queries, group, group_pad)
