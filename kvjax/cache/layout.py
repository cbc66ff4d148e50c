"""Static shape of the paged KV cache: layers, layer groups by attention window, pages.

The names of the cache's shape (the attention axes' letters are ``kvjax/axes.py``'s, which
uses the same names for the axes both share):
  num_layers      decoder layers
  num_groups      layer groups; one per distinct attention window, each with its own pool
  group_layers    layers in one group
  num_pages       pages in one group's device pool (the null page included)
  num_host_pages  pages in one group's host pool (ids from 0; 0 = no host tier)
  num_disk_pages  pages in one group's disk pool (ids from 0; 0 = no disk tier)
  tokens_per_block  tokens per page and block: ``KvCacheConfig.tokens_per_block``, read
                  only by ``CacheLayout.for_model``; everything after it reads
                  ``layout.tokens_per_block``
  num_kv_heads    KV heads (MHA = query heads, GQA fewer, MQA 1)
  head_dim        per-head width
  max_seqs        sequences in a batch
  pages_per_seq   block-table width
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.cache.quant import KV_STORAGE_DTYPES, QUANTIZED_DTYPES, SCALE_DTYPE, SCALE_GRANULARITIES, QuantizedPages
from kvjax.cache.sizing import CacheSize, choose_cache_size, require_fits
from kvjax.config import ConfigError, KvCacheConfig

NULL_PAGE = 0
"""Page 0 of every pool is never handed out: block tables point padding and released
(out-of-window) blocks at it, and padding tokens write into it. Its contents are garbage
by design and every read of it is masked by length or window."""


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The cache geometry: hashable static description of the page pools of every tier (a jit
    static argument), built once per engine (``for_model``) and read by the engine, the
    manager, snapshots and experiments.

    Attributes:
      layer_windows: attention window of each layer in tokens, <= max_seq_len (full layers
        carry max_seq_len).
      num_pages: device pages per group pool, in group order (null page included).
      tokens_per_block: tokens per page (``KvCacheConfig.tokens_per_block``).
      num_kv_heads, head_dim: KV geometry.
      max_seq_len: longest sequence; a window >= max_seq_len means full attention.
      dtype: KV dtype name: "float32", "bfloat16", "float16", or the quantized "int8" /
        "fp8" (float8_e4m3fn values plus float32 scales, see ``kvjax.cache.quant``).
      scale_granularity: scales of a quantized dtype, "token" (per token and KV head) or
        "page" (per page and KV head); ignored by the float dtypes.
      num_host_pages: host-tier pages per group (0 = no offload).
      num_disk_pages: disk-tier pages per group (0 = no disk tier; needs a host tier).
    """

    layer_windows: tuple[int, ...]
    num_pages: tuple[int, ...]
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: str = "float32"
    scale_granularity: str = "token"
    num_host_pages: int = 0
    num_disk_pages: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 1:
            raise ValueError(f"max_seq_len={self.max_seq_len!r} must be a positive int (tokens)")
        if (
            isinstance(self.tokens_per_block, bool)
            or not isinstance(self.tokens_per_block, int)
            or self.tokens_per_block < 1
        ):
            raise ValueError(f"tokens_per_block={self.tokens_per_block!r} must be a positive int (tokens per page)")
        windows = self.layer_windows
        if not windows or not all(isinstance(w, int) and 0 < w <= self.max_seq_len for w in windows):
            raise ValueError(
                f"layer_windows={windows!r} must be a non-empty tuple of ints in [1, max_seq_len={self.max_seq_len}]"
            )
        for field in ("num_host_pages", "num_disk_pages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field}={value!r} must be an int >= 0")
        if self.num_disk_pages and not self.num_host_pages:
            raise ValueError(
                f"num_disk_pages={self.num_disk_pages} needs a host tier (num_host_pages=0): blocks reach the disk "
                "tier only from the host tier"
            )
        if self.dtype not in KV_STORAGE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {tuple(KV_STORAGE_DTYPES)}")
        if self.scale_granularity not in SCALE_GRANULARITIES:
            raise ValueError(f"scale_granularity={self.scale_granularity!r} must be one of {SCALE_GRANULARITIES}")
        if len(self.num_pages) != self.num_groups:
            raise ValueError(
                f"num_pages has {len(self.num_pages)} entries but the windows {self.group_windows} "
                f"define {self.num_groups} layer groups"
            )
        if not all(isinstance(n, int) and n >= 2 for n in self.num_pages):
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 per group (page {NULL_PAGE} is the null page)")

    @classmethod
    def for_model(
        cls,
        kv_config: KvCacheConfig,
        *,
        model_windows: Sequence[int],
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        model_dtype: str,
        hybrid: bool = False,
    ) -> tuple[CacheLayout, CacheSize]:
        """The geometry of a model's cache under ``kv_config``, and how its size was chosen.

        The one place where the config's sizes become pages: ``tokens_per_block`` is the page
        size; the device pools get the tokens ``choose_cache_size`` allows (every group the
        same page count, the null page added); ``host_cache_size`` and ``disk_cache_size``
        (bytes) become whole pages of every group (``bytes_per_block`` each). Windows are the
        config's ``max_attention_window`` cycled over the layers, else the model's, capped at
        ``max_seq_len``.

        Per-group pools: with ``pool_ratio`` (or ``avg_seq_len``, or for a hybrid model with
        neither, half of ``max_seq_len`` after a warning) the device cache's bytes are split
        between the layer groups by ``group_shares`` instead, and each group gets the pages
        its share buys; a group must still hold one ``max_seq_len`` sequence (a windowed
        group: its window plus one page).

        Args:
          model_windows: the model's attention window per layer, tokens.
          num_kv_heads, head_dim: the model's KV geometry.
          max_seq_len: longest prompt + generation, tokens.
          model_dtype: dtype name of the model's weights (the KV dtype for ``dtype="auto"``).
          hybrid: the model has recurrent layers (the ``avg_seq_len`` fallback applies).

        Raises:
          ValueError: the cache (or one group's pool) holds fewer tokens than ``max_seq_len``.
          ConfigError: the device cache or host tier does not fit the memory there is.
        """
        if kv_config.max_attention_window is not None:
            windows = kv_config.windows_for(len(model_windows), max_seq_len)
        else:
            windows = tuple(min(w, max_seq_len) for w in model_windows)
        probe = cls(
            layer_windows=windows,
            num_pages=(2,) * len(dict.fromkeys(windows)),
            tokens_per_block=kv_config.tokens_per_block,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_seq_len=max_seq_len,
            dtype=model_dtype if kv_config.dtype == "auto" else kv_config.dtype,
            scale_granularity=kv_config.scale_granularity,
        )
        size = choose_cache_size(kv_config, probe.bytes_per_token)
        shares = probe.group_shares(kv_config, hybrid)
        if shares is None:
            num_pages = (probe.pages_for(size.num_tokens) + 1,) * probe.num_groups
            if num_pages[0] - 1 < probe.pages_for(max_seq_len):
                raise ValueError(
                    f"the cache holds {size.num_tokens} tokens, fewer than max_seq_len={max_seq_len}; "
                    "raise kv_cache_config.max_tokens / free_gpu_memory_fraction or lower max_seq_len"
                )
        else:
            budget = size.num_tokens * probe.bytes_per_token
            num_pages = tuple(
                int(share * budget) // (layers * probe.bytes_per_page_layer) + 1
                for share, layers in zip(shares, probe.group_layers)
            )
            for g, (pages, window) in enumerate(zip(num_pages, probe.group_windows)):
                need = min(probe.pages_for(max_seq_len), probe.pages_for(window) + 1)
                if pages - 1 < need:
                    field = "pool_ratio" if kv_config.pool_ratio is not None else "avg_seq_len"
                    raise ValueError(
                        f"kv_cache_config.{field}: layer group {g} (window {window}) gets {pages - 1} pages of its "
                        f"{budget:,}-byte share, fewer than the {need} one max_seq_len={max_seq_len} sequence needs; "
                        f"give it a larger share or raise max_tokens / free_gpu_memory_fraction"
                    )
        block = probe.bytes_per_block
        for field in ("host_cache_size", "disk_cache_size"):
            value = getattr(kv_config, field)
            if 0 < value < block:
                raise ConfigError(
                    f"kv_cache_config.{field}={value:,} holds no block: one block (a page of every layer group) "
                    f"takes {block:,} bytes here; use 0 (no tier) or at least {block:,}"
                )
        num_host_pages = kv_config.host_cache_size // block
        require_fits(kv_config, size, num_host_pages * block)
        num_disk_pages = kv_config.disk_cache_size // block
        layout = dataclasses.replace(
            probe, num_pages=num_pages, num_host_pages=num_host_pages, num_disk_pages=num_disk_pages
        )
        return layout, size

    def group_shares(self, kv_config: KvCacheConfig, hybrid: bool = False) -> tuple[float, ...] | None:
        """Each layer group's share of the device cache's bytes (summing to 1), or None for
        the same page count in every group (always for a single group).

        ``pool_ratio`` normalised if set; else with ``avg_seq_len`` L (for a hybrid model with
        neither: ``max_seq_len // 2``, after a warning) group g's weight is its layers times
        min(window_g, L), the tokens a sequence of length L keeps there.

        Raises:
          ConfigError: ``pool_ratio`` does not have one weight per layer group.
        """
        if kv_config.pool_ratio is not None:
            ratio = kv_config.pool_ratio
            if len(ratio) != self.num_groups:
                raise ConfigError(
                    f"pool_ratio={list(ratio)} must have one weight per layer group: this model has "
                    f"{self.num_groups} (windows {list(self.group_windows)})"
                )
            return tuple(w / sum(ratio) for w in ratio) if self.num_groups > 1 else None
        if self.num_groups == 1:
            return None
        avg = kv_config.avg_seq_len
        if avg is None and hybrid:
            avg = max(self.max_seq_len // 2, 1)
            logging.warning(
                "kv_cache_config: neither pool_ratio nor avg_seq_len is set for a hybrid model; sizing the "
                "layer groups' pools for avg_seq_len = max_seq_len // 2 = %d tokens", avg,
            )
        if avg is None:
            return None
        weights = [layers * min(window, avg) for layers, window in zip(self.group_layers, self.group_windows)]
        return tuple(w / sum(weights) for w in weights)

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
        """Dtype of the stored K/V values (int8 / float8_e4m3fn for the quantized dtypes)."""
        return KV_STORAGE_DTYPES[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def scale_slots(self) -> int:
        """Scales per page and KV head: tokens_per_block ("token"), 1 ("page"), 0 (float dtypes)."""
        if not self.quantized:
            return 0
        return self.tokens_per_block if self.scale_granularity == "token" else 1

    @property
    def bytes_per_page_layer(self) -> int:
        """K and V bytes of one page in one layer, scales included:
        2 · kv_heads · (tokens_per_block · head_dim · bytes(dtype) + scale_slots · 4)."""
        values = self.tokens_per_block * self.head_dim * self.jnp_dtype.itemsize
        return 2 * self.num_kv_heads * (values + self.scale_slots * SCALE_DTYPE.itemsize)

    @property
    def bytes_per_token_layer(self) -> int:
        """K and V bytes of one token in one layer, scales included, rounded up to whole bytes:
        ceil(bytes_per_page_layer / tokens_per_block)."""
        return -(-self.bytes_per_page_layer // self.tokens_per_block)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, scales included, rounded up to whole bytes:
        ceil(layers · bytes_per_page_layer / tokens_per_block). For the float dtypes exactly
        2 · layers · kv_heads · head_dim · bytes(dtype); per-token scales add 2 · layers ·
        kv_heads · 4; per-page scales add that divided by tokens_per_block."""
        return -(-self.num_layers * self.bytes_per_page_layer // self.tokens_per_block)

    def bytes_per_page(self, group: int) -> int:
        """K and V bytes (scales included) of one page of ``group`` (all layers of the group)."""
        return self.bytes_per_page_layer * self.group_layers[group]

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes (scales included) of one block in every group: one page per group."""
        return sum(self.bytes_per_page(g) for g in range(self.num_groups))

    def pool_bytes(self) -> int:
        return sum(self.bytes_per_page(g) * n for g, n in enumerate(self.num_pages))

    def page_shape(self, layer: int) -> tuple[int, ...]:
        """Shape of one layer's pages: [num_pages, tokens_per_block, num_kv_heads, head_dim]."""
        return (self.num_pages[self.layer_group[layer]], self.tokens_per_block, self.num_kv_heads, self.head_dim)

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window, or None if the layer attends to the whole sequence."""
        window = self.layer_windows[layer]
        return window if window < self.max_seq_len else None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def host_zeros(self, group: int, num_pages: int) -> np.ndarray | QuantizedPages:
        """A host (numpy) pool for ``group`` of ``num_pages`` pages, K and V stacked on axis 0:
        [2, group_layers, num_pages, tokens_per_block, kv_heads, head_dim], or for a quantized dtype
        ``QuantizedPages`` of such values and [2, group_layers, num_pages, scale_slots, kv_heads]
        scales (the layout of ``kvjax.cache.pool.read_pages``)."""
        lead = (2, self.group_layers[group], num_pages)
        values = np.zeros((*lead, self.tokens_per_block, self.num_kv_heads, self.head_dim), dtype=self.jnp_dtype)
        if not self.quantized:
            return values
        scales = np.zeros((*lead, self.scale_slots, self.num_kv_heads), SCALE_DTYPE)
        return QuantizedPages(values=values, scales=scales)  # type: ignore[arg-type]  # the host tier's numpy pytree
