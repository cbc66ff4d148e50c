"""Pieces shared by the TPU and GPU attention kernels: validation, row layout, softmax step.

The kernels see one KV head at a time. Its query heads (``group`` of them) and the query
tokens of one block are flattened into *rows*, ordered (query, group)::

    q [s, q, H, d] --> rows [s, h, q * g, d]      row r = query r // g, head r % g of KV head h

Every row carries its query's absolute position; a negative position is a padding row.
Key slot ``t`` of a sequence is position ``t`` (page ``t // page_size`` of its table).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jax import lax

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
QUANTIZED_STORAGE = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
"""Page dtypes that come with scales (dequantized inside the kernels)."""


def check_inputs(
    q: jax.Array,
    q_positions: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> None:
    """Trace-time checks of shapes, dtypes and static options; raises ValueError.

    Args:
      q: [num_seqs, num_queries, num_heads, head_dim].
      q_positions: [num_seqs, num_queries] int32.
      k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim].
      lengths: [num_seqs] int32.
      page_indices: [num_seqs, pages_per_seq] int32.
      sliding_window: None or a positive window in tokens.
      logit_soft_cap: None or a positive cap.
      k_scales, v_scales: both None (float pages) or both [num_pages, page_size or 1,
        num_kv_heads] float32, the scales of int8 / float8_e4m3fn pages.
    """
    if q.ndim != 4:
        raise ValueError(f"q.shape={q.shape} must be [num_seqs, num_queries, num_heads, head_dim]")
    num_seqs, num_queries, num_heads, head_dim = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages.shape={k_pages.shape} and v_pages.shape={v_pages.shape} must be equal "
            "[num_pages, page_size, num_kv_heads, head_dim]"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages.dtype={k_pages.dtype} must equal v_pages.dtype={v_pages.dtype}")
    _, _, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim={head_dim} must equal the pages' head_dim={kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if q_positions.shape != (num_seqs, num_queries):
        raise ValueError(f"q_positions.shape={q_positions.shape} must be {(num_seqs, num_queries)}")
    if lengths.shape != (num_seqs,):
        raise ValueError(f"lengths.shape={lengths.shape} must be {(num_seqs,)}")
    if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs:
        raise ValueError(f"page_indices.shape={page_indices.shape} must be [{num_seqs}, pages_per_seq]")
    for name, array in (("q_positions", q_positions), ("lengths", lengths), ("page_indices", page_indices)):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={array.dtype} must be int32")
    check_scales(k_pages, k_scales, v_scales)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be None or >= 1")
    if logit_soft_cap is not None and logit_soft_cap <= 0:
        raise ValueError(f"{logit_soft_cap=} must be None or > 0")


def check_scales(k_pages: jax.Array, k_scales: jax.Array | None, v_scales: jax.Array | None) -> None:
    """Trace-time checks of quantized pages' scales (see ``check_inputs``); raises ValueError."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (quantized pages) or both be None")
    if k_scales is None:
        return
    if k_pages.dtype not in QUANTIZED_STORAGE:
        raise ValueError(f"k_pages.dtype={k_pages.dtype} must be int8 or float8_e4m3fn when scales are given")
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    allowed = ((num_pages, page_size, num_kv_heads), (num_pages, 1, num_kv_heads))
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.shape not in allowed:
            raise ValueError(f"{name}.shape={scales.shape} must be {allowed[0]} (per token) or {allowed[1]} (per page)")
        if scales.dtype != jnp.float32:
            raise ValueError(f"{name}.dtype={scales.dtype} must be float32")
    if k_scales.shape != v_scales.shape:
        raise ValueError(f"k_scales.shape={k_scales.shape} must equal v_scales.shape={v_scales.shape}")


def to_rows(q: jax.Array, num_kv_heads: int, group_pad: int, num_queries_pad: int) -> jax.Array:
    """Lays query heads of one KV head out as rows, padding groups and queries with zeros.

    Args:
      q: [num_seqs, num_queries, num_heads, head_dim].
      num_kv_heads: KV heads; ``num_heads = num_kv_heads * group``.
      group_pad: group size after padding (>= group).
      num_queries_pad: query count after padding (>= num_queries).

    Returns:
      [num_seqs, num_kv_heads, num_queries_pad * group_pad, head_dim].
    """
    qg = rearrange(q, "s q (h g) d -> s h q g d", h=num_kv_heads)
    group, num_queries = qg.shape[3], qg.shape[2]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, num_queries_pad - num_queries), (0, group_pad - group), (0, 0)))
    return rearrange(qg, "s h q g d -> s h (q g) d")


def from_rows(rows: jax.Array, num_queries: int, group: int, group_pad: int) -> jax.Array:
    """Inverse of ``to_rows``: [s, h, q_pad * g_pad, d] -> [s, num_queries, h * group, d]."""
    out = rearrange(rows, "s h (q g) d -> s q h g d", g=group_pad)[:, :num_queries, :, :group]
    return rearrange(out, "s q h g d -> s q (h g) d")


def row_positions(q_positions: jax.Array, group_pad: int, num_queries_pad: int) -> jax.Array:
    """Absolute position of every row; padded queries get -1 (padding rows).

    Args:
      q_positions: [num_seqs, num_queries] int32.

    Returns:
      [num_seqs, num_queries_pad * group_pad] int32.
    """
    pad = num_queries_pad - q_positions.shape[1]
    positions = jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1)
    return jnp.repeat(positions, group_pad, axis=1)


def pad_page_table(page_indices: jax.Array, pages_per_seq_pad: int) -> jax.Array:
    """Pads each block table to ``pages_per_seq_pad`` entries by repeating its last page.

    The added slots lie past every length, so they are masked; repeating a real entry keeps
    every index inside the pool without naming a reserved page.

    Args:
      page_indices: [num_seqs, pages_per_seq] int32.

    Returns:
      [num_seqs, pages_per_seq_pad] int32.
    """
    pad = pages_per_seq_pad - page_indices.shape[1]
    return jnp.pad(page_indices, ((0, 0), (0, pad)), mode="edge")


def kv_token_range(
    positions: jax.Array, lengths: jax.Array, sliding_window: int | None
) -> tuple[jax.Array, jax.Array]:
    """The key slots ``[start, end)`` that some row of a block can see.

    Args:
      positions: [..., rows] int32 row positions of each block (negative = padding).
      lengths: [...] int32 valid slots of the block's sequence.
      sliding_window: None or the window in tokens.

    Returns:
      start, end: [...] int32; ``end <= start`` means the block sees no key.
    """
    valid = positions >= 0
    end = jnp.minimum(lengths, jnp.max(positions, axis=-1) + 1)
    if sliding_window is None:
        start = jnp.zeros_like(end)
    else:
        min_pos = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=-1)
        start = jnp.maximum(min_pos - (sliding_window - 1), 0)
    return start, jnp.maximum(end, 0)


def visible_mask(
    row_pos: jax.Array, key_pos: jax.Array, length: jax.Array, sliding_window: int | None
) -> jax.Array:
    """Exact causal mask by position.

    Args:
      row_pos: [rows, 1] int32 (negative = padding row).
      key_pos: [1, block_k] int32.
      length: scalar int32.

    Returns:
      [rows, block_k] bool.
    """
    visible = (key_pos <= row_pos) & (key_pos < length) & (row_pos >= 0)
    if sliding_window is not None:
        visible &= row_pos - key_pos < sliding_window
    return visible


def softmax_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    key_live: jax.Array,
    m: jax.Array,
    l: jax.Array,
    acc: jax.Array,
    *,
    sm_scale: float,
    logit_soft_cap: float | None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax step over a block of keys.

    Masked logits are replaced, not added to, so a NaN key cannot leak; values outside
    ``key_live`` (past the length, released by the window: possibly the null page or NaN)
    are zeroed before ``p @ v`` so that ``0 * NaN`` cannot appear.

    Quantized keys and values are dequantized by folding their scales into the step:
    ``q · (s_k k) = s_k (q · k)`` scales the logits' columns and ``p (s_v v) = (p s_v) v``
    the probabilities' columns, so the ``[block_k, head_dim]`` tiles are only cast.

    Args:
      q: [rows, head_dim].
      k, v: [block_k, head_dim].
      visible: [rows, block_k] bool.
      key_live: [block_k, 1] bool, slots inside the block's ``kv_token_range``; the others'
        values are zeroed.
      m, l: [rows, 1] float32 running max and denominator.
      acc: [rows, head_dim] float32 running numerator.
      k_scale, v_scale: None (float k, v) or [1, block_k] float32 scales of quantized k, v.

    Returns:
      The updated (m, l, acc).
    """
    if k_scale is not None:
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    # f32 inputs ask for exact f32 products (Triton and Mosaic would otherwise use TF32/bf16 passes).
    precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else lax.Precision.DEFAULT
    dot = functools.partial(lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    logits = dot(q, k, (((1,), (1,)), ((), ())))
    if k_scale is not None:
        logits = logits * k_scale
    logits = logits * sm_scale  # [rows, block_k]
    if logit_soft_cap is not None:
        logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
    logits = jnp.where(visible, logits, MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))  # [rows, 1]
    alpha = jnp.exp(m - m_next)  # [rows, 1]
    p = jnp.where(visible, jnp.exp(logits - m_next), 0.0)  # [rows, block_k]
    v = jnp.where(key_live, v, jnp.zeros((), v.dtype))  # [block_k, head_dim]
    p_v = p if v_scale is None else jnp.where(visible, p * v_scale, 0.0)  # a masked slot's scale may be anything
    pv = dot(p_v.astype(v.dtype), v, (((1,), (0,)), ((), ())))
    l_next = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    return m_next, l_next, alpha * acc + pv


def finish(l: jax.Array, acc: jax.Array) -> jax.Array:
    """acc / l, with rows that saw no key (l == 0) set to zero. [rows, 1], [rows, d] -> [rows, d]."""
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
