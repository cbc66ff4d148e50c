"""The device page pool and pure, jittable operations on it (SPEC A1, A2).

A pool holds, per layer, K and V as ``[num_pages, page_size, num_kv_heads, head_dim]``; the
layers of one group (same attention window) share page ids and a block table. Only KV heads are stored, so a token costs exactly
``2 · layers · kv_heads · head_dim · bytes(dtype)``.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.layout import NULL_PAGE, CacheLayout


@flax.struct.dataclass
class PagePool:
    """K and V pages of every layer.

    Attributes:
      k, v: one array per layer, [num_pages(group of the layer), page_size, num_kv_heads, head_dim].
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_pool(layout: CacheLayout) -> PagePool:
    """A zeroed pool for ``layout``."""
    k = tuple(jnp.zeros(layout.page_shape(layer), layout.jnp_dtype) for layer in range(layout.num_layers))
    v = tuple(jnp.zeros(layout.page_shape(layer), layout.jnp_dtype) for layer in range(layout.num_layers))
    return PagePool(k=k, v=v)


def slot_mapping(block_tables: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Where each token's KV lives.

    Args:
      block_tables: [max_seqs, pages_per_seq] int32.
      positions: [max_seqs, num_tokens] int32 absolute positions; negative = padding.
      page_size: tokens per page.

    Returns:
      (page ids, offsets in page), both [max_seqs, num_tokens] int32; padding tokens map
      to slot 0 of the null page.
    """
    valid = positions >= 0
    safe = jnp.where(valid, positions, 0)
    pages = jnp.take_along_axis(block_tables, safe // page_size, axis=1, mode="clip")
    pages = jnp.where(valid, pages, NULL_PAGE)
    offsets = jnp.where(valid, safe % page_size, 0)
    return pages, offsets


def write_layer(pages: jax.Array, page_ids: jax.Array, offsets: jax.Array, values: jax.Array) -> jax.Array:
    """Scatters one layer's new K (or V) into its pages.

    In-bounds is promised (padding maps to the null page): a bounds-checked scatter makes
    XLA select over the whole pool on every write.

    Args:
      pages: [num_pages, page_size, num_kv_heads, head_dim].
      page_ids, offsets: [max_seqs, num_tokens] from ``slot_mapping``.
      values: [max_seqs, num_tokens, num_kv_heads, head_dim].
    """
    return pages.at[page_ids, offsets].set(values.astype(pages.dtype), mode="promise_in_bounds")


def _group_layers(layout: CacheLayout, group: int) -> list[int]:
    return [layer for layer, g in enumerate(layout.layer_group) if g == group]


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def copy_pages(pool: PagePool, layout: CacheLayout, group: int, src: jax.Array, dst: jax.Array) -> PagePool:
    """Copies whole pages ``src[i] -> dst[i]`` in every layer of ``group`` (copy on partial reuse).

    Args:
      src, dst: [num_copies] int32 page ids.
    """
    k, v = list(pool.k), list(pool.v)
    for layer in _group_layers(layout, group):
        k[layer] = k[layer].at[dst].set(k[layer][src])
        v[layer] = v[layer].at[dst].set(v[layer][src])
    return PagePool(k=tuple(k), v=tuple(v))


@functools.partial(jax.jit, static_argnums=(1, 2))
def read_pages(pool: PagePool, layout: CacheLayout, group: int, page_ids: jax.Array) -> jax.Array:
    """K and V of ``page_ids`` in ``group``: [2, group_layers, len(page_ids), page_size, kv_heads, head_dim]."""
    layers = _group_layers(layout, group)
    return jnp.stack([jnp.stack([pool.k[i][page_ids] for i in layers]), jnp.stack([pool.v[i][page_ids] for i in layers])])


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def write_pages(pool: PagePool, layout: CacheLayout, group: int, page_ids: jax.Array, kv: jax.Array) -> PagePool:
    """Writes ``kv`` (as returned by ``read_pages``) into ``page_ids`` of ``group``."""
    k, v = list(pool.k), list(pool.v)
    for n, layer in enumerate(_group_layers(layout, group)):
        k[layer] = k[layer].at[page_ids].set(kv[0, n].astype(k[layer].dtype))
        v[layer] = v[layer].at[page_ids].set(kv[1, n].astype(v[layer].dtype))
    return PagePool(k=tuple(k), v=tuple(v))
