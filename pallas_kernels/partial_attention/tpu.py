"""Partial-token attention over a paged KV cache: Pallas TPU kernel.

Grid ``(num_seqs, num_kv_heads, num_query_blocks)``; every step owns one block of rows
(``block_q`` queries times the ``group`` query heads of one KV head) and walks the KV
blocks its rows can see, ``pages_per_block`` pages at a time::

    HBM  k_pages[page_indices[s, i*P + j], :, h, :]  --DMA-->  k_vmem_buffer[slot, j]
         block i+1 is copied into one slot while block i is read from the other.

Block tables, lengths and each query block's key range ``[start, end)`` are scalar-prefetched
into SMEM; K and V stay in HBM (``pl.ANY``). Grid steps share no state, so every grid
axis is parallel. Paged decode is the case ``num_queries == 1``.

Quantized (int8 / float8_e4m3fn) pages come with scales ``[num_pages, tokens_per_block or 1,
num_kv_heads]``, also left in HBM: each page's scales of the head are DMA'd beside its values
into ``[2, pages_per_block, tokens_per_block or 1]`` buffers and folded into the softmax step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.tuned_sizes import block_sizes

InterpretArg = bool | pltpu.InterpretParams


def _kernel(
    # Scalar prefetch (SMEM).
    lengths_ref,  # [num_seqs] int32
    page_indices_ref,  # [num_seqs * pages_per_seq_pad] int32, flattened block tables
    kv_start_ref,  # [num_seqs * num_query_blocks] int32, first visible slot of each block
    kv_end_ref,  # [num_seqs * num_query_blocks] int32, one past the last visible slot
    # Inputs.
    q_ref,  # [block_rows, head_dim]
    row_pos_ref,  # [block_rows, 1] int32
    k_pages_hbm_ref,  # [num_pages, tokens_per_block, num_kv_heads, head_dim]
    v_pages_hbm_ref,  # [num_pages, tokens_per_block, num_kv_heads, head_dim]
    *refs,
    pages_per_seq_pad: int,
    spec: common.AttentionSpec,
    quantized: bool,
):
    """``refs`` are, for float pages::

        o_ref  [block_rows, head_dim]; scratch k_vmem_buffer, v_vmem_buffer
        [2, pages_per_block, tokens_per_block, head_dim]; sems, DMA semaphores [2, 2] (k or v, slot)

    and for quantized pages::

        k_scales_hbm_ref, v_scales_hbm_ref [num_pages, tokens_per_block or 1, num_kv_heads]; o_ref;
        k_vmem_buffer, v_vmem_buffer; k_scale_vmem_buffer, v_scale_vmem_buffer
        [2, pages_per_block, tokens_per_block or 1]; sems [4, 2] (k, v, k scales, v scales; slot)
    """
    pairs: tuple[tuple[Any, Any], ...]  # (HBM ref, VMEM buffer) of every array copied in
    if quantized:
        (k_scales_hbm_ref, v_scales_hbm_ref, o_ref, k_vmem_buffer, v_vmem_buffer,
         k_scale_vmem_buffer, v_scale_vmem_buffer, sems) = refs
        pairs = (
            (k_pages_hbm_ref, k_vmem_buffer), (v_pages_hbm_ref, v_vmem_buffer),
            (k_scales_hbm_ref, k_scale_vmem_buffer), (v_scales_hbm_ref, v_scale_vmem_buffer),
        )
    else:
        o_ref, k_vmem_buffer, v_vmem_buffer, sems = refs
        pairs = ((k_pages_hbm_ref, k_vmem_buffer), (v_pages_hbm_ref, v_vmem_buffer))
    seq, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pages_per_block, tokens_per_block = k_vmem_buffer.shape[1], k_vmem_buffer.shape[2]
    block_k = pages_per_block * tokens_per_block
    block_rows, head_dim = q_ref.shape
    length = lengths_ref[seq]
    range_index = seq * pl.num_programs(2) + q_block
    kv_start, kv_end = kv_start_ref[range_index], kv_end_ref[range_index]
    first_block = kv_start // block_k
    end_block = jnp.where(kv_end > kv_start, pl.cdiv(kv_end, block_k), first_block)

    def block_copies(kv_block, slot) -> list:
        """The page DMAs of KV block ``kv_block`` into buffer ``slot`` (K, V, then their scales, per page)."""
        copies = []
        for j in range(pages_per_block):
            page = page_indices_ref[seq * pages_per_seq_pad + kv_block * pages_per_block + j]
            for which, (hbm_ref, vmem_buffer) in enumerate(pairs):
                src = hbm_ref.at[page, :, head]  # values [tokens_per_block, head_dim], scales [tokens_per_block or 1]
                copies.append(pltpu.make_async_copy(src, vmem_buffer.at[slot, j], sems.at[which, slot]))
        return copies

    @pl.when(first_block < end_block)
    def _prefetch_first():
        for copy in block_copies(first_block, 0):
            copy.start()

    q = q_ref[...]  # [block_rows, head_dim]
    row_pos = row_pos_ref[...]  # [block_rows, 1]

    def body(kv_block, carry):
        slot = (kv_block - first_block) % 2

        @pl.when(kv_block + 1 < end_block)
        def _prefetch_next():
            for copy in block_copies(kv_block + 1, 1 - slot):
                copy.start()

        for copy in block_copies(kv_block, slot):
            copy.wait()
        k = k_vmem_buffer[slot].reshape(block_k, head_dim)
        v = v_vmem_buffer[slot].reshape(block_k, head_dim)
        scales = {}
        if quantized:
            shape = (pages_per_block, tokens_per_block)
            scales = dict(
                k_scale=jnp.broadcast_to(k_scale_vmem_buffer[slot], shape).reshape(1, block_k),
                v_scale=jnp.broadcast_to(v_scale_vmem_buffer[slot], shape).reshape(1, block_k),
            )
        key_row = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, block_k]
        key_col = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [block_k, 1]
        visible = common.visible_mask(row_pos, key_row, length, spec.sliding_window)
        key_live = (key_col >= kv_start) & (key_col < kv_end)
        return common.softmax_step(carry, q, k, v, visible, key_live, spec=spec, **scales)

    _, l, acc = lax.fori_loop(first_block, end_block, body, common.initial_carry((block_rows,), head_dim))
    o_ref[...] = common.finish(l, acc).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("spec", "block_q", "pages_per_block", "interpret"))
def partial_attention(
    q: jax.Array,
    q_positions: jax.Array,
    kv: common.PagedKV,
    spec: common.AttentionSpec,
    *,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret: InterpretArg = False,
) -> jax.Array:
    """Query rows at absolute positions over paged KV, on TPU.

    Args:
      q, q_positions, kv, spec: the attention arguments (``pallas_kernels.common.check_inputs``);
        pages and scales stay in HBM.
      block_q: queries per grid step (rows = block_q * group); None = tuned table.
      pages_per_block: pages per DMA'd KV block; None = tuned table.
      interpret: False on TPU; True or ``pltpu.InterpretParams()`` to run on CPU.

    Returns:
      [num_seqs, num_queries, num_heads, head_dim] in q's dtype.
    """
    common.check_inputs(q, q_positions, kv)
    k_pages, v_pages, lengths, page_indices, scale_args = kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices, kv.scales
    quantized = bool(scale_args)
    num_seqs, num_queries, num_heads, head_dim = q.shape
    _, tokens_per_block, num_kv_heads, _ = k_pages.shape
    tuned = block_sizes("tpu", "partial")
    block_q = tuned.block_q if block_q is None else block_q
    pages_per_block = tuned.pages_per_block(tokens_per_block) if pages_per_block is None else pages_per_block
    if block_q < 1:
        raise ValueError(f"{block_q=} must be >= 1")
    if pages_per_block < 1:
        raise ValueError(f"{pages_per_block=} must be >= 1")
    group = num_heads // num_kv_heads
    block_q = min(block_q, num_queries)
    num_query_blocks = pl.cdiv(num_queries, block_q)
    num_queries_pad = num_query_blocks * block_q
    block_rows = block_q * group
    if num_query_blocks > 1 and block_rows % 8:
        raise ValueError(f"{block_q=} times {group=} must be a multiple of 8 (TPU sublanes) when it splits the queries")
    pages_per_block = min(pages_per_block, page_indices.shape[1])
    pages_per_seq_pad = pl.cdiv(page_indices.shape[1], pages_per_block) * pages_per_block

    rows = common.to_rows(q, num_kv_heads, group, num_queries_pad)  # [s, h, R, d]
    row_pos = common.row_positions(q_positions, group, num_queries_pad)  # [s, R]
    kv_start, kv_end = common.kv_token_range(
        row_pos.reshape(num_seqs, num_query_blocks, block_rows), lengths[:, None], spec.sliding_window
    )  # [s, num_query_blocks] each
    table = common.pad_page_table(page_indices, pages_per_seq_pad).reshape(-1)

    kernel = functools.partial(_kernel, pages_per_seq_pad=pages_per_seq_pad, spec=spec, quantized=quantized)
    scratch = [
        pltpu.VMEM((2, pages_per_block, tokens_per_block, head_dim), k_pages.dtype),
        pltpu.VMEM((2, pages_per_block, tokens_per_block, head_dim), v_pages.dtype),
    ]
    if quantized:
        scratch += [pltpu.VMEM((2, pages_per_block, scale_args[0].shape[1]), jnp.float32)] * 2
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_seqs, num_kv_heads, num_query_blocks),
            in_specs=[
                pl.BlockSpec((None, None, block_rows, head_dim), lambda s, h, b, *_: (s, h, b, 0)),
                pl.BlockSpec((None, block_rows, 1), lambda s, h, b, *_: (s, b, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
                *[pl.BlockSpec(memory_space=pl.ANY) for _ in scale_args],
            ],
            out_specs=pl.BlockSpec((None, None, block_rows, head_dim), lambda s, h, b, *_: (s, h, b, 0)),
            scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA((4 if quantized else 2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="partial_attention_tpu",
    )(lengths, table, kv_start.reshape(-1), kv_end.reshape(-1), rows, row_pos[..., None], k_pages, v_pages, *scale_args)
    return common.from_rows(out, num_queries, group, group)
