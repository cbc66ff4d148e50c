"""Plain-jnp reference of partial-token attention over a paged KV cache.

Query rows sit at arbitrary absolute positions (CacheBlend's selected tokens plus the
suffix, or one chunk of a chunked prefill). Masking is exact by position::

    key visible  <=>  key_pos <= query_pos  and  key_pos < length
                      and  query_pos - key_pos < sliding_window

GQA/MQA are handled by reshaping the query heads into ``[num_kv_heads, group]``: the KV
is never repeated in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from pallas_kernels.common import MASK_VALUE, AttentionSpec, PagedKV


def gather_pages(pages: jax.Array, page_indices: jax.Array, scales: jax.Array | None = None) -> jax.Array:
    """Gathers each sequence's pages into one contiguous run of slots (dequantized if scaled).

    Args:
      pages: [num_pages, tokens_per_block, num_kv_heads, head_dim].
      page_indices: [num_seqs, pages_per_seq] int32.
      scales: None, or [num_pages, tokens_per_block or 1, num_kv_heads] float32 scales of
        quantized (int8 / float8_e4m3fn) pages; the run is then ``pages * scales`` in float32.

    Returns:
      [num_seqs, pages_per_seq * tokens_per_block, num_kv_heads, head_dim].
    """
    run = pages[page_indices]  # [s, p, t, h, d]
    if scales is not None:
        run = run.astype(jnp.float32) * scales[page_indices][..., None]  # scales [s, p, t or 1, h, 1]
    return rearrange(run, "s p t h d -> s (p t) h d")


def partial_attention_ref(q: jax.Array, q_positions: jax.Array, kv: PagedKV, spec: AttentionSpec) -> jax.Array:
    """Attention of query rows at absolute positions over paged keys and values.

    Args:
      q, q_positions, kv, spec: the attention arguments (``pallas_kernels.common.check_inputs``;
        the reference does not check them).

    Returns:
      [num_seqs, num_queries, num_heads, head_dim] in q's dtype.
    """
    k_pages, lengths, page_indices = kv.k_pages, kv.lengths, kv.page_indices
    num_kv_heads = k_pages.shape[2]
    group = q.shape[2] // num_kv_heads
    k = gather_pages(k_pages, page_indices, kv.k_scales)  # [s, k, h, d]
    v = gather_pages(kv.v_pages, page_indices, kv.v_scales)  # [s, k, h, d]
    # Slots past a sequence's length may hold anything (the null page, stale or NaN data):
    # zero them so that 0 * garbage cannot leak into the output.
    in_length = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # [s, k]
    k = jnp.where(in_length[:, :, None, None], k, jnp.zeros((), k.dtype))
    v = jnp.where(in_length[:, :, None, None], v, jnp.zeros((), v.dtype))
    # Query heads of one KV head are folded into the row axis: one batched matmul per
    # (sequence, KV head), and the KV is never repeated.
    qg = rearrange(q, "s q (h g) d -> s h (g q) d", h=num_kv_heads)
    k = rearrange(k, "s k h d -> s h k d")
    v = rearrange(v, "s k h d -> s h k d")
    logits = jnp.einsum("shrd,shkd->shrk", qg, k, preferred_element_type=jnp.float32) * spec.sm_scale
    if spec.logit_soft_cap is not None:
        logits = spec.logit_soft_cap * jnp.tanh(logits / spec.logit_soft_cap)
    key_pos = jnp.arange(k.shape[2], dtype=jnp.int32)[None, None, :]  # [1, 1, k]
    query_pos = jnp.tile(q_positions, (1, group))[:, :, None]  # [s, (g q), 1]
    visible = (key_pos <= query_pos) & (key_pos < lengths[:, None, None]) & (query_pos >= 0)
    if spec.sliding_window is not None:
        visible &= query_pos - key_pos < spec.sliding_window
    visible = visible[:, None]  # [s, 1, (g q), k]
    logits = jnp.where(visible, logits, MASK_VALUE)
    probs = jnp.where(visible, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)
    denom = jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("shrk,shkd->shrd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32) / denom
    return rearrange(out, "s h (g q) d -> s q (h g) d", g=group).astype(q.dtype)
