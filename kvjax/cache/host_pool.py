"""The host and disk tiers' pages: ``HostPool`` owns them and is the only code that writes them.

Each layer group has one host pool (numpy, ``layout.num_host_pages`` pages) and, with a disk
tier, one ``PageFile`` (``layout.num_disk_pages`` pages, each verified by its digest when
read). Pages go in and come out as ``kvjax.cache.pool.read_pages`` returns them: K and V
stacked on axis 0, [2, group_layers, num_pages, tokens_per_block, num_kv_heads, head_dim], or for a
quantized dtype ``QuantizedPages`` of such values and [2, group_layers, num_pages,
scale_slots, num_kv_heads] float32 scales; the host pool stores them so.

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
from kvjax.cache.page_file import PageFile
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
      ValueError: the disk tier does not fit the free space of ``disk_dir``, or ``disk_dir``
        is not a folder that can be created and written.
    """

    def __init__(self, layout: CacheLayout, disk_dir: str | pathlib.Path | None = None) -> None:
        self.layout = layout
        groups = range(layout.num_groups)
        self.host: tuple[HostPages, ...] = (
            tuple(layout.host_zeros(g, layout.num_host_pages) for g in groups) if layout.num_host_pages else ()
        )
        """Per group, the host tier's pages (empty without a host tier)."""
        self.disk: tuple[PageFile, ...] = ()
        """Per group, the disk tier's page file (empty without a disk tier)."""
        if layout.num_disk_pages:
            folder = _disk_folder(layout, disk_dir)
            self.disk = tuple(
                PageFile(folder / f"disk_g{g:03d}.bin", layout.host_zeros(g, 1), layout.num_disk_pages) for g in groups
            )
            weakref.finalize(self, _remove_disk_tier, self.disk, folder)

    def _host(self, tier: TierName) -> tuple[HostPages, ...]:
        if tier not in ("host", "disk"):
            raise ValueError(f"tier={tier!r} must be 'host' or 'disk'")
        return self.host

    def store(self, tier: TierName, group: int, slots: np.ndarray, kv: HostPages) -> None:
        """Writes the first ``len(slots)`` pages of ``kv`` into ``slots`` of ``group``'s pool on
        ``tier`` (a failed disk write loses its page; see ``PageFile``)."""
        if tier == "disk":
            self.disk[group].write(slots, kv)
        else:
            store_host_pages(self._host(tier)[group], slots, kv)

    def load(self, tier: TierName, group: int, slots: np.ndarray, num_pages: int) -> HostPages:
        """``slots`` of ``group``'s pool on ``tier``, zero-padded to ``num_pages`` pages (a copy).

        Raises:
          LostPageError: a disk page that did not pass ``check_disk`` in this step.
        """
        if tier == "disk":
            return self.disk[group].read(slots, num_pages)
        return load_host_pages(self._host(tier)[group], slots, num_pages)

    def check_disk(self, group: int, page: int) -> bool:
        """Whether disk page ``page`` of ``group`` is intact (the manager asks before it reuses
        the block; a lost page is dropped and recomputed)."""
        return self.disk[group].check(page)

    def end_step(self) -> None:
        """Forgets the disk records checked in this step (called after the step's page ops)."""
        for page_file in self.disk:
            page_file.end_step()

    def pool_ids(self) -> Iterator[tuple[TierName, int]]:
        """(tier, group) of every pool, host tier first (the order of ``pools``)."""
        yield from (("host", g) for g in range(len(self.host)))
        yield from (("disk", g) for g in range(len(self.disk)))

    def pools(self) -> Iterator[tuple[TierName, int, HostPages]]:
        """(tier, group, pages) of every pool, host tier first, for saving: the host pages are
        read-only views, the disk pages a copy read from the file (lost pages zero)."""
        for g, pages in enumerate(self.host):
            yield "host", g, pages
        for g, page_file in enumerate(self.disk):
            yield "disk", g, page_file.read_all()

    def check_restore(self, tier: TierName, group: int, saved: HostPages) -> None:
        """Raises ``ValueError`` unless ``saved`` has the shapes and dtypes of ``group``'s pool on
        ``tier`` (``restore`` writes nothing before every pool passed this)."""
        num_pages = self.layout.num_host_pages if tier == "host" else self.layout.num_disk_pages
        mine = self.layout.host_zeros(group, 0)
        if jax.tree.structure(mine) != jax.tree.structure(saved):
            raise ValueError(f"saved {tier} pages of group {group} are not {type(mine).__name__}")
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(saved)):
            want = (*a.shape[:2], num_pages, *a.shape[3:])
            if b.shape != want or b.dtype != a.dtype:
                raise ValueError(f"saved {tier} pages of group {group} have shape {b.shape} {b.dtype}, the pool {want} {a.dtype}")

    def restore(self, tier: TierName, group: int, saved: HostPages) -> None:
        """Overwrites the whole pool of ``group`` on ``tier`` with ``saved`` (same shapes and dtypes)."""
        self.check_restore(tier, group, saved)
        if tier == "disk":
            self.disk[group].write_all(saved)
            return
        for mine, values in zip(jax.tree.leaves(self.host[group]), jax.tree.leaves(saved)):
            mine[...] = values


def _disk_folder(layout: CacheLayout, disk_dir: str | pathlib.Path | None) -> pathlib.Path:
    """A new folder for the page files under ``disk_dir``, after checking that it can hold them."""
    parent = pathlib.Path(disk_dir).expanduser() if disk_dir else pathlib.Path(tempfile.gettempdir())
    where = f"kv_cache_config.disk_cache_dir={str(disk_dir)!r}"
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{where} is a file, not a folder; point it at a folder (created if missing)")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        folder = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-disk-", dir=parent))
    except OSError as err:
        raise ValueError(f"{where}: cannot create the disk tier's folder there ({err.strerror or err})") from err
    need = layout.num_disk_pages * layout.bytes_per_block
    free = shutil.disk_usage(folder).free
    if need > free:
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError(
            f"kv_cache_config.disk_cache_size: the disk tier's {layout.num_disk_pages} pages need {need:,} bytes "
            f"in {where} but {free:,} are free; lower disk_cache_size or choose another folder"
        )
    return folder


def _remove_disk_tier(page_files: tuple[PageFile, ...], folder: pathlib.Path) -> None:
    for page_file in page_files:
        page_file.close()
    shutil.rmtree(folder, ignore_errors=True)
