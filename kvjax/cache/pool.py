"""The device page pool and pure, jittable operations on it.

A pool holds, per layer, K and V as ``[num_pages, tokens_per_block, num_kv_heads, head_dim]`` (or,
for a quantized dtype, ``QuantizedPages`` of such values plus their scales, see
``kvjax.cache.quant``); the layers of one group (same attention window) share page ids and a
block table. Only KV heads are stored, so a token costs ``layout.bytes_per_token``:
``2 · layers · kv_heads · head_dim · bytes(dtype)``, plus the scales of a quantized dtype.
Every op here takes either kind of layer; a page's scales travel with its values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.layout import NULL_PAGE, CacheLayout
from kvjax.cache.quant import QuantizedPages, init_quantized, write_quantized

Pages = jax.Array | QuantizedPages
"""One layer's K (or V) pages: a float array or quantized values with scales."""


@flax.struct.dataclass
class PagePool:
    """K and V pages of every layer.

    Attributes:
      k, v: one entry per layer, [num_pages(group of the layer), tokens_per_block, num_kv_heads,
        head_dim] arrays, or ``QuantizedPages`` of that shape for a quantized dtype.
    """

    k: tuple[Pages, ...]
    v: tuple[Pages, ...]


def _zeros(layout: CacheLayout, layer: int) -> Pages:
    if layout.quantized:
        return init_quantized(layout.page_shape(layer), layout.jnp_dtype, layout.scale_granularity)
    return jnp.zeros(layout.page_shape(layer), layout.jnp_dtype)


def init_pool(layout: CacheLayout) -> PagePool:
    """A zeroed pool for ``layout``."""
    k = tuple(_zeros(layout, layer) for layer in range(layout.num_layers))
    v = tuple(_zeros(layout, layer) for layer in range(layout.num_layers))
    return PagePool(k=k, v=v)


def slot_mapping(block_tables: jax.Array, positions: jax.Array, tokens_per_block: int) -> tuple[jax.Array, jax.Array]:
    """Where each token's KV lives.

    Args:
      block_tables: [max_seqs, pages_per_seq] int32.
      positions: [max_seqs, num_tokens] int32 absolute positions; negative = padding.
      tokens_per_block: tokens per page.

    Returns:
      (page ids, offsets in page), both [max_seqs, num_tokens] int32; padding tokens map
      to slot 0 of the null page.
    """
    valid = positions >= 0
    safe = jnp.where(valid, positions, 0)
    pages = jnp.take_along_axis(block_tables, safe // tokens_per_block, axis=1, mode="clip")
    pages = jnp.where(valid, pages, NULL_PAGE)
    offsets = jnp.where(valid, safe % tokens_per_block, 0)
    return pages, offsets


def write_layer(pages: Pages, page_ids: jax.Array, offsets: jax.Array, values: jax.Array) -> Pages:
    """Scatters one layer's new K (or V) into its pages (quantizing it for quantized pages).

    In-bounds is promised (padding maps to the null page): a bounds-checked scatter makes
    XLA select over the whole pool on every write.

    Args:
      pages: [num_pages, tokens_per_block, num_kv_heads, head_dim], or ``QuantizedPages``.
      page_ids, offsets: [max_seqs, num_tokens] from ``slot_mapping``.
      values: [max_seqs, num_tokens, num_kv_heads, head_dim].
    """
    if isinstance(pages, QuantizedPages):
        return write_quantized(pages, page_ids, offsets, values)
    return pages.at[page_ids, offsets].set(values.astype(pages.dtype), mode="promise_in_bounds")


def read_slots(pages: Pages, page_ids: jax.Array, offsets: jax.Array) -> jax.Array:
    """One layer's K (or V) at arbitrary slots, dequantized: [...] ids/offsets -> [..., num_kv_heads, head_dim]."""
    if isinstance(pages, QuantizedPages):
        scales = pages.scales[page_ids, _scale_slot(pages, offsets)]  # [..., K]
        return pages.values[page_ids, offsets].astype(jnp.float32) * scales[..., None]
    return pages[page_ids, offsets]


def _scale_slot(pages: QuantizedPages, offsets: jax.Array) -> jax.Array:
    """The scale slot of each offset: the offset itself (per-token scales) or 0 (per-page)."""
    return offsets if pages.scales.shape[1] == pages.values.shape[1] else jnp.zeros_like(offsets)


def _group_layers(layout: CacheLayout, group: int) -> list[int]:
    return [layer for layer, g in enumerate(layout.layer_group) if g == group]


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def copy_pages(pool: PagePool, layout: CacheLayout, group: int, src: jax.Array, dst: jax.Array) -> PagePool:
    """Copies whole pages ``src[i] -> dst[i]`` in every layer of ``group`` (copy on partial reuse).

    Args:
      src, dst: [num_copies] int32 page ids.
    """
    k, v = list(pool.k), list(pool.v)
    copy = lambda a: a.at[dst].set(a[src])
    for layer in _group_layers(layout, group):
        k[layer] = jax.tree.map(copy, k[layer])
        v[layer] = jax.tree.map(copy, v[layer])
    return PagePool(k=tuple(k), v=tuple(v))


@functools.partial(jax.jit, static_argnums=(1, 2))
def read_pages(pool: PagePool, layout: CacheLayout, group: int, page_ids: jax.Array) -> Pages:
    """K and V of ``page_ids`` in ``group``, as stored (quantized pages keep their scales).

    Returns:
      [2, group_layers, len(page_ids), tokens_per_block, kv_heads, head_dim], or ``QuantizedPages``
      of such values and [2, group_layers, len(page_ids), scale_slots, kv_heads] scales.
    """
    layers = _group_layers(layout, group)
    stack = lambda *a: jnp.stack(a)
    gather = lambda a: a[page_ids]
    k = jax.tree.map(stack, *[jax.tree.map(gather, pool.k[i]) for i in layers])
    v = jax.tree.map(stack, *[jax.tree.map(gather, pool.v[i]) for i in layers])
    return jax.tree.map(stack, k, v)


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def write_pages(pool: PagePool, layout: CacheLayout, group: int, page_ids: jax.Array, kv: Pages) -> PagePool:
    """Writes ``kv`` (as returned by ``read_pages``) into ``page_ids`` of ``group``."""
    k, v = list(pool.k), list(pool.v)
    for n, layer in enumerate(_group_layers(layout, group)):
        k[layer] = jax.tree.map(lambda a, new, n=n: a.at[page_ids].set(new[0, n].astype(a.dtype)), k[layer], kv)
        v[layer] = jax.tree.map(lambda a, new, n=n: a.at[page_ids].set(new[1, n].astype(a.dtype)), v[layer], kv)
    return PagePool(k=tuple(k), v=tuple(v))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_layer_pages(k_pages: Pages, v_pages: Pages, page_ids: jax.Array, kv: Pages) -> tuple[Pages, Pages]:
    """Writes one layer of whole pages (``kv`` as ``read_pages`` returns it for a one-layer
    group: [2, 1, len(page_ids), ...]) into ``page_ids`` of that layer's K and V pages."""
    k = jax.tree.map(lambda a, new: a.at[page_ids].set(new[0, 0].astype(a.dtype)), k_pages, kv)
    v = jax.tree.map(lambda a, new: a.at[page_ids].set(new[1, 0].astype(a.dtype)), v_pages, kv)
    return k, v


def sequence_slots(
    tables: Sequence[Sequence[int]], positions: np.ndarray, tokens: np.ndarray, num_tokens: int, tokens_per_block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host-side slot arrays that place the KV stored at ``positions`` of a block table at
    token indices ``tokens`` of a ``num_tokens``-token sequence (the addresses
    ``kvjax.blend.fusor.read_layer`` reads).

    Args:
      tables: one block table (page ids) per layer group.
      positions: [n] token positions within the tables' sequence.
      tokens: [n] indices in [0, num_tokens) that receive them.
      tokens_per_block: tokens per page.

    Returns:
      (page_ids [num_groups, num_tokens] int32, offsets [num_tokens] int32, valid
      [num_tokens] bool); tokens not placed point at slot 0 of the null page, invalid.
    """
    positions = np.asarray(positions, np.int64)
    page_ids = np.full((len(tables), num_tokens), NULL_PAGE, np.int32)
    offsets = np.zeros(num_tokens, np.int32)
    valid = np.zeros(num_tokens, bool)
    for g, table in enumerate(tables):
        page_ids[g, tokens] = np.asarray(table, np.int32)[positions // tokens_per_block]
    offsets[tokens] = positions % tokens_per_block
    valid[tokens] = True
    return page_ids, offsets, valid
