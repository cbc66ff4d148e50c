"""``PageFile``: one layer group's disk-tier pages in a file, each page verified when read.

The file holds one fixed-size record per page: record ``p`` starts at byte ``p * record_bytes``
and is the page's slice of every leaf of the host-pages layout (``kvjax.cache.host_pool``), in
leaf order, C order: [2, group_layers, tokens_per_block, num_kv_heads, head_dim] values and, for
a quantized dtype, [2, group_layers, scale_slots, num_kv_heads] float32 scales. Each write
keeps the record's 16-byte BLAKE2b digest (``hashlib``) in memory; a read returns a page only
if its bytes still hash to that digest.

Reads go through ``os.pread`` on a descriptor held open, never through a memory map: a file
that another process truncated, zeroed or damaged gives a short read or a digest mismatch, never
a fault, and a deleted folder leaves the open file readable. Such a page is *lost*: ``check``
says so, and the manager drops its block and recomputes it. A write that fails (a full disk,
a file-size limit) loses the page it was writing instead of raising; ``write_errors`` counts them.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Sequence

import jax
import numpy as np

from kvjax.cache.quant import QuantizedPages

HostPages = np.ndarray | QuantizedPages
"""One group's pages on the host or disk tier: [2, group_layers, pages, ...] values (the host
pool's layout, ``kvjax.cache.host_pool``), quantized with their scales."""

_DIGEST_BYTES = 16


class LostPageError(RuntimeError):
    """A disk page was read that ``check`` had not passed in this step (it changed meanwhile)."""


def _digest(record: bytes) -> bytes:
    return hashlib.blake2b(record, digest_size=_DIGEST_BYTES).digest()


class PageFile:
    """One group's disk-tier pages (the record layout is in the module docstring).

    Args:
      path: the page file (created, empty and sparse; removed by ``close``).
      template: a one-page host pool of the group (``CacheLayout.host_zeros(group, 1)``): its
        leaves give the record's parts, their shapes and dtypes.
      num_pages: pages in the file (ids 0 .. num_pages - 1).
    """

    def __init__(self, path: pathlib.Path, template: HostPages, num_pages: int) -> None:
        self.path = path
        self.num_pages = num_pages
        self._template = template
        self._parts = [(leaf.shape[:2] + leaf.shape[3:], leaf.dtype) for leaf in jax.tree.leaves(template)]
        """Per leaf, (shape of one page's slice, dtype)."""
        self.record_bytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in self._parts)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._digests: dict[int, bytes] = {}
        """Page id -> digest of its last successful write (absent: never written, or lost)."""
        self._checked: dict[int, bytes] = {}
        """Records that passed ``check`` since the last ``end_step``: what ``read`` serves."""
        self.write_errors = 0
        """Writes that failed (their pages are lost)."""

    def close(self) -> None:
        """Closes and removes the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ records

    def _record(self, kv: HostPages, i: int) -> bytes:
        """Page ``i`` of ``kv`` (host-pages layout) as one record."""
        return b"".join(np.ascontiguousarray(leaf[:, :, i]).tobytes() for leaf in jax.tree.leaves(kv))

    def _pages(self, records: Sequence[bytes | None], num_pages: int, layer: int | None = None) -> HostPages:
        """Records as host pages [2, L, num_pages, ...] (missing records and the padding zero);
        with ``layer``, only that layer of the group, [2, 1, num_pages, ...]."""
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        out = [
            np.zeros((shape[0], len(range(shape[1])[layers]), num_pages, *shape[2:]), dtype)
            for shape, dtype in self._parts
        ]
        for i, record in enumerate(records):
            if record is None:
                continue
            offset = 0
            for leaf, (shape, dtype) in zip(out, self._parts):
                count = int(np.prod(shape))
                leaf[:, :, i] = np.frombuffer(record, dtype, count=count, offset=offset).reshape(shape)[:, layers]
                offset += count * dtype.itemsize
        return jax.tree.unflatten(jax.tree.structure(self._template), out)

    def _read_verified(self, page: int) -> bytes | None:
        digest = self._digests.get(page)
        if digest is None:
            return None
        try:
            record = os.pread(self._fd, self.record_bytes, page * self.record_bytes)
        except OSError:
            return None
        if len(record) != self.record_bytes or _digest(record) != digest:
            return None
        return record

    # ------------------------------------------------------------------ the tier's operations

    def write(self, slots: np.ndarray, kv: HostPages) -> None:
        """Writes page ``i`` of ``kv`` (host-pages layout) to page ``slots[i]``, for every slot."""
        for i, page in enumerate(int(s) for s in slots):
            self._checked.pop(page, None)
            self._digests.pop(page, None)
            record = self._record(kv, i)
            try:
                written = os.pwrite(self._fd, record, page * self.record_bytes)
            except OSError:
                written = -1
            if written != len(record):
                self.write_errors += 1
                continue
            self._digests[page] = _digest(record)

    def check(self, page: int) -> bool:
        """Whether ``page`` still holds what was last written to it. A page that passes is kept
        for ``read`` until ``end_step``; a page that fails is lost until written again."""
        if page in self._checked:
            return True
        record = self._read_verified(page)
        if record is None:
            self._digests.pop(page, None)
            return False
        self._checked[page] = record
        return True

    def read(self, slots: np.ndarray, num_pages: int, layer: int | None = None) -> HostPages:
        """Pages ``slots`` as host pages, zero-padded to ``num_pages`` pages (with ``layer``,
        only that layer of the group); each must have passed ``check`` in this step (or pass
        it now).

        Raises:
          LostPageError: a page is damaged (it changed after the manager matched it).
        """
        records = []
        for page in (int(s) for s in slots):
            if not self.check(page):
                raise LostPageError(f"disk page {page} of {str(self.path)!r} changed after it was checked")
            records.append(self._checked[page])
        return self._pages(records, num_pages, layer)

    def end_step(self) -> None:
        """Forgets the records kept by ``check`` (the step's onboards have read them)."""
        self._checked.clear()

    def read_all(self) -> HostPages:
        """Every page as host pages (lost or never written pages zero), for a snapshot."""
        return self._pages([self._read_verified(p) for p in range(self.num_pages)], self.num_pages)

    def write_all(self, saved: HostPages) -> None:
        """Overwrites every page with ``saved`` (host pages of ``num_pages`` pages).

        Raises:
          ValueError: ``saved`` has other shapes or dtypes than this file's pages.
        """
        for leaf, (shape, dtype) in zip(jax.tree.leaves(saved), self._parts):
            want = (*shape[:2], self.num_pages, *shape[2:])
            if leaf.shape != want or leaf.dtype != dtype:
                raise ValueError(f"saved disk pages have shape {leaf.shape} {leaf.dtype}, the page file {want} {dtype}")
        self.write(np.arange(self.num_pages), saved)
