"""Quantized KV pages: int8 or fp8 (float8_e4m3fn) values with float32 scales.

A quantized layer's pages are one pytree, ``QuantizedPages(values, scales)``, used wherever a
full-precision layer's ``[num_pages, tokens_per_block, num_kv_heads, head_dim]`` array is: the page
ops of ``kvjax.cache.pool`` and the attention entry points accept either. Symmetric absmax
quantization over ``head_dim``; the scale granularity is fixed by the scales' second axis:

  "token"  scales [num_pages, tokens_per_block, num_kv_heads]: one scale per token and KV head, set
           when the token is written; nothing written earlier ever changes.
  "page"   scales [num_pages, 1, num_kv_heads]: one scale per page and KV head, the running
           absmax of the page's tokens. A write whose tokens exceed the page's scale raises it
           and re-quantizes the tokens already in the page (one more rounding for them); a
           write at offset 0 starts the page afresh (pages fill in position order, so any
           older content of a page whose first slot is written is stale).

Dequantization, ``values * scales``, happens inside attention (the XLA reference and the
blocked implementation dequantize the gathered pages; the Pallas kernels fold the K scale
into the logits and the V scale into the probabilities).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

QUANTIZED_DTYPES = ("int8", "fp8")
"""KV dtypes stored as quantized values plus scales."""
KV_STORAGE_DTYPES = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
    "int8": jnp.dtype(jnp.int8),
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
}
"""Storage dtype of each KV dtype name."""
SCALE_GRANULARITIES = ("token", "page")
SCALE_DTYPE = jnp.dtype(jnp.float32)
MIN_SCALE = 1e-12
"""Floor of a scale, so that an all-zero token or page divides by a positive number."""


@flax.struct.dataclass
class QuantizedPages:
    """One layer's quantized K (or V) pages.

    Attributes:
      values: [num_pages, tokens_per_block, num_kv_heads, head_dim] int8 or float8_e4m3fn.
      scales: [num_pages, tokens_per_block or 1, num_kv_heads] float32 (per token or per page).
    """

    values: jax.Array
    scales: jax.Array


def qmax(dtype: jnp.dtype) -> float:
    """Largest magnitude a quantized value takes: 127 (int8) or 448 (float8_e4m3fn)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    if dtype == jnp.float8_e4m3fn:
        return float(jnp.finfo(dtype).max)
    raise ValueError(f"dtype={dtype} is not a quantized KV dtype (int8 or float8_e4m3fn)")


def absmax_scale(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Scale that maps the absmax of ``x`` over its last axis onto ``qmax(dtype)``: [..., d] -> [...] float32."""
    return jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / qmax(dtype), MIN_SCALE)


def quantize(x: jax.Array, scales: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x / scales`` rounded to ``dtype`` (int8: nearest, clipped to +-127; fp8: clipped to +-448).

    Args:
      x: [..., d] float.
      scales: [...] float32, positive; broadcast over the last axis of ``x``.
    """
    return _to_storage(x.astype(jnp.float32) / scales[..., None], dtype)


def _to_storage(y: jax.Array, dtype: jnp.dtype) -> jax.Array:
    limit = qmax(dtype)
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.clip(jnp.round(y), -limit, limit).astype(dtype)
    return jnp.clip(y, -limit, limit).astype(dtype)


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """``values * scales`` in float32.

    Args:
      values: [..., tokens_per_block, num_kv_heads, head_dim].
      scales: [..., tokens_per_block or 1, num_kv_heads].
    """
    return values.astype(jnp.float32) * scales[..., None]


def dequantize_pages(pages: jax.Array | QuantizedPages) -> jax.Array:
    """A layer's pages in a float dtype: full-precision pages as they are, quantized ones dequantized."""
    return dequantize(pages.values, pages.scales) if isinstance(pages, QuantizedPages) else pages


def init_quantized(shape: tuple[int, ...], dtype: jnp.dtype, granularity: str) -> QuantizedPages:
    """Zeroed pages of ``shape`` = [num_pages, tokens_per_block, num_kv_heads, head_dim]."""
    if granularity not in SCALE_GRANULARITIES:
        raise ValueError(f"scale_granularity={granularity!r} must be one of {SCALE_GRANULARITIES}")
    num_pages, tokens_per_block, num_kv_heads, _ = shape
    scale_slots = tokens_per_block if granularity == "token" else 1
    return QuantizedPages(
        values=jnp.zeros(shape, dtype), scales=jnp.zeros((num_pages, scale_slots, num_kv_heads), SCALE_DTYPE)
    )


def write_quantized(pages: QuantizedPages, page_ids: jax.Array, offsets: jax.Array, x: jax.Array) -> QuantizedPages:
    """Quantizes one layer's new K (or V) and scatters it into its pages.

    Args:
      pages: the layer's quantized pages.
      page_ids, offsets: [max_seqs, num_tokens] int32 slots (in bounds; padding maps to the null page).
      x: [max_seqs, num_tokens, num_kv_heads, head_dim] float.
    """
    dtype = pages.values.dtype
    num_pages, tokens_per_block = pages.values.shape[:2]
    token_scales = absmax_scale(x, dtype)  # [S, T, K]
    if pages.scales.shape[1] == tokens_per_block:
        return QuantizedPages(
            values=pages.values.at[page_ids, offsets].set(quantize(x, token_scales, dtype), mode="promise_in_bounds"),
            scales=pages.scales.at[page_ids, offsets].set(token_scales, mode="promise_in_bounds"),
        )
    old = pages.scales[:, 0]  # [P, K]
    fresh = jnp.zeros(num_pages, bool).at[page_ids].max(offsets == 0, mode="promise_in_bounds")  # [P]
    base = jnp.where(fresh[:, None], 0.0, old)  # [P, K]
    new = base.at[page_ids].max(token_scales, mode="promise_in_bounds")  # [P, K]
    ratio = jnp.where(new > 0, base / jnp.where(new > 0, new, 1.0), 1.0)  # [P, K], <= 1
    values = pages.values
    if page_ids.size < num_pages:  # re-quantize only the written pages (duplicates write equal pages)
        touched = values[page_ids]  # [S, T, tokens_per_block, K, d]
        rescaled = _to_storage(touched.astype(jnp.float32) * ratio[page_ids][:, :, None, :, None], dtype)
        values = values.at[page_ids].set(rescaled, mode="promise_in_bounds")
    else:  # the write covers more slots than the pool has pages: one pass over the pool is cheaper
        values = _to_storage(values.astype(jnp.float32) * ratio[:, None, :, None], dtype)
    values = values.at[page_ids, offsets].set(quantize(x, new[page_ids], dtype), mode="promise_in_bounds")
    return QuantizedPages(values=values, scales=new[:, None, :])
