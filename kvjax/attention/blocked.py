"""Blocked (flash-style) partial-token attention in plain XLA, for backends without a Pallas
kernel (CPU).

Same contract as ``partial_attention_ref``, computed the way the kernels compute it: query
rows in blocks of ``block_q``, and for each query block an online softmax over key blocks
of ``block_k`` slots, with the kernels' own step (``pallas_kernels.common.softmax_step``). The loop's trip count is
dynamic: a query block visits only the key
blocks between its lowest visible position (the sliding window) and its highest query
position, so the attention work follows the causal triangle and the sequence's actual
length, not the block table's width (only the one gather of each sequence's page run
follows the width). No ``[q, k]`` score matrix wider than one key block is materialised.
Key blocks that every valid row sees whole (below the lowest query position, inside the
highest one's window: all but the diagonal blocks of a prefill) run without building a mask;
a call with one key block runs no loop. Decode (``paged_attention``) is one softmax over the
whole gathered run, without key blocks.

On a 2-core CPU against the reference (SmolLM2 shapes, 9 query / 3 KV heads, page 32):
2,048-token prefill 2.6x faster, 1,024-token 2.2x, batch-8 decode at 1k context 2.9x.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from einops import rearrange

from pallas_kernels.common import (
    MASK_VALUE,
    AttentionSpec,
    Carry,
    PagedKV,
    check_inputs,
    initial_carry,
    softmax_step,
    visible_mask,
)

BLOCK_Q = 256
"""Query rows per block (per KV head the block holds ``group * BLOCK_Q`` rows)."""
BLOCK_K = 256
"""Key slots per block, rounded down to whole pages."""


@functools.partial(jax.jit, static_argnames=("spec", "block_q", "block_k"))
def partial_attention(
    q: jax.Array,
    q_positions: jax.Array,
    kv: PagedKV,
    spec: AttentionSpec,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> jax.Array:
    """Attention of query rows at absolute positions over paged keys and values.

    Args:
      q, q_positions, kv, spec: the attention arguments (``pallas_kernels.common.check_inputs``);
        each sequence's run is dequantized once.
      block_q: query rows per block; block_k: key slots per block (>= one page).

    Returns:
      [num_seqs, num_queries, num_heads, head_dim] in q's dtype.
    """
    check_inputs(q, q_positions, kv)
    num_queries = q.shape[1]
    tokens_per_block = kv.k_pages.shape[1]
    pages_per_seq = kv.page_indices.shape[1]
    pages_per_block = max(1, min(block_k // tokens_per_block, pages_per_seq))
    num_key_blocks = -(-pages_per_seq // pages_per_block)
    page_indices = jnp.pad(kv.page_indices, ((0, 0), (0, num_key_blocks * pages_per_block - pages_per_seq)))

    rows = min(block_q, num_queries)
    num_query_blocks = -(-num_queries // rows)
    pad = num_query_blocks * rows - num_queries
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_positions = jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1)
    # Each sequence's page run, gathered once per call and split into key blocks:
    # [num_key_blocks, s, kv_heads, slots_per_block, d]. (Gathering inside the key-block loop
    # instead makes the loop carry the whole pool, which XLA then copies on every call.)
    k_blocks, v_blocks = (
        rearrange(_gather(pages, scales, page_indices), "s (n p) t h d -> n s h (p t) d", p=pages_per_block)
        for pages, scales in ((kv.k_pages, kv.k_scales), (kv.v_pages, kv.v_scales))
    )
    blocks = [
        query_block(q[:, i * rows : (i + 1) * rows], q_positions[:, i * rows : (i + 1) * rows], k_blocks, v_blocks,
                    kv.lengths, spec)
        for i in range(num_query_blocks)
    ]
    return jnp.concatenate(blocks, axis=1)[:, :num_queries].astype(q.dtype)


def query_block(
    qb: jax.Array,
    pos: jax.Array,
    k_blocks: jax.Array,
    v_blocks: jax.Array,
    lengths: jax.Array,
    spec: AttentionSpec,
) -> jax.Array:
    """One block of query rows of each sequence over its key blocks: an online softmax over the
    blocks that hold a visible slot (``over_key_blocks``), masked exactly by position
    (``pallas_kernels.common.visible_mask``). The step of both blocked implementations: paged
    (``partial_attention``, the blocks cut from each sequence's gathered page run) and
    contiguous (``kvjax.attention.rows``, one sequence, s = 1).

    Args:
      qb: [s, q, H, d] queries; pos: [s, q] int32 their positions (negative = padding row).
      k_blocks, v_blocks: [n, s, h, k, d] float32, key block j holding slots j*k .. j*k + k - 1.
      lengths: [s] int32 valid slots of each sequence.
      spec: scale, window and soft cap.

    Returns:
      [s, q, H, d] float32 (zero for padding rows).
    """
    num_key_blocks, _, num_kv_heads, slots_per_block, head_dim = k_blocks.shape
    group = qb.shape[2] // num_kv_heads
    qg = rearrange(qb, "s q (h g) d -> s h (g q) d", h=num_kv_heads).astype(jnp.float32) * spec.sm_scale
    scaled = dataclasses.replace(spec, sm_scale=1.0)  # qg comes scaled (once per query block, not per key block)
    query_pos = jnp.tile(pos, (1, group))[:, :, None]  # [s, (g q), 1]
    lowest = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max))
    highest = jnp.minimum(jnp.max(pos), jnp.max(lengths) - 1)

    def attend(j: jax.Array, carry: Carry, masked: bool) -> Carry:
        visible = None
        if masked:
            key_pos = j * slots_per_block + jnp.arange(slots_per_block, dtype=jnp.int32)  # [k]
            key_pos = key_pos[None, None, :]
            visible = visible_mask(query_pos, key_pos, lengths[:, None, None], spec.sliding_window)[:, None]
        return softmax_step(carry, qg, k_blocks[j], v_blocks[j], visible, spec=scaled)

    carry = over_key_blocks(
        attend,
        initial_carry((qb.shape[0], num_kv_heads, group * qb.shape[1]), head_dim),
        num_key_blocks=num_key_blocks,
        block=slots_per_block,
        lowest=lowest,
        highest=highest,
        sliding_window=spec.sliding_window,
    )
    out = normalized(carry, query_pos[:, None, :, 0] >= 0)
    return rearrange(out, "s h (g q) d -> s q (h g) d", g=group)


def normalized(carry: Carry, valid: jax.Array) -> jax.Array:
    """The attention output of the rows: numerator / denominator, zero for padding rows.

    Args:
      carry: the rows' state (``pallas_kernels.common.Carry``).
      valid: bool broadcastable to the rows [..., r]; False = padding row (which may have
        accumulated garbage over unmasked blocks).

    Returns:
      [..., r, d] float32.
    """
    _, denom, acc = carry
    return jnp.where(valid[..., None], acc / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny), 0.0)


def over_key_blocks(
    attend: Callable[..., Carry], carry: Carry, *, num_key_blocks: int, block: int,
    lowest: jax.Array, highest: jax.Array, sliding_window: int | None,
) -> Carry:
    """Runs ``attend(j, carry, masked)`` over the key blocks that hold a visible slot.

    Blocks [first, last) hold every visible slot: causal up to the highest query position and
    past the lowest one's window. Those below the lowest query position and inside the highest
    one's window are seen whole by every valid row and run with ``masked=False``; the others
    with ``masked=True``. One key block in all runs once, masked, without a loop.

    Args:
      attend: one key block's step (``j`` is traced inside the loops).
      num_key_blocks: key blocks in the run; block: key slots per block.
      lowest: [] int32 lowest valid query position (int32 max when no row is valid).
      highest: [] int32 highest valid query position, capped at the last valid slot (< 0 when
        no row is valid).
      sliding_window: as in ``partial_attention``.
    """
    masked = functools.partial(attend, masked=True)
    if num_key_blocks == 1:
        return masked(0, carry)
    first = jnp.int32(0)
    last = jnp.clip(highest // block + 1, 0, num_key_blocks)
    full_end = jnp.clip((jnp.minimum(lowest, highest) + 1) // block, 0, last)
    full_start = jnp.int32(0)
    if sliding_window is not None:  # without a window, nothing lies before the unmasked blocks
        first = jnp.clip(lowest - sliding_window + 1, 0, None) // block
        full_start = jnp.clip(-(-(highest - sliding_window + 1) // block), first, None)
        carry = jax.lax.fori_loop(first, jnp.minimum(full_start, last), masked, carry)
    full_end = jnp.maximum(full_end, full_start)
    carry = jax.lax.fori_loop(full_start, full_end, functools.partial(attend, masked=False), carry)
    return jax.lax.fori_loop(jnp.maximum(full_end, first), last, masked, carry)


def _gather(pages: jax.Array, scales: jax.Array | None, page_indices: jax.Array) -> jax.Array:
    """pages[page_indices] in float32 (dequantized when scaled): [s, pages_per_seq, tokens_per_block, h, d].

    Float32 once per call: the softmax step casts its probabilities to the values' dtype, and
    the XLA path computes both products in float32."""
    run = pages[page_indices].astype(jnp.float32)
    return run if scales is None else run * scales[page_indices][..., None]


def paged_attention(q: jax.Array, kv: PagedKV, spec: AttentionSpec) -> jax.Array:
    """Decode attention (the query of each sequence is its token at ``lengths - 1``).

    One softmax over each sequence's whole gathered run, left in its gathered layout
    [s, slots, kv_heads, d]: both products are einsums with the KV head as a batch axis
    wherever it lies, so XLA places it (no key-block split, no transposed copy of the run).
    It is kept beside ``partial_attention`` (which also serves one query row) because the
    whole SmolLM2 decode step is faster with it: measured in one process on a 2-core CPU
    (``configs/profile_step.py``, decode_ab.csv), batch 8 at 128 / 256 / 512 / 1024 cached
    tokens 7% / 35% / 29% / 12% faster, batch 1 5% / 17% / 16% / 11%.

    Args:
      q, kv, spec: the attention arguments of decode (``pallas_kernels.common.check_inputs``).

    Returns:
      [num_seqs, num_heads, head_dim] in q's dtype.
    """
    check_inputs(q, None, kv)
    num_seqs, _, head_dim = q.shape
    num_kv_heads, lengths = kv.k_pages.shape[2], kv.lengths
    k, v = (
        _gather(pages, scales, kv.page_indices).reshape(num_seqs, -1, num_kv_heads, head_dim)
        for pages, scales in ((kv.k_pages, kv.k_scales), (kv.v_pages, kv.v_scales))
    )  # [s, slots, kv_heads, d]
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    # The query of each sequence sits at lengths - 1: [s, slots].
    visible = visible_mask((lengths - 1)[:, None], key_pos, lengths[:, None], spec.sliding_window)
    # Slots no query sees may hold anything (the null page, stale or NaN data): zero their
    # values so that 0 * garbage cannot leak; their logits are masked below.
    v = jnp.where(visible[:, :, None, None], v, jnp.zeros((), v.dtype))
    qg = rearrange(q, "s (h g) d -> s h g d", h=num_kv_heads).astype(jnp.float32) * spec.sm_scale
    logits = jnp.einsum("shgd,skhd->shgk", qg, k, preferred_element_type=jnp.float32)
    if spec.logit_soft_cap is not None:
        logits = spec.logit_soft_cap * jnp.tanh(logits / spec.logit_soft_cap)
    logits = jnp.where(visible[:, None, None], logits, MASK_VALUE)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.where(visible[:, None, None], jnp.exp(logits - row_max), 0.0)
    acc = jnp.einsum("shgk,skhd->shgd", probs, v, preferred_element_type=jnp.float32)
    out = normalized((row_max, jnp.sum(probs, axis=-1, keepdims=True), acc), (lengths > 0)[:, None, None])
    return rearrange(out, "s h g d -> s (h g) d").astype(q.dtype)
