"""The host and disk tiers' pages: ``HostPool`` owns them and is the only code that writes them.

Each layer group has one host pool (numpy, ``layout.num_host_pages`` pages) and, with a disk
tier, one disk pool (the same arrays memory-mapped from files, ``layout.num_disk_pages``
pages). A pool's pages are stored as ``kvjax.cache.pool.read_pages`` returns them: K and V
stacked on axis 0, [2, group_layers, num_pages, tokens_per_block, num_kv_heads, head_dim], or for a
quantized dtype ``QuantizedPages`` of such values and [2, group_layers, num_pages,
scale_slots, num_kv_heads] float32 scales.

The tiers are written in place by their owner: they are the big, slow memory (a copy per
offload would cost the whole tier), and the disk tier is a file. The device pool stays a
pytree updated by pure functions (``kvjax.cache.pool``).
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Literal

import jax
import numpy as np

from kvjax.cache.layout import CacheLayout
from kvjax.cache.quant import QuantizedPages

HostPages = np.ndarray | QuantizedPages
"""One group's pages on the host or disk tier (layout above)."""

TierName = Literal["host", "disk"]


def store_host_pages(host: HostPages, slots: np.ndarray, kv: HostPages) -> None:
    """Writes the first ``len(slots)`` pages of ``kv`` (``read_pages`` output, on the host) into
    pool slots ``slots``, in place (values and scales alike)."""
    for h, a in zip(jax.tree.leaves(host), jax.tree.leaves(kv)):
        h[:, :, slots] = a[:, :, : len(slots)]


def load_host_pages(host: HostPages, slots: np.ndarray, num_pages: int) -> HostPages:
    """Pool slots ``slots`` as ``write_pages`` input, zero-padded to ``num_pages`` pages."""

    def take(h: np.ndarray) -> np.ndarray:
        out = np.zeros((*h.shape[:2], num_pages, *h.shape[3:]), h.dtype)
        out[:, :, : len(slots)] = h[:, :, slots]
        return out

    return jax.tree.map(take, host)


class HostPool:
    """The host tier's and the disk tier's pages of every layer group.

    Args:
      layout: the cache geometry (``num_host_pages`` and ``num_disk_pages`` per group).
      disk_dir: parent folder of the disk tier's page files (None: the system temp dir); the
        files go into a new folder there, removed when this object is collected.

    Raises:
      ValueError: the disk tier does not fit the free space of ``disk_dir``.
    """

    def __init__(self, layout: CacheLayout, disk_dir: str | pathlib.Path | None = None) -> None:
        self.layout = layout
        groups = range(layout.num_groups)
        self.host: tuple[HostPages, ...] = (
            tuple(layout.host_zeros(g, layout.num_host_pages) for g in groups) if layout.num_host_pages else ()
        )
        """Per group, the host tier's pages (empty without a host tier)."""
        self.disk: tuple[HostPages, ...] = ()
        """Per group, the disk tier's memory-mapped pages (empty without a disk tier)."""
        if layout.num_disk_pages:
            parent = pathlib.Path(disk_dir or tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            need = layout.num_disk_pages * layout.bytes_per_block
            free = shutil.disk_usage(parent).free
            if need > free:
                raise ValueError(
                    f"kv_cache_config.disk_cache_size: the disk tier's {layout.num_disk_pages} pages need {need:,} bytes "
                    f"in disk_cache_dir={str(parent)!r} but {free:,} are free; lower disk_cache_size or choose another folder"
                )
            folder = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-disk-", dir=parent))
            weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
            self.disk = tuple(layout.disk_pages(g, layout.num_disk_pages, folder) for g in groups)

    def _tier(self, tier: TierName) -> tuple[HostPages, ...]:
        if tier not in ("host", "disk"):
            raise ValueError(f"tier={tier!r} must be 'host' or 'disk'")
        return self.host if tier == "host" else self.disk

    def store(self, tier: TierName, group: int, slots: np.ndarray, kv: HostPages) -> None:
        """Writes the first ``len(slots)`` pages of ``kv`` into ``slots`` of ``group``'s pool on ``tier``."""
        store_host_pages(self._tier(tier)[group], slots, kv)

    def load(self, tier: TierName, group: int, slots: np.ndarray, num_pages: int) -> HostPages:
        """``slots`` of ``group``'s pool on ``tier``, zero-padded to ``num_pages`` pages (a copy)."""
        return load_host_pages(self._tier(tier)[group], slots, num_pages)

    def pools(self) -> Iterator[tuple[TierName, int, HostPages]]:
        """(tier, group, pages) of every pool, host tier first; the pages are read-only views for
        saving (write through ``store`` or ``restore``)."""
        for tier in ("host", "disk"):
            for g, pages in enumerate(self._tier(tier)):
                yield tier, g, pages

    def restore(self, tier: TierName, group: int, saved: HostPages) -> None:
        """Overwrites the whole pool of ``group`` on ``tier`` with ``saved`` (same shapes and dtypes)."""
        for mine, values in zip(jax.tree.leaves(self._tier(tier)[group]), jax.tree.leaves(saved)):
            if mine.shape != values.shape or mine.dtype != values.dtype:
                raise ValueError(
                    f"saved {tier} pages of group {group} have shape {values.shape} {values.dtype}, "
                    f"the pool {mine.shape} {mine.dtype}"
                )
            mine[...] = values
