"""Static shape of the paged KV cache: layers, layer groups by attention window, pages.

Glossary (used in shape comments across ``kvjax.cache`` and the model):
  num_layers      decoder layers
  num_groups      layer groups; one per distinct attention window, each with its own pool
  group_layers    layers in one group
  num_pages       pages in one group's pool (the null page included)
  page_size       tokens per page (= tokens_per_block)
  num_kv_heads    KV heads (MHA = query heads, GQA fewer, MQA 1)
  head_dim        per-head width
  max_seqs        sequences in a batch
  pages_per_seq   block-table width
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0
"""Page 0 of every pool is never handed out: block tables point padding and released
(out-of-window) blocks at it, and padding tokens write into it. Its contents are garbage
by design and every read of it is masked by length or window."""


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Hashable static description of the page pools (a jit static argument).

    Attributes:
      layer_windows: attention window of each layer (full layers carry max_seq_len).
      num_pages: pages per group pool, in group order (null page included).
      page_size: tokens per page.
      num_kv_heads, head_dim: KV geometry.
      max_seq_len: longest sequence; a window >= max_seq_len means full attention.
      dtype: storage dtype name ("float32", "bfloat16", "float16").
    """

    layer_windows: tuple[int, ...]
    num_pages: tuple[int, ...]
    page_size: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if len(self.num_pages) != self.num_groups:
            raise ValueError(
                f"num_pages has {len(self.num_pages)} entries but the windows {self.group_windows} "
                f"define {self.num_groups} layer groups"
            )
        if any(n < 2 for n in self.num_pages):
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 per group (page {NULL_PAGE} is the null page)")

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    @functools.cached_property
    def group_windows(self) -> tuple[int, ...]:
        """Distinct windows in order of first appearance; group g has window group_windows[g]."""
        return tuple(dict.fromkeys(self.layer_windows))

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @functools.cached_property
    def layer_group(self) -> tuple[int, ...]:
        return tuple(self.group_windows.index(w) for w in self.layer_windows)

    @functools.cached_property
    def group_layers(self) -> tuple[int, ...]:
        return tuple(self.layer_group.count(g) for g in range(self.num_groups))

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers: 2 · layers · kv_heads · head_dim · bytes(dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.jnp_dtype.itemsize

    def bytes_per_page(self, group: int) -> int:
        """K and V bytes of one page of ``group`` (all layers of the group)."""
        per_layer = 2 * self.page_size * self.num_kv_heads * self.head_dim * self.jnp_dtype.itemsize
        return per_layer * self.group_layers[group]

    def pool_bytes(self) -> int:
        return sum(self.bytes_per_page(g) * n for g, n in enumerate(self.num_pages))

    def page_shape(self, layer: int) -> tuple[int, ...]:
        """Shape of one layer's pages: [num_pages, page_size, num_kv_heads, head_dim]."""
        return (self.num_pages[self.layer_group[layer]], self.page_size, self.num_kv_heads, self.head_dim)

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window, or None if the layer attends to the whole sequence."""
        window = self.layer_windows[layer]
        return window if window < self.max_seq_len else None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def host_zeros(self, group: int, num_pages: int) -> np.ndarray:
        """A host (numpy) pool for ``group`` of ``num_pages`` pages, K and V stacked on axis 0."""
        shape = (2, self.group_layers[group], num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        return np.zeros(shape, dtype=self.jnp_dtype)
