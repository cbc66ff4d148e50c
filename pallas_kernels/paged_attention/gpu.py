"""Paged decode attention: Pallas Triton GPU kernel with split-KV (flash-decoding).

Grid ``(num_seqs, num_kv_heads, k_splits)``. A program takes the query heads of one KV head
(padded to a power of two, at least 16 rows for ``tl.dot``) and one contiguous share of the
sequence's block table, gathers ``pages_per_block`` pages per loop step from the pool and
keeps an online softmax. The shares are merged afterwards by their log-sum-exp::

    table[s]  |-- split 0 --|-- split 1 --|-- ... --|      each split: (acc, m, l)
    out = sum_k exp(m_k - m) acc_k / sum_k exp(m_k - m) l_k,   m = max_k m_k

Splitting keeps every SM busy at small batch; at large batch ``k_splits`` drops to 1.
``tokens_per_block`` and ``head_dim`` must be powers of two (Triton tiles).
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
    q_ref,  # [rows, head_dim]
    k_pages_ref,  # [num_pages, tokens_per_block, head_dim], this program's KV head
    v_pages_ref,  # [num_pages, tokens_per_block, head_dim]
    page_indices_ref,  # [pages_per_split] int32, this split's share of the block table
    lengths_ref,  # [1] int32
    *refs,
    pages_per_block: int,
    spec: common.AttentionSpec,
):
    # refs: quantized pages' k_scales_ref, v_scales_ref [num_pages, tokens_per_block or 1] (this KV
    # head), then acc_ref [rows, head_dim] float32 (unnormalised numerator), m_ref [rows] float32
    # (running max), l_ref [rows] float32 (denominator).
    *scale_refs, acc_ref, m_ref, l_ref = refs
    split = pl.program_id(2)
    rows, head_dim = q_ref.shape
    tokens_per_block = k_pages_ref.shape[1]
    pages_per_split = page_indices_ref.shape[0]
    block_k = pages_per_block * tokens_per_block
    split_start = split * pages_per_split * tokens_per_block
    length = lengths_ref[0]
    kv_start = 0 if spec.sliding_window is None else jnp.maximum(length - spec.sliding_window, 0)
    first_block = jnp.maximum(kv_start - split_start, 0) // block_k
    end_block = jnp.clip(pl.cdiv(length - split_start, block_k), first_block, pages_per_split // pages_per_block)
    q = q_ref[...]
    row_pos = jnp.full((rows, 1), length - 1, jnp.int32)

    def body(kv_block, carry):
        pages = page_indices_ref[pl.ds(kv_block * pages_per_block, pages_per_block)]  # [pages_per_block]
        k = k_pages_ref[pages].reshape(block_k, head_dim)
        v = v_pages_ref[pages].reshape(block_k, head_dim)
        key_pos = split_start + kv_block * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        visible = common.visible_mask(row_pos, key_pos[None, :], length, spec.sliding_window)
        key_live = ((key_pos >= kv_start) & (key_pos < length))[:, None]
        return common.softmax_step(
            carry, q, k, v, visible, key_live, spec=spec,
            **gather_scales(scale_refs, pages, tokens_per_block),
        )

    m, l, acc = lax.fori_loop(first_block, end_block, body, common.initial_carry((rows,), head_dim))
    acc_ref[...] = acc
    m_ref[...] = m.reshape(rows)
    l_ref[...] = l.reshape(rows)


def choose_k_splits(num_seqs: int, num_kv_heads: int, num_blocks: int, min_programs: int) -> int:
    """Smallest power-of-two split count giving ``min_programs`` programs, at most ``num_blocks``."""
    k_splits = 1
    while num_seqs * num_kv_heads * k_splits < min_programs and 2 * k_splits <= num_blocks:
        k_splits *= 2
    return k_splits


@functools.partial(
    jax.jit, static_argnames=("spec", "pages_per_block", "k_splits", "num_warps", "num_stages", "interpret")
)
def paged_attention(
    q: jax.Array,
    kv: common.PagedKV,
    spec: common.AttentionSpec,
    *,
    pages_per_block: int | None = None,
    k_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention on GPU: the newest token of each sequence over its pages.

    Args:
      q, kv, spec: the attention arguments of decode (``pallas_kernels.common.check_inputs``).
      pages_per_block: pages gathered per loop step (power of two); None = tuned table.
      k_splits: shares each table is split into (power of two); None = enough for
        the tuned ``min_programs``.
      num_warps, num_stages: Triton launch parameters; None = tuned table.
      interpret: run on CPU with the Pallas interpreter.

    Returns:
      [num_seqs, num_heads, head_dim] in q's dtype.
    """
    common.check_inputs(q, None, kv)
    k_pages, page_indices, scale_args = kv.k_pages, kv.page_indices, kv.scales
    num_seqs, num_heads, head_dim = q.shape
    num_pages, tokens_per_block, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    tuned = block_sizes("gpu", "decode")
    pages_per_block = tuned.pages_per_block(tokens_per_block) if pages_per_block is None else pages_per_block
    check_gpu_shapes(tokens_per_block, head_dim, pages_per_block)
    num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    if k_splits is None:
        k_splits = choose_k_splits(num_seqs, num_kv_heads, num_blocks, tuned.min_programs)
    if not is_power_of_two(k_splits):
        raise ValueError(f"{k_splits=} must be a power of two")
    pages_per_split = pl.next_power_of_2(pl.cdiv(num_blocks, k_splits)) * pages_per_block
    group = num_heads // num_kv_heads
    rows = max(pl.next_power_of_2(group), MIN_DOT_ROWS)

    q_rows = common.to_rows(q[:, None], num_kv_heads, rows, 1)  # [s, h, rows, d]
    table = common.pad_page_table(page_indices, k_splits * pages_per_split)
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, spec=spec)
    partial_shape = (k_splits, num_seqs, num_kv_heads, rows)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, k_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, k: (s, h, 0, 0)),
            pl.BlockSpec((num_pages, tokens_per_block, None, head_dim), lambda s, h, k: (0, 0, h, 0)),
            pl.BlockSpec((num_pages, tokens_per_block, None, head_dim), lambda s, h, k: (0, 0, h, 0)),
            pl.BlockSpec((None, pages_per_split), lambda s, h, k: (s, k)),
            pl.BlockSpec((None, 1), lambda s, h, k: (s, 0)),
            *[pl.BlockSpec((num_pages, a.shape[1], None), lambda s, h, k: (0, 0, h)) for a in scale_args],
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, k: (k, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (k, s, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (k, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or tuned.num_warps, num_stages=num_stages or tuned.num_stages
        ),
        interpret=interpret,
        name="paged_attention_gpu",
    )(q_rows, k_pages, kv.v_pages, table, kv.lengths[:, None], *scale_args)

    m_all = jnp.max(m, axis=0)  # [s, h, rows]
    weight = jnp.exp(m - m_all)  # [k_splits, s, h, rows]
    l_all = jnp.sum(weight * l, axis=0)[..., None]  # [s, h, rows, 1]
    acc_all = jnp.sum(weight[..., None] * acc, axis=0)  # [s, h, rows, d]
    out = common.finish(l_all, acc_all).astype(q.dtype)
    return common.from_rows(out, 1, group, rows)[:, 0]
