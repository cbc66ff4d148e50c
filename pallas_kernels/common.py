"""Pieces shared by the attention implementations: the shared arguments (``PagedKV``,
``AttentionSpec``) and their validation, row layout, and the online-softmax step of every
kernel and of the blocked XLA form.

The kernels see one KV head at a time. Its query heads (``group`` of them) and the query
tokens of one block are flattened into *rows*, ordered (query, group)::

    q [s, q, H, d] --> rows [s, h, q * g, d]      row r = query r // g, head r % g of KV head h

Every row carries its query's absolute position; a negative position is a padding row.
Key slot ``j`` of a sequence is position ``j`` (page ``j // tokens_per_block`` of its table).
Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from einops import rearrange
from jax import lax

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
QUANTIZED_STORAGE = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
"""Page dtypes that come with scales (dequantized inside the kernels)."""


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How an attention call turns q·k into weights; a static argument of every entry (hashable).

    Attributes:
      sm_scale: scale of q·k.
      sliding_window: None, or a positive window in tokens: a key is visible only if
        query_pos - key_pos < sliding_window.
      logit_soft_cap: None, or a positive cap: logits become cap * tanh(logits / cap).

    Raises:
      ValueError: naming the field outside its range.
    """

    sm_scale: float
    sliding_window: int | None = None
    logit_soft_cap: float | None = None

    def __post_init__(self) -> None:
        sliding_window, logit_soft_cap = self.sliding_window, self.logit_soft_cap
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{sliding_window=} must be None or >= 1")
        if logit_soft_cap is not None and logit_soft_cap <= 0:
            raise ValueError(f"{logit_soft_cap=} must be None or > 0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One layer's paged keys and values as an attention call reads them (a pytree).

    Attributes:
      k_pages, v_pages: [num_pages, tokens_per_block, num_kv_heads, head_dim], one layer's
        pool; ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA / MQA).
      lengths: [num_seqs] int32 valid KV slots of each sequence (in decode the new token
        included; a decode sequence of length 0 is padding and yields zeros). Slots at or
        past the length may hold anything (never read into the output).
      page_indices: [num_seqs, pages_per_seq] int32 block tables: key slot ``j`` of sequence
        ``i`` is ``k_pages[page_indices[i, j // tokens_per_block], j % tokens_per_block]``.
        Entries past a sequence's length may point anywhere in the pool (e.g. the null page).
      k_scales, v_scales: both None (float pages), or both [num_pages, tokens_per_block or 1,
        num_kv_heads] float32 per-token or per-page scales of int8 / float8_e4m3fn pages
        (K = k_pages * k_scales), dequantized inside attention.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    lengths: jax.Array
    page_indices: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

    @property
    def scales(self) -> tuple[jax.Array, ...]:
        """(k_scales, v_scales) for quantized pages, () for float pages."""
        return () if self.k_scales is None or self.v_scales is None else (self.k_scales, self.v_scales)


def check_inputs(q: jax.Array, q_positions: jax.Array | None, kv: PagedKV) -> None:
    """Trace-time checks of the attention arguments; raises ValueError naming the one that is off.

    Every implementation of both ops (``partial_attention``: query rows at absolute
    positions; ``paged_attention``: decode, one query per sequence at ``lengths - 1``, without
    ``q_positions``) takes ``q``, then ``q_positions`` (partial only), ``kv`` and an
    ``AttentionSpec``, positionally in this order, and its tuning by keyword.

    Args:
      q: partial attention [num_seqs, num_queries, num_heads, head_dim]; decode
        [num_seqs, num_heads, head_dim], the query of the token at position lengths - 1.
      q_positions: partial attention [num_seqs, num_queries] int32 absolute positions, a
        negative one marks a padding row (its output is zero); decode has none (None here).
      kv: the pages, lengths and block tables (``PagedKV``).
    """
    k_pages, v_pages, lengths, page_indices = kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices
    decode = q_positions is None
    expected = "[num_seqs, num_heads, head_dim]" if decode else "[num_seqs, num_queries, num_heads, head_dim]"
    if q.ndim != (3 if decode else 4):
        raise ValueError(f"q.shape={q.shape} must be {expected}")
    num_seqs, num_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages.shape={k_pages.shape} and v_pages.shape={v_pages.shape} must be equal "
            "[num_pages, tokens_per_block, num_kv_heads, head_dim]"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages.dtype={k_pages.dtype} must equal v_pages.dtype={v_pages.dtype}")
    _, _, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim={head_dim} must equal the pages' head_dim={kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if q_positions is not None and q_positions.shape != q.shape[:2]:
        raise ValueError(f"q_positions.shape={q_positions.shape} must be {q.shape[:2]}")
    if lengths.shape != (num_seqs,):
        raise ValueError(f"lengths.shape={lengths.shape} must be {(num_seqs,)}")
    if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs:
        raise ValueError(f"page_indices.shape={page_indices.shape} must be [{num_seqs}, pages_per_seq]")
    integers = (("lengths", lengths), ("page_indices", page_indices))
    for name, array in integers if q_positions is None else (("q_positions", q_positions), *integers):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={array.dtype} must be int32")
    check_scales(k_pages, kv.k_scales, kv.v_scales)


def check_scales(k_pages: jax.Array, k_scales: jax.Array | None, v_scales: jax.Array | None) -> None:
    """Trace-time checks of quantized pages' scales (see ``check_inputs``); raises ValueError."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (quantized pages) or both be None")
    if k_scales is None or v_scales is None:
        return
    if k_pages.dtype not in QUANTIZED_STORAGE:
        raise ValueError(f"k_pages.dtype={k_pages.dtype} must be int8 or float8_e4m3fn when scales are given")
    num_pages, tokens_per_block, num_kv_heads, _ = k_pages.shape
    allowed: tuple[tuple[int, ...], ...] = ((num_pages, tokens_per_block, num_kv_heads), (num_pages, 1, num_kv_heads))
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


Carry = tuple[jax.Array, jax.Array, jax.Array]
"""Online-softmax state of a block of query rows, all float32: running max [..., r, 1],
denominator [..., r, 1] and unnormalised numerator [..., r, d]."""


def initial_carry(rows: tuple[int, ...], head_dim: int) -> Carry:
    """The state before any key of rows of shape ``rows`` (e.g. ``(block_rows,)``): max
    ``MASK_VALUE``, denominator and numerator zero."""
    return (
        jnp.full((*rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((*rows, 1), jnp.float32),
        jnp.zeros((*rows, head_dim), jnp.float32),
    )


def softmax_step(
    carry: Carry,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array | None,
    key_live: jax.Array | None = None,
    *,
    spec: AttentionSpec,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> Carry:
    """One online-softmax step of a block of query rows over a block of keys.

    The step of every Pallas kernel (one [rows, head_dim] tile, traced inside the kernel
    body) and of the blocked XLA implementation (the same arrays with leading batch axes,
    e.g. sequences and KV heads).

    Masked logits are replaced by ``MASK_VALUE``, not added to, so a NaN key cannot leak;
    values outside ``key_live`` (past the length, released by the window: possibly the null
    page, stale or NaN data) are zeroed before ``p @ v`` so that ``0 * NaN`` cannot appear.

    Quantized keys and values are dequantized by folding their scales into the step:
    ``q · (s_k k) = s_k (q · k)`` scales the logits' columns and ``p (s_v v) = (p s_v) v``
    the probabilities' columns, so the ``[block_k, head_dim]`` tiles are only cast.

    Args:
      carry: the rows' state (see ``Carry``).
      q: [..., r, d] queries.
      k, v: [..., k, d] the block's keys and values; ``p`` is cast to v's dtype for ``p @ v``.
      visible: bool broadcastable to [..., r, k]; None when every row sees every key of the
        block (no mask is built; padding rows then accumulate garbage the caller zeroes).
      key_live: bool broadcastable to [..., k, 1], the slots whose values are read (the
        others' are zeroed); None = the slots some row sees (every slot when ``visible`` is None).
      spec: scale and soft cap (its ``sm_scale`` 1.0 when q arrives scaled; the window is
        the caller's, in ``visible``).
      k_scale, v_scale: None (float k, v), or float32 scales broadcastable to [..., 1, k] of
        quantized k, v (with a ``visible`` mask: a masked slot's scale may be anything).

    Returns:
      The updated state.
    """
    m, l, acc = carry
    if k_scale is not None:
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    if key_live is None and visible is not None:
        key_live = jnp.any(visible, axis=-2)[..., None]
    # f32 inputs ask for exact f32 products (Triton and Mosaic would otherwise use TF32/bf16 passes).
    precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else lax.Precision.DEFAULT
    logits = jnp.einsum("...rd,...kd->...rk", q, k, precision=precision, preferred_element_type=jnp.float32)
    if k_scale is not None:
        logits = logits * k_scale
    logits = logits * spec.sm_scale  # [..., r, k]
    if spec.logit_soft_cap is not None:
        logits = spec.logit_soft_cap * jnp.tanh(logits / spec.logit_soft_cap)
    if visible is not None:
        logits = jnp.where(visible, logits, MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))  # [..., r, 1]
    alpha = jnp.exp(m - m_next)  # [..., r, 1]
    p = jnp.exp(logits - m_next)  # [..., r, k]
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    if key_live is not None:
        v = jnp.where(key_live, v, jnp.zeros((), v.dtype))  # [..., k, d]
    p_v = p  # with scales, a masked slot's scale may be anything: masked again after scaling
    if v_scale is not None:
        p_v = p * v_scale if visible is None else jnp.where(visible, p * v_scale, 0.0)
    pv = jnp.einsum("...rk,...kd->...rd", p_v.astype(v.dtype), v, precision=precision,
                    preferred_element_type=jnp.float32)
    l_next = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
    return m_next, l_next, alpha * acc + pv


def finish(l: jax.Array, acc: jax.Array) -> jax.Array:
    """acc / l, with rows that saw no key (l == 0) set to zero. [rows, 1], [rows, d] -> [rows, d]."""
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
