"""The device page pool and pure, jittable operations on it (SPEC A1, A2).

A pool holds, per layer group, K and V as ``[group_layers, num_pages, page_size,
num_kv_heads, head_dim]``. Only KV heads are stored, so a token costs exactly
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
    """K and V pages of every layer group.

    Attributes:
      k, v: one array per group, [group_layers, num_pages, page_size, num_kv_heads, head_dim].
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_pool(layout: CacheLayout) -> PagePool:
    """A zeroed pool for ``layout``."""
    k = tuple(jnp.zeros(layout.pool_shape(g), layout.jnp_dtype) for g in range(layout.num_groups))
    v = tuple(jnp.zeros(layout.pool_shape(g), layout.jnp_dtype) for g in range(layout.num_groups))
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


def write_layer(
    pages: jax.Array, slot: int | jax.Array, page_ids: jax.Array, offsets: jax.Array, values: jax.Array
) -> jax.Array:
    """Scatters one layer's new K (or V) into a group pool.

    Args:
      pages: [group_layers, num_pages, page_size, num_kv_heads, head_dim].
      slot: the layer's index within the group.
      page_ids, offsets: [max_seqs, num_tokens] from ``slot_mapping``.
      values: [max_seqs, num_tokens, num_kv_heads, head_dim].
    """
    return pages.at[slot, page_ids, offsets].set(values.astype(pages.dtype), mode="drop")


@functools.partial(jax.jit, static_argnums=1, donate_argnums=0)
def copy_pages(pool: PagePool, group: int, src: jax.Array, dst: jax.Array) -> PagePool:
    """Copies whole pages ``src[i] -> dst[i]`` of one group, all its layers (copy on partial
    reuse). Pairs with ``dst == NULL_PAGE`` are padding.

    Args:
      group: the layer group (static).
      src, dst: [num_copies] int32 page ids.
    """
    k = list(pool.k)
    v = list(pool.v)
    k[group] = k[group].at[:, dst].set(k[group][:, src])
    v[group] = v[group].at[:, dst].set(v[group][:, src])
    return PagePool(k=tuple(k), v=tuple(v))


@functools.partial(jax.jit, static_argnums=1)
def read_pages(pool: PagePool, group: int, page_ids: jax.Array) -> jax.Array:
    """K and V of ``page_ids`` in ``group``: [2, group_layers, len(page_ids), page_size, kv_heads, head_dim]."""
    return jnp.stack([pool.k[group][:, page_ids], pool.v[group][:, page_ids]])


@functools.partial(jax.jit, static_argnums=1, donate_argnums=0)
def write_pages(pool: PagePool, group: int, page_ids: jax.Array, kv: jax.Array) -> PagePool:
    """Writes ``kv`` (as returned by ``read_pages``) into ``page_ids`` of ``group``."""
    k = list(pool.k)
    v = list(pool.v)
    k[group] = k[group].at[:, page_ids].set(kv[0].astype(k[group].dtype))
    v[group] = v[group].at[:, page_ids].set(kv[1].astype(v[group].dtype))
    return PagePool(k=tuple(k), v=tuple(v))
