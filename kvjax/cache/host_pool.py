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

A tier's reads can be slowed down to emulate slower storage (``TierThrottle``: NVMe, SSD or
network storage on a machine whose page cache makes the disk tier memory-speed). This is an
emulation: the bytes are copied at this machine's speed, then the read sleeps until it has
lasted ``latency + bytes / bandwidth``, using no CPU while it waits.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Literal

import jax
import numpy as np

from kvjax.cache.layout import CacheLayout
from kvjax.cache.page_file import HostPages, PageFile
from kvjax.cache.quant import QuantizedPages

TierName = Literal["host", "disk"]


@dataclasses.dataclass(frozen=True)
class TierThrottle:
    """Emulated read speed of a tier.

    Attributes:
      read_gbps: bandwidth in GB/s (1e9 bytes per second); 0 = no bandwidth limit.
      latency_ms: added to every read, in milliseconds.
    """

    read_gbps: float = 0.0
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("read_gbps", "latency_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < float("inf")):
                raise ValueError(f"TierThrottle.{name}={value!r} must be a finite number >= 0")

    @property
    def active(self) -> bool:
        return self.read_gbps > 0 or self.latency_ms > 0

    def seconds(self, num_bytes: int) -> float:
        """Emulated duration of one read of ``num_bytes`` bytes."""
        return self.latency_ms * 1e-3 + (num_bytes / (self.read_gbps * 1e9) if self.read_gbps else 0.0)

    def wait(self, start: float, num_bytes: int) -> None:
        """Sleeps until a read of ``num_bytes`` that began at ``start`` (``time.perf_counter``)
        has lasted ``seconds(num_bytes)``."""
        if self.active:
            left = start + self.seconds(num_bytes) - time.perf_counter()
            if left > 0:
                time.sleep(left)


def store_host_pages(host: HostPages, slots: np.ndarray, kv: HostPages) -> None:
    """Writes the first ``len(slots)`` pages of ``kv`` (``read_pages`` output, on the host) into
    pool slots ``slots``, in place (values and scales alike)."""
    for h, a in zip(jax.tree.leaves(host), jax.tree.leaves(kv)):
        h[:, :, slots] = a[:, :, : len(slots)]


def load_host_pages(host: HostPages, slots: np.ndarray, num_pages: int, layer: int | None = None) -> HostPages:
    """Pool slots ``slots`` as ``write_pages`` input, zero-padded to ``num_pages`` pages; with
    ``layer``, only that layer of the group (``[2, 1, num_pages, ...]``)."""
    layers = slice(None) if layer is None else slice(layer, layer + 1)

    def take(h: np.ndarray) -> np.ndarray:
        h = h[:, layers]
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
      throttles: per tier ("host", "disk"), the emulated read speed of ``load``; absent = unthrottled.

    Raises:
      ValueError: the disk tier does not fit the free space of ``disk_dir``, or ``disk_dir``
        is not a folder that can be created and written.
    """

    def __init__(
        self,
        layout: CacheLayout,
        disk_dir: str | pathlib.Path | None = None,
        throttles: Mapping[TierName, TierThrottle] | None = None,
    ) -> None:
        self.layout = layout
        self.throttles: dict[TierName, TierThrottle] = {
            "host": TierThrottle(),
            "disk": TierThrottle(),
            **(throttles or {}),
        }
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

    def load(
        self, tier: TierName, group: int, slots: np.ndarray, num_pages: int, layer: int | None = None
    ) -> HostPages:
        """``slots`` of ``group``'s pool on ``tier``, zero-padded to ``num_pages`` pages (a copy),
        as fast as the tier's throttle allows (one read).

        Args:
          layer: only this layer of the group (its index among the group's layers), as
            ``[2, 1, num_pages, ...]``; None = every layer.

        Raises:
          LostPageError: a disk page that did not pass ``check_disk`` in this step.
        """
        start = time.perf_counter()
        if tier == "disk":
            pages = self.disk[group].read(slots, num_pages, layer)
        else:
            pages = load_host_pages(self._host(tier)[group], slots, num_pages, layer)
        num_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(pages)) * len(slots) // max(num_pages, 1)
        self.throttles[tier].wait(start, num_bytes)
        return pages

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
        if isinstance(mine, QuantizedPages) != isinstance(saved, QuantizedPages):
            raise ValueError(f"saved {tier} pages of group {group} are not {type(mine).__name__}")
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(saved)):
            want = (*a.shape[:2], num_pages, *a.shape[3:])
            if b.shape != want or b.dtype != a.dtype:
                raise ValueError(
                    f"saved {tier} pages of group {group} have shape {b.shape} {b.dtype}, the pool {want} {a.dtype}"
                )

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
